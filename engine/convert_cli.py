"""`trellis convert`: HF folder → EXL3 folder (engine/convert.py), resumable with -r.

Progress goes to stderr as readable lines, or to stdout as JSON lines with --progress-json (the
desktop app's wizard reads those)."""
from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="quantize a Hugging Face model folder to EXL3")
    p.add_argument("-i", "--in-dir", required=True, type=Path, help="input HF model folder (safetensors)")
    p.add_argument("-o", "--out-dir", required=True, type=Path, help="output folder (must not exist or be empty)")
    p.add_argument("-b", "--bits", required=True, type=float, help="target bits per weight, 1.0..8.0")
    p.add_argument("-hb", "--head-bits", type=int, default=6, help="head bits 1..8, or 16 = unquantized (default 6)")
    p.add_argument("-w", "--work-dir", type=Path, default=None, help="working folder (default <out>.work)")
    p.add_argument("-r", "--resume", action="store_true", help="resume the job in the working folder")
    p.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"], help="trellis codebook (default mul1)")
    p.add_argument("--cal-rows", type=int, default=250, help="calibration rows (default 250)")
    p.add_argument("--cal-cols", type=int, default=2048, help="tokens per calibration row (default 2048)")
    p.add_argument("--calibration", type=Path, default=None, help="text file or folder to calibrate on instead of the built-in mix")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--seed", type=int, default=0, help="seed for signs and random calibration rows (default 0)")
    p.add_argument("--scale-search", default="auto", choices=["auto", "full", "fast"],
                   help="global scale search effort (auto: full on CUDA, fast on CPU)")
    p.add_argument("--allocation", default="measured", choices=["measured", "heuristic"],
                   help="how the bpw budget is spread: measured (K per linear from its measured effect on the "
                        "output, default) or heuristic (the reference's fixed order, K per group of linears)")
    p.add_argument("--shard-mb", type=float, default=8192, help="output shard size in MB (default 8192)")
    p.add_argument("--keep-work", action="store_true", help="keep the working folder after success")
    p.add_argument("--progress-json", action="store_true", help="print progress as JSON lines on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-module log lines")
    p.set_defaults(func=run)


def run(args) -> int:
    from engine.convert import ConversionJob, ConvertSettings

    settings = ConvertSettings(
        in_dir=str(args.in_dir), out_dir=str(args.out_dir), bits=args.bits, head_bits=args.head_bits,
        work_dir=str(args.work_dir) if args.work_dir else None, codebook=args.codebook,
        cal_rows=args.cal_rows, cal_cols=args.cal_cols, device=args.device, seed=args.seed,
        calibration=str(args.calibration) if args.calibration else None, scale_effort=args.scale_search,
        shard_mb=args.shard_mb, keep_work=args.keep_work, allocation=args.allocation,
    )

    def on_progress(e) -> None:
        if args.progress_json:
            print(e.to_json(), flush=True)
        elif not args.quiet and e.stage == "measure" and e.total and e.index == e.total:
            print(f"[measure] sensitivities of {e.total} linears measured ({e.elapsed_s:.0f} s)", file=sys.stderr, flush=True)
        elif not args.quiet and e.stage == "module":
            eta = f", ETA {e.eta_s:.0f} s" if e.eta_s is not None else ""
            print(f"[{e.index}/{e.total}] {e.module} done ({e.elapsed_s:.0f} s{eta})", file=sys.stderr, flush=True)

    def on_log(line: str) -> None:
        if not args.quiet and not args.progress_json:
            print("  " + line, file=sys.stderr, flush=True)

    out = ConversionJob(settings, resume=args.resume, progress=on_progress, log=on_log).run()
    if not args.progress_json:
        print(str(out))
    return 0
