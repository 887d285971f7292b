"""Gemma 2 and Gemma 3 (text): the Llama recipe with Gemma's changes.

- every RMSNorm applies (1 + w), and each block norms both before *and after* attention and MLP;
- the embedding is multiplied by √hidden (rounded to the checkpoint's dtype, as Gemma does);
- attention scores are scaled by query_pre_attn_scalar**-0.5, not head_dim**-0.5;
- Gemma 2: scores soft-capped with tanh, logits soft-capped too, sliding/global layers alternate;
- Gemma 3: q/k RMSNorm per head, a sliding/global pattern (5:1 by default) whose sliding layers
  use their own rope base (rope_local_base_freq), no attention soft-capping.

    x = embed(ids) * √hidden
    for each layer:
        x = x + post_attention_norm(o_proj(attention(...)))   on input_layernorm(x)
        x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    logits = softcap(lm_head(norm(x)))
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.cache.contiguous import KVCache
from engine.io.hf_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.decoder import Attention
from engine.models.layers import GatedMLP
from engine.models.loading import WeightLoader
from engine.models.rope import RotaryEmbedding


class GemmaLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, load: WeightLoader, key: str):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = load.norm(f"{key}.input_layernorm", h, eps, unit_offset=True)
        self.self_attn = Attention(c, layer, load, f"{key}.self_attn", unit_offset=True)
        self.post_attention_layernorm = load.norm(f"{key}.post_attention_layernorm", h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = load.norm(f"{key}.pre_feedforward_layernorm", h, eps, unit_offset=True)
        self.mlp = GatedMLP(
            load.linear(f"{key}.mlp.gate_proj", h, c.intermediate_size),
            load.linear(f"{key}.mlp.up_proj", h, c.intermediate_size),
            load.linear(f"{key}.mlp.down_proj", c.intermediate_size, h),
            c.hidden_act,
        )
        self.post_feedforward_layernorm = load.norm(f"{key}.post_feedforward_layernorm", h, eps, unit_offset=True)
        # One decode row: the attention kernel may write o_proj's input (engine/ops/chain.py), o_proj
        # then launched by the norm that reads it. Head dim 256 only, where that rides on the
        # tensor-core walk and ops.ATTN_CHAIN_D256 (off: measured slower than o_proj's own prep,
        # session 24): at head dim 128 (the 27B models) the chain with Gemma's soft cap or q/k
        # norms has not run on a GPU yet, so those keep o_proj's prep kernel.
        self.self_attn.defer_output = c.head_dim == 256

    def forward(self, x, cos, sin, mask, cache):
        x, mlp_out = self.residual_forward(x, None, cos, sin, mask, cache)
        return x + ops.as_tensor(mlp_out)

    def residual_forward(self, x, pending, cos, sin, mask, cache):
        """(residual stream, this layer's normed MLP output not yet added to it), as
        DecoderLayer.residual_forward: each residual add rides with the norm after it, `pending`
        (the previous layer's) with this layer's input norm, the normed attention output with the
        pre-feedforward norm; on the GPU both run in the prep of the grouped product that reads
        them. The post-attention and post-feedforward norms stay pending too (PendingNorm), so the
        next norm can take them along (RMSNorm.pending): with ops.PREP_DOUBLE_NORM the decode
        prep computes both; otherwise each is a kernel of its own."""
        h = self.input_layernorm.pending(x) if pending is None else self.input_layernorm.pending(pending, x)
        a = self.post_attention_layernorm.pending(self.self_attn(h, cos, sin, mask, cache))
        h = self.pre_feedforward_layernorm.pending(a, ops.as_sum(h))
        out = self.post_feedforward_layernorm.pending(ops.as_tensor(self.mlp(h)))
        return ops.as_sum(h), out


class GemmaLM(CausalLM):
    def __init__(self, c: ModelConfig, load: WeightLoader, prefix: str = "model.", head_key: str = "lm_head",
                 progress: Callable[[int, int], None] | None = None):
        super().__init__(c, load.device, load.dtype)
        total = c.num_layers + 2
        embed_key = f"{prefix}embed_tokens"
        self.embed_tokens = load.embedding(embed_key, c.vocab_size, c.hidden_size)
        # Gemma computes √hidden in the embedding's dtype (55.4256 becomes 55.5 in bf16).
        stored = load.stored_dtype(f"{embed_key}.weight")
        self.embed_scale = float(torch.tensor(c.hidden_size ** 0.5, dtype=stored))
        self.rotary_global = RotaryEmbedding(c.rope, c.head_dim).to(load.device)
        self.rotary_local = RotaryEmbedding(c.local_rope, c.head_dim).to(load.device) if c.local_rope else None
        layers = []
        for i in range(c.num_layers):
            layers.append(GemmaLayer(c, i, load, f"{prefix}layers.{i}"))
            if progress:
                progress(i + 1, total)
        self.layers = nn.ModuleList(layers)
        self.norm = load.norm(f"{prefix}norm", c.hidden_size, c.rms_norm_eps, unit_offset=True)
        self.lm_head = load.head(head_key, self.embed_tokens, c.hidden_size, c.vocab_size, c.tie_word_embeddings)
        self.final_softcap = c.final_logit_softcapping
        if progress:
            progress(total, total)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        positions, masks = self._attention_inputs(input_ids, cache)
        rope_global = self.rope(self.rotary_global, positions, cache)
        rope_local = self.rope(self.rotary_local, positions, cache) if self.rotary_local else rope_global

        x, pending = self.embed(input_ids), None
        for layer in self.layers:
            cos, sin = rope_local if layer.self_attn.is_local else rope_global
            x, pending = layer.residual_forward(x, pending, cos, sin, masks[layer.self_attn.window], cache)
        h = self.norm(x) if pending is None else self.norm.add_forward(pending, x)[0]
        logits = self.head_logits(h)

        if cache is not None:
            cache.advance(input_ids.shape[1])
        return logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from the final-normed hidden state, soft-capped (Gemma 2)."""
        logits = self.lm_head(h).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
