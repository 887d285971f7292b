"""Synthetic EXL3 models with real model shapes, for speed measurements.

Any 16-bit pattern is a valid trellis code (every bitstream decodes), so random bits give a
model with exactly the memory traffic and compute of a real one, without a 16 GB download or a
conversion. Scales are chosen so the reconstructed weights have RMS 1/sqrt(in), which keeps
activations finite through the layers.

    python -m bench.synth --shape llama3-8b --bits 4 --out /tmp/l8b
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.formats.exl3 import MARKER_VALUES, pad_to_128


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128
    # "gemma2": four norms per layer, tied embedding, soft caps; "qwen3": per-head q/k norms;
    # "gemma3": Gemma 2's norms and embedding, q/k norms, a local rope on the sliding layers
    family: str = "llama"


SHAPES = {
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256),
    "llama3-70b": Shape(8192, 28672, 80, 64, 8, 128256),
    "tiny": Shape(256, 768, 2, 4, 2, 512, 64),
    # Gemma-2-9B: head dim 256, scores soft-capped at 50, a 4,096-token window on alternate layers
    "gemma2-9b": Shape(3584, 14336, 42, 16, 8, 256000, 256, "gemma2"),
    "tiny-gemma2": Shape(256, 768, 2, 4, 2, 512, 64, "gemma2"),
    # Qwen3-8B: an RMSNorm over each q and k head before RoPE
    "qwen3-8b": Shape(4096, 12288, 36, 32, 8, 151936, 128, "qwen3"),
    "tiny-qwen3": Shape(256, 768, 2, 4, 2, 512, 128, "qwen3"),  # head dim 128, as every Qwen3's
    # Gemma-3-12B: head dim 256, q/k norms, five 1,024-token sliding layers to one global
    "gemma3-12b": Shape(3840, 15360, 48, 16, 8, 262208, 256, "gemma3"),
    "tiny-gemma3": Shape(256, 768, 2, 4, 2, 512, 64, "gemma3"),
}


def quantization_config(bits: float, head_bits: int, codebook: str) -> dict:
    return {
        "quant_method": "exl3",
        "version": "synthetic",
        "bits": float(bits),
        "head_bits": head_bits,
        "codebook": codebook,
        "calibration": {"rows": 0, "cols": 0},
        "out_scales": "always",
    }


def dimensions(shape: Shape) -> dict:
    """The config.json fields every family spells alike."""
    return {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
    }


def family_fields(shape: Shape) -> dict:
    """The config.json fields of the shape's family besides the dimensions: architecture, rope,
    norms' eps, windows, caps, activation, tying, special tokens."""
    gemma = {"rms_norm_eps": 1e-6, "query_pre_attn_scalar": shape.head_dim, "hidden_activation": "gelu_pytorch_tanh",
             "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
    if shape.family == "gemma2":
        return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **gemma,
                "max_position_embeddings": 8192, "rope_theta": 10000.0, "sliding_window": 4096,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    if shape.family == "gemma3":
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **gemma,
                "max_position_embeddings": 131072, "rope_theta": 1000000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 10000.0,
                "sliding_window": 1024, "sliding_window_pattern": 6}
    if shape.family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "max_position_embeddings": 40960,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False, "hidden_act": "silu",
                "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def config_for(shape: Shape, bits: float, head_bits: int, codebook: str) -> dict:
    return {**family_fields(shape), **dimensions(shape), "torch_dtype": "bfloat16",
            "quantization_config": quantization_config(bits, head_bits, codebook)}


