"""Per-layer timing of one EXL3 linear against dense fp16 in the same run (anchors.md §1).

    python -m bench.linear                       # anchors shapes, K 2..6, m 1/8/32, mul1
    python -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 32 --codebook mul1 mcg 3inst

One JSON line per (shape, m, K, codebook, path): microseconds per call (median of CUDA-event
timed batches), the dense fp16 time of the same shape in the same run, and their ratio. `cold`
rotates through enough weight copies that nothing is served from L2 (as in a real decode step,
which touches each layer once); `hot` reuses one copy, as the anchors table was measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

ANCHOR_SHAPES = ["4096x4096", "4096x14336", "14336x4096", "8192x28672", "28672x8192"]
# anchors.md §1: (shape, m) -> (fp16 us, {K: exl3 us}), the reference on the lent H200.
ANCHORS = {
    ("4096x4096", 1): (26.6, {2: 14.5, 3: 15.5, 4: 15.3, 5: 15.0, 6: 15.8}),
    ("4096x4096", 8): (27.0, {2: 18.8, 3: 18.2, 4: 17.9, 5: 24.4, 6: 24.6}),
    ("4096x4096", 32): (26.4, {2: 43.5, 3: 44.1, 4: 43.4, 5: 46.2, 6: 46.1}),
    ("4096x14336", 1): (31.3, {2: 25.7, 3: 27.9, 4: 26.0, 5: 25.3, 6: 29.1}),
    ("4096x14336", 8): (31.4, {2: 30.3, 3: 39.9, 4: 30.0, 5: 41.1, 6: 41.2}),
    ("4096x14336", 32): (32.0, {2: 77.4, 3: 80.9, 4: 75.3, 5: 86.4, 6: 87.3}),
    ("14336x4096", 1): (34.4, {2: 28.4, 3: 32.5, 4: 31.6, 5: 28.1, 6: 32.2}),
    ("14336x4096", 8): (35.0, {2: 30.1, 3: 35.7, 4: 33.7, 5: 53.0, 6: 54.1}),
    ("14336x4096", 32): (33.8, {2: 96.0, 3: 101.8, 4: 94.2, 5: 108.9, 6: 108.8}),
    ("8192x28672", 1): (110.0, {2: 70.4, 3: 72.5, 4: 69.0, 5: 83.1, 6: 109.8}),
    ("8192x28672", 8): (111.7, {2: 109.0, 3: 111.3, 4: 105.8, 5: 116.5, 6: 116.9}),
    ("8192x28672", 32): (112.9, {2: 215.3, 3: 222.9, 4: 212.9, 5: 234.4, 6: 235.1}),
    ("28672x8192", 1): (108.8, {2: 70.3, 3: 72.9, 4: 75.4, 5: 75.9, 6: 93.0}),
    ("28672x8192", 8): (109.8, {2: 97.0, 3: 111.3, 4: 101.1, 5: 126.0, 6: 126.7}),
    ("28672x8192", 32): (113.0, {2: 245.5, 3: 254.1, 4: 240.8, 5: 264.5, 6: 266.8}),
}
L2_BYTES = 60 << 20


# "events": the calls issued from Python between two CUDA events (what an eager caller sees; a
# small layer is then host-bound). "graph": the same calls captured once in a CUDA graph and
# replayed, so only GPU time counts, as in the engine's graph-replayed decode.
TIMING = {"mode": "events"}


def time_calls(fn, calls: int, warmup: int, batches: int = 5) -> float:
    """Median microseconds per call over `batches` CUDA-event timed runs of `calls` calls."""
    for _ in range(warmup):
        fn(0)
    torch.cuda.synchronize()
    run = lambda: [fn(i) for i in range(calls)]  # noqa: E731
    if TIMING["mode"] == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
        run()
    per_call = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        per_call.append(a.elapsed_time(b) * 1000.0 / calls)
    return statistics.median(per_call)


def copies_for(nbytes: int, cold: bool) -> int:
    return max(1, -(-4 * L2_BYTES // nbytes)) if cold else 1


def make_layer(n_in: int, n_out: int, K: int, codebook: str, device, gen):
    from engine.formats.exl3 import EXL3Tensors

    trellis = torch.randint(-32768, 32768, (n_in // 16, n_out // 16, 16 * K), dtype=torch.int32, device=device, generator=gen).to(torch.int16)
    sign = lambda n: (torch.randint(0, 2, (n,), device=device, generator=gen) * 2 - 1).half()  # noqa: E731
    return EXL3Tensors(trellis, sign(n_in) * n_in ** -0.25, sign(n_out) * n_in ** -0.25, codebook)


def bench_shape(shape: str, ms, Ks, codebooks, paths, cold: bool, calls: int, warmup: int, out=sys.stdout):
    from engine import ops

    n_in, n_out = (int(v) for v in shape.split("x"))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for m in ms:
        x = torch.randn(m, n_in, device=dev, generator=gen).half()
        ws = [torch.randn(n_in, n_out, device=dev, generator=gen).half() for _ in range(copies_for(n_in * n_out * 2, cold))]
        dense_us = time_calls(lambda i: torch.matmul(x, ws[i % len(ws)]), calls, warmup)
        del ws
        for cb in codebooks:
            for K in Ks:
                layers = [make_layer(n_in, n_out, K, cb, dev, gen) for _ in range(copies_for(n_in * n_out * K // 8, cold))]
                for path in paths:
                    if path == "torch" and (m > 8 or n_in * n_out > 4096 * 14336 or TIMING["mode"] == "graph"):
                        continue  # the reference path reconstructs per call: seconds of timing
                    c = max(3, calls // 50) if path == "torch" else calls
                    if path == "fused2":  # the previous kernel generation, for a same-run ratio
                        fn = lambda i: ops.exl3_gemm(x, layers[i % len(layers)], mode="fused", version=2)  # noqa: E731
                    else:
                        fn = lambda i: ops.exl3_gemm(x, layers[i % len(layers)], mode=path)  # noqa: E731
                    us = time_calls(fn, c, min(warmup, 3) if path == "torch" else warmup)
                    anchor = ANCHORS.get((shape, m))
                    ref_ratio = None
                    if anchor and K in anchor[1]:
                        ref_ratio = round(anchor[1][K] / anchor[0], 3)
                    row = {
                        "bench": "linear", "shape": shape, "m": m, "K": K, "codebook": cb, "path": path,
                        "cache": "cold" if cold else "hot", "timing": TIMING["mode"], "us": round(us, 2),
                        "fp16_us": round(dense_us, 2),
                        "ratio_vs_fp16": round(us / dense_us, 3), "reference_ratio_vs_fp16": ref_ratio,
                        "trellis_GBps": round(n_in * n_out * K / 8 / us / 1e3, 1),
                    }
                    print(json.dumps(row), file=out, flush=True)
                    rows.append(row)
                del layers
    return rows


def run_once(args) -> int:
    """Warm up, then call each configuration's product once more: a target for profilers."""
    from engine import ops

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes:
        n_in, n_out = (int(v) for v in shape.split("x"))
        for cb in args.codebook:
            for K in args.K:
                t = make_layer(n_in, n_out, K, cb, dev, gen)
                for m in args.m:
                    x = torch.randn(m, n_in, device=dev, generator=gen).half()
                    for _ in range(3):
                        ops.exl3_gemm(x, t)
    torch.cuda.synchronize()
    return 0


