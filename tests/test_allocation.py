"""Measured bit allocation: the allocator keeps the budget, prefers sensitive groups and is
optimal where greedy can be checked; sensitivities are positive, finite, deterministic and leave
the model untouched; the quantization-like noise tracks the real quantizer's output error."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from safetensors.torch import save_file

from engine.quantize.allocation import (CODEBOOK_MSE, QGroup, allocate_bits, allocate_measured, average_bits,
                                       measured_k_range)
from engine.quantize.hessian import HessianAccumulator


def _llama_groups(layers, hidden, inter, q, kv):
    groups, order = [], 0
    for i in range(layers):
        sizes = {"qkv": hidden * (q + 2 * kv), "o": q * hidden, "gu": 2 * hidden * inter, "d": inter * hidden}
        for name, n in sizes.items():
            groups.append(QGroup(f"model.layers.{i}.{name}", i, 2 if name in ("qkv", "o") else 1, n, order))
            order += 1
    return groups


def _random_sensitivity(groups, seed):
    rng = random.Random(seed)
    return {g.name: rng.lognormvariate(0, 2) for g in groups}


@pytest.mark.parametrize("bpw", [1.0, 2.0, 2.37, 3.0, 4.0, 4.6, 5.0, 7.9, 8.0])
def test_measured_allocation_keeps_the_budget_and_leaves_nothing_usable(bpw):
    groups = _llama_groups(6, 256, 768, 256, 128)
    sens = _random_sensitivity(groups, 1)
    bits = allocate_measured(groups, sens, bpw)
    total = sum(g.numel for g in groups)
    budget = int(bpw * total)
    used = sum(g.numel * bits[g.name] for g in groups)
    assert used <= budget and average_bits(groups, bits) <= bpw
    assert all(1 <= k <= 8 for k in bits.values())
    # whatever is left over is too small for any group that could still move up
    assert all(g.numel > budget - used for g in groups if bits[g.name] < 8)


def test_measured_allocation_prefers_sensitive_groups():
    groups = _llama_groups(4, 256, 768, 256, 128)
    sens = {g.name: float(g.numel) for g in groups}  # equal sensitivity per weight: uniform K
    assert set(allocate_measured(groups, sens, 4.0).values()) == {4}
    assert allocate_measured(groups, sens, 4.0) == allocate_bits(groups, 4.0, 4)
    sens["model.layers.0.d"] *= 1000
    sens["model.layers.2.o"] /= 1000
    bits = allocate_measured(groups, sens, 4.0)
    assert bits["model.layers.0.d"] >= 6 and bits["model.layers.2.o"] <= 2
    assert average_bits(groups, bits) <= 4.0
    # among groups of one size, more sensitive never means fewer bits
    sens = _random_sensitivity(groups, 2)
    bits = allocate_measured(groups, sens, 3.3)
    for a, b in itertools.combinations(groups, 2):
        if a.numel == b.numel and sens[a.name] > sens[b.name]:
            assert bits[a.name] >= bits[b.name], (a.name, b.name)


def test_measured_k_range_keeps_one_step_around_the_target():
    assert [measured_k_range(b) for b in (1.0, 2.0, 2.5, 4.0, 4.6, 8.0)] == [(1, 2), (1, 3), (1, 4), (3, 5), (3, 6), (7, 8)]
    groups = _llama_groups(4, 256, 768, 256, 128)
    sens = {g.name: float(g.numel) for g in groups}
    sens["model.layers.0.d"] *= 1e6
    sens["model.layers.2.o"] /= 1e6
    bits = allocate_measured(groups, sens, 4.0, *measured_k_range(4.0))
    assert bits["model.layers.0.d"] == 5 and bits["model.layers.2.o"] == 3  # unbounded: 8 and 1
    assert set(bits.values()) <= {3, 4, 5} and average_bits(groups, bits) <= 4.0


def test_measured_allocation_is_deterministic_with_ties():
    groups = _llama_groups(3, 256, 768, 256, 128)
    sens = {g.name: 1.0 for g in groups}
    a = allocate_measured(groups, sens, 3.71)
    assert a == allocate_measured(groups, dict(reversed(sens.items())), 3.71)
    assert a == allocate_measured(list(groups), sens, 3.71)


@pytest.mark.parametrize("bpw", [1.5, 2.0, 2.75, 4.0, 5.5])
def test_greedy_allocation_is_optimal_for_equal_sized_groups(bpw):
    """With equal sizes every upgrade costs the same, and D is convex: greedy must match an
    exhaustive search over all 8^4 allocations."""
    groups = [QGroup(f"g{i}", i, 1, 1000, i) for i in range(4)]
    sens = _random_sensitivity(groups, int(bpw * 10))
    bits = allocate_measured(groups, sens, bpw)
    budget = int(bpw * 4000)

    def cost(ks):
        return sum(sens[g.name] * CODEBOOK_MSE[k] for g, k in zip(groups, ks))

    best = min(cost(ks) for ks in itertools.product(range(1, 9), repeat=4) if 1000 * sum(ks) <= budget)
    assert cost([bits[g.name] for g in groups]) == pytest.approx(best, rel=1e-12)


def test_codebook_mse_table_is_convex_and_decreasing():
    d = [CODEBOOK_MSE[k] for k in range(1, 9)]
    gains = [a - b for a, b in zip(d, d[1:])]
    assert all(g > 0 for g in gains) and all(a > b for a, b in zip(gains, gains[1:]))


def test_codebook_mse_table_matches_the_encoder():
    """Spot check of the table's K=3 entry: Gaussian tiles at the searched scale."""
    from engine.formats.exl3 import CODEBOOK_SCALE
    from engine.quantize.scale_search import search_scale
    from engine.quantize.viterbi import encode_tiles
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g) * CODEBOOK_SCALE
    tiles = torch.randn(48, 256, generator=g) * CODEBOOK_SCALE
    s = search_scale(w, 3, "mul1", "fast")
    _, dec = encode_tiles(tiles * s, 3, "mul1")
    d = float((dec / s - tiles).square().mean() / tiles.square().mean())
    assert d == pytest.approx(CODEBOOK_MSE[3], rel=0.1)


