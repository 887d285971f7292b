"""VRAM planner: will this model, at this context, fit on this GPU — before anything is loaded.

Pure arithmetic over plain numbers (no torch, no Qt) so the desktop app, the CLI and the engine
share one answer. A plan is the sum of four parts:

- weights: the bytes of every tensor in the model folder (read from safetensors headers, which
  is exact), or an estimate from config.json for a hub model that is not downloaded yet;
- KV cache: per token per layer, K and V of `num_kv_heads × head_dim` values, either fp16 or
  quantized (spec §6: a group of 32 values takes b uint32 words plus one fp16 scale, so
  b/8 + 2/32 bytes per value), allocated in pages of 256 tokens per sequence;
- activations: the peak of one prefill chunk through the widest layer plus the logits;
- overhead: the CUDA context and allocator slack, fixed plus a small share of the rest.

The numbers are deliberately a little pessimistic: a planner that says "fits" and then runs out
of memory is worse than one that leaves a few hundred MiB unused.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import ConfigError
from engine.io.hf_config import ARCHITECTURE_FAMILIES, family_default
from engine.io.json_files import read_json_object
from engine.io.safetensors_header import read_header, weight_files

GiB = 1024 ** 3
MiB = 1024 ** 2

PAGE_SIZE = 256            # KV cache page, tokens (spec §6)
CACHE_GROUP = 32           # values per quantization group (spec §6)
PREFILL_CHUNK = 2048       # tokens pushed through the model at once during prefill
# The most a soft-capped prefill's scores and probabilities take at once (Gemma 2's attention,
# which SDPA cannot run): engine.models.layers.CAPPED_SCORES_BYTES, restated here to keep this
# module free of torch; a test holds the two equal.
CAPPED_SCORES_BYTES = 256 * MiB
CUDA_CONTEXT_BYTES = 450 * MiB   # CUDA context + cuBLAS workspace + kernels, per GPU
ALLOCATOR_SLACK = 0.03     # fragmentation share of weights + cache
PAD = 128                  # EXL3 pads linear shapes to multiples of 128 (spec §1.5)

_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
_CONFIG_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass
class ModelSpec:
    """What the planner needs to know about a model, whatever it was read from."""
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    weight_bytes: int
    embedding_bytes: int
    parameters: int
    bits: float | None = None          # EXL3 decoder bpw, None for an unquantized model
    head_bits: int | None = None
    weights_exact: bool = True         # True when read from file headers, False when estimated
    vision: bool = False
    softcapped_attention: bool = False  # Gemma 2: prefill attention holds score chunks (activation_bytes)


@dataclass
class PlanRequest:
    context: int
    batch: int = 1
    k_bits: int | None = None          # None = fp16 cache; else 2..8
    v_bits: int | None = None
    gpu_bytes: list[int] = field(default_factory=list)   # free memory per GPU; empty = unknown
    draft: ModelSpec | None = None
    # The GPU runs without the CUDA kernels (the engine's reason, or ""): an EXL3 model's linears
    # then load a dense fp16 copy beside their trellis (engine/models/layers.py).
    without_kernels: str = ""


@dataclass
class Plan:
    model: str
    context: int
    batch: int
    cache_bits: str                    # "fp16" or "K,V"
    weights: int
    kv_cache: int
    activations: int
    overhead: int
    total: int
    capacity: int | None
    fits: bool | None
    headroom: int | None               # capacity - total (negative when it does not fit)
    largest_context: int | None        # largest context that fits with these settings
    model_max_context: int
    weights_exact: bool
    advice: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gib"] = {k: round(d[k] / GiB, 3) for k in ("weights", "kv_cache", "activations", "overhead", "total")}
        if self.capacity is not None:
            d["gib"]["capacity"] = round(self.capacity / GiB, 3)
        return d


# ----------------------------------------------------------------------------------------------
# Reading a model: config.json fields and safetensors headers (no tensor data is touched)

def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _text_config(cfg: dict) -> dict:
    """Multimodal configs keep the language model's numbers under text_config."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        for k in ("quantization_config", "architectures"):
            if k in cfg:
                merged[k] = cfg[k]
        return merged
    return cfg


