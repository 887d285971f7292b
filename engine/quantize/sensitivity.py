"""Measured sensitivity of a model's output to quantization error, per allocation unit.

Why: a fixed bpw is best spent where the output cares most. For every unit g that gets one K
(the converter uses single linears; groups of linears such as q/k/v work the same way) we
estimate s_g, the growth of the output KL divergence per unit of codebook relative MSE, so that
quantizing g at K bits costs about s_g·D(K) (D: the codebook's relative MSE,
engine.quantize.allocation.CODEBOOK_MSE) and the allocator can trade bits between units
(allocation.allocate_measured).

How: on the unquantized model, perturb one group at a time with noise shaped like the
quantizer's own error at a probe level D_probe, run the calibration rows to the logits and
measure KL(clean ‖ perturbed); s_g = KLD_g / D_probe. The clean pass runs once and keeps every
layer's input, so a group in layer l only reruns layers l..end and the head.

The noise is "quantization-like" rather than plain i.i.d. Gaussian, because that is what makes
s_g predictive of the real converter (engine.quantize.linear):
- the quantizer encodes a regularized weight (signs, Hadamards, row/column scales; spec 5.4)
  whose trellis error is close to i.i.d. at D(K) of its power; mapped back through su/sv that is
  an error with per-row and per-column magnitudes following the weight's own;
- LDLQ feeds each row block's error forward, so the error that reaches the output is shaped by
  the input Hessian H: with H' = (I + L̃)·D·(I + L̃)ᵀ (block LDL) the error is
  Δ = (I + L̃ᵀ)⁻¹·η for i.i.d. η. Groups whose inputs are very anisotropic gain much more from
  LDLQ than others, and plain noise would misjudge them.
H comes from 128k calibration tokens on the clean model (HessianStream), about as good as the
converter's own. Against the real quantizer on SmolLM2 layers, this noise gives output errors
tr(EHEᵀ) within 1.2-1.7x of the real ones (the trellis does a little worse than D(K) on real,
slightly heavy-tailed weights), where i.i.d. noise of the same norm is 6-10x off and varies far
more between tensors. All randomness is seeded per tensor, so the measurement is deterministic
on a given device.

Measured sensitivities are slopes of a first-order model: the KLDs of perturbations in
different units add up (bench/alloc_sim.py: on SmolLM2 the sum is within 10% of the joint KLD
on the same rows at 3-5 bpw, 20% at 2 bpw, where everything perturbed at once interacts), and
they are taken on calibration text, not on the text the model will later see; the gain on held-out
text is about half of the gain on the sample.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from engine.formats.exl3 import hadamard128, pad_to_128
from engine.quantize.allocation import CODEBOOK_MSE, K_MAX
from engine.quantize.block_runner import DECODER_SLOTS, LinearSlot, ModelRunner
from engine.quantize.hessian import HessianAccumulator
from engine.quantize.ldlq import block_ldl
from engine.quantize.linear import _seed
from engine.quantize.regularize import random_signs, regularize, rotate_hessian


@dataclass(frozen=True)
class SensitivityGroup:
    """One allocation group: the linears of one layer that share a K."""

    name: str                      # e.g. "model.layers.3.qkv"
    layer: int
    layer_key: str                 # e.g. "model.layers.3" (tensor keys are layer_key + "." + slot.name)
    slots: tuple[LinearSlot, ...]


def decoder_groups(layer_keys: list[str], per_tensor: bool = False) -> list[SensitivityGroup]:
    """The heuristic's groups (qkv, o, gu, d per layer) in model order; per_tensor: one unit per
    linear instead, named by its tensor key (what the converter measures and allocates)."""
    out = []
    for i, key in enumerate(layer_keys):
        if per_tensor:
            out += [SensitivityGroup(f"{key}.{s.name}", i, key, (s,)) for s in DECODER_SLOTS]
            continue
        for group in dict.fromkeys(s.group for s in DECODER_SLOTS):
            out.append(SensitivityGroup(f"{key}.{group}", i, key, tuple(s for s in DECODER_SLOTS if s.group == group)))
    return out


# ------------------------------------------------------------------------------------------------
# noise shaped like the quantizer's error


@torch.no_grad()
def quantization_noise(weight: torch.Tensor, hessian: torch.Tensor | None, rel_mse: float, key: str, qmap: str,
                       seed: int = 0, shaped: bool = True) -> torch.Tensor:
    """An error tensor [out, in] (HF orientation, like `weight`) that looks like the quantizer's
    error at codebook relative MSE `rel_mse`: i.i.d. in the regularized domain (same signs and
    scales as the quantizer would use), fed back through LDLQ when a padded input Hessian is given.
    `shaped=False` gives plain i.i.d. noise of relative Frobenius norm sqrt(rel_mse) instead."""
    device = weight.device
    n_out, n_in = weight.shape
    gen = torch.Generator(device=device).manual_seed(_seed(seed, key + "/noise"))
    if not shaped:
        noise = torch.randn(n_out, n_in, generator=gen, device=device)
        return noise * math.sqrt(rel_mse) * (weight.float().norm() / noise.norm().clamp_min(1e-30))
    p_in, p_out = pad_to_128(n_in), pad_to_128(n_out)
    w = torch.zeros(p_in, p_out, dtype=torch.float32, device=device)
    w[:n_in, :n_out] = weight.float().T
    reg = regularize(w, random_signs(p_in, _seed(seed, qmap), device), random_signs(p_out, _seed(seed, key), device))
    if reg.all_zero:
        return torch.zeros_like(weight, dtype=torch.float32)
    # the global scale g would multiply the target and divide su: it cancels in the error
    eta = torch.randn(p_in, p_out, generator=gen, device=device) * math.sqrt(rel_mse * float(reg.w.square().mean()))
    if hessian is not None:
        lt = block_ldl(rotate_hessian(hessian.to(device), reg.su))  # strictly block-lower
        eta = torch.linalg.solve_triangular(lt.T, eta, upper=True, unitriangular=True)
    err = hadamard128(hadamard128(eta, dim=0), dim=1) * reg.su[:, None] * reg.sv[None, :]
    return err[:n_in, :n_out].T.contiguous()


# ------------------------------------------------------------------------------------------------
# the measurement

# Rows × tokens of calibration text the measurement runs. The token sample, not the noise draw,
# limits the precision: on SmolLM2 at 4 x 256 tokens, two disjoint samples give sensitivities a
# median 20% apart (log-correlation 0.97), two noise seeds 5% (0.99). A GPU affords 8x the tokens
# and still takes seconds; a CPU conversion is slow anyway, so its measurement stays small.
SAMPLE = {"cuda": (16, 512), "cpu": (4, 256)}


# Calibration tokens behind the noise-shaping Hessians: ~85x the widest input (1536) of a small
# model and plenty for 8B-class widths (14336: 9x), at a quarter of the default set's cost.
HESSIAN_TOKENS = 1 << 17


def hessian_rows(ids: torch.Tensor, max_tokens: int = HESSIAN_TOKENS) -> torch.Tensor:
    """Every k-th calibration row (all kinds: prose, code, random ids, like the converter's own
    Hessians), at most max_tokens tokens in all."""
    rows = max(1, min(ids.shape[0], max_tokens // ids.shape[1]))
    step = -(-ids.shape[0] // rows)
    return ids[::step]


def probe_mse(bpw: float) -> float:
    """Noise level of the probe: the codebook's error at the K nearest the target, so the
    sensitivities are slopes taken where the model will actually operate."""
    return CODEBOOK_MSE[max(1, min(K_MAX, round(bpw)))]


def measurement_bytes(num_layers: int, hidden: int, vocab: int, tokens: int) -> int:
    """Memory the measurement holds besides the model: every layer's input, the clean log-probs,
    one chunk of perturbed logits and a layer's working activations (rough, generous)."""
    return 4 * tokens * (hidden * (num_layers + 8) + 2 * vocab)