def dispatch_overhead(calls: int = 2000) -> dict:
    """Host microseconds per call on a tiny layer (GPU time negligible): ops.exl3_gemm vs the raw
    extension call vs a plain torch.matmul."""
    import time

    from engine import ops

    dev = torch.device("cuda")
    t = make_layer(128, 128, 4, "mcg", dev, torch.Generator(device=dev).manual_seed(0))
    x = torch.randn(1, 128, device=dev).half()
    w = torch.randn(128, 128, device=dev).half()
    ext = ops.extension()
    ws = ops.workspace(dev, 32 * 128)
    cnt = ops.block_counters(dev, 1)
    fns = {
        "ops_exl3_gemm_us": lambda: ops.exl3_gemm(x, t),
        "ext_exl3_gemm_us": lambda: ext.exl3_gemm(x, t.suh, t.svh, t.trellis, None, 1, ws, 0, 0, 3, cnt, [], None, 0,
                                                           None, 0.0, None, None, [], [], 0, 0, [], None, False),
        "torch_matmul_us": lambda: torch.matmul(x, w),
    }
    res = {}
    for name, fn in fns.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        res[name] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    return res


def check_once(n_in: int, n_out: int, K: int, codebook: str, m: int, version: int | None = None) -> float:
    """Relative RMS of the fused product against the fp32 reference (sanity line in the log)."""
    from engine import ops
    from engine.formats.exl3 import exl3_matmul_reference

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    t = make_layer(n_in, n_out, K, codebook, dev, gen)
    x = torch.randn(m, n_in, device=dev, generator=gen).half()
    y = ops.exl3_gemm(x, t, version=version).float()
    ref = exl3_matmul_reference(x.float(), t)
    return float((y - ref).norm() / ref.norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="EXL3 linear vs dense fp16 timing (JSON lines)")
    ap.add_argument("--shapes", nargs="+", default=ANCHOR_SHAPES)
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--K", nargs="+", type=int, default=[2, 3, 4, 5, 6])
    ap.add_argument("--codebook", nargs="+", default=["mul1"])
    ap.add_argument("--paths", nargs="+", default=["auto"], help="auto fused fused2 (previous kernel) dense torch")
    ap.add_argument("--cache", choices=["cold", "hot", "both"], default="both")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--probe", action="store_true",
                    help="also time the fused kernel with its decode left out and with its MMAs left out")
    ap.add_argument("--once", action="store_true", help="a few calls per config and no timing (for ncu)")
    ap.add_argument("--timing", choices=["events", "graph"], default="events",
                    help="events: Python-issued calls (host cost included); graph: replay of captured calls (GPU only)")
    ap.add_argument("--min-units", type=int, default=None,
                    help="version-3 product: fewest units per warp when the launcher shrinks the grid (default 8)")
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help="also time these occupancy configurations of the fused kernel (10 + CFG, K = 4), "
                         "each checked against the reference first")
    args = ap.parse_args(argv)
    TIMING["mode"] = args.timing
    if args.once:
        return run_once(args)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "linear", "error": "no CUDA device"}))
        return 1
    if args.min_units is not None:
        from engine import ops
        ops.extension().set_gemv_min_units(args.min_units)
    print(json.dumps({"bench": "linear", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "check_rel_rms_8192x28672_K4_m8": round(check_once(8192, 28672, 4, "mul1", 8), 6),
                      "check_rel_rms_8192x28672_K4_m1": round(check_once(8192, 28672, 4, "mul1", 1), 6),
                      "check_rel_rms_v2_8192x28672_K4_m8": round(check_once(8192, 28672, 4, "mul1", 8, 2), 6)}), flush=True)
    print(json.dumps({"bench": "linear", **dispatch_overhead()}), flush=True)
    modes = ["cold", "hot"] if args.cache == "both" else [args.cache]
    for shape in args.shapes:
        for mode in modes:
            bench_shape(shape, args.m, args.K, args.codebook, args.paths, mode == "cold", args.calls, args.warmup)
    if args.probe:
        probe(args)
    if args.variants:
        tune(args)
    return 0


