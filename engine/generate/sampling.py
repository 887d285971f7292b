"""Choosing the next token from a row of logits.

Order of operations (the common convention, so settings mean what users expect from other tools):
repetition penalty → temperature → top-k → top-p → min-p → draw. Temperature 0 means greedy
(argmax) and skips everything else, so greedy output never depends on the other knobs or on the
seed. Randomness comes only from a `torch.Generator` seeded from the settings, so a seeded run is
reproducible.

Cost matters here: a decode step on the GPU takes a few milliseconds, and a draw over a 128k
vocabulary done naively (a full sort for top-p, torch.multinomial over every token on the CPU)
took longer than the step itself (bench/sampling.py). So the filters hand on only the tokens they
keep (candidates), top-p looks at the most likely tokens first and sorts everything only when
they do not reach p, and the draw builds its CDF where the logits are and brings back one index.
sample_next runs the same steps as one pipeline with no host sync (choose), replayed on a GPU as
one CUDA graph (sampling_graph), so a token costs the host one wait; pick_next leaves the token on
the device, where the generation loop feeds it to the next step before reading it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from engine import ops
from engine.errors import ConfigError


@dataclass
class SamplerSettings:
    temperature: float = 0.0      # 0 → greedy
    top_k: int = 0                # 0 → off
    top_p: float = 1.0            # 1 → off
    min_p: float = 0.0            # 0 → off; drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # 1 → off; >1 discourages tokens already seen
    seed: int | None = None       # None → nondeterministic

    def validate(self) -> "SamplerSettings":
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (got {self.min_p})")
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
    ids = previous_ids.unique()  # where the ids are (the CPU in generation): no device sync
    if logits.is_cuda and not ids.is_cuda:  # from pinned memory: the copy waits for no queued step
        ids = ids.pin_memory().to(logits.device, non_blocking=True)
    else:
        ids = ids.to(logits.device)
    picked = logits[..., ids]
    logits = logits.clone()
    logits[..., ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


FIRST_LOOK = 1024  # how many of the most likely tokens top-p looks at before widening


def candidates(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               first: int = FIRST_LOOK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens top-k, top-p and min-p leave to draw from, as (their logits, their ids), logits
    [vocab]; ids None means every token, in order. Where a filter applies they come most likely
    first, and only those tokens travel on (a draw then touches k tokens, not the vocabulary).

    top-k keeps the k most likely tokens; top-p the smallest most-likely set whose probability
    reaches p (within the top k when both apply); min-p the tokens at least min_p times as likely
    as the most likely one. The most likely token always survives. Top-p looks at the `first`
    most likely tokens first and widens the search (8x at a time, up to a full sort) only when
    they hold less than p and min-p would keep every one of them (else min-p's cut, inside the
    look, is the smaller set and no token past the look can be drawn)."""
    n = logits.shape[-1]
    k = top_k if 0 < top_k < n else n
    if k == n and top_p >= 1.0:
        if min_p <= 0.0:
            return logits, None
        ids = (logits - logits.max() >= math.log(min_p)).nonzero().flatten()
        return logits[ids], ids
    look = k if k < n else min(n, first)
    while True:
        vals, ids = torch.topk(logits, look)  # most likely first
        if look == k or look == n:  # after top-k the distribution is the k tokens'
            probs = torch.softmax(vals, dim=-1)
        else:  # these tokens' share of the whole distribution
            probs = torch.exp(vals - vals[0]) / torch.exp(logits - vals[0]).sum()
        mass = torch.cumsum(probs, dim=-1)
        if (look == k or look == n or bool(mass[-1] >= top_p)
                or (min_p > 0.0 and bool(min_p_cuts_inside(vals, min_p)))):
            break
        look = min(n, look * 8)
    keep = vals.numel()
    if top_p < 1.0:  # the tokens whose probability before them is under p: a prefix
        keep = max(1, int(((mass - probs) < top_p).sum()))
    if min_p > 0.0:
        keep = min(keep, max(1, int((vals - vals[0] >= math.log(min_p)).sum())))
    return vals[:keep], ids[:keep]


