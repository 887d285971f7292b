"""The single-sequence generation loop: prefill the prompt into a contiguous KV cache, then
decode one token at a time until EOS, a stop string, the token limit or a cancel request. On a
CUDA device the decode steps are CUDA-graph replays (engine.generate.graph_decode); the prefill
and the sampler stay eager.

With graphs the loop is pipelined: the token a step chooses stays on the device and feeds the next
step's graph before the host reads it, so the GPU computes token t+1 while the host waits for
token t, detokenizes it and streams it. Only a top-p draw that needs more candidates than the
first look (rare) makes the host draw again; the step queued with the device's token is then
taken back (the cache truncated) and run again with the right one. TRELLIS_PIPELINE=0 turns it
off (a host round trip between every two steps, as before).

Streaming is the subtle part. A token can end in the middle of a UTF-8 character (byte-level BPE
splits emoji and CJK across tokens), and a stop string can be split across tokens too. So text is
only handed to `on_text` once it is final: complete characters that cannot turn out to be the
start of a stop string. The concatenation of all `on_text` deltas always equals `result.text`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.errors import ConfigError
from engine.generate.graph_decode import graph_decoder, pipelined
from engine.generate.sampling import SamplerSettings, pick_next

REPLACEMENT_CHAR = "\ufffd"  # what the decoder yields for an incomplete UTF-8 sequence


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0   # prefill + first sample
    decode_s: float = 0.0                 # after the first token
    total_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.time_to_first_token_s if self.time_to_first_token_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens/s of the one-token-at-a-time phase (the first token belongs to prefill)."""
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "time_to_first_token_s": round(self.time_to_first_token_s, 4),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "total_s": round(self.total_s, 4)}


@dataclass
class GenerationResult:
    token_ids: list[int]          # generated ids (an ending EOS is not included)
    text: str                     # decoded text, stop string and everything after it removed
    finish_reason: str            # "eos" | "stop" | "length" | "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, one token at a time, in O(1) per token.

    It re-decodes only a short window (the previous chunk's tokens plus the new ones), because
    some decoders (SentencePiece's leading-space rule) need the token before to get the
    spacing right. Output waits while the window ends in an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class StopStringFilter:
    """Finds stop strings in streamed text and holds back any tail that might start one."""

    def __init__(self, stop_strings: Sequence[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self.text = ""        # all text seen so far, up to (not including) a found stop string
        self.emitted = 0      # how much of self.text has been released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add decoded text; return what may be released now."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0))
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_tail())

    def flush(self) -> str:
        return self._release(len(self.text))

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def generate(model, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int,
             sampler: SamplerSettings | None = None, stop_strings: Sequence[str] = (),
             on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt_ids` (which must already hold any BOS)."""
    sampler = (sampler or SamplerSettings()).validate()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ConfigError("the prompt is empty: nothing to continue from")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        if len(prompt_ids) >= context:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
        max_new_tokens = min(max_new_tokens, context - len(prompt_ids))

    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    decoder = IncrementalDecoder(tokenizer)
    stops = StopStringFilter(stop_strings)
    generator = sampler.make_generator()
    eos_ids = set(getattr(tokenizer, "eos_ids", ()) or ())
    device = _model_device(model)
    graphs = graph_decoder(model)  # replays decode steps as CUDA graphs; None off CUDA
    generated: list[int] = []
    history = torch.tensor(prompt_ids, dtype=torch.long)

    def emit(delta: str) -> None:
        if delta and on_text is not None:
            on_text(delta)

    start = time.perf_counter()
    finish_reason = "length"
    with torch.inference_mode():
        if max_new_tokens > 0:
            max_len = len(prompt_ids) + max_new_tokens
            cache = graphs.new_cache(1, max_len) if graphs else model.new_cache(1, max_len)
            logits = model(torch.tensor([prompt_ids], dtype=torch.long, device=device), cache=cache)[0, -1]
        first_token_at = None
        pipeline = graphs is not None and pipelined()

        def pick(logits):
            return pick_next(logits, sampler, generator, history if sampler.repetition_penalty != 1.0 else None)

        def step_with(ids):
            return (graphs.step(ids) if graphs else model(ids, cache=cache))[0, -1]

        pending = pick(logits) if max_new_tokens > 0 else None
        for step in range(max_new_tokens):
            if should_stop is not None and should_stop():
                finish_reason = "cancelled"
                break
            last = step + 1 >= max_new_tokens
            queued = step_with(pending.ids) if pipeline and not last else None
            token = pending.result()
            if pending.redrawn and queued is not None:  # the queued step used another token
                cache.truncate(cache.length - 1)
                queued = None
            if first_token_at is None:
                first_token_at = time.perf_counter()
            if token in eos_ids:
                finish_reason = "eos"
                break
            generated.append(token)
            if sampler.repetition_penalty != 1.0:
                history = torch.cat([history, torch.tensor([token])])
            emit(stops.feed(decoder.push(token)))
            if stops.stopped:
                finish_reason = "stop"
                break
            if not last:
                if queued is None:
                    queued = step_with(torch.tensor([[token]], dtype=torch.long, device=device))
                pending = pick(queued)
    if not stops.stopped:
        emit(stops.feed(decoder.flush()))
        if stops.stopped:
            finish_reason = "stop"
        emit(stops.flush())
    end = time.perf_counter()

    stats.generated_tokens = len(generated)
    stats.total_s = end - start
    if first_token_at is not None:
        stats.time_to_first_token_s = first_token_at - start
        stats.decode_s = end - first_token_at
    return GenerationResult(token_ids=generated, text=stops.text, finish_reason=finish_reason, stats=stats)
