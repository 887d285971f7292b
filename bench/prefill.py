"""Prefill speed on a synthetic EXL3 model (anchors.md §2), torch path and CUDA path.

    python -m bench.prefill --shape llama3-8b --bits 4 --lengths 1024 4096

Times one forward over a prompt of T tokens with a fresh KV cache. `last_logits` runs the
model's layers as its forward does but applies the head to the last position only (what a
generator needs, and what the reference's prefill computes); `full` is the model's forward as is
(all T positions' logits, fp32).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from bench.decode import add_model_args, load_kind, model_dir_of


class _LastPositionHead(torch.nn.Module):
    """A model's head applied to the last position only."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, -1:])


def forward_last_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Llama-style models: their layers one by one, as sessions 3-19 measured them. Others (Gemma)
    run their own forward with the head swapped for one that reads the last position only."""
    from engine.models.layers import attention_mask

    if not hasattr(model, "rotary"):
        head = model.lm_head
        model.lm_head = _LastPositionHead(head)
        try:
            return model(ids, cache)
        finally:
            model.lm_head = head
    T = ids.shape[1]
    positions = torch.arange(0, T, device=model.device)
    cos, sin = model.rotary(positions, model.dtype)
    masks = {w: attention_mask(0, T, w, model.device) for w in {l.self_attn.window for l in model.layers}}
    x = F.embedding(ids, model.embed_tokens)
    for layer in model.layers:
        x = layer(x, cos, sin, masks[layer.self_attn.window], cache)
    cache.advance(T)
    return model.lm_head(model.norm(x[:, -1:])).float()


def time_prefill(model, T: int, mode: str, reps: int = 3) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=model.device)
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            cache = model.new_cache(1, T)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mode == "full":
                model(ids, cache)
            else:
                forward_last_logits(model, ids, cache)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            del cache
    return T / min(times)


def profile_prefill(model, T: int, path: str) -> None:
    """Which GPU kernels one prefill spends its time in."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (1, T), device=model.device)
    with torch.inference_mode():
        forward_last_logits(model, ids, model.new_cache(1, T))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward_last_logits(model, ids, model.new_cache(1, T))
            torch.cuda.synchronize()
    print(f"profile prefill {path} T={T}:")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="prefill tokens/s on a synthetic EXL3 model")
    add_model_args(ap)
    ap.add_argument("--paths", nargs="+", default=["torch", "cuda"],
                    help="torch (dense fp16), cuda, cuda-hadwarp (cuda with the fp16 Hadamards a warp per "
                         "128-block, as before session 17: a same-run baseline), cuda-normsep (cuda with the "
                         "grouped products' norm and member input transforms as separate passes, as before "
                         "session 18), cuda-hadonce (cuda with a block per Hadamard tile, as before session 18), "
                         "cuda-cappedsoftmax / -nocappedsoftmax (Gemma 2's capped attention probabilities in one kernel / "
                         "as PyTorch passes); paths may repeat")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--modes", nargs="+", default=["last_logits", "full"])
    ap.add_argument("--profile", action="store_true", help="print the top GPU kernels of one prefill per path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "prefill", "error": "no CUDA device"}))
        return 1
    from engine import ops

    model_dir = model_dir_of(args)
    loaded: dict = {}
    capped_default = ops.CAPPED_SOFTMAX
    for path in args.paths:
        model, load_s = load_kind(loaded, model_dir, path)
        if path != "torch":
            ops.extension().set_had_tiles(ops.HAD_TILES and path != "cuda-hadwarp")
            ops.extension().set_had_pipeline(ops.HAD_PIPELINE and path != "cuda-hadonce")
            ops.NORM_HAD = path != "cuda-normsep"
            ops.CAPPED_SOFTMAX = {"cuda-cappedsoftmax": True, "cuda-nocappedsoftmax": False}.get(path, capped_default)
        for T in args.lengths:
            for mode in args.modes:
                try:
                    tps = time_prefill(model, T, mode)
                    row = {"bench": "prefill", "shape": args.shape, "bits": args.bits, "path": path, "tokens": T,
                           "mode": mode, "tokens_per_s": round(tps, 0), "load_s": round(load_s, 1)}
                except Exception as e:
                    row = {"bench": "prefill", "path": path, "tokens": T, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
                print(json.dumps(row), flush=True)
        if args.profile:
            profile_prefill(model, max(args.lengths), path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
