"""Converter quality on a real model: convert at several bpw, then perplexity and KL divergence
against the unquantized model on held-out text, plus conversion times. JSON lines on stdout.

    python -m bench.convert_quality --model SMOLLM2_BF16_DIR --eval-text austen.txt --out /tmp/cq
    (--gguf PATH imports the model from a GGUF first when --model does not exist yet;
     bench/eval_text.py makes austen.txt from Debian's r-cran-janeaustenr)

Defaults follow the issue: 2.0/3.0/4.0/5.0 bpw, head 6 bits, 40 windows of 2048 tokens,
calibration 250 rows x 2048 tokens, scale search "full" on CUDA. Reference numbers (exllamav3
v1.4.1 on SmolLM2-135M zero-padded to hidden 640, H200): KLD 0.77 / 0.155 / 0.042 / 0.014 at
2/3/4/5 bpw, 90-100 s per conversion, bf16 perplexity 29.1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engine.evaluate import score_windows, split_windows

REFERENCE_KLD = {2.0: 0.77, 3.0: 0.155, 4.0: 0.042, 5.0: 0.014}


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def eval_windows(tokenizer, text: str, windows: int, seqlen: int) -> list[list[int]]:
    chunks = [c for c in split_windows(tokenizer.encode(text), seqlen, None) if len(c) == seqlen]
    if len(chunks) < windows:
        print(f"warning: text gives only {len(chunks)} windows of {seqlen} tokens (asked {windows})", file=sys.stderr)
    return chunks[:windows]


def compare(model, ref, windows: list[list[int]]) -> dict:
    """Perplexity of both, mean KL(ref ‖ model) per token, top-1 agreement."""
    s = score_windows(model, windows, ref)
    return {"ppl": s["ppl"], "ref_ppl": s["ref_ppl"], "kld": s["kl_div"],
            "top1_agreement": s["top1_agreement"], "tokens": s["tokens"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="unquantized HF model folder (bf16)")
    ap.add_argument("--gguf", type=Path, default=None, help="import this GGUF into --model first if it is missing")
    ap.add_argument("--eval-text", required=True, type=Path, help="held-out UTF-8 text")
    ap.add_argument("--out", required=True, type=Path, help="folder for the converted models")
    ap.add_argument("--bits", default="2.0,3.0,4.0,5.0")
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--cal-rows", type=int, default=250)
    ap.add_argument("--cal-cols", type=int, default=2048)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scale-search", default="auto", choices=["auto", "full", "fast"])
    ap.add_argument("--allocation", default="measured", choices=["measured", "heuristic"])
    ap.add_argument("--eval-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--keep", action="store_true", help="keep converted models")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay the Viterbi encoder as CUDA graphs (TRELLIS_CUDA_GRAPHS=1; fewer launches)")
    args = ap.parse_args(argv)
    if args.cuda_graphs:
        import os
        os.environ["TRELLIS_CUDA_GRAPHS"] = "1"

    from engine.convert import ConversionJob, ConvertSettings
    from engine.models import load_model
    from engine.tokenizer import Tokenizer

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if not args.model.is_dir():
        if args.gguf is None:
            ap.error(f"{args.model} does not exist (give --gguf to import it)")
        from engine.gguf_import import import_gguf
        t0 = time.time()
        import_gguf(args.gguf, args.model)
        emit({"event": "import_gguf", "seconds": round(time.time() - t0, 2), "model": str(args.model)})
    dtype = getattr(torch, args.eval_dtype)
    tok = Tokenizer.from_dir(args.model)
    windows = eval_windows(tok, args.eval_text.read_text(encoding="utf-8"), args.windows, args.seqlen)
    ref = load_model(args.model, device=device, dtype=dtype)
    emit({"event": "setup", "device": str(device), "windows": len(windows), "seqlen": args.seqlen,
          "cuda_graphs": bool(args.cuda_graphs), "allocation": args.allocation, "cal": [args.cal_rows, args.cal_cols],
          "model": str(args.model), "eval_text": str(args.eval_text)})
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for bits in [float(b) for b in args.bits.split(",")]:
        out = args.out / f"{bits:.2f}bpw"
        if out.exists():
            import shutil
            shutil.rmtree(out)
        settings = ConvertSettings(in_dir=str(args.model), out_dir=str(out), bits=bits, head_bits=args.head_bits,
                                   codebook=args.codebook, cal_rows=args.cal_rows, cal_cols=args.cal_cols,
                                   device=str(device), scale_effort=args.scale_search, allocation=args.allocation,
                                   work_dir=str(args.out / f"{bits:.2f}bpw.work"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        ConversionJob(settings, log=lambda m: print(m, file=sys.stderr, flush=True)).run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - t0
        emit({"event": "convert", "bits": bits, "seconds": round(seconds, 2)})
        model = load_model(out, device=device, dtype=dtype)
        q = compare(model, ref, windows)
        del model
        row = {"event": "quality", "bits": bits, "head_bits": args.head_bits, "convert_seconds": round(seconds, 2),
               **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in q.items()}}
        if bits in REFERENCE_KLD:
            row["reference_kld"] = REFERENCE_KLD[bits]
        emit(row)
        rows.append(row)
        if not args.keep:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
    emit({"event": "summary", "results": [{k: r[k] for k in ("bits", "ppl", "kld", "convert_seconds")} for r in rows],
          "ref_ppl": rows[0]["ref_ppl"] if rows else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
