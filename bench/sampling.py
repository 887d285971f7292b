"""Cost of choosing one token (engine.generate.sampling.sample_next) at a 128k vocabulary.

    python -m bench.sampling [--device cuda] [--vocab 128256] [--calls 50]

At a few milliseconds per GPU decode step the sampler is part of the step: it runs once per
token, between the forward and the next one. For each preset this times sample_next and, in the
same run, the sampler as it was before session 12 (a full sort for top-p and torch.multinomial
over every token on the CPU), on the same logits. Prints one JSON line per preset.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.generate.sampling import SamplerSettings, apply_repetition_penalty, pick_next, sample_next

# The app's presets (app/settings.py) and the worker protocol's defaults.
PRESETS = {
    "balanced": SamplerSettings(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=0),
    "creative": SamplerSettings(temperature=1.0, top_p=0.95, min_p=0.02, seed=0),
    "protocol-default": SamplerSettings(temperature=0.8, top_k=50, seed=0),
    "temperature-only": SamplerSettings(temperature=1.0, seed=0),
    "greedy": SamplerSettings(temperature=0.0, seed=0),
}


def previous_sample_next(logits: torch.Tensor, settings: SamplerSettings, generator: torch.Generator) -> int:
    """The sampler before session 12, the same-run baseline (min-p did not exist: left out)."""
    logits = logits.float()
    if settings.greedy:
        return int(torch.argmax(logits, dim=-1))
    logits = logits / settings.temperature
    if 0 < settings.top_k < logits.shape[-1]:
        threshold = torch.topk(logits, settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = torch.cumsum(probs, dim=-1) - probs >= settings.top_p
        drop_sorted[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def time_us(fn, calls: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()  # int(...) syncs with the device every call, as generation does
    return (time.perf_counter() - t0) * 1e6 / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: each preset's kernels per pick (pick_next, no host wait) and their summed time")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    # logits shaped like a language model's: a few likely tokens (falling off like a power law)
    # over a long flat tail; the top token holds roughly a third of the probability
    logits = torch.randn(args.vocab, generator=g) * 2.0
    head = torch.randperm(args.vocab, generator=g)[:200]
    logits[head] += 16.0 - 2.0 * torch.log1p(torch.arange(200.0))
    logits = logits.to(device)
    previous = torch.randint(0, args.vocab, (64,)).to(device)
    for name, s in PRESETS.items():
        s.validate()
        gen = s.make_generator()
        now = time_us(lambda: sample_next(logits, s, gen, previous), args.calls, device)
        before = time_us(lambda: previous_sample_next(apply_repetition_penalty(logits, previous, 1.0), s, gen),
                         args.calls, device)
        print(json.dumps({"bench": "sampling", "preset": name, "device": str(device), "vocab": args.vocab,
                          "top_token_prob": round(float(torch.softmax(logits.float(), -1).max()), 3),
                          "us": round(now, 1), "previous_us": round(before, 1),
                          "speedup": round(before / now, 2)}), flush=True)
        if args.profile and device.type == "cuda":
            print(json.dumps(gpu_kernels(lambda: pick_next(logits, s, gen).result(), name)), flush=True)
    return 0


def gpu_kernels(fn, preset: str, calls: int = 20) -> dict:
    """The GPU side of a pick, which the pipelined generation loop puts between two decode steps:
    kernels and copies per call, by name, and their sum."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name[:70]] = per.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / calls
    return {"bench": "sampling_gpu", "preset": preset, "gpu_us_per_pick": round(sum(per.values()), 1),
            "kernels": {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}


if __name__ == "__main__":
    raise SystemExit(main())
