"""Batch-1 decode speed on a synthetic EXL3 model (anchors.md §2), torch path and CUDA path.

    python -m bench.decode --shape llama3-8b --bits 4 --model-dir /tmp/l8b

Loop as the reference measured it: one token per forward, argmax, host sync each token. Paths:
  torch       load_model as is (its QuantLinear keeps a reconstructed dense fp16 weight)
  cuda        EXL3 linears routed through the kernels (engine.ops), eager PyTorch around them
  cuda-graph  the same, one CUDA graph per decode step: a static-shape step (position and KV
              write index live on the device, attention over the whole cache with a mask), so
              no host work is left per token but the sync that reads the token
Prints one JSON line per (path, context).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def ensure_model(model_dir: Path, shape: str, bits: float, codebook: str) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from bench.synth import SHAPES, write_synth_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    write_synth_model(model_dir, SHAPES[shape], bits, codebook=codebook, device=dev)
    print(json.dumps({"bench": "synth", "dir": str(model_dir), "seconds": round(time.time() - t0, 1)}), flush=True)
    return model_dir


def load(model_dir: Path, path: str):
    from engine.models import load_model
    from engine.ops.model_patch import route_quant_linears

    t0 = time.time()
    if path == "torch":  # the baseline: QuantLinear keeps a reconstructed dense weight
        os.environ["TRELLIS_KERNELS"] = "torch"
    try:
        model = load_model(model_dir, device="cuda")
    finally:
        os.environ.pop("TRELLIS_KERNELS", None)
    if path != "torch":
        route_quant_linears(model)
    torch.cuda.synchronize()
    return model, time.time() - t0


class StaticStep:
    """One decode step of a Llama-style DecoderLM with static shapes, for CUDA graph capture.
    Reads the model's own modules; only the plumbing (positions, cache writes, mask) differs."""

    def __init__(self, model, max_len: int):
        self.m = model
        c = model.config
        dev = model.device
        self.max_len = max_len
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.cos_t, self.sin_t = model.rotary(torch.arange(max_len, device=dev), model.dtype)
        shape = (1, c.num_kv_heads, max_len, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(c.num_layers)]
        self.key_pos = torch.arange(max_len, device=dev)
        self.graph = None

    def step(self) -> torch.Tensor:
        from engine.models.rope import apply_rope

        m = self.m
        cos = self.cos_t.index_select(0, self.pos)
        sin = self.sin_t.index_select(0, self.pos)
        mask = (self.key_pos <= self.pos)[None, None, None, :]
        x = F.embedding(self.ids, m.embed_tokens)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, 1, a.num_heads, a.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(1, 1, a.num_kv_heads, a.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(1, 1, a.num_kv_heads, a.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=a.scale, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = m.lm_head(m.norm(x))
        self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)
        return self.ids

    def capture(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.step()

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.out


def decode_eager(model, context: int, tokens: int) -> float:
    """Tokens/s of the model's own forward with its KV cache (one token per forward)."""
    cache = model.new_cache(1, context + tokens + 8)
    if context:
        cache.length = context  # the cache content does not change the work done
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        for _ in range(3):
            ids = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
            int(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            ids = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
            int(ids)  # host sync per token, like the reference's loop
        dt = time.perf_counter() - t0
    return tokens / dt


def decode_graph(model, context: int, tokens: int) -> float:
    with torch.inference_mode():
        st = StaticStep(model, context + tokens + 16)
        st.pos.fill_(context)
        st.capture()
        st.pos.fill_(context)
        for _ in range(3):
            int(st.run())
        st.pos.fill_(context)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            int(st.run())
        dt = time.perf_counter() - t0
    return tokens / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="batch-1 decode tokens/s on a synthetic EXL3 model")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--model-dir", default="/tmp/trellis-synth-llama3-8b")
    ap.add_argument("--paths", nargs="+", default=["torch", "cuda", "cuda-graph"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 4096])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print the top CPU ops of 3 eager tokens per path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "decode", "error": "no CUDA device"}))
        return 1
    model_dir = ensure_model(Path(args.model_dir), args.shape, args.bits, args.codebook)
    loaded = {}
    for path in args.paths:
        kind = "torch" if path == "torch" else "cuda"
        if kind not in loaded:
            loaded.clear()
            torch.cuda.empty_cache()
            loaded[kind] = load(model_dir, kind)
        model, load_s = loaded[kind]
        for ctx in args.contexts:
            try:
                tps = decode_graph(model, ctx, args.tokens) if path == "cuda-graph" else decode_eager(model, ctx, args.tokens)
                row = {"bench": "decode", "shape": args.shape, "bits": args.bits, "path": path, "context": ctx,
                       "tokens_per_s": round(tps, 1), "load_s": round(load_s, 1),
                       "gpu_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
            except Exception as e:  # report and go on: one failing path must not hide the others
                row = {"bench": "decode", "path": path, "context": ctx, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
        if args.profile and path != "cuda-graph":
            profile_eager(model, path)
    return 0


def profile_eager(model, path: str) -> None:
    """Where an eager decode token's host time goes (top ops by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(1, 64)
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(ids, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ids = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
                int(ids)
    print(f"profile {path}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    raise SystemExit(main())
