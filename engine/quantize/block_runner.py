"""Running a loaded model one piece at a time, for sequential quantization.

The converter needs what a normal forward pass hides: the embedding output, one decoder layer
at a time (with its own rotary tables and mask), the final norm, and handles on every linear so
it can capture their inputs and swap in quantized weights. This adapter gives that view over
the engine's own model classes (engine/models: DecoderLM for Llama/Mistral/Qwen2/Qwen3, GemmaLM
for Gemma 2/3), so the converter runs exactly the code the engine runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.gemma import GemmaLM
from engine.models.layers import attention_mask


@dataclass(frozen=True)
class LinearSlot:
    """One quantizable linear of a decoder layer."""

    name: str       # attribute path inside the layer, e.g. "self_attn.q_proj"
    qmap: str       # shared-input group: one Hessian per qmap
    group: str      # bit-allocation group (moves up together)
    priority: int   # 2 attention, 1 MLP


# Order = the reference's tensor_storage order (q, k, v, o, up, gate, down).
DECODER_SLOTS = (
    LinearSlot("self_attn.q_proj", "attn.input", "qkv", 2),
    LinearSlot("self_attn.k_proj", "attn.input", "qkv", 2),
    LinearSlot("self_attn.v_proj", "attn.input", "qkv", 2),
    LinearSlot("self_attn.o_proj", "attn.o", "o", 2),
    LinearSlot("mlp.up_proj", "mlp.input", "gu", 1),
    LinearSlot("mlp.gate_proj", "mlp.input", "gu", 1),
    LinearSlot("mlp.down_proj", "mlp.down", "d", 1),
)
# Unquantized per-layer tensors in storage order (those absent from a family are skipped).
LAYER_NORMS = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
               "pre_feedforward_layernorm", "post_feedforward_layernorm")


class ModelRunner:
    def __init__(self, model: nn.Module):
        self.model = model
        self.is_gemma = isinstance(model, GemmaLM)
        self.num_layers = len(model.layers)

    def linear(self, layer: int, name: str) -> nn.Module:
        mod = self.model.layers[layer]
        for part in name.split("."):
            mod = getattr(mod, part)
        return mod

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids.to(self.model.device))

    @torch.no_grad()
    def run_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        layer = m.layers[i]
        if self.is_gemma:
            rope = m.rotary_local if (layer.self_attn.is_local and m.rotary_local) else m.rotary_global
        else:
            rope = m.rotary
        cos, sin = rope(pos, m.dtype)
        mask = attention_mask(0, T, layer.self_attn.window, x.device)
        return layer(x, cos, sin, mask, None)

    @torch.no_grad()
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    @torch.no_grad()
    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head_logits(x)
