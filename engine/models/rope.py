"""Rotary position embeddings: inverse frequencies per scaling type, and applying them.

The frequency formulas follow the published methods (and the way transformers evaluates them,
so that logits agree with checkpoints' reference implementation): plain RoPE, linear position
interpolation, Llama 3.1's smoothed band scaling and YaRN.
"""
from __future__ import annotations

import math

import torch

from engine.io.hf_config import RopeConfig


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim/2], attention_scaling): cos/sin are multiplied by the scaling."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta ** exponents)

    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unknown rope type {rope.rope_type}")  # hf_config rejects these earlier


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    factor, base, orig_len = rope.factor, rope.theta, rope.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    return inv_freq, float(attention)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for given positions; the cached frequencies live on the model's device.

    A decode step runs this once per token, so it is kept to few kernels: the frequencies are
    stored already repeated for both halves, and the scaling is skipped where it is 1."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(rope, head_dim)
        self.register_buffer("inv_freq_both", torch.cat((inv_freq, inv_freq)), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: LongTensor [T] → cos, sin [T, head_dim] in `dtype` (angles in fp32)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq_both[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
