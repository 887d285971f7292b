"""bench/sa_stamps.py's reading of the block-shared product's stamps (kSaStamp), on a hand-made
buffer: the kernel's packing of a team's metadata, and the idle SM time and late teams it reports."""
from bench.sa_stamps import STAMP_WORDS, decode_stamps, summarize


def _team(sm, slice_, block, flushes, start, first_unit, last_flush, end, grid_block=0, units=1) -> list[int]:
    meta = 1 << 63 | flushes << 40 | block << 24 | slice_ << 12 | sm
    meta -= 1 << 64  # as the int64 buffer holds it
    return [meta, start, first_unit, last_flush, end, grid_block, units, 0]


def test_decode_reads_the_kernels_packing_and_skips_empty_slots():
    words = _team(131, 27, 8, 3, 1000, 2000, 9000, 9500, 263, 40) + [0] * STAMP_WORDS + _team(0, 0, 0, 2, 0, 1, 2, 3)
    teams = decode_stamps(words)
    assert [(t["sm"], t["slice"], t["block"], t["flushes"]) for t in teams] == [(131, 27, 8, 3), (0, 0, 0, 2)]
    assert (teams[0]["start"], teams[0]["first_unit"], teams[0]["last_flush"], teams[0]["end"]) == (1000, 2000, 9000, 9500)
    assert (teams[0]["grid_block"], teams[0]["units"]) == (263, 40)


def test_summary_finds_the_idle_sm_and_the_late_flush_count():
    # SM 0: two teams ending at 100 us; SM 1: its teams end at 90 and 80 us (3 flushes each), so
    # it idles 10 us of the 100 us span and SM 0 none: a 5% mean idle share.
    us = 1000
    words = (_team(0, 0, 0, 2, 0, 5 * us, 99 * us, 100 * us) + _team(0, 1, 0, 2, 0, 5 * us, 99 * us, 100 * us)
             + _team(1, 0, 1, 3, 0, 5 * us, 88 * us, 90 * us) + _team(1, 1, 1, 3, 0, 5 * us, 78 * us, 80 * us))
    s = summarize(decode_stamps(words))
    assert (s["teams"], s["sms"], s["span_us"], s["start_spread_us"]) == (4, 2, 100.0, 0.0)
    assert s["sm_idle_share"] == 0.05
    assert s["end_before_last_us_by_flushes"] == {"2": 0.0, "3": 15.0}
    assert s["end_before_last_us"]["max"] == 20.0
    assert s["last_flush_us_mean"] == 1.5 and s["last_flush_us_max"] == 2.0
    assert s["slice_end_spread_us"] == 5.0


def test_summary_by_wave_of_the_blocks_placed_first():
    # Two SMs: blocks 0 and 1 placed first (wave 0) end at 80 / 90 us with 30 units; blocks 2 and 3
    # end at 100 us with 20 units each.
    us = 1000
    words = (_team(0, 0, 0, 2, 0, us, 79 * us, 80 * us, 0, 30) + _team(1, 1, 0, 2, 0, us, 89 * us, 90 * us, 1, 30)
             + _team(0, 0, 1, 2, 0, us, 99 * us, 100 * us, 2, 20) + _team(1, 1, 1, 2, 0, us, 99 * us, 100 * us, 3, 20))
    s = summarize(decode_stamps(words), sms=2)
    assert s["end_before_last_us_by_wave"] == {"0": 15.0, "1": 0.0}
    assert s["units_by_wave"] == {"0": 30, "1": 20}
    assert "units_by_wave" not in summarize(decode_stamps(words))


def test_summary_of_nothing_written():
    assert summarize(decode_stamps([0] * 4 * STAMP_WORDS)) == {"teams": 0}


def test_block_pairs_of_each_sm():
    # SM 0: grid block 0 starts at 0 and ends at 60 us, block 2 starts 1 us later and ends at 80;
    # SM 1: block 1 starts first but ends last (90 against 86). SM 2 ran one block: not a pair.
    us = 1000
    words = (_team(0, 0, 0, 2, 0, us, 59 * us, 60 * us, 0) + _team(0, 0, 2, 2, us, 2 * us, 79 * us, 80 * us, 2)
             + _team(1, 0, 1, 2, 0, us, 89 * us, 90 * us, 1) + _team(1, 0, 3, 2, us, 2 * us, 85 * us, 86 * us, 3)
             + _team(2, 0, 4, 2, 0, us, 89 * us, 90 * us, 4))
    s = summarize(decode_stamps(words))
    assert (s["pair_sms"], s["pair_end_gap_us"], s["pair_first_started_ends_first"]) == (2, 12.0, 0.5)
