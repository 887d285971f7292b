"""Float32 emulation of the two summation orders behind decode attention's per-head q/k norm
(head_rms_norm in csrc/decode_attention.cu), which promises the bits of rms_norm_kernel
(csrc/hadamard_norm.cu) at n = head dim:

- rms_norm_kernel: 128 threads, thread t holds the pair t (its x*x + y*y, fused as
  pair_square_sum rounds it), each warp sums by an xor butterfly, then the block's 4 warp sums go
  through a second butterfly (lanes past 4 adding zeros): (w0 + w2) + (w1 + w3);
- head_rms_norm: lane l holds the pairs D/64 * l .. (its halves of the head row), replays the
  first butterfly on pair indices (in-lane below D/64, across lanes above), then adds the warps'
  sums by shuffles of 16 (and 8).

Every addition is rounded to float32 as the GPU rounds it, so equal sums here mean equal bits
there, if the kernels do what their comments say.  python -m bench.head_norm_emulator
"""
from __future__ import annotations

import numpy as np

f32 = np.float32


def pair_square_sum(x: float, y: float) -> np.float32:
    """fma(x, x, rn(y * y)): the exact x*x plus the rounded y*y, rounded once."""
    return f32(np.float64(x) * np.float64(x) + np.float64(f32(y) * f32(y)))


def norm_kernel_sum(pairs: list[tuple[float, float]], threads: int = 128) -> np.float32:
    v = [f32(0)] * threads
    for t, (x, y) in enumerate(pairs):
        v[t] = pair_square_sum(x, y)
    sums = []
    for w in range(threads // 32):
        lanes = v[32 * w:32 * w + 32]
        for s in (16, 8, 4, 2, 1):
            lanes = [f32(lanes[l] + lanes[l ^ s]) for l in range(32)]
        sums.append(lanes[0])
    lanes = [sums[l] if l < len(sums) else f32(0) for l in range(32)]
    for s in (16, 8, 4, 2, 1):
        lanes = [f32(lanes[l] + lanes[l ^ s]) for l in range(32)]
    return lanes[0]


def head_norm_sum(pairs: list[tuple[float, float]]) -> np.float32:
    dl = len(pairs) // 16  # halves per lane
    P = dl // 2            # pairs per lane
    ss = [[pair_square_sum(*pairs[P * l + e]) for e in range(P)] for l in range(32)]
    for s in (16, 8, 4, 2, 1):
        if s >= P:
            ss = [[f32(ss[l][e] + ss[l ^ (s // P)][e]) for e in range(P)] for l in range(32)]
        else:
            ss = [[f32(ss[l][e] + ss[l][e ^ s]) for e in range(P)] for l in range(32)]
    total = [ss[l][0] for l in range(32)]
    if dl >= 4:
        total = [f32(total[l] + total[l ^ 16]) for l in range(32)]
    if dl == 8:
        total = [f32(total[l] + total[l ^ 8]) for l in range(32)]
    assert all(t == total[0] for t in total), "lanes disagree"
    return total[0]


def mismatches(D: int, rows: int = 200, seed: int = 0) -> int:
    """Rows of fp16 values (of mixed magnitudes) whose two sums differ."""
    rng = np.random.default_rng(seed)
    bad = 0
    for _ in range(rows):
        x = (rng.standard_normal(D) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float16).astype(np.float32)
        pairs = [(x[2 * i], x[2 * i + 1]) for i in range(D // 2)]
        bad += norm_kernel_sum(pairs) != head_norm_sum(pairs)
    return bad


if __name__ == "__main__":
    for D in (64, 128, 256):
        print({"D": D, "rows": 200, "mismatches": mismatches(D)})
