"""Hugging Face `config.json` → `ModelConfig`: the few numbers a forward pass needs.

HF configs drift over time (old `rope_theta` + `rope_scaling` vs. the newer `rope_parameters`
dict, flat vs. nested `text_config`, per-family defaults that are simply left out of the file).
Everything version- and family-specific is resolved here, once, so the model code reads plain
fields and never looks at the raw JSON. No torch import: tools such as the planner and
`inspect` use this module too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, UnsupportedArchitecture
from engine.io.json_files import read_json_object

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# HF `architectures[0]` → the model family that implements it (engine/models registry key).
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Values transformers assumes when a config leaves them out. Real Gemma 3 multimodal configs,
# for example, carry only a handful of `text_config` keys and rely on all of these.
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 10000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "hidden_act": "silu",
}
_QWEN2_VL_DEFAULTS: dict[str, Any] = {**_COMMON_DEFAULTS, "rms_norm_eps": 1e-5}


@dataclass(frozen=True)
class RopeConfig:
    """One rotary-embedding setting (a model may have two: global and sliding-window layers)."""

    rope_type: str = "default"          # one of SUPPORTED_ROPE_TYPES
    theta: float = 10000.0
    factor: float = 1.0                 # linear / llama3 / yarn
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    original_max_position_embeddings: int | None = None  # llama3 / yarn
    attention_factor: float | None = None  # yarn: None → derived from factor (and mscale)
    beta_fast: float = 32.0             # yarn
    beta_slow: float = 1.0              # yarn
    mscale: float | None = None         # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True               # yarn


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from config.json, with every family default already applied."""

    architecture: str
    family: str                          # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3"
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str                      # "silu" | "gelu_pytorch_tanh" | ...
    rope: RopeConfig                     # global (full-attention) layers
    local_rope: RopeConfig | None = None  # sliding layers, when they use another base (Gemma 3)
    qkv_bias: bool = False               # q/k/v projections carry a bias (Qwen2, attention_bias)
    o_bias: bool = False                 # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False                # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()    # FULL_ATTENTION / SLIDING_ATTENTION per layer
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this**-0.5, not head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    quantization: dict | None = None     # `quantization_config` as stored (exl3: bits, head_bits...)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def window_for_layer(self, layer: int) -> int | None:
        """Sliding-window size for `layer`, or None when it attends to the whole context."""
        if self.sliding_window is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def rope_for_layer(self, layer: int) -> RopeConfig:
        if self.local_rope is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.local_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        """Factor applied to q·k before softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json` (or a config.json path) and parse it."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {path.parent} (is this a model folder?)")
    return parse_model_config(read_json_object(path), source=str(path))


def parse_model_config(raw: Any, source: str = "config.json") -> ModelConfig:
    """Parse an already-loaded config dict; `source` names it in error messages."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{source}: missing 'architectures' (cannot tell which model family this is)")
    arch = archs[0]
    family = ARCHITECTURE_FAMILIES.get(arch)
    if family is None:
        raise UnsupportedArchitecture(
            f"unsupported architecture {arch}; supported: {', '.join(sorted(ARCHITECTURE_FAMILIES))}")

    text = _text_fields(raw, source)
    f = _Fields(text, _defaults_for(family, arch), source)

    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    layers = f.int("num_hidden_layers")
    kv_heads = f.int("num_key_value_heads", default=heads)
    head_dim = f.int("head_dim", default=None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                              "and no head_dim is given")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

    max_pos = f.int("max_position_embeddings")
    rope, local_rope = _parse_rope(text, family, max_pos, f, source)
    layer_types, window = _parse_attention_pattern(text, family, layers, f, source)

    if family in ("gemma2", "gemma3"):
        act = f.str("hidden_activation", default=None) or f.str("hidden_act", default="gelu_pytorch_tanh")
    else:
        act = f.str("hidden_act")
    attention_bias = f.bool("attention_bias", default=False)

    quant = raw.get("quantization_config")
    return ModelConfig(
        architecture=arch,
        family=family,
        model_type=str(text.get("model_type", raw.get("model_type", ""))),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=f.int("intermediate_size"),
        vocab_size=f.int("vocab_size"),
        rms_norm_eps=f.float("rms_norm_eps"),
        tie_word_embeddings=_tie_word_embeddings(raw, text, f),
        max_position_embeddings=max_pos,
        hidden_act=act,
        rope=rope,
        local_rope=local_rope,
        # Qwen2 always has q/k/v biases; Mistral never has any; the rest follow attention_bias.
        qkv_bias={"qwen2": True, "mistral": False}.get(family, attention_bias),
        o_bias=False if family in ("qwen2", "mistral") else attention_bias,
        mlp_bias=f.bool("mlp_bias", default=False) if family == "llama" else False,
        qk_norm=family in ("qwen3", "gemma3"),
        sliding_window=window,
        layer_types=layer_types,
        query_pre_attn_scalar=f.float("query_pre_attn_scalar") if family in ("gemma2", "gemma3") else None,
        attn_logit_softcapping=f.float("attn_logit_softcapping", default=None) if family.startswith("gemma") else None,
        final_logit_softcapping=f.float("final_logit_softcapping", default=None) if family.startswith("gemma") else None,
        quantization=quant if isinstance(quant, dict) else None,
        raw=raw,
    )


