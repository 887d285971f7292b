"""The sampler on CUDA logits (pytest -m gpu): the filters and the CDF run on the device and only
an index comes back, so the same seed must draw the same tokens from the same logits on the GPU
as on the CPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine.generate.sampling import SamplerSettings, candidates, sample_next  # noqa: E402

DEV = "cuda"


@pytest.mark.parametrize("settings", [
    SamplerSettings(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1),
    SamplerSettings(temperature=1.0, top_p=0.95, seed=2),
    SamplerSettings(temperature=0.8, top_k=50, seed=3),
    SamplerSettings(temperature=1.0, min_p=0.1, seed=4),
    SamplerSettings(temperature=1.2, seed=5),
])
def test_same_seed_same_tokens_on_gpu_and_cpu(settings):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128256, generator=g) * 2.0
    head = torch.randperm(128256, generator=g)[:200]
    logits[head] += 10.0 - 1.0 * torch.log1p(torch.arange(200.0))  # every preset keeps several tokens
    kept_cpu = candidates(logits / settings.temperature, settings.top_k, settings.top_p, settings.min_p)[1]
    kept_gpu = candidates(logits.cuda() / settings.temperature, settings.top_k, settings.top_p, settings.min_p)[1]
    if kept_cpu is None:
        assert kept_gpu is None
    else:
        assert set(kept_cpu.tolist()) == set(kept_gpu.cpu().tolist())
    draws = {}
    for device in ("cpu", "cuda"):
        gen = settings.make_generator()
        x = logits.to(device)
        draws[device] = [sample_next(x, settings, gen) for _ in range(100)]
    assert draws["cpu"] == draws["cuda"]
    assert len(set(draws["cpu"])) > 1  # it does sample
    # ... and on the GPU as a captured graph: an op that reads a device value on the host would
    # fail the capture (the draw then runs eagerly, as slow as before the graphs)
    from engine.generate import sampling_graph

    assert sampling_graph.DISABLED["why"] == "" and sampling_graph._graphs


def test_graphs_widen_top_p_and_stay_few():
    """Flat logits make top-p look past its first 1,024 tokens (a second graph, larger look) and
    still draw what the CPU draws; many settings keep at most KEEP graphs."""
    from engine.generate import sampling_graph

    logits = torch.randn(50000, generator=torch.Generator().manual_seed(1)) * 0.05
    s = SamplerSettings(temperature=1.0, top_p=0.9, seed=7)
    draws = {}
    for device in ("cpu", "cuda"):
        gen = s.make_generator()
        draws[device] = [sample_next(logits.to(device), s, gen) for _ in range(20)]
    assert draws["cpu"] == draws["cuda"] and len(set(draws["cpu"])) > 10
    assert any(key.look > 1024 for key in sampling_graph._graphs)
    for k in range(1, 10):
        sample_next(logits.cuda(), SamplerSettings(temperature=1.0, top_k=k, seed=0), None)
    assert len(sampling_graph._graphs) <= sampling_graph.KEEP


@pytest.mark.parametrize("top_k,top_p,min_p", [(50, 1.0, 0.0), (50, 0.9, 0.05), (1000, 0.5, 0.0), (0, 0.95, 0.0),
                                               (0, 0.9, 0.2), (7, 1.0, 0.3), (0, 0.99, 0.0), (0, 0.99, 0.05)])
def test_sample_top_kernel_is_the_torch_steps(top_k, top_p, min_p, monkeypatch):
    """The one-block kernel after top-k (ops.sample_top) picks what choose()'s PyTorch steps pick,
    over many uniforms: the same token, the same widen flag (top-p 0.95 and 0.99 without top-k
    widen: these logits' top 1,024 tokens hold 0.94 of the mass; not with min-p 0.05, which cuts
    inside them), and the bad flag for NaN logits."""
    from engine import ops
    from engine.generate.sampling import choose

    g = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = (torch.randn(128256, generator=g) * 2.0).cuda()
    logits[torch.randperm(128256, generator=g)[:300].cuda()] += 8.0
    us = torch.rand(300, generator=g, dtype=torch.float64).tolist() + [0.0, 1.0 - 2**-53]
    picks = {}
    for kernel in (True, False):
        monkeypatch.setattr(ops, "sample_top_available", lambda x, on=kernel: on)
        picks[kernel] = [choose(logits, top_k, top_p, min_p, torch.tensor(u, dtype=torch.float64, device=DEV)).tolist()
                         for u in us]
    assert picks[True] == picks[False]
    widens = top_k == 0 and top_p >= 0.95 and min_p == 0.0  # min-p 0.05 cuts inside the top 1,024
    assert all(p[1] == widens for p in picks[True])
    assert widens or len({p[0] for p in picks[True]}) > 1
    monkeypatch.setattr(ops, "sample_top_available", lambda x: True)
    for value in (float("nan"), float("inf")):  # the max comes from topk's first value: NaN and +inf lead
        bad = logits.clone()
        bad[5] = value
        assert choose(bad, top_k, top_p, min_p, torch.tensor(0.5, dtype=torch.float64, device=DEV))[2].item() == 1
    nothing = torch.full_like(logits, float("-inf"))
    assert choose(nothing, top_k, top_p, min_p, torch.tensor(0.5, dtype=torch.float64, device=DEV))[2].item() == 1


def test_a_failed_capture_falls_back_to_eager_draws(monkeypatch):
    """If a sampler graph cannot be captured, the draw still happens (eagerly, the same token) and
    later draws skip capturing."""
    from engine.generate import sampling_graph

    def refuse(*args):
        raise RuntimeError("capture refused")

    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 3
    s = SamplerSettings(temperature=0.9, top_k=40, seed=11)
    want = [sample_next(logits, s, g) for g in [s.make_generator()] for _ in range(10)]
    monkeypatch.setattr(sampling_graph, "_capture", refuse)
    monkeypatch.setattr(sampling_graph, "_graphs", sampling_graph.OrderedDict())
    monkeypatch.setitem(sampling_graph.DISABLED, "why", "")
    gen = s.make_generator()
    assert [sample_next(logits.cuda(), s, gen) for _ in range(10)] == want
    assert "capture refused" in sampling_graph.DISABLED["why"] and not sampling_graph._graphs


def _stable_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest by value, ties in index order, NaN largest: a stable descending sort's head."""
    vals, ids = torch.sort(x, descending=True, stable=True)
    return vals[:k], ids[:k]


