"""The lane-level emulation of decode attention's tensor-core walk (bench/attn_walk_emulator.py) on
the CPU: the ring layout, ldmatrix addresses, MMA fragments, online softmax and output placement of
both forms of the walk give the reference attention. The 16-key form (head dims 64, 128) is the
one GPU runs vouch for; the 8-key form of head dim 256 is checked against the same model. And the
kernel's per-head q/k norm sums in the norm kernel's order (bench/head_norm_emulator.py)."""
import numpy as np
import pytest

from bench.attn_walk_emulator import check
from bench.head_norm_emulator import head_norm_sum, mismatches


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("keys,heads,masked,cap", [(16, 4, "none", None), (37, 3, "head", None), (24, 1, "tail", 1.5),
                                                   (9, 2, "none", 1.5)])
def test_emulated_walk_gives_the_reference_attention(D, keys, heads, masked, cap):
    # fp16 probabilities bound the error near 1e-3; a misplaced fragment or row is off by ~1
    assert check(D, keys, heads, masked, cap, seed=D + keys) < 2e-3


@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_norm_sums_in_the_norm_kernels_order(D):
    """decode attention's per-head q/k norm adds a head's squares in rms_norm_kernel's order, so
    its sums (and so its outputs) are the norm kernel's to the bit (bench/head_norm_emulator.py)."""
    assert mismatches(D, rows=60, seed=D) == 0
    # the order matters: a plain left-to-right float32 sum disagrees on some rows
    rng = np.random.default_rng(1)
    differs = 0
    for _ in range(60):
        x = (rng.standard_normal(D) * 30).astype(np.float16).astype(np.float32)
        pairs = [(x[2 * i], x[2 * i + 1]) for i in range(D // 2)]
        plain = np.float32(0)
        for a, b in pairs:
            plain = np.float32(plain + np.float32(a * a + b * b))
        differs += plain != head_norm_sum(pairs)
    assert differs > 0
