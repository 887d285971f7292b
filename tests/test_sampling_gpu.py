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