def tune(args) -> None:
    """Occupancy configurations of the version-3 product (csrc/exl3_gemv_geom.cuh, gv_tune), each
    checked against the reference and timed cold, so that one run picks the best."""
    from engine import ops

    for variant in args.variants:
        with ops.debug_variant(variant):
            for shape in args.shapes:
                n_in, n_out = (int(v) for v in shape.split("x"))
                checks = {m: round(check_once(n_in, n_out, 4, "mul1", m), 6) for m in args.m}
                for row in bench_shape(shape, args.m, [4], ["mul1"], ["fused"], True, args.calls, args.warmup,
                                       out=open("/dev/null", "w")):
                    print(json.dumps({**row, "bench": "linear_tune", "variant": variant,
                                      "check_rel_rms": checks.get(row["m"])}), flush=True)


PROBES = ((1, "no_decode"), (2, "no_mma"), (3, "one_stream"), (4, "launch_only"), (5, "no_tail"),
          (6, "no_finish"), (0, "no_prep"), (0, "full"))


def probe(args) -> None:
    """Which stage limits the fused kernel: time it whole and with one stage left out (the
    decode, the MMAs, the split-k tail, the output stage, the prep kernel before it; or all but
    the launch). Results are wrong; only the times mean something. 4-6 exist for K = 4 MUL1."""
    from engine import ops

    ext = ops.extension()
    for shape in args.shapes:
        for variant, name in PROBES:
            ext.set_prep_skip(name == "no_prep")
            try:
                with ops.debug_variant(variant):
                    for row in bench_shape(shape, args.m, args.K, args.codebook, ["fused"], True, args.calls,
                                           args.warmup, out=open("/dev/null", "w")):
                        print(json.dumps({**row, "bench": "linear_probe", "variant": name}), flush=True)
            finally:
                ext.set_prep_skip(False)


if __name__ == "__main__":
    raise SystemExit(main())