def tensor_sizes(model_dir: Path) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype, shape, bytes) for every tensor of the folder, from headers only."""
    out: dict[str, tuple[str, list[int], int]] = {}
    for path in weight_files(model_dir):
        entries, _ = read_header(path)
        out.update({name: (e.dtype, list(e.shape), e.nbytes) for name, e in entries.items()})
    return out


def _load_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"{model_dir} is not a model folder (no config.json)")
    return read_json_object(cfg_path)


def _shape_numbers(cfg: dict, name: str) -> dict:
    t = _text_config(cfg)
    try:
        hidden = int(_first(t, "hidden_size", "n_embd", "d_model"))
        layers = int(_first(t, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_first(t, "num_attention_heads", "n_head"))
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: config.json lacks hidden_size / num_hidden_layers / num_attention_heads") from None
    kv_heads = int(_first(t, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_first(t, "head_dim", default=hidden // heads))
    inter = int(_first(t, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
    vocab = int(_first(t, "vocab_size", default=32000))
    max_ctx = int(_first(t, "max_position_embeddings", "n_positions", "max_seq_len", default=4096))
    if min(hidden, layers, heads, kv_heads, head_dim, inter, vocab) <= 0:
        raise ConfigError(f"{name}: config.json has a non-positive dimension")
    archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    gemma2 = "gemma2" in (t.get("model_type", cfg.get("model_type")), ARCHITECTURE_FAMILIES.get(str(archs[0])))
    cap_default = family_default("gemma2", "attn_logit_softcapping") if gemma2 else None
    capped = t.get("attn_logit_softcapping", cap_default) is not None
    return dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                inter=inter, vocab=vocab, max_ctx=max_ctx, arch=str(archs[0]), capped=capped,
                tied=bool(_first(t, "tie_word_embeddings", default=cfg.get("tie_word_embeddings", False))),
                vision=isinstance(cfg.get("vision_config"), dict))


def _quant(cfg: dict) -> tuple[float | None, int | None]:
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "exl3":
        return float(q.get("bits", 4.0)), int(q.get("head_bits", 6))
    return None, None


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _estimate_weights(n: dict, bits: float | None, head_bits: int | None, dtype_bytes: int) -> tuple[int, int, int]:
    """(weight bytes, embedding bytes, parameters) from config dimensions alone.

    Linears of a quantized model cost bits/8 per (padded) weight plus fp16 suh/svh vectors; the
    embedding and norms stay 16-bit. An unquantized model costs `dtype_bytes` per weight."""
    h, hd = n["hidden"], n["head_dim"]
    linears = [  # (in, out) per layer
        (h, n["heads"] * hd), (h, n["kv_heads"] * hd), (h, n["kv_heads"] * hd), (n["heads"] * hd, h),
        (h, n["inter"]), (h, n["inter"]), (n["inter"], h),
    ]
    per_layer_params = sum(i * o for i, o in linears) + 2 * h
    embed_params = n["vocab"] * h
    head_params = 0 if n["tied"] else n["vocab"] * h
    params = n["layers"] * per_layer_params + embed_params + head_params + h
    embed_bytes = embed_params * 2
    if bits is None:
        total = params * dtype_bytes
        return total, embed_params * dtype_bytes, params
    lin_bytes = 0
    for i, o in linears:
        ip, op = _round_up(i, PAD), _round_up(o, PAD)
        lin_bytes += math.ceil(ip * op * bits / 8) + 2 * (ip + op)
    head_i, head_o = _round_up(h, PAD), _round_up(n["vocab"], PAD)
    head_bytes = math.ceil(head_i * head_o * (head_bits or 6) / 8) + 2 * (head_i + head_o)
    total = n["layers"] * (lin_bytes + 4 * h) + embed_bytes + head_bytes + 2 * h
    return total, embed_bytes, params


def spec_from_config(cfg: dict, name: str = "model", bits: float | None = None,
                     head_bits: int | None = None) -> ModelSpec:
    """A spec from a config dict alone (a hub model not downloaded, or a conversion target).

    `bits`/`head_bits` override the config's quantization (the wizard's "what if 3.5 bpw")."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: config is not a JSON object")
    n = _shape_numbers(cfg, name)
    qb, qh = _quant(cfg)
    bits = bits if bits is not None else qb
    head_bits = head_bits if head_bits is not None else qh
    t = _text_config(cfg)
    dtype_bytes = _CONFIG_DTYPE_BYTES.get(str(_first(t, "torch_dtype", "dtype", default="bfloat16")), 2)
    weights, embed, params = _estimate_weights(n, bits, head_bits, dtype_bytes)
    return ModelSpec(name=name, architecture=n["arch"], num_layers=n["layers"], hidden_size=n["hidden"],
                     intermediate_size=n["inter"], num_heads=n["heads"], num_kv_heads=n["kv_heads"],
                     head_dim=n["head_dim"], vocab_size=n["vocab"], max_context=n["max_ctx"],
                     weight_bytes=weights, embedding_bytes=embed, parameters=params, bits=bits,
                     head_bits=head_bits, weights_exact=False, vision=n["vision"],
                     softcapped_attention=n["capped"])