def exl3_linear(key: str, n_in: int, n_out: int, K: int, codebook: str, gen: torch.Generator, device) -> Iterator[tuple[str, torch.Tensor]]:
    pi, po = pad_to_128(n_in), pad_to_128(n_out)
    trellis = torch.randint(-32768, 32768, (pi // 16, po // 16, 16 * K), dtype=torch.int32, generator=gen, device=device)
    mag = n_in ** -0.25
    signs = lambda n: torch.randint(0, 2, (n,), generator=gen, device=device).float() * 2 - 1  # noqa: E731
    yield f"{key}.trellis", trellis.to(torch.int16)
    yield f"{key}.suh", (signs(pi) * mag).half()
    yield f"{key}.svh", (signs(po) * mag).half()
    if codebook != "3inst":
        yield f"{key}.{codebook}", torch.tensor(MARKER_VALUES[codebook], dtype=torch.int32)


def layer_bits(bits: float) -> list[int]:
    """Integer K for (qkv, o, gate/up, down): floor(bits), with attention raised first, like the
    reference's allocation for a uniform target."""
    base = int(math.floor(bits))
    return [base, base, base, base] if bits == base else [base + 1, base + 1, base, base]


def synth_modules(shape: Shape, bits: float, head_bits: int, codebook: str, seed: int = 0, device="cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the tensors of one module at a time (embedding, each layer, head) so the 70B shape
    never needs to sit in memory at once."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    gemma = shape.family in ("gemma2", "gemma3")

    def unit_norm(n: int) -> torch.Tensor:
        """A norm weight that scales by one: Gemma's norms apply (1 + w)."""
        return torch.full((n,), 0.0 if gemma else 1.0, dtype=torch.bfloat16, device=device)

    yield [("model.embed_tokens.weight", (torch.randn(shape.vocab, h, generator=gen, device=device) * 0.02).bfloat16())]
    kq, ko, kgu, kd = layer_bits(bits)
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        norms = ["input_layernorm", "post_attention_layernorm"]
        if gemma:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        tensors = [(f"{p}.{n}.weight", unit_norm(h)) for n in norms]
        if shape.family in ("qwen3", "gemma3"):
            tensors += [(f"{p}.self_attn.{n}.weight", unit_norm(hd)) for n in ("q_norm", "k_norm")]
        for name, n_in, n_out, K in [
            ("self_attn.q_proj", h, shape.heads * hd, kq),
            ("self_attn.k_proj", h, shape.kv_heads * hd, kq),
            ("self_attn.v_proj", h, shape.kv_heads * hd, kq),
            ("self_attn.o_proj", shape.heads * hd, h, ko),
            ("mlp.gate_proj", h, i, kgu),
            ("mlp.up_proj", h, i, kgu),
            ("mlp.down_proj", i, h, kd),
        ]:
            tensors += list(exl3_linear(f"{p}.{name}", n_in, n_out, K, codebook, gen, device))
        yield tensors
    head = [("model.norm.weight", unit_norm(h))]
    head += list(exl3_linear("lm_head", h, shape.vocab, head_bits, codebook, gen, device))
    yield head


def write_synth_model(out: Path, shape: Shape, bits: float, head_bits: int = 6, codebook: str = "mul1", seed: int = 0, shard_bytes: int = 4 << 30, device="cpu") -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush(final: bool = False):
        nonlocal size
        if shards[-1]:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file({k: v.cpu() for k, v in shards[-1].items()}, str(out / name))
            written.append((name, list(shards[-1])))
            shards[-1] = {}
            size = 0

    for module in synth_modules(shape, bits, head_bits, codebook, seed, device):
        nbytes = sum(t.numel() * t.element_size() for _, t in module)
        if size and size + nbytes > shard_bytes:
            flush()
        shards[-1].update(dict(module))
        size += nbytes
    flush()
    n = len(written)
    weight_map = {}
    for idx, (name, keys) in enumerate(written):
        final = f"model-{idx + 1:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update({k: final for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = config_for(shape, bits, head_bits, codebook)
    config["trellis_synth_shape"] = next((name for name, s in SHAPES.items() if s == shape), "custom")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--codebook", choices=["mul1", "mcg", "3inst"], default="mul1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to draw the random bits (cuda is faster)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    path = write_synth_model(Path(args.out), SHAPES[args.shape], args.bits, args.head_bits, args.codebook, args.seed, device=args.device)
    print(json.dumps({"synth_model": str(path), "shape": args.shape, "bits": args.bits}))


if __name__ == "__main__":
    main()