# --------------------------------------------------------------------------------------------
# helpers


def _text_fields(raw: dict, source: str) -> dict:
    """The dict that holds the language model's fields.

    Multimodal configs nest them under `text_config` (Gemma 3 always, Qwen2.5-VL in newer saves);
    older Qwen2.5-VL saves keep them flat at the top level.
    """
    nested = raw.get("text_config")
    if nested is None:
        return raw
    if not isinstance(nested, dict):
        raise ConfigError(f"{source}: 'text_config' must be an object")
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(nested)
    return merged


def family_default(family: str, key: str) -> Any:
    """What transformers assumes for `key` when a config of `family` leaves it out (None: nothing;
    the planner reads it for configs it does not parse in full)."""
    return _defaults_for(family, "").get(key)


def _defaults_for(family: str, arch: str) -> dict:
    if family == "gemma2":
        return _GEMMA2_DEFAULTS
    if family == "gemma3":
        return _GEMMA3_DEFAULTS
    if arch == "Qwen2_5_VLForConditionalGeneration":
        return _QWEN2_VL_DEFAULTS
    return _COMMON_DEFAULTS


def _tie_word_embeddings(raw: dict, text: dict, f: "_Fields") -> bool:
    """Top-level key wins; pre-v5 multimodal saves put it in text_config; either `true` ties."""
    values = [d["tie_word_embeddings"] for d in (raw, raw.get("text_config") or {})
              if isinstance(d, dict) and d.get("tie_word_embeddings") is not None]
    if not values:
        return bool(f.defaults.get("tie_word_embeddings", False))
    return any(bool(v) for v in values)


class _Fields:
    """Typed access to config fields with family defaults and one-line errors."""

    _MISSING = object()

    def __init__(self, values: dict, defaults: dict, source: str):
        self.values, self.defaults, self.source = values, defaults, source

    def _get(self, key: str, default: Any):
        value = self.values.get(key)
        if value is not None:
            return value
        if key in self.defaults:
            return self.defaults[key]
        if default is not self._MISSING:
            return default
        raise ConfigError(f"{self.source}: missing required field '{key}'")

    def int(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
            raise ConfigError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return int(value)

    def float(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.source}: '{key}' must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: '{key}' must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self.source}: '{key}' must be a string, got {value!r}")
        return value


def _parse_attention_pattern(text: dict, family: str, layers: int, f: _Fields,
                             source: str) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention kinds and the window size, following each family's rules in HF."""
    window = f.int("sliding_window", default=None)
    if family in ("qwen2", "qwen3") and not f.bool("use_sliding_window", default=False):
        window = None  # Qwen configs carry a window value that is off unless use_sliding_window

    explicit = text.get("layer_types")
    if explicit is not None:
        if (not isinstance(explicit, list) or len(explicit) != layers
                or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in explicit)):
            raise ConfigError(f"{source}: 'layer_types' must list {layers} entries of "
                              f"'{FULL_ATTENTION}' or '{SLIDING_ATTENTION}'")
        types = tuple(explicit)
    elif family == "mistral":
        types = (SLIDING_ATTENTION,) * layers  # Mistral's window (if any) applies to every layer
    elif family in ("qwen2", "qwen3"):
        # transformers' defaults when the key is absent: 28 (Qwen2/3), 80 (Qwen2.5-VL)
        default_first = 80 if str(text.get("model_type") or "").startswith("qwen2_5_vl") else 28
        first_sliding = f.int("max_window_layers", default=default_first) if window is not None else layers
        types = tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers))
    elif family == "gemma2":
        types = tuple(SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(layers))
    elif family == "gemma3":
        pattern = f.int("sliding_window_pattern")
        types = tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers))
    else:
        types = (FULL_ATTENTION,) * layers

    if family == "llama":
        window = None  # Llama has no sliding attention
    if window is None and family != "gemma3":
        # No window: every layer sees the whole context. (Gemma 3 keeps its pattern even then,
        # because its "sliding" layers also use the local rope base.)
        types = (FULL_ATTENTION,) * layers
    return types, window