# ------------------------------------------------------------------------------------------ noise


def _layer_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(128, 256, generator=g) * 0.02
    mix = torch.randn(256, 256, generator=g) / 256 ** 0.5 + torch.eye(256)
    X = (torch.randn(4000, 256, generator=g) @ mix) * torch.linspace(0.1, 3.0, 256)
    acc = HessianAccumulator(256)
    acc.add(X)
    return W, acc.finalize()


def _output_error(E, W, H):
    return float(((E @ H) * E).sum() / ((W @ H) * W).sum())


def test_quantization_noise_tracks_the_real_quantizer():
    """The stand-in for quantization error (LDLQ-shaped, at the codebook's D(K)) gives about the
    output error the real quantizer does; plain i.i.d. noise at the same norm is far worse."""
    from engine.quantize.linear import LinearSpec, quantize_linears
    from engine.quantize.sensitivity import quantization_noise
    W, H = _layer_problem()
    (q,) = quantize_linears([LinearSpec("l", W, 3, "a")], {"a": H}, "mul1", seed=0, effort="fast")
    real = _output_error(q.dense_weight() - W, W, H)
    shaped = _output_error(quantization_noise(W, H, CODEBOOK_MSE[3], "l", "a"), W, H)
    iid = quantization_noise(W, None, CODEBOOK_MSE[3], "l", "a", shaped=False)
    assert float(iid.square().sum() / W.square().sum()) == pytest.approx(CODEBOOK_MSE[3], rel=1e-4)
    assert 0.5 < real / shaped < 2.0, (real, shaped)
    assert _output_error(iid, W, H) > 1.5 * shaped
    unshaped = quantization_noise(W, None, CODEBOOK_MSE[3], "l", "a")  # no Hessian: the uncalibrated path
    assert float(unshaped.square().sum() / W.square().sum()) == pytest.approx(CODEBOOK_MSE[3], rel=0.15)


# ------------------------------------------------------------------------------------------ measurement


