"""Batch-1 decode speed on a synthetic EXL3 model (anchors.md §2), torch path and CUDA path.

    python -m bench.decode --shape llama3-8b --bits 4 --model-dir /tmp/l8b

Loop as the reference measured it: one token per forward, argmax, host sync each token. Paths:
  torch       load_model as is (its QuantLinear keeps a reconstructed dense fp16 weight)
  cuda        EXL3 linears routed through the kernels (engine.ops), eager PyTorch around them
  cuda-graph  the same, each decode step a CUDA-graph replay of the model's own forward over a
              static cache (engine.generate.graph_decode, what generate() uses on CUDA), so no
              host work is left per token but the sync that reads the token
Prints one JSON line per (path, context).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def ensure_model(model_dir: Path, shape: str, bits: float, codebook: str) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from bench.synth import SHAPES, write_synth_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    write_synth_model(model_dir, SHAPES[shape], bits, codebook=codebook, device=dev)
    print(json.dumps({"bench": "synth", "dir": str(model_dir), "seconds": round(time.time() - t0, 1)}), flush=True)
    return model_dir


def load(model_dir: Path, path: str):
    from engine.models import load_model
    from engine.ops.model_patch import route_quant_linears

    t0 = time.time()
    if path == "torch":  # the baseline: QuantLinear keeps a reconstructed dense weight
        os.environ["TRELLIS_KERNELS"] = "torch"
    try:
        model = load_model(model_dir, device="cuda")
    finally:
        os.environ.pop("TRELLIS_KERNELS", None)
    if path != "torch":
        route_quant_linears(model)
    torch.cuda.synchronize()
    return model, time.time() - t0


def decode_eager(model, context: int, tokens: int) -> float:
    """Tokens/s of the model's own forward with its KV cache (one token per forward)."""
    cache = model.new_cache(1, context + tokens + 8)
    return _timed_decode(lambda ids: model(ids, cache), cache, context, tokens)


def decode_graph(model, context: int, tokens: int) -> float:
    """Tokens/s of the engine's CUDA-graph decode (engine.generate.graph_decode), as generate() runs it."""
    from engine.generate.graph_decode import GraphDecoder

    decoder = GraphDecoder(model)  # directly, whatever TRELLIS_CUDA_GRAPHS says
    cache = decoder.new_cache(1, context + tokens + 8)
    tps = _timed_decode(decoder.step, cache, context, tokens)
    if decoder.disabled:  # it fell back to eager steps: that is not this path's number
        raise RuntimeError(f"capture failed: {decoder.disabled}")
    return tps


def _timed_decode(step, cache, context: int, tokens: int) -> float:
    if context:
        cache.advance(context)  # the cache content does not change the work done
    ids = torch.ones(1, 1, dtype=torch.long, device=cache.device)
    with torch.inference_mode():
        for _ in range(3):
            ids = step(ids)[:, -1].argmax(-1, keepdim=True)
            int(ids)
        cache.truncate(context)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            ids = step(ids)[:, -1].argmax(-1, keepdim=True)
            int(ids)  # host sync per token, like the reference's loop
        dt = time.perf_counter() - t0
    return tokens / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="batch-1 decode tokens/s on a synthetic EXL3 model")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--model-dir", default="/tmp/trellis-synth-llama3-8b")
    ap.add_argument("--paths", nargs="+", default=["torch", "cuda", "cuda-graph"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 4096])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print the top CPU ops of 3 eager tokens per path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "decode", "error": "no CUDA device"}))
        return 1
    model_dir = ensure_model(Path(args.model_dir), args.shape, args.bits, args.codebook)
    loaded = {}
    for path in args.paths:
        kind = "torch" if path == "torch" else "cuda"
        if kind not in loaded:
            loaded.clear()
            torch.cuda.empty_cache()
            loaded[kind] = load(model_dir, kind)
        model, load_s = loaded[kind]
        for ctx in args.contexts:
            try:
                tps = decode_graph(model, ctx, args.tokens) if path == "cuda-graph" else decode_eager(model, ctx, args.tokens)
                row = {"bench": "decode", "shape": args.shape, "bits": args.bits, "path": path, "context": ctx,
                       "tokens_per_s": round(tps, 1), "load_s": round(load_s, 1),
                       "gpu_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
            except Exception as e:  # report and go on: one failing path must not hide the others
                row = {"bench": "decode", "path": path, "context": ctx, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
        if args.profile and path != "cuda-graph":
            profile_eager(model, path)
    return 0


def profile_eager(model, path: str) -> None:
    """Where an eager decode token's host time goes (top ops by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(1, 64)
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(ids, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ids = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
                int(ids)
    print(f"profile {path}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    raise SystemExit(main())