def _parse_rope(text: dict, family: str, max_pos: int, f: _Fields,
                source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """Global rope (and Gemma 3's local one) from either config generation.

    Old style: `rope_theta` + optional `rope_scaling` dict. New style: `rope_parameters`, either
    flat or nested by layer type (`full_attention` / `sliding_attention`).
    """
    theta = f.float("rope_theta", default=10000.0)
    orig_max = text.get("original_max_position_embeddings")
    params = text.get("rope_parameters")
    scaling = text.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: '{name}' must be an object")

    nested = isinstance(params, dict) and any(k in params for k in (FULL_ATTENTION, SLIDING_ATTENTION))
    if family == "gemma3":
        if nested:
            full = params.get(FULL_ATTENTION) or {}
            local = params.get(SLIDING_ATTENTION) or {}
        else:
            full = dict(params or scaling or {})
            local = {}
        local_theta = f.float("rope_local_base_freq")
        rope = _rope_from_dict(full, theta, max_pos, orig_max, source)
        local_rope = _rope_from_dict(local, local_theta, max_pos, orig_max, source)
        return rope, local_rope
    if nested:
        full = params.get(FULL_ATTENTION) or {}
        local = params.get(SLIDING_ATTENTION)
        rope = _rope_from_dict(full, theta, max_pos, orig_max, source)
        local_rope = _rope_from_dict(local, theta, max_pos, orig_max, source) if local else None
        return rope, local_rope
    return _rope_from_dict(dict(params or scaling or {}), theta, max_pos, orig_max, source), None


def _rope_from_dict(d: dict, theta: float, max_pos: int, top_orig_max: Any, source: str) -> RopeConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: rope settings must be an object")
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    if rope_type == "mrope":
        rope_type = "default"  # Qwen2.5-VL multimodal rope: plain rope when all positions are text
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope type '{rope_type}' is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    def num(key: str, default: Any) -> Any:
        value = d.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{source}: rope '{key}' must be a number, got {value!r}")
        return float(value)

    base = num("rope_theta", theta)
    if base <= 0:
        raise ConfigError(f"{source}: rope_theta must be positive, got {base}")
    orig_max = None
    if rope_type in ("llama3", "yarn"):
        # transformers lets a top-level original_max_position_embeddings (Phi-3 style) win
        orig_max = top_orig_max if top_orig_max is not None else d.get("original_max_position_embeddings", max_pos)
        if isinstance(orig_max, bool) or not isinstance(orig_max, (int, float)) or orig_max <= 0:
            raise ConfigError(f"{source}: rope original_max_position_embeddings must be positive, got {orig_max!r}")
        orig_max = int(orig_max)
    factor = num("factor", None)
    if factor is None:
        if rope_type in ("linear", "llama3"):
            raise ConfigError(f"{source}: rope type '{rope_type}' needs a 'factor'")
        factor = max_pos / orig_max if rope_type == "yarn" else 1.0
    if factor <= 0:
        raise ConfigError(f"{source}: rope factor must be positive, got {factor}")
    if num("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: partial rotary embeddings (partial_rotary_factor) are not supported")
    low = num("low_freq_factor", 1.0)
    high = num("high_freq_factor", 4.0)
    if rope_type == "llama3" and high <= low:
        raise ConfigError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
    return RopeConfig(
        rope_type=rope_type,
        theta=base,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=orig_max,
        attention_factor=num("attention_factor", None),
        beta_fast=num("beta_fast", None) or 32.0,
        beta_slow=num("beta_slow", None) or 1.0,
        mscale=num("mscale", None),
        mscale_all_dim=num("mscale_all_dim", None),
        truncate=bool(d.get("truncate", True)),
    )
