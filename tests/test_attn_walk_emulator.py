"""The lane-level emulation of decode attention's tensor-core walk (bench/attn_walk_emulator.py) on
the CPU: the ring layout, ldmatrix addresses, MMA fragments, online softmax and output placement of
both forms of the walk give the reference attention. The 16-key form (head dims 64, 128) is the
one GPU runs vouch for; the 8-key form of head dim 256 is checked against the same model."""
import pytest

from bench.attn_walk_emulator import check


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("keys,heads,masked,cap", [(16, 4, "none", None), (37, 3, "head", None), (24, 1, "tail", 1.5),
                                                   (9, 2, "none", 1.5)])
def test_emulated_walk_gives_the_reference_attention(D, keys, heads, masked, cap):
    # fp16 probabilities bound the error near 1e-3; a misplaced fragment or row is off by ~1
    assert check(D, keys, heads, masked, cap, seed=D + keys) < 2e-3