def free_bytes(device: torch.device) -> int:
    """Memory the measurement may use: free device memory, or the RAM Linux calls available
    (free plus reclaimable cache)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _log_probs(runner: ModelRunner, h: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.log_softmax(runner.head_logits(runner.final_norm(h))[..., :vocab].float(), dim=-1)


def _kl_sum(runner: ModelRunner, ref: torch.Tensor, h: torch.Tensor, vocab: int, chunk_rows: int) -> float:
    """Σ over tokens of KL(ref ‖ model(h)), computed a few rows at a time (the logits are big)."""
    total = 0.0
    for a in range(0, h.shape[0], chunk_rows):
        logp = _log_probs(runner, h[a:a + chunk_rows], vocab)
        r = ref[a:a + chunk_rows]
        total += float((r.exp() * (r - logp)).sum(dtype=torch.float64))
    return total


def _capture_hessians(runner: ModelRunner, layer: int, x: torch.Tensor, slots,
                      chunks: list[slice] | None = None, device: torch.device | None = None):
    """Input Hessians (damped, padded) of layer `layer` over the rows of x, one per qmap of
    `slots`; also returns the layer's output (on x's device)."""
    device = device or x.device
    first: dict[str, str] = {}
    for slot in slots:
        first.setdefault(slot.qmap, slot.name)
    acc, hooks = {}, []
    for qmap, name in first.items():
        lin = runner.linear(layer, name)
        acc[qmap] = HessianAccumulator(pad_to_128(lin.in_features), device)
        hooks.append(lin.register_forward_pre_hook(lambda m, args, a=acc[qmap]: a.add(args[0])))
    out = torch.empty_like(x)
    try:
        for sl in chunks or [slice(0, x.shape[0])]:
            out[sl] = runner.run_layer(layer, x[sl].to(device)).to(out.device)
    finally:
        for h in hooks:
            h.remove()
    return {q: a.finalize() for q, a in acc.items()}, out


class HessianStream:
    """The input Hessians of the unquantized model's layers over calibration rows, one
    layer at a time (layer l's are captured while the stream advances through it), so only one
    layer's Hessians exist at once. The noise that stands in for quantization must be shaped by
    Hessians as good as the converter's: from a few thousand tokens they are rank-deficient, and
    LDLQ-shaped noise then hides in directions those same tokens never excite, which makes
    every group look far less sensitive than it is on other text."""

    def __init__(self, runner: ModelRunner, ids: torch.Tensor, chunks: list[slice], state_device: torch.device,
                 slots=DECODER_SLOTS):
        self.runner, self.chunks, self.slots = runner, chunks, slots
        self.device = runner.model.device
        self.states = torch.cat([runner.embed(ids[sl]).to(state_device) for sl in chunks])
        self.next = 0

    @torch.no_grad()
    def __call__(self, layer: int) -> dict[str, torch.Tensor | None]:
        if layer < self.next:
            raise ValueError(f"layer {layer} was already passed (next is {self.next})")
        while True:
            hess, self.states = _capture_hessians(self.runner, self.next, self.states, self.slots, self.chunks, self.device)
            self.next += 1
            if self.next > layer:
                return hess


@torch.no_grad()
def measure_sensitivities(runner: ModelRunner, ids: torch.Tensor, groups: list[SensitivityGroup], probe_mse: float,
                          seed: int = 0, shaped: bool = True,
                          hessians: Callable[[int], dict[str, torch.Tensor | None]] | None = None,
                          progress: Callable[[int, int, str], None] | None = None) -> dict[str, float]:
    """s_g = KL(clean ‖ g perturbed at `probe_mse`) / probe_mse, KL averaged per token over the
    sample rows `ids` [rows, tokens]. `hessians(layer)` gives the noise-shaping Hessians per
    qmap; it is called once per layer in increasing order (a HessianStream over the
    calibration set); None captures them on the sample itself (only for tiny tests: see
    HessianStream). Runs on the model's device; the model is left exactly as it was (perturbed
    weights are swapped in and back, never modified in place)."""
    model = runner.model
    device = model.device
    vocab = model.config.vocab_size
    rows, tokens = ids.shape
    chunk_rows = max(1, (8192 if device.type == "cuda" else 1024) // tokens)
    inputs = []
    x = runner.embed(ids.to(device))
    for i in range(runner.num_layers):
        inputs.append(x)
        x = runner.run_layer(i, x)
    ref = torch.cat([_log_probs(runner, x[a:a + chunk_rows], vocab) for a in range(0, rows, chunk_rows)])
    del x
    n_tok = rows * tokens
    out: dict[str, float] = {}
    done = 0
    by_layer: dict[int, list[SensitivityGroup]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, []).append(g)
    for layer in sorted(by_layer):
        lgroups = by_layer[layer]
        hess = {}
        if shaped:
            slots = [s for g in lgroups for s in g.slots]
            hess = hessians(layer) if hessians is not None else _capture_hessians(runner, layer, inputs[layer], slots)[0]
        for g in lgroups:
            saved = {}
            try:
                for slot in g.slots:
                    lin = runner.linear(layer, slot.name)
                    saved[slot.name] = lin.weight
                    noise = quantization_noise(lin.weight, hess.get(slot.qmap), probe_mse, f"{g.layer_key}.{slot.name}",
                                               slot.qmap, seed, shaped)
                    lin.weight = (lin.weight.float() + noise).to(lin.weight.dtype)
                h = inputs[layer]
                for j in range(layer, runner.num_layers):
                    h = runner.run_layer(j, h)
                kld = _kl_sum(runner, ref, h, vocab, chunk_rows) / n_tok
            finally:
                for name, w in saved.items():
                    runner.linear(layer, name).weight = w
            out[g.name] = kld / probe_mse
            done += 1
            if progress:
                progress(done, len(groups), g.name)
    return out
