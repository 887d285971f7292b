"""bench.transcript_redraw runs on a small chat and reports its three figures (the timings
themselves are the benchmark's business, not a test's)."""
from __future__ import annotations

import json

from bench import transcript_redraw


def test_transcript_bench_reports_its_figures(qapp, capsys):
    assert transcript_redraw.main(["--messages", "6", "--reps", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["bench"] == "transcript_redraw" and row["messages"] == 6 and row["reps"] == 2
    assert all(row[k] > 0 for k in ("answer_start_ms", "answer_finish_ms", "full_redraw_ms"))
