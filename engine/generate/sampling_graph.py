"""sampling.choose as one CUDA graph per sampler setting.

On the GPU, choose() is a dozen small kernels or more (thirty where no sample_top kernel serves);
launched one by one from Python they cost more host time than the draw is worth (bench/sampling.py:
0.3-0.5 ms a token, a tenth of a decode step). Captured once per (device, vocabulary, settings)
and replayed, a token costs three launches (the logits and the uniform into the graph's inputs,
the replay) and one sync. A failed capture is reported once, and choose() then runs eagerly, as
it always does on the CPU.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine import ops
from engine.generate.sampling import FIRST_LOOK, choose

KEEP = 4  # graphs kept (least recently used dropped): a chat changes settings rarely


@dataclass
class ChooseGraph:
    logits: torch.Tensor   # the graph's input, fp32 [vocab]
    u: torch.Tensor        # the uniform, float64 0-dim
    out: torch.Tensor      # choose()'s result
    graph: torch.cuda.CUDAGraph


class GraphKey(NamedTuple):
    """What a captured graph was captured for; topk_kernel is ops.TOPK_KERNEL at capture (a
    benchmark switches it between runs)."""
    device: int
    vocab: int
    top_k: int
    top_p: float
    min_p: float
    look: int
    topk_kernel: bool


_graphs: "OrderedDict[GraphKey, ChooseGraph]" = OrderedDict()
DISABLED = {"why": ""}  # set when a capture failed: later draws run choose() eagerly


def _capture(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, look: int) -> ChooseGraph:
    static = logits.detach().clone()
    u = torch.zeros((), dtype=torch.float64, device=logits.device)
    side = torch.cuda.Stream(device=logits.device)
    side.wait_stream(torch.cuda.current_stream(logits.device))
    with torch.cuda.stream(side):  # warm-up off the capture, as CUDA graphs ask
        choose(static, top_k, top_p, min_p, u, look)
    torch.cuda.current_stream(logits.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the worker's command thread may query device memory meanwhile (as graph_decode).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = choose(static, top_k, top_p, min_p, u, look)
    return ChooseGraph(static, u, out, graph)


def launch_choose(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float,
                  look: int = FIRST_LOOK) -> torch.Tensor:
    """choose() on these logits with uniform u, queued: its int64 [3] (token, widen, bad) where
    the logits are, not read (on a GPU a graph's output buffer, valid until the next launch with
    the same settings)."""
    if logits.device.type != "cuda" or DISABLED["why"]:
        return choose(logits, top_k, top_p, min_p, torch.tensor(u, dtype=torch.float64, device=logits.device), look)
    key = GraphKey(logits.device.index, logits.shape[-1], top_k, top_p, min_p, look, ops.TOPK_KERNEL)
    g = _graphs.get(key)
    if g is None:
        try:
            g = _capture(logits, top_k, top_p, min_p, look)
        except Exception as e:  # the draw does not need a graph: say so once, go on without
            DISABLED["why"] = f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]
            print(f"trellis: sampler graph capture failed, sampling without graphs ({DISABLED['why']})",
                  file=sys.stderr, flush=True)
            return launch_choose(logits, top_k, top_p, min_p, u, look)
        _graphs[key] = g
        while len(_graphs) > KEEP:
            _graphs.popitem(last=False)
    _graphs.move_to_end(key)
    g.logits.copy_(logits)
    g.u.fill_(u)
    g.graph.replay()
    return g.out


def run_choose(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float,
               look: int = FIRST_LOOK) -> tuple[int, bool, bool]:
    """choose() on these logits with uniform u: (token, widen, bad), one host sync."""
    token, widen, bad = launch_choose(logits, top_k, top_p, min_p, u, look).tolist()
    return token, bool(widen), bool(bad)
