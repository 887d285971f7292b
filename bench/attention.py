"""Decode attention alone: one query per sequence against a KV cache of S slots, on the GPU.

    python -m bench.attention                          # Llama-3.1-8B heads, 256 .. 32,768 slots
    python -m bench.attention --slots 4096 32768 --paths mma scalar sdpa

One JSON line per (slots, path): microseconds per call (graph replay, median of CUDA-event timed
batches), the bytes of K and V a call reads, the rate that makes, and the floor: those bytes at the
read rate of a plain reduction over 1 GiB measured in the same run. `cold` (the default) rotates
through enough caches that each call reads its K and V from DRAM, as a decode step does (every
layer has its own cache). Paths: `mma` our kernel's tensor-core key walk (shipped for head dims
64 and 128), `scalar` its scalar walk (everywhere before session 19; head dim 256), `sdpa`
torch's scaled_dot_product_attention on the same tensors (the engine's fallback), `capped`
engine.models.layers.capped_attention (the fallback where scores are soft-capped, which SDPA
cannot do). `--softcap C` caps the scores as Gemma 2 does (sdpa then has nothing to offer and is
left out); Gemma-2-9B's heads: `--heads 16 --kv-heads 8 --dim 256 --softcap 50`.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.linear import TIMING, copies_for, time_calls


def read_rate_gbps(nbytes: int = 1 << 30) -> float:
    """The rate a plain reduction reads DRAM at: the floor's bandwidth."""
    src = torch.ones(nbytes // 2, dtype=torch.float16, device="cuda")
    us = time_calls(lambda i: src.sum(dtype=torch.float32), calls=10, warmup=3)
    return nbytes / us / 1e3


def bench_slots(slots: int, paths, heads: int, kv_heads: int, dim: int, cold: bool, calls: int, warmup: int,
                floor_gbps: float, mma_one_split: int, softcap: float | None = None):
    from engine import ops
    from engine.models.layers import capped_attention

    ext = ops.extension()
    g = torch.Generator(device="cuda").manual_seed(slots)
    kv_bytes = 2 * kv_heads * slots * dim * 2
    n = copies_for(kv_bytes, cold)
    caches = [(torch.randn(1, kv_heads, slots, dim, generator=g, device="cuda").half(),
               torch.randn(1, kv_heads, slots, dim, generator=g, device="cuda").half()) for _ in range(n)]
    q = torch.randn(1, heads, 1, dim, generator=g, device="cuda").half()
    scale = dim ** -0.5
    if softcap is None:
        want = torch.nn.functional.scaled_dot_product_attention(q, caches[0][0], caches[0][1], scale=scale,
                                                                enable_gqa=True)
    else:
        want = capped_attention(q.float(), caches[0][0].float(), caches[0][1].float(), None, scale, softcap)
    rows = []
    for path in paths:
        if (path == "sdpa" and softcap is not None) or (path == "capped" and softcap is None):
            continue  # SDPA cannot cap scores; capped_attention is the fallback for capped ones
        if path == "capped":
            def call(i):
                k, v = caches[i % n]
                return capped_attention(q, k, v, None, scale, softcap)
        elif path == "sdpa":
            def call(i):
                k, v = caches[i % n]
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        else:
            ext.set_attn_mma_slots(1 if path == "mma" else 0)
            ext.set_attn_mma_d256(path == "mma")  # head dim 256: off by default (ops.ATTN_MMA_D256)

            def call(i):
                k, v = caches[i % n]
                return ops.decode_attention(q, k, v, None, scale, softcap=softcap)
        got = call(0)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        us = time_calls(call, calls, warmup)
        row = {"bench": "attention", "path": path, "slots": slots, "heads": heads, "kv_heads": kv_heads, "dim": dim,
               "softcap": softcap, "cold": cold, "mma_one_split": mma_one_split, "us": round(us, 2),
               "kv_MB": round(kv_bytes / 1e6, 2), "GBps": round(kv_bytes / us / 1e3, 1),
               "floor_us": round(kv_bytes / floor_gbps / 1e3, 2),
               "check_rel_rms_vs_" + ("sdpa" if softcap is None else "capped_fp32"): round(err, 6)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS)
    ext.set_attn_mma_d256(ops.ATTN_MMA_D256)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", nargs="+", type=int, default=[256, 1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--paths", nargs="+", default=["mma", "scalar", "sdpa"], choices=["mma", "scalar", "sdpa", "capped"])
    ap.add_argument("--softcap", type=float, default=None, help="cap the scores as Gemma 2 does (e.g. 50)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--cache", choices=["cold", "hot"], default="cold")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mma-one-split", type=int, default=None,
                    help="the tensor-core walk takes one split for spans of at most this many slots (default: shipped)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "attention", "error": "no CUDA device"}))
        return 1
    TIMING["mode"] = "graph"
    from engine import ops
    one_split = ops.ATTN_MMA_ONE_SPLIT if args.mma_one_split is None else args.mma_one_split
    ops.extension().set_attn_mma_one_split(one_split)
    floor = read_rate_gbps()
    print(json.dumps({"bench": "attention", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "read_GBps": round(floor, 1)}), flush=True)
    for slots in args.slots:
        bench_slots(slots, args.paths, args.heads, args.kv_heads, args.dim, args.cache == "cold", args.calls,
                    args.warmup, floor, one_split, args.softcap)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
