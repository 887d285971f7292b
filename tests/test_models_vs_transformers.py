"""Every family against transformers itself: tiny random models built at test time.

Each model is created with transformers (a test-only dependency), saved with save_pretrained,
loaded with our loader, and both compute logits in fp32 for the same ids. Weights are
re-randomised with a larger spread than transformers' init so that every part of the
network (norm weights, biases, softcaps, rope) visibly moves the logits.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import FormatError, ModelLoadError, UnsupportedArchitecture
from engine.io.safetensors_io import TensorStore, write_safetensors
from engine.models import load_model

pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)
SEQ = 20


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in name:
                # Gemma norms are stored as offsets from 1, Llama-style ones around 1.
                p.copy_(0.2 * noise + (0.0 if "gemma" in type(model).__name__.lower() else 1.0))
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def _build(cls_name: str, config, tmp_path, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    _randomize(model, seed)
    model.save_pretrained(tmp_path)
    return model


def _ids(vocab: int, batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    assert scale > 0.5, "test model too quiet to tell anything apart"
    assert err <= rel * scale, f"max abs error {err:.3g} vs logits scale {scale:.3g}"


def _compare(hf_model, tmp_path, vocab: int, rel: float = 1e-4):
    ids = _ids(vocab)
    with torch.no_grad():
        theirs = hf_model(input_ids=ids).logits.float()
        model = load_model(tmp_path)
        ours = model(ids)
    _assert_close(ours, theirs, rel)
    return model, ids, ours


def _check_cached_decode(model, ids: torch.Tensor, full: torch.Tensor, prefill: int = 7) -> None:
    """Prefill, then a 3-token chunk, then one token at a time: same logits as one full pass."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    with torch.no_grad():
        parts = [model(ids[:, :prefill], cache), model(ids[:, prefill:prefill + 3], cache)]
        for t in range(prefill + 3, ids.shape[1]):
            parts.append(model(ids[:, t:t + 1], cache))
    assert cache.length == ids.shape[1]
    _assert_close(torch.cat(parts, dim=1), full, rel=1e-5)


# ---------------------------------------------------------------- Llama (+ rope scalings)


