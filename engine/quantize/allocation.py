"""Bit allocation for a fractional bpw target (spec 5.10): every tensor gets an integer K, groups
of tensors (q/k/v, o, gate/up, down) move up together in sweeps while the budget allows.

Attention groups go first (they are small and sensitive), then MLPs; within a priority, layers
nearest either end of the stack first (the first and last layers matter most)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class QGroup:
    name: str            # e.g. "model.layers.3.self_attn.qkv"
    layer: int
    priority: int        # 2 attention, 1 MLP
    numel: int           # Σ in·out (padded) of the group's tensors
    order: int           # declaration order within the model


def allocate_bits(groups: list[QGroup], bpw: float, num_layers: int) -> dict[str, int]:
    """K per group name; the weighted average never exceeds bpw (except when bpw < 1... never: K ≥ 1)."""
    k0 = max(1, min(8, int(math.floor(bpw))))
    total = sum(g.numel for g in groups)
    budget = int(bpw * total)
    bits = {g.name: k0 for g in groups}
    used = k0 * total
    ranked = sorted(groups, key=lambda g: (-g.priority, min(g.layer, num_layers - 1 - g.layer), g.layer, g.order))
    changed = True
    while changed:
        changed = False
        for g in ranked:
            if bits[g.name] < 8 and used + g.numel <= budget:
                bits[g.name] += 1
                used += g.numel
                changed = True
    return bits


def average_bits(groups: list[QGroup], bits: dict[str, int]) -> float:
    total = sum(g.numel for g in groups)
    return sum(bits[g.name] * g.numel for g in groups) / total if total else 0.0
