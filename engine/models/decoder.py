"""Llama-style decoder: Llama, Mistral, Qwen2/2.5 (+VL text), Qwen3.

One pre-norm transformer with switches from ModelConfig: q/k/v (and o) biases, Qwen3's
per-head q/k RMSNorm, a tied or separate head, sliding-window layers.

    x = embed(ids)
    for each layer:
        x = x + o_proj(attention(rope(q), rope(k), v))     on input_layernorm(x)
        x = x + down(silu(gate(h)) * up(h))                with h = post_attention_layernorm(x)
    logits = lm_head(norm(x))

On the GPU each residual add is done by the kernel of the norm that follows it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.cache.contiguous import KVCache
from engine.cache.static import StaticKVCache
from engine.io.hf_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.layers import GatedMLP, QuantLinearGroup, attention
from engine.models.loading import WeightLoader
from engine.models.rope import RotaryEmbedding


class Attention(nn.Module):
    """Self-attention shared by every family. The switches come from the config (biases, per-head
    q/k norm, sliding window, Gemma 2's score soft-capping); `unit_offset` is Gemma's (1 + w) norm."""

    def __init__(self, c: ModelConfig, layer: int, load: WeightLoader, key: str, unit_offset: bool = False):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = load.linear(f"{key}.q_proj", c.hidden_size, q_size, bias=c.qkv_bias)
        self.k_proj = load.linear(f"{key}.k_proj", c.hidden_size, kv_size, bias=c.qkv_bias)
        self.v_proj = load.linear(f"{key}.v_proj", c.hidden_size, kv_size, bias=c.qkv_bias)
        self.o_proj = load.linear(f"{key}.o_proj", q_size, c.hidden_size, bias=c.o_bias)
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            self.q_norm = load.norm(f"{key}.q_norm", c.head_dim, c.rms_norm_eps, unit_offset=unit_offset)
            self.k_norm = load.norm(f"{key}.k_norm", c.head_dim, c.rms_norm_eps, unit_offset=unit_offset)
        self.window = c.window_for_layer(layer)
        # Gemma 3's sliding layers use their own rope base; other families have one rope.
        self.is_local = c.local_rope is not None and c.rope_for_layer(layer) is c.local_rope
        self.scale = c.attention_scale
        self.softcap = c.attn_logit_softcapping
        self.qkv: QuantLinearGroup | None = None  # set by fuse_projections on the GPU
        # Set by a layer whose next reader launches deferred products (engine/ops/chain.py): the
        # output may then be an ops.Deferred (chains) or ops.OpenSums (open sums).
        self.defer_output = False

    def fuse_projections(self, device_type: str | None) -> bool:
        if self.qkv is None:
            self.qkv = QuantLinearGroup.build([self.q_proj, self.k_proj, self.v_proj], device_type)
        return self.qkv is not None

    def forward(self, x: "torch.Tensor | ops.PendingNorm", cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x)  # a pending input norm is computed by the grouped product's prep
        else:
            x = ops.as_tensor(x)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        rope = None
        if T == 1 and isinstance(cache, StaticKVCache):  # a decode step
            norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
            rope = cache.pending_rope(self.layer, q, k, v, cos, sin, norms, self.window)
            if norms is not None and not rope.serves(mask):  # the norms first, on their own
                rope = cache.pending_rope(self.layer, self.q_norm(q), self.k_norm(k), v, cos, sin, window=self.window)
            if rope.serves(mask):  # the attention kernel does the norms (if left to it), RoPE and store
                q, k, v = rope.q, rope.keys, rope.values
            else:  # RoPE and the cache write in one kernel of their own
                q, k, v, rope = rope.apply(), rope.keys, rope.values, None
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = ops.rope_qk(q, k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            if cache is not None:
                k, v = cache.update(self.layer, k, v)
        if self.defer_output and getattr(self.o_proj, "compressed", False):
            # one decode row: the attention kernel writes o_proj's input, o_proj stays deferred
            chained = ops.attention_into_chain(q, k, v, mask, self.scale, self.o_proj.exl3, self.o_proj.out_features,
                                               rope, self.softcap)
            if chained is not None:
                return chained[1]
        out = attention(q, k, v, mask, self.scale, self.softcap, rope)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        if self.defer_output and hasattr(self.o_proj, "deferred"):
            return self.o_proj.deferred(out)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, load: WeightLoader, key: str):
        super().__init__()
        self.input_layernorm = load.norm(f"{key}.input_layernorm", c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer, load, f"{key}.self_attn")
        self.post_attention_layernorm = load.norm(f"{key}.post_attention_layernorm", c.hidden_size, c.rms_norm_eps)
        inter = c.intermediate_size
        self.mlp = GatedMLP(
            load.linear(f"{key}.mlp.gate_proj", c.hidden_size, inter, bias=c.mlp_bias),
            load.linear(f"{key}.mlp.up_proj", c.hidden_size, inter, bias=c.mlp_bias),
            load.linear(f"{key}.mlp.down_proj", inter, c.hidden_size, bias=c.mlp_bias),
            c.hidden_act,
        )
        # Both outputs go to a norm that a grouped product reads (residual_forward), so on the GPU
        # they may stay deferred (chains: that product launches them, their output stage writing
        # its input) or open (open sums: that product's prep finishes them).
        self.self_attn.defer_output = self.mlp.defer_output = True

    def forward(self, x, cos, sin, mask, cache):
        x, mlp_out = self.residual_forward(x, None, cos, sin, mask, cache)
        return x + ops.as_tensor(mlp_out)

    def residual_forward(self, x, pending, cos, sin, mask, cache):
        """(residual stream, this layer's MLP output not yet added to it). Each residual add
        rides with the norm that follows it: `pending` (the previous layer's MLP output) with this
        layer's input norm, the attention output with the post-attention norm. On the GPU both
        norms (and their adds) run inside the prep of the grouped product that reads them, so
        `h.sum`, the residual stream, exists once that product has run. At one row the attention
        and MLP outputs may be deferred products (engine/ops/chain.py): the grouped product that
        reads the norm launches them, and their output stage writes its input (and the sum)."""
        h = self.input_layernorm.pending(x) if pending is None else self.input_layernorm.pending(pending, x)
        a = self.self_attn(h, cos, sin, mask, cache)
        h = self.post_attention_layernorm.pending(a, ops.as_sum(h))
        out = self.mlp(h)
        return ops.as_sum(h), out


class DecoderLM(CausalLM):
    def __init__(self, c: ModelConfig, load: WeightLoader, prefix: str = "model.", head_key: str = "lm_head",
                 progress: Callable[[int, int], None] | None = None):
        super().__init__(c, load.device, load.dtype)
        total = c.num_layers + 2
        self.embed_tokens = load.embedding(f"{prefix}embed_tokens", c.vocab_size, c.hidden_size)
        self.rotary = RotaryEmbedding(c.rope, c.head_dim).to(load.device)
        layers = []
        for i in range(c.num_layers):
            layers.append(DecoderLayer(c, i, load, f"{prefix}layers.{i}"))
            if progress:
                progress(i + 1, total)
        self.layers = nn.ModuleList(layers)
        self.norm = load.norm(f"{prefix}norm", c.hidden_size, c.rms_norm_eps)
        self.lm_head = load.head(head_key, self.embed_tokens, c.hidden_size, c.vocab_size, c.tie_word_embeddings)
        if progress:
            progress(total, total)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        positions, masks = self._attention_inputs(input_ids, cache)
        cos, sin = self.rope(self.rotary, positions, cache)

        x, pending = self.embed(input_ids), None
        for layer in self.layers:
            x, pending = layer.residual_forward(x, pending, cos, sin, masks[layer.self_attn.window], cache)
        h = self.norm(x) if pending is None else self.norm.add_forward(pending, x)[0]
        logits = self.head_logits(h)

        if cache is not None:
            cache.advance(input_ids.shape[1])
        return logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from the final-normed hidden state."""
        return self.lm_head(h).float()