@pytest.mark.parametrize("n", [128256, 151936, 49152, 2049, 2048, 100, 64])
@pytest.mark.parametrize("k", [1, 50, 64])
def test_topk_kernel_is_a_stable_sorts_head(n, k):
    """ops.topk's two-launch kernel (k <= 64) returns exactly the k largest logits, largest first,
    ties to the lower index: on random logits, on integer logits full of ties, and with NaN, +inf
    and -inf among them; vocabularies that fill their last 2,048-logit chunk or not."""
    from engine import ops
    from tests.gpu_layers import kernels_run

    if k > n:
        pytest.skip("k above the vocabulary")
    g = torch.Generator().manual_seed(n + k)
    cases = [torch.randn(n, generator=g) * 3.0, torch.randint(-4, 4, (n,), generator=g).float()]
    special = torch.randn(n, generator=g)
    special[torch.randperm(n, generator=g)[: max(1, n // 50)]] = float("-inf")
    special[n // 3] = float("inf")
    special[n // 2] = float("nan")
    special[n - 1] = float("nan")
    cases.append(special)
    for x in cases:
        x = x.cuda()
        vals, ids = ops.topk(x, k)
        ref_vals, ref_ids = _stable_top(x, k)
        assert torch.equal(ids, ref_ids), (n, k)
        torch.testing.assert_close(vals, ref_vals, rtol=0, atol=0, equal_nan=True)
    assert kernels_run(lambda: ops.topk(x, k), "topk_")  # the kernel served, not torch.topk


def test_topk_kernel_hands_what_it_cannot_serve_to_torch():
    """What the kernel does not serve goes to torch.topk, with torch's values: k above 64 (top-p's
    first look at 1,024 tokens among them), fp16 vectors, and more than 8,192 first-stage candidates
    (128 blocks of 2,048 logits at k = 64); the limits come from the kernel's own check."""
    from engine import ops
    from tests.gpu_layers import kernels_run

    x = torch.randn(128256, device=DEV)
    past = torch.randn(128 * 2048 + 1, device=DEV)
    for args in ((x, 65), (x, 1024), (x.half(), 50), (past, 64)):
        vals, _ = ops.topk(*args)
        assert torch.equal(vals, torch.topk(*args)[0])
        assert not kernels_run(lambda: ops.topk(*args), "topk_chunks")
    assert kernels_run(lambda: ops.topk(past[:-1], 64), "topk_chunks")
    serves = ops.extension().topk_small_serves
    assert serves(128256, 64) and serves(64, 64) and not serves(63, 64) and not serves(128256, 0)
    assert not serves(2**31, 1)
