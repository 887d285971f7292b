"""Gemma on the GPU (pytest -m gpu): its (1 + w) norms run as the rms_norm kernel (or inside a
grouped product's prep), not as eight PyTorch ops each, and an fp16 forward on the GPU gives the
fp32 CPU model's logits."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine.models import load_model  # noqa: E402
from tests.gpu_layers import kernel_names, same_top, static_steps, step_kernel_names  # noqa: E402
from tests.test_static_cache import decode_logits, tiny_model  # noqa: E402


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_norms_are_kernels_and_match_the_cpu(family, tmp_path):
    """One fp16 decode step runs each of a layer's four norms (and Gemma 3's per-head q/k norms) as
    one rms_norm kernel and no PyTorch reduction; prefill and steps on the GPU give the fp32 CPU
    model's logits to fp16 rounding."""
    cpu = tiny_model(family, tmp_path / "m")
    gpu = load_model(tmp_path / "m", device="cuda", dtype=torch.float16)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cpu.config.vocab_size, (1, 14), generator=g)
    want = decode_logits(cpu, cpu.new_cache(1, 14), ids)
    got = decode_logits(gpu, gpu.new_cache(1, 14), ids.cuda())
    scale = max(w.abs().max().item() for w in want)
    for o, w in zip(got, want):
        assert (o.float().cpu() - w).abs().max().item() < 2e-2 * scale
        assert same_top(o.float().cpu(), w)

    cache = gpu.new_cache(1, 16)
    with torch.inference_mode():
        gpu(ids[:, :8].cuda(), cache)
        names = kernel_names(lambda: gpu(ids[:, 8:9].cuda(), cache))
    layers = len(gpu.layers)
    per_layer = 4 + (2 if family == "gemma3" else 0)  # input, post-attention, pre- and post-feedforward; q/k
    assert sum("rms_norm_kernel" in n for n in names) == layers * per_layer + 1  # + the final norm
    assert not [n for n in names if "reduce_kernel" in n], "a norm ran as PyTorch ops"


@pytest.mark.parametrize("name,head_dim", [("tiny-gemma2", 64), ("tiny-gemma2", 128), ("tiny-gemma2", 256),
                                           ("tiny-gemma3", 256)])
def test_exl3_gemma_on_the_kernels_matches_the_cpu_reference(tmp_path, name, head_dim, request, monkeypatch):
    """A synthetic EXL3 Gemma 2 (bench.synth's tiny shape: head dim 64; the 27B's head dim 128;
    and Gemma 2's head dim 256, whose 8-key tensor-core walk is turned on here) and Gemma 3 (head
    dim 256, its q/k norms inside decode attention turned on too) on the GPU: the fused products,
    whose preps compute Gemma's (1 + w) norms with the residual adds (and, turned on here, the
    post-norms before them: ops.PREP_DOUBLE_NORM), the prefill's norm passes and Gemma 2's capped
    attention probabilities (in one kernel, turned on here: ops.CAPPED_SOFTMAX), and
    graph-replayed decode steps (the decode kernel with Gemma 2's soft cap, or with Gemma 3's q/k
    norms and local rope; at head dim 256 writing o_proj's input, ops.ATTN_CHAIN_D256, on here)
    give the CPU reference path's logits (fp16 kernels against fp32 reference math, the bound of
    the fixture models' test)."""
    from dataclasses import replace

    from bench.synth import SHAPES, write_synth_model
    from engine import ops
    from tests.gpu_layers import replayed_logits

    shape = replace(SHAPES[name], head_dim=head_dim)
    if head_dim == 256:
        ops.extension().set_attn_mma_d256(True)
        request.addfinalizer(lambda: ops.extension().set_attn_mma_d256(ops.ATTN_MMA_D256))
    monkeypatch.setattr(ops, "ATTN_HEAD_NORMS", True)
    monkeypatch.setattr(ops, "PREP_DOUBLE_NORM", True)
    monkeypatch.setattr(ops, "CAPPED_SOFTMAX", True)
    monkeypatch.setattr(ops, "ATTN_CHAIN_D256", True)
    path = write_synth_model(tmp_path / "g", shape, 4.0, head_bits=6, device="cuda")
    cpu = load_model(path, device="cpu", dtype=torch.float32)
    gpu = load_model(path, device="cuda")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cpu.config.vocab_size, (1, 40), generator=g)
    want = decode_logits(cpu, cpu.new_cache(1, 64), ids, prompt=30)
    got = replayed_logits(gpu, ids.cuda())  # prefill of 30, then ten replayed steps
    assert len(got) == len(want) == 11
    for o, w in zip(got, want):
        o = o.float().cpu()
        assert ((o - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item() < 3e-2
        assert same_top(o, w)


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3"])
def test_exl3_gemma_post_norms_ride_in_the_next_prep(tmp_path, name, monkeypatch):
    """With ops.PREP_DOUBLE_NORM a decode step launches no post-attention or post-feedforward norm
    kernel: the next grouped product's prep (the double-normed prep_frag: gate/up in every layer,
    q/k/v from the second on) takes each with the residual add and the norm after it. The step's
    rms_norm kernels are then the last layer's post-feedforward norm and the final norm, against
    two per layer and the final norm with the setting off (Gemma 3's q/k norms run as kernels here,
    two more per layer either way). Prefill and steps give the logits of the setting off to fp16
    rounding (the inner norm's sum of squares is added in the prep's order, not the norm kernel's)."""
    from bench.synth import SHAPES, write_synth_model
    from engine import ops

    monkeypatch.setattr(ops, "ATTN_HEAD_NORMS", False)
    path = write_synth_model(tmp_path / "g", SHAPES[name], 4.0, head_bits=6, device="cuda")
    model = load_model(path, device="cuda")
    layers = len(model.layers)
    qk = 2 if name == "tiny-gemma3" else 0
    ids = torch.randint(0, model.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(5)).cuda()
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(ops, "PREP_DOUBLE_NORM", on)
        logits[on] = static_steps(model, ids, prompt=20)
        names = step_kernel_names(model, ids, prompt=20)
        norms = sum("rms_norm_kernel" in n for n in names)
        doubled = sum("prep_frag_kernel<false, true>" in n for n in names)
        if on:
            assert (norms, doubled) == (qk * layers + 2, 2 * layers - 1), names
        else:
            assert (norms, doubled) == ((2 + qk) * layers + 1, 0), names
    assert len(logits[True]) == len(logits[False]) == 7
    for a, b in zip(logits[True], logits[False]):
        a, b = a.float().cpu(), b.float().cpu()
        assert ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() < 1e-2
        assert same_top(a, b)