def _tiny_llama(path, hidden=64, inter=160, vocab=256, layers=2):
    path.mkdir(parents=True)
    heads, kv, hd = 2, 1, 32
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, s=0.08):
        return torch.randn(*shape, generator=g) * s

    t = {"model.embed_tokens.weight": rnd(vocab, hidden, s=1.0), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": rnd(vocab, hidden, s=0.3)}
    for i in range(layers):
        L = f"model.layers.{i}"
        t.update({f"{L}.input_layernorm.weight": torch.ones(hidden), f"{L}.post_attention_layernorm.weight": torch.ones(hidden),
                  f"{L}.self_attn.q_proj.weight": rnd(heads * hd, hidden), f"{L}.self_attn.k_proj.weight": rnd(kv * hd, hidden),
                  f"{L}.self_attn.v_proj.weight": rnd(kv * hd, hidden), f"{L}.self_attn.o_proj.weight": rnd(hidden, heads * hd),
                  f"{L}.mlp.gate_proj.weight": rnd(inter, hidden), f"{L}.mlp.up_proj.weight": rnd(inter, hidden),
                  f"{L}.mlp.down_proj.weight": rnd(hidden, inter, s=0.3 if i == 0 else 0.02)})
    save_file(t, str(path / "model.safetensors"))
    return path


def _measure(runner, ids, probe):
    from engine.quantize.sensitivity import HessianStream, decoder_groups, measure_sensitivities
    groups = decoder_groups([f"model.layers.{i}" for i in range(runner.num_layers)])
    stream = HessianStream(runner, ids, [slice(0, 4), slice(4, 8)], torch.device("cpu"))
    return groups, measure_sensitivities(runner, ids[:3, :24], groups, probe, seed=0, hessians=stream)


def test_sensitivities_are_positive_finite_deterministic_and_leave_the_model_alone(tmp_path):
    from engine.models import load_model
    from engine.quantize.block_runner import ModelRunner
    model = load_model(_tiny_llama(tmp_path / "m"), dtype=torch.float32)
    runner = ModelRunner(model)
    before = {n: (b, b.clone()) for n, b in model.named_buffers()}
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    groups, s4 = _measure(runner, ids, CODEBOOK_MSE[4])
    assert list(s4) == [g.name for g in groups] and len(s4) == 8
    assert all(v > 0 and v == v and v != float("inf") for v in s4.values()), s4
    after = dict(model.named_buffers())
    assert all(after[n] is obj and torch.equal(obj, copy) for n, (obj, copy) in before.items())
    _, again = _measure(runner, ids, CODEBOOK_MSE[4])
    assert again == s4
    # first-order regime: a 4x smaller probe gives about the same slope
    _, s5 = _measure(runner, ids, CODEBOOK_MSE[5])
    assert all(0.5 < s5[k] / s4[k] < 2.0 for k in s4), (s4, s5)
    # the MLP with the deliberately large down projection (layer 0) stands out, both of its groups
    big = min(s4["model.layers.0.gu"], s4["model.layers.0.d"])
    assert all(big > 5 * v for k, v in s4.items() if k not in ("model.layers.0.gu", "model.layers.0.d")), s4


def test_per_linear_sensitivities_cover_every_linear(tmp_path):
    from engine.models import load_model
    from engine.quantize.block_runner import DECODER_SLOTS, ModelRunner
    from engine.quantize.sensitivity import decoder_groups, measure_sensitivities
    runner = ModelRunner(load_model(_tiny_llama(tmp_path / "m", layers=1), dtype=torch.float32))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    groups = decoder_groups(["model.layers.0"], per_tensor=True)
    assert [g.name for g in groups] == [f"model.layers.0.{s.name}" for s in DECODER_SLOTS]
    s = measure_sensitivities(runner, ids, groups, CODEBOOK_MSE[3])  # Hessians from the sample itself
    assert list(s) == [g.name for g in groups] and all(0 < v < float("inf") for v in s.values())


def test_hessian_stream_matches_a_direct_capture(tmp_path):
    from engine.models import load_model
    from engine.quantize.block_runner import DECODER_SLOTS, ModelRunner
    from engine.quantize.sensitivity import HessianStream, _capture_hessians
    runner = ModelRunner(load_model(_tiny_llama(tmp_path / "m"), dtype=torch.float32))
    ids = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(1))
    stream = HessianStream(runner, ids, [slice(0, 2), slice(2, 5)], torch.device("cpu"))
    h1 = stream(1)  # skipping layer 0 advances through it
    with torch.no_grad():
        x = runner.run_layer(0, runner.embed(ids))
    want, _ = _capture_hessians(runner, 1, x, DECODER_SLOTS)
    assert set(h1) == set(want) == {"attn.input", "attn.o", "mlp.input", "mlp.down"}
    for q in want:
        assert torch.allclose(h1[q], want[q], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError):
        stream(0)


def test_hessian_rows_are_spread_and_capped():
    from engine.quantize.sensitivity import hessian_rows
    ids = torch.arange(250 * 2048).reshape(250, 2048)
    h = hessian_rows(ids)
    assert h.numel() <= 1 << 17 and h.shape[0] == 63 and torch.equal(h[1], ids[4])
    assert torch.equal(hessian_rows(ids[:6, :64]), ids[:6, :64])
