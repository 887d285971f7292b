"""Bit allocation for a bpw target: every tensor gets an integer K, within the budget
Σ numel·K ≤ int(bpw·Σ numel) (the head excluded, it has its own fixed K).

`allocate_bits` is the reference's heuristic (spec 5.10): groups of tensors (q/k/v, o, gate/up,
down) move up together in sweeps while the budget allows. Attention groups go first (they are
small and sensitive), then MLPs; within a priority, layers nearest either end of the stack first
(the first and last layers matter most). At an integer bpw it is simply K = bpw everywhere.

`allocate_measured` spends the same budget where measured sensitivities say it buys the most
(engine.quantize.sensitivity): it minimizes the predicted KLD Σ s_g·D(K_g)."""
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


# Relative MSE D(K) = E[(decoded − w)²] / E[w²] of the trellis codebook at K bits per weight, for
# i.i.d. Gaussian targets (what the regularization makes of a weight). Measured once with
# engine.quantize.viterbi.encode_tiles (CPU encoder, mul1): 512 Gaussian 16×16 tiles, encoded at
# the global scale found by scale_search.search_scale(effort="full") on a separate 512×512 Gaussian
# matrix, seed 0. mcg and 3inst are within 1-3% at K ≤ 5 and 10% at K ≥ 7, which moves no
# allocation decision (only ratios D(K)/D(K+1) ≈ 3.8-4.0 matter), so one table serves all three.
CODEBOOK_MSE = {1: 0.273268, 2: 0.0684454, 3: 0.0174397, 4: 0.00445511, 5: 0.00114452, 6: 3.00062e-4,
                7: 7.99101e-5, 8: 2.10096e-5}
K_MAX = 8


def measured_k_range(bpw: float) -> tuple[int, int]:
    """The K a measured allocation may give a tensor at this bpw: one step either side of the
    target's K. Sensitivities are slopes taken at the target's error level; far from it the
    first-order model fails, mostly by underrating large errors. Unbounded, on SmolLM2 at
    4.0 bpw it gave layer 0's q and k projections K = 1 (relative errors 0.05-0.07) and the
    held-out KLD rose from 0.042 (heuristic) to 0.052."""
    return max(1, math.floor(bpw) - 1), min(K_MAX, math.ceil(bpw) + 1)


def allocate_measured(groups: list[QGroup], sensitivity: dict[str, float], bpw: float,
                      k_min: int = 1, k_max: int = K_MAX) -> dict[str, int]:
    """K per group minimizing Σ s_g·D(K_g) under Σ numel_g·K_g ≤ int(bpw·Σ numel) (the same
    budget as `allocate_bits`).

    Greedy marginal analysis: start every group at k_min and repeatedly take the one-bit upgrade
    with the largest predicted KLD drop per stored bit, s_g·(D(K) − D(K+1)) / numel_g, that still
    fits. D is convex in K, so each group's upgrades come in decreasing order of value and the
    greedy path is optimal at every budget it passes through exactly (what it can leave unused
    is less than one group's numel). Ties break by declaration order, so it is deterministic."""
    import heapq

    k_min = max(1, min(k_min, K_MAX))
    k_max = max(k_min, min(k_max, K_MAX))
    total = sum(g.numel for g in groups)
    budget = int(bpw * total)
    bits = {g.name: k_min for g in groups}
    used = k_min * total
    if used > budget:
        raise ValueError(f"{bpw} bpw is below the minimum of {k_min} bits per weight")

    def gain(g: QGroup, k: int) -> float:
        return max(0.0, float(sensitivity[g.name])) * (CODEBOOK_MSE[k] - CODEBOOK_MSE[k + 1]) / g.numel

    heap = [(-gain(g, k_min), g.order, i) for i, g in enumerate(groups) if k_min < k_max and g.numel > 0]
    heapq.heapify(heap)
    while heap:
        _, _, i = heapq.heappop(heap)
        g = groups[i]
        if used + g.numel > budget:
            continue  # the budget only shrinks: this group can never move up again
        bits[g.name] += 1
        used += g.numel
        if bits[g.name] < k_max:
            heapq.heappush(heap, (-gain(g, bits[g.name]), g.order, i))
    return bits


def predicted_kld(groups: list[QGroup], sensitivity: dict[str, float], bits: dict[str, int]) -> float:
    """Σ s_g·D(K_g): the first-order KLD the sensitivities predict for an allocation."""
    return sum(float(sensitivity[g.name]) * CODEBOOK_MSE[bits[g.name]] for g in groups)