def spec_from_dir(model_dir: str | Path) -> ModelSpec:
    """A spec from a model folder: dimensions from config.json, weight bytes exact from headers."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a folder")
    cfg = _load_config(model_dir)
    spec = spec_from_config(cfg, name=model_dir.name)
    if not weight_files(model_dir):
        raise ConfigError(f"{model_dir} has no .safetensors weights")
    sizes = tensor_sizes(model_dir)
    spec.weight_bytes = sum(b for _, _, b in sizes.values())
    spec.embedding_bytes = sum(b for k, (_, _, b) in sizes.items() if k.endswith("embed_tokens.weight"))
    spec.weights_exact = True
    return spec


# ----------------------------------------------------------------------------------------------
# The arithmetic

def _cache_bytes_per_value(bits: int | None) -> float:
    if bits is None:
        return 2.0
    if not 2 <= bits <= 8:
        raise ConfigError(f"cache bits must be between 2 and 8, not {bits}")
    return bits / 8 + 2 / CACHE_GROUP


def kv_cache_bytes(spec: ModelSpec, context: int, batch: int = 1, k_bits: int | None = None,
                   v_bits: int | None = None) -> int:
    """Pages of 256 tokens per sequence × layers × (K + V) bytes per token."""
    tokens = _round_up(max(context, 1), PAGE_SIZE) * batch
    values = spec.num_layers * spec.num_kv_heads * spec.head_dim
    per_token = values * (_cache_bytes_per_value(k_bits) + _cache_bytes_per_value(v_bits))
    return int(math.ceil(tokens * per_token))


def activation_bytes(spec: ModelSpec, context: int, batch: int = 1, quantized_cache: bool = False) -> int:
    """Peak working memory of one prefill chunk through one layer, plus the logits.

    fp16 buffers for the residual stream, the normed input, q/k/v, the attention output and the
    MLP's gate+up pair; fp32 logits for the last token of each sequence. A quantized cache is
    dequantized one layer at a time into an fp16 scratch for attention. Soft-capped attention
    (Gemma 2) holds fp16 scores and probabilities of a chunk's queries over the whole context, up
    to CAPPED_SCORES_BYTES (SDPA's kernels hold none)."""
    chunk = min(max(context, 1), PREFILL_CHUNK)
    h, hd = spec.hidden_size, spec.head_dim
    per_token = 2 * (3 * h + (spec.num_heads + 2 * spec.num_kv_heads) * hd + spec.num_heads * hd
                     + 2 * spec.intermediate_size)
    scratch = 0
    if quantized_cache:
        scratch = _round_up(context, PAGE_SIZE) * batch * spec.num_kv_heads * hd * 2 * 2
    if spec.softcapped_attention:
        query_row = batch * spec.num_heads * max(context, 1) * 2 * 2
        scratch += min(chunk * query_row, max(CAPPED_SCORES_BYTES, query_row))
    logits = batch * _round_up(spec.vocab_size, PAD) * 4 * 2   # logits + sampling copy
    return chunk * per_token + scratch + logits


def dense_copy_bytes(spec: ModelSpec) -> int:
    """The fp16 copies an EXL3 model's linears take where the CUDA kernels are missing: every
    parameter but the embedding and the norms, two bytes each (nothing for an unquantized model)."""
    if spec.bits is None:
        return 0
    linear_params = spec.parameters - spec.vocab_size * spec.hidden_size - (2 * spec.num_layers + 1) * spec.hidden_size
    return 2 * max(0, linear_params)


def _parts(spec: ModelSpec, req: PlanRequest, context: int) -> tuple[int, int, int, int]:
    quant = req.k_bits is not None or req.v_bits is not None
    weights = spec.weight_bytes + (dense_copy_bytes(spec) if req.without_kernels else 0)
    kv = kv_cache_bytes(spec, context, req.batch, req.k_bits, req.v_bits)
    act = activation_bytes(spec, context, req.batch, quant)
    if req.draft is not None:
        weights += req.draft.weight_bytes + (dense_copy_bytes(req.draft) if req.without_kernels else 0)
        kv += kv_cache_bytes(req.draft, context, req.batch)
    gpus = max(1, len(req.gpu_bytes))
    overhead = gpus * CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * (weights + kv))
    return weights, kv, act, overhead


def largest_context(spec: ModelSpec, req: PlanRequest, limit: int | None = None) -> int | None:
    """Largest context (a multiple of 256, at most `limit`) whose total fits, 0 if none does."""
    if not req.gpu_bytes:
        return None
    capacity = sum(req.gpu_bytes)
    limit = limit or spec.max_context
    fits = lambda c: sum(_parts(spec, req, c)) <= capacity
    if not fits(PAGE_SIZE):
        return 0
    lo, hi = 1, max(1, limit // PAGE_SIZE)    # in pages; fits(lo * 256) is True
    if fits(hi * PAGE_SIZE):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * PAGE_SIZE) else (lo, mid)
    return lo * PAGE_SIZE


