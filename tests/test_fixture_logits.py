"""Our loader on the reference fixtures: unquantized HF models and exllamav3-converted EXL3 models.

The oracle is the reference implementation's own output stored next to each model (see
../shared/fixtures/exl3-ref/README.md). Thresholds are the issue's: relative RMS error < 1e-2
and top-1 agreement >= 0.98.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine.errors import FormatError, ModelLoadError
from engine.io.safetensors_io import TensorStore, write_safetensors
from engine.models import load_model
from engine.models.layers import QuantLinear
from tests.conftest import EXL3_TAGS

MAX_REL_RMS = 1e-2
MIN_TOP1 = 0.98


def rel_rms(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def top1(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def manifest(ref_fixtures):
    return json.loads((ref_fixtures / "manifest.json").read_text())


@pytest.fixture(scope="module")
def token_ids(manifest):
    return torch.tensor(manifest["token_ids"])


@pytest.fixture(scope="module")
def exl3_models(ref_fixtures):
    """Each EXL3 fixture loaded once for this file (loading reconstructs every linear)."""
    cache = {}

    def get(tag):
        if tag not in cache:
            cache[tag] = load_model(ref_fixtures / "exl3" / tag)
        return cache[tag]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_unquantized_matches_hf_logits(ref_fixtures, token_ids, arch):
    ref = load_file(str(ref_fixtures / "hf" / f"{arch}.hf_logits.safetensors"))["logits"]
    with torch.no_grad():
        ours = load_model(ref_fixtures / "hf" / arch)(token_ids)
    assert ours.shape == ref.shape == (2, 96, 512)
    assert rel_rms(ours, ref) < MAX_REL_RMS
    assert top1(ours, ref) >= MIN_TOP1


def test_unquantized_equals_local_transformers(ref_fixtures, token_ids):
    """The stored hf_logits were computed elsewhere (their own rounding, ~0.9% apart from a CPU
    fp32 run); against transformers on this machine, in fp32, we agree to float precision."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_fixtures / "hf" / "qwen2", dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=token_ids).logits.float()
        ours = load_model(ref_fixtures / "hf" / "qwen2")(token_ids)
    assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()


@pytest.mark.parametrize("tag", EXL3_TAGS)
def test_exl3_matches_reference_logits(ref_fixtures, token_ids, exl3_models, tag):
    ref = load_file(str(ref_fixtures / "exl3" / f"{tag}.ref.safetensors"))["logits"]
    model = exl3_models(tag)
    assert isinstance(model.layers[0].self_attn.q_proj, QuantLinear)
    # Tied in config.json, but the converter quantized a head: that one must be used.
    assert isinstance(model.lm_head, QuantLinear)
    with torch.no_grad():
        ours = model(token_ids)
    assert ours.shape == ref.shape
    assert rel_rms(ours, ref) < MAX_REL_RMS
    assert top1(ours, ref) >= MIN_TOP1


@pytest.mark.parametrize("tag", ["llama-4.0bpw-mul1-h6", "qwen2-3.0bpw-mul1-h6"])
def test_exl3_cached_greedy_follows_reference(manifest, exl3_models, tag):
    """Greedy decoding through the KV cache reproduces the reference's (uncached) continuation.
    Late tokens may legitimately flip where two logits tie within rounding, so only a prefix
    is required."""
    info = manifest["models"][tag]
    prompt, want = info["prompt_ids"], info["greedy_ids_after_prompt"]
    model = exl3_models(tag)
    cache = model.new_cache(1, len(prompt) + len(want))
    got = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache)
        for _ in want:
            got.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[got[-1]]]), cache)
    assert got[:12] == want[:12]


# ---------------------------------------------------------------- corrupted copies of a fixture


@pytest.fixture
def exl3_copy(ref_fixtures, tmp_path):
    src = ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6"
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def _edit_tensors(model_dir, drop=(), add=None):
    store = TensorStore(model_dir)
    tensors = {n: store.get(n) for n in store.keys() if n not in drop}
    store.close()
    tensors.update(add or {})
    write_safetensors(model_dir / "model.safetensors", tensors)


def test_trellis_shape_disagreeing_with_config(exl3_copy):
    cfg = json.loads((exl3_copy / "config.json").read_text())
    cfg["intermediate_size"] = 1024  # the file's MLP trellis is for 768
    (exl3_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.gate_proj"):
        load_model(exl3_copy)


def test_missing_exl3_scale_tensor(exl3_copy):
    _edit_tensors(exl3_copy, drop={"model.layers.0.self_attn.k_proj.svh"})
    with pytest.raises(FormatError, match=r"model\.layers\.0\.self_attn\.k_proj"):
        load_model(exl3_copy)


def test_both_codebook_markers(exl3_copy):
    _edit_tensors(exl3_copy, add={"model.layers.0.self_attn.q_proj.mcg": torch.tensor(-877912083, dtype=torch.int32)})
    with pytest.raises(FormatError, match="mcg"):
        load_model(exl3_copy)


def test_missing_norm_is_named(exl3_copy):
    _edit_tensors(exl3_copy, drop={"model.layers.0.input_layernorm.weight"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.input_layernorm\.weight"):
        load_model(exl3_copy)


# ---------------------------------------------------------------- padding (no fixture needed)


def test_padded_exl3_linear_zero_extends_and_trims():
    """in=96, out=160 are stored padded to 128 x 256: QuantLinear must equal the reference
    forward on the zero-extended input, trimmed to the 160 real outputs (spec §1.5)."""
    from engine.formats.exl3 import EXL3Tensors, exl3_matmul_reference

    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-32768, 32768, (128 // 16, 256 // 16, 16 * 3), generator=g).to(torch.int16)
    suh = (torch.randn(128, generator=g) * 0.05).half()
    svh = (torch.randn(256, generator=g)).half()
    svh[160:] = 0  # padded output channels carry zero scales, as the converter writes them
    bias = torch.randn(256, generator=g).half()
    t = EXL3Tensors(trellis, suh, svh, "mul1", bias, "demo")
    layer = QuantLinear(t, 96, 160, torch.float32)
    x = torch.randn(3, 96, generator=g)
    want = exl3_matmul_reference(x, t)
    assert want.shape[-1] == 256
    torch.testing.assert_close(layer(x), want[:, :160], rtol=1e-4, atol=1e-4)
    assert layer.weight.shape == (160, 96) and layer.bits == 3