def min_p_cuts_inside(vals: torch.Tensor, min_p: float) -> torch.Tensor:
    """Whether min-p (> 0) drops the last of these most-likely-first values, and so every value
    past them: top-p then needs no wider look. A 0-dim bool tensor (no host sync)."""
    return vals[-1] - vals[0] < math.log(min_p)


NO_DRAW = "no token can be drawn: the logits are NaN, +inf or all -inf"


def draw(logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """An index into `logits` drawn from their softmax, by inverse CDF with one uniform from
    `generator` (a CPU generator, so one seed gives one answer on any device). The CDF is built
    where the logits are; only the index comes back."""
    finite = torch.isfinite(logits)
    if not bool((finite | (logits == float("-inf"))).all() & finite.any()):  # one sync for both
        raise ValueError(NO_DRAW)
    cdf = weights_cdf(logits, logits.max())
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cdf, (cdf[-1] * u).reshape(1), right=True))
    return min(i, logits.numel() - 1)


def weights_cdf(vals: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The running sum of exp(vals - top) in float64: the softmax's CDF times its total, which is
    all an inverse-CDF draw needs (it scales the uniform by the last entry). Not softmax then
    cumsum: on a GPU the softmax of one 128k row is one block, ~90 us (bench/sampling.py
    --profile), where these elementwise and scan kernels spread over the device."""
    return torch.cumsum(torch.exp(vals.double() - top.double()), dim=-1)


def choose(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, u: torch.Tensor,
           look: int = FIRST_LOOK) -> torch.Tensor:
    """candidates() and draw() as one pipeline of tensor ops with no host sync, so that a GPU
    runs it as one CUDA graph (sampling_graph) and the host waits once per token. Returns int64
    [3]: the token, whether top-p needs more than the `look` most likely tokens (then nothing
    else is meaningful: sample_next widens and runs again), and whether the logits hold NaN or
    +inf or nothing finite. `u` is draw()'s uniform as a 0-dim float64 tensor on the logits'
    device. The survivors keep their places (masked with -inf), not compacted, so their number
    never reaches the host."""
    n = logits.shape[-1]
    k = top_k if 0 < top_k < n else n

    def never() -> torch.Tensor:  # a widen flag that cannot be set (made only where needed: a kernel each)
        return torch.zeros((), dtype=torch.bool, device=logits.device)

    if k == n and top_p >= 1.0:  # the whole vocabulary in index order, min-p masking it
        # The max: NaN if any is NaN, +inf if any is, -inf if all are, so one value says all three.
        # Read at ops.argmax's index (which orders NaN first, as torch.argmax): on a GPU one small
        # kernel and a gather, where torch's reduce of one 128k row takes ~15 us. index_select,
        # not logits[index]: a 0-dim index tensor would be read on the host (a sync, which also
        # breaks the graph capture).
        top = logits.index_select(0, ops.argmax(logits).reshape(1)).squeeze(0)
        ids, vals, widen = None, logits, never()
        if min_p > 0.0:
            vals = logits.masked_fill(logits - top < math.log(min_p), float("-inf"))
        last = int_where_last(vals) if min_p > 0.0 else torch.full((), n - 1, dtype=torch.long, device=logits.device)
    else:
        look = k if k < n else min(n, look)
        vals, ids = ops.topk(logits, look)  # most likely first
        top = vals[0]  # the max, as logits.max() (topk puts NaN above +inf), without its reduction
        whole = look == k or look == n
        # After top-k the distribution is the k tokens'; otherwise these tokens' share of the whole
        # distribution, over z.
        z = None if whole else torch.exp(logits - vals[0]).sum()
        if look <= 1024 and ops.sample_top_available(logits):  # the rest in one kernel, the same steps
            return ops.sample_top(vals, ids, top, z, top_p, min_p, u)
        probs = torch.softmax(vals, dim=-1) if whole else torch.exp(vals - vals[0]) / z
        mass = torch.cumsum(probs, dim=-1)
        if whole or top_p >= 1.0:
            widen = never()
        else:
            widen = mass[-1] < top_p
            if min_p > 0.0:  # min-p's cut inside the look: no token past it can be drawn
                widen = widen & ~min_p_cuts_inside(vals, min_p)
        keep = torch.full((), look, dtype=torch.long, device=logits.device)
        if top_p < 1.0:  # the tokens whose probability before them is under p: a prefix
            keep = ((mass - probs) < top_p).sum().clamp(min=1)
        if min_p > 0.0:
            keep = torch.minimum(keep, (vals - vals[0] >= math.log(min_p)).sum().clamp(min=1))
        vals = vals.masked_fill(torch.arange(look, device=logits.device) >= keep, float("-inf"))
        last = keep - 1
    cdf = weights_cdf(vals, top)
    i = torch.minimum(torch.searchsorted(cdf, (cdf[-1] * u).reshape(1), right=True), last.reshape(1))
    token = (i if ids is None else ids.index_select(0, i))[0]
    return torch.stack([token, widen.long(), (~torch.isfinite(top)).long()])


def int_where_last(vals: torch.Tensor) -> torch.Tensor:
    """Index of the last entry above -inf (a tensor: no host sync); 0 when there is none."""
    live = vals > float("-inf")
    return (torch.arange(vals.numel(), device=vals.device) * live).max()


@dataclass
class PendingToken:
    """A token chosen on the device and not yet read by the host. `ids` ([1, 1] int64 where the
    logits are) can feed the next decode step before the host knows the token, so the GPU runs
    that step while the host waits, detokenizes and streams (engine.generate.loop). The pick is
    copied to pinned host memory as soon as it is queued, so result() waits for the pick only,
    not for work queued after it. result() reads the token; `redrawn` then says whether the host
    had to draw again (top-p needing more than the tokens looked at), in which case whatever was
    fed `ids` used a token that was not the answer and must be taken back."""
    ids: torch.Tensor
    out: torch.Tensor           # the pick: int64 [] (greedy) or choose()'s [token, widen, bad]
    redraw: Callable[[], int] | None = None  # the host's widening draw, for choose() picks
    redrawn: bool = False
    ready: torch.cuda.Event | None = None    # recorded after the copy to the host

    def __post_init__(self):
        if self.out.is_cuda:
            host = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
            host.copy_(self.out, non_blocking=True)
            self.out, self.ready = host, torch.cuda.Event()
            self.ready.record()

    def result(self) -> int:
        if self.ready is not None:
            self.ready.synchronize()
        if self.out.dim() == 0:
            return int(self.out)
        token, widen, bad = self.out.tolist()
        if bad:
            raise ValueError(NO_DRAW)
        if widen:
            self.redrawn = True
            return self.redraw()
        return token


def pick_next(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator | None = None,
              previous_ids: torch.Tensor | None = None) -> PendingToken:
    """sample_next without the host sync: the token stays on the device until result()."""
    from engine.generate.sampling_graph import launch_choose, run_choose

    logits = logits.float()
    if previous_ids is not None:
        logits = apply_repetition_penalty(logits, previous_ids, settings.repetition_penalty)
    if settings.greedy:
        out = ops.argmax(logits)
        return PendingToken(out.reshape(1, 1), out)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    scaled = logits / settings.temperature  # a tensor of its own: the redraw may read it after the next step
    n, look = logits.shape[-1], FIRST_LOOK
    args = (settings.top_k, settings.top_p, settings.min_p, u)

    def redraw() -> int:  # top-p needs more than `look` tokens: widen 8x at a time, a sync each
        wider = look
        while True:
            wider = min(n, wider * 8)
            token, widen, bad = run_choose(scaled, *args, wider)
            if bad:
                raise ValueError(NO_DRAW)
            if not widen or wider >= n:
                return token

    out = launch_choose(scaled, *args, look)
    return PendingToken(out[:1].reshape(1, 1), out, redraw)


def sample_next(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator | None = None,
                previous_ids: torch.Tensor | None = None) -> int:
    """One token id from fp32 logits [vocab]. `previous_ids` feeds the repetition penalty. One
    host sync per call: the token (on CUDA the filters and the draw replay as one CUDA graph)."""
    return pick_next(logits, settings, generator, previous_ids).result()
