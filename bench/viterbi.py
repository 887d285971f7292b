"""Trellis encoder throughput: the fused CUDA Viterbi kernel against the torch path, same GPU, same run.

    python -m bench.viterbi                                  # K 2..5, batches of 96 and 1024 tiles
    python -m bench.viterbi --K 2 4 --tiles 36 96 1024 --codebook mul1 3inst

One LDLQ step of the converter encodes one row of out/16 tiles, so small batches (36..1000)
are what matters. One JSON line per (codebook, K, tiles): tiles/s of each path (median wall time
of synchronized calls through encode_tiles, so host work counts too), the speedup, and the share
of tiles whose states the two paths chose identically (expected 1.0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def seconds_per_call(fn, reps: int) -> float:
    fn()  # warm-up: extension build, LUT upload, allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--K", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--tiles", type=int, nargs="+", default=[96, 1024])
    p.add_argument("--codebook", nargs="+", default=["mul1"])
    p.add_argument("--reps", type=int, default=5, help="timed calls of the kernel path")
    p.add_argument("--torch-reps", type=int, default=2, help="timed calls of the torch path")
    args = p.parse_args(argv)

    from engine import ops
    from engine.quantize.viterbi import encode_tiles

    if not torch.cuda.is_available():
        print(json.dumps({"bench": "viterbi", "error": "no CUDA device"}))
        return 1
    os.environ.pop("TRELLIS_NO_CUDA_VITERBI", None)
    if not ops.kernels_available("cuda"):
        print(json.dumps({"bench": "viterbi", "error": "CUDA extension unavailable"}))
        return 1
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    for cb in args.codebook:
        for K in args.K:
            for n in args.tiles:
                x = torch.randn(n, 256, device=dev, generator=gen)
                k_s = seconds_per_call(lambda: encode_tiles(x, K, cb), args.reps)
                t_s = seconds_per_call(lambda: encode_tiles(x, K, cb, native=False), args.torch_reps)
                st_k, _ = encode_tiles(x, K, cb)
                st_t, _ = encode_tiles(x, K, cb, native=False)
                same = float((st_k == st_t).all(dim=1).float().mean())
                print(json.dumps({
                    "bench": "viterbi", "gpu": gpu, "codebook": cb, "K": K, "tiles": n,
                    "kernel_ms": round(k_s * 1e3, 3), "torch_ms": round(t_s * 1e3, 3),
                    "kernel_tiles_per_s": round(n / k_s, 1), "torch_tiles_per_s": round(n / t_s, 1),
                    "speedup": round(t_s / k_s, 2), "same_states": same,
                }), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
