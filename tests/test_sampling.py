"""Sampling: greedy is argmax, masks keep exactly the right tokens, seeds reproduce."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.generate.sampling import SamplerSettings, apply_repetition_penalty, candidates, draw, sample_next


def random_logits(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_regardless_of_other_knobs():
    for seed in range(5):
        logits = random_logits(seed=seed)
        settings = SamplerSettings(temperature=0, top_k=3, top_p=0.1, seed=seed)
        assert sample_next(logits, settings, settings.make_generator()) == int(logits.argmax())


def kept(logits, top_k=0, top_p=1.0, min_p=0.0, first=1024) -> set[int]:
    vals, ids = candidates(logits, top_k, top_p, min_p, first)
    ids = torch.arange(logits.numel()) if ids is None else ids
    assert torch.equal(vals, logits[ids])  # the survivors' own logits
    return set(ids.tolist())


def test_top_k_keeps_the_k_largest():
    logits = random_logits()
    assert kept(logits, top_k=10) == set(torch.topk(logits, 10).indices.tolist())
    vals, ids = candidates(logits, 10)
    assert torch.equal(vals, torch.sort(vals, descending=True).values)  # most likely first
    assert kept(logits, top_k=0) == set(range(1000)) and candidates(logits)[1] is None


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    assert kept(logits, top_p=0.5) == {0}
    assert kept(logits, top_p=0.6) == {0, 2}
    assert kept(logits, top_p=0.8) == {0, 2}
    assert kept(logits, top_p=0.81) == {0, 2, 3}
    assert kept(logits, top_p=1.0) == {0, 1, 2, 3}
    assert kept(logits, top_p=1e-6) == {0}  # the top token always survives
    assert kept(logits, top_k=2, top_p=0.7) == {0, 2}  # within the top k: 0.5 / 0.8 < 0.7
    assert kept(logits, top_k=2, top_p=0.6) == {0}  # 0.5 / 0.8 >= 0.6


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99, 0.9999])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_top_p_from_the_most_likely_first_is_the_full_sort(p, scale):
    """Looking at the 16 most likely tokens first (widening 8x at a time when they hold less than
    p) keeps the same tokens as sorting the whole vocabulary: flat logits (scale 0.3) need the
    widening, peaked ones (3.0) do not."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(int(p * 1e4))) * scale
    got = kept(logits, top_p=p, first=16)
    assert got == kept(logits, top_p=p, first=5000)
    probs = torch.softmax(logits, -1)[sorted(got)]
    assert probs.sum() >= p - 1e-6  # reaches p ...
    assert probs.sum() - probs.min() < p  # ... and without its least likely token would not


def test_min_p_keeps_tokens_within_a_factor_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    assert kept(logits, min_p=0.0) == {0, 1, 2, 3}
    assert kept(logits, min_p=0.2) == {0, 2, 3}   # 0.15 >= 0.1, 0.05 < 0.1
    assert kept(logits, min_p=0.5) == {0, 2}
    assert kept(logits, min_p=1.0) == {0}
    assert kept(logits, top_p=0.9, min_p=0.5) == {0, 2}  # both: the smaller set
    s = SamplerSettings(temperature=1.0, min_p=0.5, seed=3)
    g = s.make_generator()
    assert {sample_next(logits, s, g) for _ in range(200)} == {0, 2}


def test_min_p_inside_the_look_spares_top_p_its_widening():
    """Ten tokens far above the rest: the 16 most likely hold a quarter of the mass, under top-p's
    0.95, but min-p 0.1 keeps only the ten, so no token past the look could be drawn. candidates()
    stops there with the full sort's answer, and choose() raises no widen flag and draws among
    the ten; without min-p it still widens."""
    from engine.generate.sampling import choose

    logits = torch.zeros(5000)
    logits[:10] = 5.0
    assert kept(logits, top_p=0.95, min_p=0.1, first=16) == kept(logits, top_p=0.95, min_p=0.1, first=5000) == set(range(10))
    picks = set()
    for u in torch.linspace(0.0, 0.999, 40).tolist():
        token, widen, bad = choose(logits, 0, 0.95, 0.1, torch.tensor(u, dtype=torch.float64), look=16).tolist()
        assert widen == 0 and bad == 0 and token < 10
        picks.add(token)
    assert len(picks) == 10
    assert choose(logits, 0, 0.95, 0.0, torch.tensor(0.5, dtype=torch.float64), look=16)[1] == 1


def test_draw_follows_the_distribution_and_only_live_tokens():
    logits = torch.full((1000,), float("-inf"))
    logits[[3, 500, 999]] = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(logits, g) for _ in range(4000)]), minlength=1000)
    assert counts.sum() == counts[[3, 500, 999]].sum()
    for i, p in ((3, 0.2), (500, 0.5), (999, 0.3)):
        assert abs(counts[i] / 4000 - p) < 0.03, (i, int(counts[i]))
    for bad in (torch.full((5,), float("-inf")), torch.tensor([0.0, float("nan")]), torch.tensor([0.0, float("inf")])):
        with pytest.raises(ValueError, match="no token can be drawn"):
            draw(bad, g)


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
                                 dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0)])
def test_invalid_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SamplerSettings(**bad).validate()


@pytest.mark.parametrize("settings,flat", [
    (SamplerSettings(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1), False),
    (SamplerSettings(temperature=1.0, top_p=0.95, seed=2), False),
    (SamplerSettings(temperature=1.0, top_p=0.95, seed=2), True),  # top-p must widen past 1,024 tokens
    (SamplerSettings(temperature=0.8, top_k=50, seed=3), False),
    (SamplerSettings(temperature=1.0, min_p=0.1, seed=4), False),
    (SamplerSettings(temperature=1.0, min_p=0.9, seed=4), True),
    (SamplerSettings(temperature=1.0, top_p=0.95, min_p=0.02, seed=6), False),  # the app's creative preset
    (SamplerSettings(temperature=1.0, top_p=0.99, min_p=0.5, seed=7), True),
    (SamplerSettings(temperature=1.2, seed=5), False),
])
def test_sample_next_is_candidates_then_draw(settings, flat):
    """sample_next runs the filters and the draw as one sync-free pipeline (choose); with the same
    uniforms it picks the tokens candidates() and draw() define."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(20000, generator=g) * (0.05 if flat else 3.0)
    gen_a, gen_b = settings.make_generator(), settings.make_generator()
    scaled = logits / settings.temperature
    want = []
    for _ in range(60):
        vals, ids = candidates(scaled, settings.top_k, settings.top_p, settings.min_p)
        i = draw(vals, gen_b)
        want.append(i if ids is None else int(ids[i]))
    got = [sample_next(logits, settings, gen_a) for _ in range(60)]
    assert got == want and len(set(got)) > 1


def test_sample_next_refuses_logits_it_cannot_draw_from():
    s = SamplerSettings(temperature=1.0, top_k=5, seed=0)
    for bad in (torch.full((50,), float("-inf")), torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, float("inf")])):
        with pytest.raises(ValueError, match="no token can be drawn"):
            sample_next(bad, s, s.make_generator())
