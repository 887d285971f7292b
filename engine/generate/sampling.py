"""Choosing the next token from a row of logits.

Order of operations (the common convention, so settings mean what users expect from other tools):
repetition penalty → temperature → top-k → top-p → draw. Temperature 0 means greedy (argmax) and
skips everything else, so greedy output never depends on the other knobs or on the seed.
Randomness comes only from a `torch.Generator` seeded from the settings, so a seeded run is
reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError


@dataclass
class SamplerSettings:
    temperature: float = 0.0      # 0 → greedy
    top_k: int = 0                # 0 → off
    top_p: float = 1.0            # 1 → off
    repetition_penalty: float = 1.0  # 1 → off; >1 discourages tokens already seen
    seed: int | None = None       # None → nondeterministic

    def validate(self) -> "SamplerSettings":
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator:
        # Draws happen on the CPU (see sample_next), so one seed gives one answer on any device.
        gen = torch.Generator(device="cpu")
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive logits (multiply negative ones) of tokens already present by `penalty`."""
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    ids = previous_ids.unique()
    picked = logits[..., ids]
    logits = logits.clone()
    logits[..., ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits to -inf (ties at the threshold are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `p`.

    The most likely token always survives, so the distribution never becomes empty."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator | None = None,
                previous_ids: torch.Tensor | None = None) -> int:
    """One token id from fp32 logits [vocab]. `previous_ids` feeds the repetition penalty."""
    logits = logits.float()
    if previous_ids is not None:
        logits = apply_repetition_penalty(logits, previous_ids.to(logits.device), settings.repetition_penalty)
    if settings.greedy:
        return int(torch.argmax(logits, dim=-1))
    logits = logits / settings.temperature
    logits = top_k_mask(logits, settings.top_k)
    logits = top_p_mask(logits, settings.top_p)
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
