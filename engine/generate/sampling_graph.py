"""sampling.choose as one CUDA graph per sampler setting.

On the GPU, choose() is some thirty small kernels; launched one by one from Python they cost more
host time than the draw is worth (bench/sampling.py: ~0.3-0.5 ms a token, a tenth of a decode
step). Captured once per (device, vocabulary, settings) and replayed, a token costs three
launches (the logits and the uniform into the graph's inputs, the replay) and one sync. On the
CPU choose() runs as it is.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.generate.sampling import choose

KEEP = 4  # graphs kept (least recently used dropped): a chat changes settings rarely


@dataclass
class ChooseGraph:
    logits: torch.Tensor   # the graph's input, fp32 [vocab]
    u: torch.Tensor        # the uniform, float64 0-dim
    out: torch.Tensor      # choose()'s result
    graph: torch.cuda.CUDAGraph


_graphs: "OrderedDict[tuple, ChooseGraph]" = OrderedDict()


def _capture(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, look: int) -> ChooseGraph:
    static = logits.detach().clone()
    u = torch.zeros((), dtype=torch.float64, device=logits.device)
    side = torch.cuda.Stream(device=logits.device)
    side.wait_stream(torch.cuda.current_stream(logits.device))
    with torch.cuda.stream(side):  # warm-up off the capture, as CUDA graphs ask
        choose(static, top_k, top_p, min_p, u, look)
    torch.cuda.current_stream(logits.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = choose(static, top_k, top_p, min_p, u, look)
    return ChooseGraph(static, u, out, graph)


def run_choose(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float,
               look: int = 1024) -> tuple[int, bool, bool]:
    """choose() on these logits with uniform u: (token, widen, bad), one host sync."""
    if logits.device.type != "cuda":
        token, widen, bad = choose(logits, top_k, top_p, min_p, torch.tensor(u, dtype=torch.float64), look).tolist()
        return token, bool(widen), bool(bad)
    key = (logits.device.index, logits.shape[-1], top_k, top_p, min_p, look)
    g = _graphs.get(key)
    if g is None:
        g = _graphs[key] = _capture(logits, top_k, top_p, min_p, look)
        while len(_graphs) > KEEP:
            _graphs.popitem(last=False)
    _graphs.move_to_end(key)
    g.logits.copy_(logits)
    g.u.fill_(u)
    g.graph.replay()
    token, widen, bad = g.out.tolist()
    return token, bool(widen), bool(bad)
