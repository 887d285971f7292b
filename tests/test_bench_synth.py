"""The synthetic-model writer used by the speed benchmarks produces loadable, valid EXL3 files."""
import json

from bench.synth import SHAPES, write_synth_model
from engine.formats.exl3 import find_exl3
from engine.io.safetensors_io import TensorStore


def test_tiny_synthetic_model_is_valid_exl3(tmp_path):
    out = write_synth_model(tmp_path / "m", SHAPES["tiny"], bits=3.5, head_bits=6, shard_bytes=300_000)
    store = TensorStore(out)
    assert len(store.files) > 1  # sharded with an index
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    q = find_exl3(store, "model.layers.0.self_attn.q_proj")
    assert (q.K, q.codebook) == (4, "mul1")  # attention raised one bit above floor(3.5)
    assert find_exl3(store, "model.layers.1.mlp.down_proj").K == 3
    head = find_exl3(store, "lm_head")
    assert head.K == 6 and head.out_features == 512
    w = q.dense_weight()
    rms = w.pow(2).mean().sqrt().item()
    assert 0.5 * 256**-0.5 < rms < 2 * 256**-0.5


def test_synthetic_gemma2_loads_with_its_norms_and_caps(tmp_path):
    """The Gemma-2 shape (bench.decode --shape gemma2-9b) writes what the Gemma loader needs: four
    norms per layer stored as offsets from 1, a quantized head beside the tied embedding, the soft
    caps; a forward gives finite logits through both caps."""
    import torch

    from engine.models import load_model

    out = write_synth_model(tmp_path / "g", SHAPES["tiny-gemma2"], bits=4.0, head_bits=6)
    model = load_model(out, device="cpu", dtype=torch.float32)
    assert model.config.family == "gemma2" and model.final_softcap == 30.0
    assert {layer.self_attn.softcap for layer in model.layers} == {50.0}
    assert find_exl3(TensorStore(out), "lm_head").K == 6
    layer = model.layers[0]
    ones = torch.ones(1, 256)
    assert torch.allclose(layer.pre_feedforward_layernorm(ones), ones, atol=1e-5)  # (1 + 0) x / rms(x)
    with torch.inference_mode():
        logits = model(torch.tensor([[5, 17, 300, 2]]), model.new_cache(1, 8))
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()
    assert logits.abs().max() <= 30.0 and logits.std() > 0.1


def test_synthetic_qwen3_loads_with_its_head_norms(tmp_path):
    """The Qwen3 shape (bench.decode --shape qwen3-8b) writes a q and a k norm over each head of
    every layer, which the Qwen3 loader reads; a forward gives finite, varied logits."""
    import torch

    from engine.models import load_model

    out = write_synth_model(tmp_path / "q", SHAPES["tiny-qwen3"], bits=4.0, head_bits=6)
    model = load_model(out, device="cpu", dtype=torch.float32)
    assert model.config.family == "qwen3" and model.config.qk_norm
    attn = model.layers[1].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (128,)
    with torch.inference_mode():
        logits = model(torch.tensor([[5, 17, 300, 2]]), model.new_cache(1, 8))
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all() and logits.std() > 0.1
    # benchmark rows name the shape the folder holds, not --shape's default
    from bench.decode import model_label

    assert model_label(out, "llama3-8b") == "tiny-qwen3"


def test_synthetic_gemma3_loads_with_its_pattern_and_head_norms(tmp_path):
    """The Gemma-3 shape (bench.decode --shape gemma3-12b): Gemma's four (1 + w) norms and q/k norms
    per layer, five sliding layers (with the local rope) to one global, no soft caps; a forward
    gives finite, varied logits."""
    import torch

    from engine.models import load_model

    out = write_synth_model(tmp_path / "g3", SHAPES["tiny-gemma3"], bits=4.0, head_bits=6)
    model = load_model(out, device="cpu", dtype=torch.float32)
    assert model.config.family == "gemma3" and model.config.qk_norm and model.final_softcap is None
    assert [layer.self_attn.window for layer in model.layers] == [1024, 1024]
    assert all(layer.self_attn.is_local and layer.self_attn.softcap is None for layer in model.layers)
    ones = torch.ones(1, 64)
    assert torch.allclose(model.layers[0].self_attn.q_norm(ones), ones, atol=1e-5)  # (1 + 0) x / rms(x)
    with torch.inference_mode():
        logits = model(torch.tensor([[5, 17, 300, 2]]), model.new_cache(1, 8))
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all() and logits.std() > 0.1
