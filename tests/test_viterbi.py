"""The trellis encoder: its output is a valid tail-biting stream that decodes (through the
format's own pack/unpack/reconstruct) to exactly the values it reports, it is optimal where we
can check optimality exhaustively, and it beats simple baselines."""
from __future__ import annotations

import itertools

import pytest
import torch

from engine.formats.exl3 import codebook_lut, pack_symbols, reconstruct, unpack_states
from engine.formats.exl3 import from_stream_tiles, to_stream_tiles
from engine.quantize.viterbi import encode_tiles


def _gauss_tiles(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 256, generator=g) * scale


CASES = [(K, "mul1") for K in range(1, 9)] + [(K, cb) for cb in ("mcg", "3inst") for K in (2, 4, 8)]


@pytest.mark.parametrize("K,codebook", CASES)
def test_states_are_a_consistent_cycle_and_decode_to_reported_values(K, codebook):
    x = _gauss_tiles(3, seed=K)
    states, decoded = encode_tiles(x, K, codebook)
    # consecutive states share 16-K bits (cyclically): only symbols are stored
    prev = torch.roll(states, 1, dims=1)
    assert torch.equal((prev & ((1 << (16 - K)) - 1)), states >> K)
    packed = pack_symbols(states, K)
    assert packed.shape == (3, 16 * K) and packed.dtype == torch.int16
    assert torch.equal(unpack_states(packed), states)
    # through the format's reconstruct: W-hat equals the decoded values, tile for tile
    trellis = packed.reshape(1, 3, 16 * K)
    w_hat = reconstruct(trellis, codebook).float()
    assert torch.equal(w_hat, from_stream_tiles(decoded.reshape(1, 3, 256)))
    assert torch.equal(decoded, codebook_lut(codebook)[states.long()].float())


def test_mse_falls_with_K_and_is_near_rate_distortion():
    x = _gauss_tiles(4, seed=1)
    mse = []
    for K in range(1, 9):
        _, dec = encode_tiles(x, K, "mul1")
        mse.append(float((dec - x).square().mean() / x.var()))
    assert all(a > b for a, b in zip(mse, mse[1:])), mse
    # Gaussian source: the rate-distortion bound is 2^-2K; a good trellis code is within ~1.5 dB
    for K, m in zip(range(1, 9), mse):
        if K <= 4:  # above that, clipping at the codebook edge (no scale search here) dominates
            assert 4.0 ** -K <= m < 1.6 * 4.0 ** -K, (K, m)


def test_beats_greedy_and_independent_rounding():
    """The best path must cost no more than a greedy walk through the same trellis."""
    K = 2
    x = _gauss_tiles(2, seed=7)
    lut = codebook_lut("mul1").float()
    _, dec = encode_tiles(x, K, "mul1")
    viterbi = (dec - x).square().sum(dim=1)
    # greedy: from the state Viterbi chose at step 0, take the locally best symbol each step
    for t in range(2):
        states, _ = encode_tiles(x[t:t + 1], K, "mul1")
        s = int(states[0, 0])
        cost = float((lut[s] - x[t, 0]) ** 2)
        for p in range(1, 256):
            cands = ((s << K) & 0xFFFF) + torch.arange(1 << K)
            errs = (lut[cands] - x[t, p]) ** 2
            s = int(cands[errs.argmin()])
            cost += float(errs.min())
        assert float(viterbi[t]) <= cost + 1e-4


@pytest.mark.parametrize("codebook", ["mul1", "3inst"])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_finds_the_exact_stream_when_one_exists(K, codebook):
    """Global optimality check: targets that are exactly the decode of a random stream have a
    zero-error tail-biting path, and the encoder must find a path of zero error."""
    g = torch.Generator().manual_seed(100 + K)
    symbols = torch.randint(0, 1 << K, (3, 256), generator=g)
    truth = unpack_states(pack_symbols(symbols, K))
    x = codebook_lut(codebook)[truth.long()].float()
    _, dec = encode_tiles(x, K, codebook)
    assert float((dec - x).abs().max()) == 0.0


def test_locally_optimal_against_exhaustive_window_search():
    """Changing any window of consecutive symbols (all 2^(K*w) choices) never lowers the cost."""
    K, w = 2, 4  # 256 alternatives per window
    x = _gauss_tiles(1, seed=3)[0]
    lut = codebook_lut("mul1").float()
    states, dec = encode_tiles(x[None], K, "mul1")
    sym = (states[0] & ((1 << K) - 1)).tolist()
    best = float((dec[0] - x).square().sum())

    def cost_of(symbols: list[int]) -> float:
        st = unpack_states(pack_symbols(torch.tensor(symbols)[None], K))[0]
        return float((lut[st.long()] - x).square().sum())

    assert abs(cost_of(sym) - best) < 1e-3
    for start in (0, 100, 252):  # 252: the window wraps around the end (tail-biting)
        for alt in itertools.product(range(1 << K), repeat=w):
            trial = list(sym)
            for j, a in enumerate(alt):
                trial[(start + j) % 256] = a
            assert cost_of(trial) >= best - 1e-3


def test_torch_path_matches_native_path_quality():
    """The CUDA/torch path and the CPU path solve the same problem: equal or near-equal cost."""
    x = _gauss_tiles(2, seed=11)
    for K in (1, 3):
        _, a = encode_tiles(x, K, "mcg")
        _, b = encode_tiles(x, K, "mcg", native=False)
        ca, cb = float((a - x).square().sum()), float((b - x).square().sum())
        assert abs(ca - cb) <= 1e-3 * cb


def test_tiling_round_trip():
    w = torch.randn(32, 48)
    t = to_stream_tiles(w)
    assert t.shape == (2, 3, 256)
    assert torch.equal(from_stream_tiles(t), w)
    # stream position 1 is row 1, col 0 of the tile (spec 3.4)
    assert t[0, 0, 1] == w[1, 0] and t[0, 0, 2] == w[8, 0] and t[0, 0, 4] == w[0, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("K", [1, 2, 4, 6])
def test_cuda_encoder_matches_cpu_quality(K):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    x = _gauss_tiles(64, seed=20 + K)
    st_gpu, dec_gpu = encode_tiles(x.cuda(), K, "mul1")
    _, dec_cpu = encode_tiles(x, K, "mul1")
    st_gpu, dec_gpu = st_gpu.cpu(), dec_gpu.cpu()
    assert torch.equal(unpack_states(pack_symbols(st_gpu, K)), st_gpu)
    assert torch.equal(dec_gpu, codebook_lut("mul1")[st_gpu.long()].float())
    c_gpu, c_cpu = float((dec_gpu - x).square().sum()), float((dec_cpu - x).square().sum())
    assert abs(c_gpu - c_cpu) <= 1e-3 * c_cpu


@pytest.mark.gpu
def test_cuda_graph_encoder_matches_eager(monkeypatch):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    monkeypatch.setenv("TRELLIS_NO_CUDA_VITERBI", "1")  # graphs replay the torch path only
    x = _gauss_tiles(40, seed=5).cuda()
    eager, _ = encode_tiles(x, 3, "mul1")
    monkeypatch.setenv("TRELLIS_CUDA_GRAPHS", "1")
    graphed, _ = encode_tiles(x, 3, "mul1")
    again, _ = encode_tiles(x[:20], 3, "mul1")  # same bucket, replayed
    assert torch.equal(eager, graphed) and torch.equal(eager[:20], again)
