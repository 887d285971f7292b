"""CUDA-graph decode: every one-token step of a model replayed from a captured CUDA graph.

At batch 1 an eager decode step is bound by Python and kernel launches, not by the GPU (an 8B
model on an H200: 8.9 tokens/s eager, 144.6 replayed). The model's own forward with a
StaticKVCache has fixed shapes and never reads a device value on the host, so one step can be
captured once and replayed per token:

    decoder = graph_decoder(model)           # None off CUDA, or with TRELLIS_CUDA_GRAPHS=0
    cache = decoder.new_cache(1, max_len)    # kept between generations while it is big enough
    logits = model(prompt_ids, cache)        # prefill: eager (its length varies)
    logits = decoder.step(next_ids)          # each decode step: one graph replay

Graphs are captured lazily, one per (batch, span) where the span is the cache's attention span
(a power of two, see engine.cache.static), all in one memory pool. They write into this
decoder's cache, so a new cache (bigger, or another batch) drops them. A failed capture is
reported once on stderr and the decoder runs the same steps eagerly from then on.
"""
from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import torch

from engine.cache.static import StaticKVCache
from engine.errors import TrellisError

WARMUP_STEPS = 2


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor     # static input [B, 1]: copied into before each replay
    logits: torch.Tensor  # static output [B, 1, vocab]: rewritten by each replay


class GraphDecoder:
    """One-token decode steps of `model` (a CausalLM) over its own StaticKVCache."""

    def __init__(self, model):
        # The model holds its decoder (graph_decoder); a weak reference back avoids a cycle, so
        # dropping the model frees the graphs and the cache without waiting for the collector.
        self._model = weakref.ref(model)
        self.device = model.device
        self.cache: StaticKVCache | None = None
        self.graphs: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        # Why steps run eagerly (None while graphs are in use).
        self.disabled: str | None = None if self.device.type == "cuda" else "the model is not on a CUDA device"

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise TrellisError("the model of this GraphDecoder has been unloaded")
        return model

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """An empty cache with room for `max_len` tokens: the one already held when it fits (so its
        graphs stay valid), else a new one."""
        if self.cache is None or self.cache.batch != batch or self.cache.max_len < max_len:
            self.graphs.clear()  # they read and write the old cache's buffers
            self.cache = None    # freed before the new one is allocated
            self.cache = self.model.new_static_cache(batch, max_len)
        self.cache.reset()
        return self.cache

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, 1, vocab] for one new token per row (ids [B, 1]), appended to the cache.

        With graphs, the result is the graph's output buffer: read it before the next step."""
        cache = self.cache
        if cache is None:
            raise TrellisError("GraphDecoder.step needs a cache: call new_cache (and prefill) first")
        if ids.dim() != 2 or ids.shape[1] != 1:
            raise ValueError(f"a decode step takes ids [batch, 1], got shape {list(ids.shape)}")
        cache.check_room(1, ids.shape[0])
        key = (ids.shape[0], cache.span(1))
        captured = self.graphs.get(key)
        if captured is None and self.disabled is None:
            captured = self._capture(*key)
        if captured is None:
            return self.model(ids, cache)
        captured.ids.copy_(ids)
        captured.graph.replay()
        cache.length += 1  # the graph moved cache.position on the device; the host count follows
        return captured.logits

    def _capture(self, batch: int, span: int) -> CapturedStep | None:
        """Record one step at the cache's current length (span is what that length gives)."""
        model, cache = self.model, self.cache
        length = cache.length
        ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        try:
            with torch.cuda.device(self.device):
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                # Warm-up on a side stream, as torch.cuda.graph asks: lazy set-up (cuBLAS handles,
                # the kernels' workspace) must happen before capture, not inside it.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_STEPS):
                        model(ids, cache)
                        cache.truncate(length)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the worker's command thread may query device memory meanwhile.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    logits = model(ids, cache)
        except Exception as e:
            self.disabled = f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]
            print(f"trellis: CUDA graph capture failed, decoding without graphs ({self.disabled})",
                  file=sys.stderr, flush=True)
            return None
        finally:
            # Warm-up and capture each counted a token (the capture ran none on the GPU). The
            # slot they wrote is rewritten by the real step before anything attends to it.
            cache.truncate(length)
        self.graphs[(batch, span)] = captured = CapturedStep(graph, ids, logits)
        return captured


def _env_on(name: str) -> bool:
    """A switch that is on unless the variable says 0 / false / off / no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def graphs_enabled(model) -> bool:
    """CUDA graphs serve decoding for a CausalLM on a CUDA device, unless TRELLIS_CUDA_GRAPHS=0."""
    device = getattr(model, "device", None)
    return (isinstance(device, torch.device) and device.type == "cuda" and hasattr(model, "new_static_cache")
            and _env_on("TRELLIS_CUDA_GRAPHS"))


def pipelined() -> bool:
    """Whether graph decoding queues each step before the host reads the previous token
    (engine.generate.loop), unless TRELLIS_PIPELINE=0."""
    return _env_on("TRELLIS_PIPELINE")


def graph_decoder(model) -> GraphDecoder | None:
    """The model's GraphDecoder (made on first use and kept on the model, so its cache and graphs
    serve every generation), or None where graphs are not used."""
    if not graphs_enabled(model):
        return None
    decoder = model.__dict__.get("_graph_decoder")
    if decoder is None:
        decoder = model._graph_decoder = GraphDecoder(model)
    return decoder
