"""When each team of the block-shared product starts, flushes last and ends (debug variants 72 / 73
/ 76 / 79, kSaStamp in csrc/exl3_gemv_sa_kernel.cuh), summarised per product call.

    python -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 72 73 [--dump teams.jsonl]

Why: session 47's ncu had the SMs active on only 92% of the 32-row product's elapsed cycles,
though every block has the same number of units. One JSON line per variant and call says how long
SMs sat idle while others ran, and whether the teams that end late share a k slice, a flush count
or an SM. Needs a build with debug variants (TRELLIS_DEBUG_VARIANTS=1) and a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

STAMP_WORDS = 8  # int64 words a team's stamps take (kSaStampWords)


def decode_stamps(words: list[int]) -> list[dict]:
    """Teams' stamps from the buffer's words (8 a team; teams that wrote nothing are skipped):
    SM, k slice, block index within the slice and in the grid, units, flushes, and four times in
    ns."""
    teams = []
    for i in range(0, len(words) - STAMP_WORDS + 1, STAMP_WORDS):
        meta = words[i] & (2**64 - 1)
        if not meta >> 63:
            continue
        teams.append({"sm": meta & 0xFFF, "slice": meta >> 12 & 0xFFF, "block": meta >> 24 & 0xFFFF,
                      "flushes": meta >> 40 & 0xFFF, "start": words[i + 1], "first_unit": words[i + 2],
                      "last_flush": words[i + 3], "end": words[i + 4], "grid_block": words[i + 5],
                      "units": words[i + 6]})
    return teams


def _us(ns: float) -> float:
    return round(ns / 1000.0, 3)


def summarize(teams: list[dict], sms: int | None = None) -> dict:
    """How the call's time splits between its teams and SMs (all times in us from the first
    block's start): the span, how far block starts and team ends spread, how long each SM had no
    team left while others ran (idle share of SM time), and team ends by flush count and slice;
    given the SM count, team ends and units by wave (0: the grid's first `sms` blocks, which the
    GPU places first, one an SM)."""
    if not teams:
        return {"teams": 0}
    t0 = min(t["start"] for t in teams)
    t_end = max(t["end"] for t in teams)
    span = t_end - t0
    late = sorted(t_end - t["end"] for t in teams)  # how long before the last team each one ended
    by_sm = defaultdict(list)
    for t in teams:
        by_sm[t["sm"]].append(t)
    idle = [(t_end - max(t["end"] for t in ts)) + (min(t["start"] for t in ts) - t0) for ts in by_sm.values()]
    by_flushes, by_slice = defaultdict(list), defaultdict(list)
    for t in teams:
        by_flushes[t["flushes"]].append(t_end - t["end"])
        by_slice[t["slice"]].append(t_end - t["end"])
    slice_means = [statistics.mean(v) for v in by_slice.values()]
    waves = {}
    if sms:
        by_wave = defaultdict(list)
        for t in teams:
            by_wave[min(t["grid_block"] // sms, 1)].append(t)
        waves = {"end_before_last_us_by_wave": {str(w): _us(statistics.mean(t_end - t["end"] for t in ts))
                                                for w, ts in sorted(by_wave.items())},
                 "units_by_wave": {str(w): round(statistics.mean(t["units"] for t in ts), 2)
                                   for w, ts in sorted(by_wave.items())}}
    return {
        "teams": len(teams), "sms": len(by_sm), "span_us": _us(span),
        **_block_pairs(by_sm),
        "start_spread_us": _us(max(t["start"] for t in teams) - t0),
        "first_unit_us_mean": _us(statistics.mean(t["first_unit"] - t["start"] for t in teams)),
        "last_flush_us_mean": _us(statistics.mean(t["end"] - t["last_flush"] for t in teams)),
        "last_flush_us_max": _us(max(t["end"] - t["last_flush"] for t in teams)),
        "end_before_last_us": {"p50": _us(late[len(late) // 2]), "p90": _us(late[int(len(late) * 0.9)]),
                               "max": _us(late[-1])},
        "sm_idle_share": round(statistics.mean(idle) / span, 4) if span else 0.0,
        "end_before_last_us_by_flushes": {str(k): _us(statistics.mean(v)) for k, v in sorted(by_flushes.items())},
        "slice_end_spread_us": _us(max(slice_means) - min(slice_means)),
        **waves,
    }


def _block_pairs(by_sm: dict) -> dict:
    """Of SMs that ran exactly two grid blocks: how far apart the two blocks ended (us, mean) and
    how often the block that started first also ended first. Session 54 found the first-started
    block ending ~13.5 us early on every SM; a twin block (variant 79) should bring this to ~0."""
    gaps, first_ends_first = [], 0
    for ts in by_sm.values():
        blocks = defaultdict(list)
        for t in ts:
            blocks[t["grid_block"]].append(t)
        if len(blocks) != 2:
            continue
        (_, a_end), (_, b_end) = sorted(
            (min(t["start"] for t in b), max(t["end"] for t in b)) for b in blocks.values())
        gaps.append(abs(a_end - b_end))
        first_ends_first += a_end <= b_end
    if not gaps:
        return {}
    return {"pair_sms": len(gaps), "pair_end_gap_us": _us(statistics.mean(gaps)),
            "pair_first_started_ends_first": round(first_ends_first / len(gaps), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x28672")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--variants", nargs="+", type=int, default=[72, 73])
    ap.add_argument("--calls", type=int, default=3, help="stamped calls per variant (after 3 unstamped warm-ups)")
    ap.add_argument("--dump", default=None, help="also write every call's teams to this JSON-lines file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "sa_stamps", "error": "no CUDA device"}))
        return 1
    from bench.linear import make_layer
    from engine import ops

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n_in, n_out = (int(v) for v in args.shape.split("x"))
    t = make_layer(n_in, n_out, 4, "mul1", dev, gen)
    x = torch.randn(args.m, n_in, device=dev, generator=gen).half()
    slots = 4096
    buf = torch.zeros(slots * STAMP_WORDS, dtype=torch.int64, device=dev)
    ext = ops.extension()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dump = open(args.dump, "a") if args.dump else None
    try:
        for variant in args.variants:
            with ops.debug_variant(variant):
                for _ in range(3):
                    ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
                for call in range(args.calls):
                    buf.zero_()
                    ext.set_sa_stamp_buffer(buf.data_ptr(), slots)
                    ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
                    torch.cuda.synchronize()
                    ext.set_sa_stamp_buffer(0, 0)
                    teams = decode_stamps(buf.cpu().tolist())
                    head = {"bench": "sa_stamps", "variant": variant, "shape": args.shape, "m": args.m,
                            "call": call}
                    print(json.dumps({**head, **summarize(teams, sms)}), flush=True)
                    if dump:
                        dump.write(json.dumps({**head, "sms": sms, "teams": teams}) + "\n")
    finally:
        ext.set_sa_stamp_buffer(0, 0)
        if dump:
            dump.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