def _gib(x: int) -> str:
    return f"{x / GiB:.1f} GiB" if x >= 0.1 * GiB else f"{x / MiB:.0f} MiB"


def _advice(spec: ModelSpec, req: PlanRequest, parts: tuple[int, int, int, int], capacity: int | None,
            best: int | None) -> str:
    text = _fit_advice(spec, req, parts, capacity, best)
    if req.without_kernels and spec.bits is not None:
        text += (f" The weights include {_gib(dense_copy_bytes(spec))} of dense fp16 copies because this GPU runs "
                 f"without the CUDA kernels ({req.without_kernels}); with the kernels they would take "
                 f"{_gib(spec.weight_bytes)}.")
    return text


def _fit_advice(spec: ModelSpec, req: PlanRequest, parts: tuple[int, int, int, int], capacity: int | None,
                best: int | None) -> str:
    weights, kv, act, overhead = parts
    total = sum(parts)
    if capacity is None:
        return (f"This needs about {_gib(total)} of GPU memory; give the GPU's free memory to see "
                f"whether it fits.")
    if total <= capacity:
        spare = capacity - total
        more = ""
        if best and best > req.context:
            more = f" and could hold up to {best:,} tokens of context"
        return f"Fits with {_gib(spare)} to spare{more}."
    # Does not fit: find the cheapest change that makes it fit.
    fixed = weights + overhead + activation_bytes(spec, PAGE_SIZE, req.batch)
    if fixed > capacity:
        avail = capacity - overhead - activation_bytes(spec, PAGE_SIZE, req.batch) - spec.embedding_bytes
        if spec.bits is not None and avail > 0 and not req.without_kernels:  # dense copies: bpw barely matters
            ratio = avail / max(1, weights - spec.embedding_bytes)
            target = math.floor(spec.bits * ratio * 4) / 4
            if target >= 1.5:
                return (f"The weights alone need {_gib(weights)}, more than the {_gib(capacity)} "
                        f"available: pick a version of about {target:g} bpw or a GPU with more memory.")
        return (f"The weights alone need {_gib(weights)}, more than the {_gib(capacity)} available: "
                f"this model needs a bigger GPU (or a lower-bpw version).")
    if best:
        msg = f"Too big by {_gib(total - capacity)}: lower the context to {best:,} tokens"
    else:
        msg = f"Too big by {_gib(total - capacity)}: lower the batch"
    if req.k_bits is None and req.v_bits is None:
        q = PlanRequest(context=req.context, batch=req.batch, k_bits=4, v_bits=4, gpu_bytes=req.gpu_bytes,
                        draft=req.draft, without_kernels=req.without_kernels)
        if sum(_parts(spec, q, req.context)) <= capacity:
            return msg + ", or use a 4-bit KV cache (--cache-bits 4,4), which fits this context."
    return msg + "."


def plan(spec: ModelSpec, req: PlanRequest) -> Plan:
    if req.context <= 0:
        raise ConfigError(f"context must be a positive number of tokens, not {req.context}")
    if req.batch <= 0:
        raise ConfigError(f"batch must be at least 1, not {req.batch}")
    if any(g <= 0 for g in req.gpu_bytes):
        raise ConfigError("GPU memory must be positive")
    parts = _parts(spec, req, req.context)
    total = sum(parts)
    capacity = sum(req.gpu_bytes) if req.gpu_bytes else None
    best = largest_context(spec, req)
    bits = "fp16" if req.k_bits is None and req.v_bits is None else f"{req.k_bits or 16},{req.v_bits or 16}"
    return Plan(model=spec.name, context=req.context, batch=req.batch, cache_bits=bits,
                weights=parts[0], kv_cache=parts[1], activations=parts[2], overhead=parts[3], total=total,
                capacity=capacity, fits=None if capacity is None else total <= capacity,
                headroom=None if capacity is None else capacity - total, largest_context=best,
                model_max_context=spec.max_context, weights_exact=spec.weights_exact,
                advice=_advice(spec, req, parts, capacity, best))


def parse_cache_bits(text: str | None) -> tuple[int | None, int | None]:
    """'4,4' / '8,4' / '4' (both) / 'fp16' / None -> (k_bits, v_bits)."""
    if text is None or text.strip().lower() in ("", "fp16", "16", "16,16"):
        return None, None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ConfigError(f"cache bits must look like K,V (for example 4,4), not {text!r}")
    out = []
    for p in parts:
        if p.lower() in ("fp16", "16"):
            out.append(None)
            continue
        try:
            b = int(p)
        except ValueError:
            raise ConfigError(f"cache bits must be whole numbers 2..8, not {p!r}") from None
        _cache_bytes_per_value(b)
        out.append(b)
    return out[0], out[1]
