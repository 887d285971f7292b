"""`trellis bench linear|decode|prefill|attention|generate|sampling|viterbi ...`: thin wrappers over python -m
bench.<name>."""
from __future__ import annotations

import argparse
import importlib


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="GPU benchmarks (JSON lines): linear, decode, prefill, attention, generate, sampling, "
                                            "viterbi")
    p.add_argument("which", choices=["linear", "decode", "prefill", "attention", "generate", "sampling", "viterbi"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="options passed to python -m bench.<which>")
    p.set_defaults(func=_run)


def _run(args) -> int:
    mod = importlib.import_module(f"bench.{args.which}")
    return int(mod.main(args.args) or 0)
