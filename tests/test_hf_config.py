"""config.json parsing: both rope generations, family defaults, layer patterns, bad input.

Rope frequencies are checked against transformers' own rope init functions, evaluated on the
same config.json, so both the parsing and the math are compared with the reference.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import ConfigError, TrellisError, UnsupportedArchitecture
from engine.io.hf_config import FULL_ATTENTION, SLIDING_ATTENTION, load_model_config, parse_model_config
from engine.models.rope import rope_frequencies

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 1000, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "silu",
}


def write(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# ---------------------------------------------------------------- fixtures from the reference


def test_reference_fixture_configs(ref_fixtures):
    llama = load_model_config(ref_fixtures / "hf" / "llama")
    assert (llama.architecture, llama.family) == ("LlamaForCausalLM", "llama")
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (256, 2, 4, 2, 64)
    assert llama.rope.theta == 500000.0 and llama.rope.rope_type == "default"  # from rope_parameters
    assert llama.tie_word_embeddings and not llama.qkv_bias and llama.vocab_size == 512
    qwen = load_model_config(ref_fixtures / "exl3" / "qwen2-3.0bpw-mul1-h6")
    assert qwen.family == "qwen2" and qwen.qkv_bias and not qwen.o_bias and not qwen.tie_word_embeddings
    assert qwen.rope.theta == 1e6 and qwen.sliding_window is None
    assert qwen.quantization["quant_method"] == "exl3" and qwen.quantization["head_bits"] == 6


# ---------------------------------------------------------------- basic fields


def test_head_dim_absent_and_present(tmp_path):
    cfg = load_model_config(write(tmp_path, LLAMA))
    assert cfg.head_dim == 32 and cfg.attention_scale == pytest.approx(32 ** -0.5)
    cfg = parse_model_config({**LLAMA, "head_dim": 64})
    assert cfg.head_dim == 64


def test_old_and_new_rope_keys_agree():
    old = parse_model_config({**LLAMA, "rope_theta": 123456.0})
    new = parse_model_config({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 123456.0}})
    assert old.rope == new.rope and old.rope.theta == 123456.0
    assert parse_model_config(LLAMA).rope.theta == 10000.0  # transformers' default base


def test_llama_attention_bias_and_mlp_bias():
    cfg = parse_model_config({**LLAMA, "attention_bias": True, "mlp_bias": True})
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias


def test_qwen3_has_qk_norm_and_no_bias():
    cfg = parse_model_config({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 128


# ---------------------------------------------------------------- rope scaling vs transformers


ROPE_CASES = [
    ("legacy linear", {"rope_theta": 50000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}),
    ("legacy llama3", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}}),
    ("new llama3", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
    ("legacy yarn", {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 1024}}),
    ("yarn with mscale", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                              "original_max_position_embeddings": 4096, "beta_fast": 32,
                                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}}),
    ("yarn attention_factor, untruncated", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 1.3,
        "original_max_position_embeddings": 2048, "truncate": False}}),
]


@pytest.mark.parametrize("name,rope", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_matches_transformers(tmp_path, name, rope):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**LLAMA, **rope}
    write(tmp_path, raw)
    ours = load_model_config(tmp_path)
    inv_freq, scaling = rope_frequencies(ours.rope, ours.head_dim)

    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    assert rope_type == ours.rope.rope_type
    hf_inv, hf_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    torch.testing.assert_close(inv_freq, hf_inv.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(hf_scaling, rel=1e-9)


def test_default_rope_matches_transformers(tmp_path):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ours = load_model_config(write(tmp_path, {**LLAMA, "rope_theta": 70000.0}))
    inv_freq, scaling = rope_frequencies(ours.rope, ours.head_dim)
    hf_inv, hf_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(AutoConfig.from_pretrained(tmp_path))
    torch.testing.assert_close(inv_freq, hf_inv.float(), rtol=1e-6, atol=0)
    assert scaling == hf_scaling == 1.0


def test_yarn_without_factor_uses_context_ratio():
    cfg = parse_model_config({**LLAMA, "max_position_embeddings": 8192,
                              "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 2048}})
    assert cfg.rope.factor == 4.0


# ---------------------------------------------------------------- sliding windows and patterns


def test_mistral_window_applies_to_every_layer():
    cfg = parse_model_config({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert [cfg.window_for_layer(i) for i in range(2)] == [4096, 4096]
    none = parse_model_config({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert [none.window_for_layer(i) for i in range(2)] == [None, None]


def test_qwen2_window_is_off_unless_enabled():
    base = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 32}
    off = parse_model_config({**base, "use_sliding_window": False})
    assert off.sliding_window is None and set(off.layer_types) == {FULL_ATTENTION}
    on = parse_model_config({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert [on.window_for_layer(i) for i in range(4)] == [None, None, 32, 32]


def test_gemma2_defaults_and_alternating_layers():
    cfg = parse_model_config({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4})
    assert cfg.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    assert cfg.sliding_window == 4096 and cfg.attn_logit_softcapping == 50.0 and cfg.final_logit_softcapping == 30.0
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.attention_scale == pytest.approx(256 ** -0.5)
    assert cfg.tie_word_embeddings and cfg.local_rope is None and not cfg.qk_norm


def test_gemma3_multimodal_sparse_text_config():
    """Real Gemma 3 4B configs carry only a few text keys; the rest are transformers defaults."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 12, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152},
    }
    cfg = parse_model_config(raw)
    assert (cfg.family, cfg.vocab_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("gemma3", 262208, 256, 8, 4)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert cfg.layer_types[4:6] == (SLIDING_ATTENTION, FULL_ATTENTION) and cfg.layer_types.count(FULL_ATTENTION) == 2
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)  # scaling: global only
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 10000.0)
    assert cfg.rope_for_layer(0) is cfg.local_rope and cfg.rope_for_layer(5) is cfg.rope
    assert cfg.window_for_layer(0) == 1024 and cfg.window_for_layer(5) is None


