"""Scoring a model on text: perplexity, and against a reference model, KL divergence and top-1
agreement. One implementation for `trellis ppl` and the converter's quality benchmark, so the
numbers they report are the same measurement."""
from __future__ import annotations

import math

import torch

from engine.generate.loop import _model_device


def split_windows(ids: list[int], seqlen: int, windows: int | None) -> list[list[int]]:
    """Consecutive non-overlapping windows; a short tail is dropped unless it is all there is."""
    chunks = [ids[i:i + seqlen] for i in range(0, len(ids), seqlen)]
    if len(chunks) > 1 and len(chunks[-1]) < seqlen:
        chunks.pop()
    chunks = [c for c in chunks if len(c) >= 2]
    return chunks[:windows] if windows is not None else chunks


def _next_token_logprobs(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(ids.to(_model_device(model)))[0, :-1, :vocab]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def score_windows(model, windows: list[list[int]], ref=None) -> dict:
    """Mean next-token NLL and perplexity over `windows`; with `ref`, also the reference's
    perplexity, mean KL(ref ‖ model) per token (how much the model loses against the
    reference) and how often both pick the same top token. Sums run on the model's device."""
    vocab = model.config.vocab_size
    nll = ref_nll = kl = 0.0
    agree = scored = 0
    for window in windows:
        ids = torch.tensor([window], dtype=torch.long)
        logp = _next_token_logprobs(model, ids, vocab)
        targets = ids[0, 1:].to(logp.device)
        nll -= logp.gather(-1, targets[:, None]).sum().item()
        scored += targets.numel()
        if ref is not None:
            ref_logp = _next_token_logprobs(ref, ids, vocab).to(logp.device)
            ref_nll -= ref_logp.gather(-1, targets[:, None]).sum().item()
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
    result = {"ppl": math.exp(nll / scored), "nll": nll / scored, "tokens": scored, "windows": len(windows)}
    if ref is not None:
        result.update({"ref_ppl": math.exp(ref_nll / scored), "kl_div": kl / scored, "top1_agreement": agree / scored})
    return result
