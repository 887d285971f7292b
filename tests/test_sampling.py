"""Sampling: greedy is argmax, masks keep exactly the right tokens, seeds reproduce."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.generate.sampling import (SamplerSettings, apply_repetition_penalty, sample_next, top_k_mask,
                                      top_p_mask)


def random_logits(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_regardless_of_other_knobs():
    for seed in range(5):
        logits = random_logits(seed=seed)
        settings = SamplerSettings(temperature=0, top_k=3, top_p=0.1, seed=seed)
        assert sample_next(logits, settings, settings.make_generator()) == int(logits.argmax())


def test_top_k_keeps_the_k_largest():
    logits = random_logits()
    masked = top_k_mask(logits, 10)
    kept = torch.isfinite(masked).nonzero().flatten()
    assert set(kept.tolist()) == set(torch.topk(logits, 10).indices.tolist())
    assert torch.equal(masked[kept], logits[kept])
    assert torch.equal(top_k_mask(logits, 0), logits)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    kept = lambda p: set(torch.isfinite(top_p_mask(logits, p)).nonzero().flatten().tolist())
    assert kept(0.5) == {0}
    assert kept(0.6) == {0, 2}
    assert kept(0.8) == {0, 2}
    assert kept(0.81) == {0, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    assert kept(1e-6) == {0}  # the top token always survives


def test_samples_only_from_the_allowed_set():
    logits = random_logits(50)
    settings = SamplerSettings(temperature=1.5, top_k=5, seed=1)
    gen = settings.make_generator()
    allowed = set(torch.topk(logits, 5).indices.tolist())
    draws = {sample_next(logits, settings, gen) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_seeded_sampling_is_reproducible_and_seed_matters():
    logits = random_logits(200)

    def run(seed):
        s = SamplerSettings(temperature=1.0, top_p=0.95, seed=seed)
        g = s.make_generator()
        return [sample_next(logits, s, g) for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0])
    counts = {}
    for t in (0.2, 5.0):
        s = SamplerSettings(temperature=t, seed=0)
        g = s.make_generator()
        counts[t] = sum(sample_next(logits, s, g) == 0 for _ in range(400))
    assert counts[0.2] > 380 and counts[5.0] < 250


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, -1.0, 1.5, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 0]), 2.0)
    assert out.tolist() == [1.0, -2.0, 1.5, 0.5]
    s = SamplerSettings(temperature=0, repetition_penalty=2.0)
    assert sample_next(logits, s, None, torch.tensor([0])) == 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(repetition_penalty=0)])
def test_invalid_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SamplerSettings(**bad).validate()