def test_gemma3_nested_rope_parameters_and_layer_types():
    raw = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 8,
           "layer_types": [FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION],
           "rope_parameters": {FULL_ATTENTION: {"rope_type": "default", "rope_theta": 2e6},
                               SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 5000.0}}}
    cfg = parse_model_config(raw)
    assert cfg.rope.theta == 2e6 and cfg.local_rope.theta == 5000.0
    assert [cfg.window_for_layer(i) for i in range(3)] == [None, 8, None]
    pattern = parse_model_config({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4,
                                  "sliding_window_pattern": 2, "rope_local_base_freq": 20000.0})
    assert pattern.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 2 and pattern.local_rope.theta == 20000.0


def test_qwen2_5_vl_flat_and_nested_text_config():
    flat = {**LLAMA, "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "rope_theta": 1e6,
            "vision_config": {"depth": 32}}
    cfg = parse_model_config(flat)
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.rope.rope_type == "default" and cfg.rope.theta == 1e6
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "tie_word_embeddings": True,
              "text_config": {k: v for k, v in flat.items() if k not in ("architectures", "vision_config")}}
    cfg2 = parse_model_config(nested)
    assert cfg2.hidden_size == 256 and cfg2.rope == cfg.rope and cfg2.tie_word_embeddings


# ---------------------------------------------------------------- bad input


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path)


def test_malformed_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)


def test_unknown_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedArchitecture) as e:
        parse_model_config({**LLAMA, "architectures": ["FalconForCausalLM"]})
    msg = str(e.value)
    assert "FalconForCausalLM" in msg and "LlamaForCausalLM" in msg and "Gemma3ForCausalLM" in msg
    assert "\n" not in msg and isinstance(e.value, TrellisError)


@pytest.mark.parametrize("raw,match", [
    ([1, 2], "JSON object"),
    ({**LLAMA, "architectures": []}, "architectures"),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
    ({**LLAMA, "num_attention_heads": "eight"}, "num_attention_heads"),
    ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({**LLAMA, "hidden_size": 250}, "head_dim"),
    ({**LLAMA, "rope_scaling": "linear"}, "rope_scaling"),
    ({**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({**LLAMA, "rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "layer_types": [FULL_ATTENTION]}, "layer_types"),
    ({**LLAMA, "architectures": ["Gemma3ForConditionalGeneration"], "text_config": "x"}, "text_config"),
])
def test_malformed_fields_are_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_model_config(raw)
