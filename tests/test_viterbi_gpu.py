"""The fused CUDA Viterbi encoder (csrc/exl3_viterbi.cu) against the torch encoder it replaces
(run on the GPU machine: pytest -m gpu)."""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats.exl3 import codebook_lut, pack_symbols, unpack_states  # noqa: E402
from engine.quantize import viterbi  # noqa: E402
from engine.quantize.viterbi import encode_tiles  # noqa: E402

CODEBOOKS = ["3inst", "mcg", "mul1"]
DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def ext():
    return ops.extension()  # builds once; a build failure fails every test with its message


def gauss_tiles(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(n, 256, generator=g, device=DEV)


def kernel_states(x: torch.Tensor, K: int, cb: str, warmup: int = 128, lookahead: int = 64) -> torch.Tensor:
    t = x.half().float().contiguous()  # what encode_tiles feeds either path
    return ops.extension().viterbi_encode(t, K, codebook_lut(cb, DEV), warmup, lookahead)


def check_against_torch(x: torch.Tensor, K: int, cb: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel vs torch on the same tiles: a valid closed cycle, decoded = LUT at the states, and
    per tile no more squared error than torch's (+1e-5 relative). Returns both state tensors."""
    st_k = kernel_states(x, K, cb, **kw)
    st_t, dec_t = encode_tiles(x, K, cb, native=False, **kw)
    lut = codebook_lut(cb, DEV).float()
    N = 1 << (16 - K)
    assert st_k.shape == st_t.shape and st_k.dtype == torch.int32
    assert int(st_k.min()) >= 0 and int(st_k.max()) < 65536
    # consecutive states overlap by 16-K bits, and the last one wraps onto the first
    assert torch.equal(torch.roll(st_k, 1, dims=1) & (N - 1), st_k >> K)
    assert torch.equal(unpack_states(pack_symbols(st_k.cpu(), K)), st_k.cpu())
    dec_k = lut[st_k.long()]
    err_k = (dec_k - x).square().sum(dim=1)
    err_t = (dec_t - x).square().sum(dim=1)
    worse = err_k > err_t * (1 + 1e-5)
    assert not bool(worse.any()), (int(worse.sum()), float((err_k - err_t).max()))
    return st_k, st_t


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), CODEBOOKS)))
def test_kernel_matches_torch_encoder(K, cb):
    check_against_torch(gauss_tiles(37, seed=K * 10 + len(cb)), K, cb)


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), CODEBOOKS)))
def test_kernel_states_identical_to_torch(K, cb):
    """Stronger than needed for quality, but expected: the kernel makes the torch path's roundings
    and tie choices (see csrc/exl3_viterbi.cu), so conversions do not depend on the path."""
    x = gauss_tiles(37, seed=K * 10 + len(cb))
    st_k = kernel_states(x, K, cb)
    st_t, _ = encode_tiles(x, K, cb, native=False)
    same = (st_k == st_t).all(dim=1).float().mean()
    assert float(same) == 1.0, float(same)


@pytest.mark.parametrize("K", [1, 2, 5, 8])
def test_encode_tiles_uses_the_kernel_and_env_var_forces_torch(K, monkeypatch):
    x = gauss_tiles(5, seed=3 + K)
    st, dec = encode_tiles(x.view(5, 1, 256), K, "mcg")  # any [..., 256] shape
    assert st.shape == (5, 1, 256)
    st, dec = st.view(5, 256), dec.view(5, 256)
    assert torch.equal(st, kernel_states(x, K, "mcg"))
    assert torch.equal(dec, codebook_lut("mcg", DEV).float()[st.long()])

    class NoKernel:
        def viterbi_encode(self, *a):
            raise AssertionError("the kernel ran despite TRELLIS_NO_CUDA_VITERBI=1")

    monkeypatch.setattr(ops, "extension", lambda: NoKernel())
    monkeypatch.setenv("TRELLIS_NO_CUDA_VITERBI", "1")
    st2, _ = viterbi.encode_tiles(x, K, "mcg")
    assert torch.equal(st2, st)


def test_more_tiles_than_blocks():
    """Each block loops over several tiles (persistent grid), reusing its scratch."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    x = gauss_tiles(2 * sms + 7, seed=99)
    for K in (2, 4):
        st_k, st_t = check_against_torch(x, K, "mul1")
        assert torch.equal(st_k, st_t)


@pytest.mark.parametrize("warmup,lookahead", [(256, 256), (64, 0), (1, 17), (200, 100)])
def test_other_pass_lengths(warmup, lookahead):
    x = gauss_tiles(9, seed=warmup + lookahead)
    for K in (1, 3, 6):
        st_k, st_t = check_against_torch(x, K, "3inst", warmup=warmup, lookahead=lookahead)
        assert torch.equal(st_k, st_t)


@pytest.mark.parametrize("K", range(1, 9))
def test_finds_the_exact_stream(K):
    """Targets that are the decode of a random stream have a zero-error cycle; the kernel finds one.

    At K = 8 the two-pass tail-biting search (free-start pass A, then pass B forced to its edge)
    can settle on another zero-cost prefix whose edge does not close the cycle exactly (measured on
    the H200: 3inst and mcg miss by one fp16 step, and the torch path does the same), so there the
    kernel must match the torch oracle instead."""
    g = torch.Generator().manual_seed(500 + K)
    symbols = torch.randint(0, 1 << K, (6, 256), generator=g)
    truth = unpack_states(pack_symbols(symbols, K)).to(DEV)
    for cb in CODEBOOKS:
        x = codebook_lut(cb, DEV).float()[truth.long()]
        if K < 8:
            st = kernel_states(x, K, cb)
            assert float((codebook_lut(cb, DEV).float()[st.long()] - x).abs().max()) == 0.0
        else:
            st_k, st_t = check_against_torch(x, K, cb)
            assert torch.equal(st_k, st_t)


def test_degenerate_inputs():
    assert kernel_states(torch.zeros(0, 256, device=DEV), 3, "mul1").shape == (0, 256)
    x = torch.zeros(3, 256, device=DEV)  # every state ties: lowest indices win, as in torch
    for K in (1, 4, 8):
        st_k, st_t = check_against_torch(x, K, "mul1")
        assert torch.equal(st_k, st_t)
    with pytest.raises(RuntimeError):
        ops.extension().viterbi_encode(torch.zeros(2, 255, device=DEV), 2, codebook_lut("mul1", DEV), 128, 64)