LLAMA_ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope", list(LLAMA_ROPES))
def test_llama(tmp_path, rope):
    from transformers import LlamaConfig

    params = {"rope_theta": 5000.0, **(LLAMA_ROPES[rope] or {"rope_type": "default"})}
    cfg = LlamaConfig(**TINY, rope_parameters=params, tie_word_embeddings=(rope == "default"))
    hf = _build("LlamaForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert model.config.rope.rope_type == params["rope_type"]
    if rope == "llama3":
        _check_cached_decode(model, ids, full)


def test_llama_attention_and_mlp_bias_head_dim(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    hf = _build("LlamaForCausalLM", cfg, tmp_path)
    _compare(hf, tmp_path, cfg.vocab_size)


# ---------------------------------------------------------------- Mistral, Qwen2, Qwen3


def test_mistral_sliding_window_shorter_than_sequence(tmp_path):
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, sliding_window=5, tie_word_embeddings=False)
    hf = _build("MistralForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert model.layers[0].self_attn.window == 5
    _check_cached_decode(model, ids, full)


def test_qwen2_bias_and_sliding_layers(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                      tie_word_embeddings=False)
    hf = _build("Qwen2ForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert model.layers[0].self_attn.q_proj.bias is not None
    assert [l.self_attn.window for l in model.layers] == [None, 6]
    _check_cached_decode(model, ids, full)


def test_qwen3_qk_norm(tmp_path):
    from transformers import Qwen3Config

    cfg = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    hf = _build("Qwen3ForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert model.layers[0].self_attn.q_norm is not None
    _check_cached_decode(model, ids, full)


# ---------------------------------------------------------------- Gemma 2 and 3


def test_gemma2_softcapping_and_alternating_window(tmp_path):
    from transformers import Gemma2Config

    cfg = Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                       sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    cfg._attn_implementation = "eager"
    hf = _build("Gemma2ForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert [l.self_attn.window for l in model.layers] == [4, None, 4]
    assert full.abs().max() <= 3.0  # the final softcap is active
    _check_cached_decode(model, ids, full)


def _gemma3_text_config(**extra):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=4, sliding_window_pattern=2,
                            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 100000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                            **extra)


def test_gemma3_text_sliding_pattern_and_local_rope(tmp_path):
    cfg = _gemma3_text_config()
    hf = _build("Gemma3ForCausalLM", cfg, tmp_path)
    model, ids, full = _compare(hf, tmp_path, cfg.vocab_size)
    assert [l.self_attn.window for l in model.layers] == [4, None, 4, None]
    assert [l.self_attn.is_local for l in model.layers] == [True, False, True, False]
    _check_cached_decode(model, ids, full)


def _copy_with_prefix(src, dst, old: str, new: str) -> None:
    """Copy a saved model, renaming tensors that start with `old` to start with `new`."""
    store = TensorStore(src)
    renamed = {(new + n[len(old):] if n.startswith(old) else n): store.get(n) for n in store.keys()}
    store.close()
    assert any(n.startswith(new) for n in renamed)
    write_safetensors(dst / "model.safetensors", renamed)
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_gemma3_conditional_generation_text_part(tmp_path):
    """Multimodal Gemma 3: the text model under either writer's prefix.

    exllamav3 and transformers' save use `language_model.model.*`; transformers 5's in-memory
    layout (and checkpoints saved without conversion) use `model.language_model.*`.
    """
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=_gemma3_text_config(), vision_config=vision, mm_tokens_per_image=4)
    hf = _build("Gemma3ForConditionalGeneration", cfg, tmp_path / "hf")
    _, ids, full = _compare(hf, tmp_path / "hf", cfg.text_config.vocab_size)

    assert "language_model.model.embed_tokens.weight" in TensorStore(tmp_path / "hf")
    _copy_with_prefix(tmp_path / "hf", tmp_path / "v5", "language_model.model.", "model.language_model.")
    with torch.no_grad():
        _assert_close(load_model(tmp_path / "v5")(ids), full)


def test_qwen2_5_vl_text_part(tmp_path):
    """Qwen2.5-VL: classic `model.layers.*` keys (spec pitfall 11b) and `model.language_model.*`."""
    from transformers import Qwen2_5_VLConfig

    text = {**TINY, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    hf = _build("Qwen2_5_VLForConditionalGeneration", cfg, tmp_path / "hf")
    model, ids, full = _compare(hf, tmp_path / "hf", TINY["vocab_size"])
    assert model.config.architecture == "Qwen2_5_VLForConditionalGeneration"

    assert "model.embed_tokens.weight" in TensorStore(tmp_path / "hf")
    _copy_with_prefix(tmp_path / "hf", tmp_path / "nested", "model.", "model.language_model.")
    with torch.no_grad():
        _assert_close(load_model(tmp_path / "nested")(ids), full)


# ---------------------------------------------------------------- load errors


def _tiny_llama_dir(tmp_path):
    from transformers import LlamaConfig

    _build("LlamaForCausalLM", LlamaConfig(**TINY, tie_word_embeddings=False), tmp_path)
    return tmp_path


def _rewrite(path, drop=(), change=None):
    store = TensorStore(path)
    tensors = {n: store.get(n) for n in store.keys() if n not in drop}
    store.close()
    tensors.update(change or {})
    write_safetensors(path / "model.safetensors", tensors)


def test_missing_tensor_is_named(tmp_path):
    d = _tiny_llama_dir(tmp_path)
    _rewrite(d, drop={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)


def test_missing_untied_head_is_named(tmp_path):
    d = _tiny_llama_dir(tmp_path)
    _rewrite(d, drop={"lm_head.weight"})
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(d)


def test_wrong_dense_shape_is_format_error(tmp_path):
    d = _tiny_llama_dir(tmp_path)
    _rewrite(d, change={"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(FormatError, match="k_proj"):
        load_model(d)


def test_unsupported_architecture(tmp_path):
    d = _tiny_llama_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="MambaForCausalLM"):
        load_model(d)


def test_cache_overflow_is_a_clear_error(tmp_path):
    from engine.errors import TrellisError

    model = load_model(_tiny_llama_dir(tmp_path))
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), cache)
        with pytest.raises(TrellisError, match="cache"):
            model(torch.zeros(1, 2, dtype=torch.long), cache)
    assert cache.length == 3
