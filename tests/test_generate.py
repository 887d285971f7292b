"""Generation loop: stopping (EOS, stop strings, length, cancel), streaming that never emits broken
UTF-8 or a partial stop string, stats, and agreement with full-sequence greedy decoding."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from engine.errors import ConfigError
from engine.generate import IncrementalDecoder, SamplerSettings, StopStringFilter, generate
from engine.tokenizer import Tokenizer
from tests.test_tokenizer import tiny_byte_tokenizer

VOCAB = tiny_byte_tokenizer().get_vocab_size()


def make_tokenizer(eos=("</s>",)) -> Tokenizer:
    backend = tiny_byte_tokenizer()
    return Tokenizer(backend=backend, bos_id=0, eos_ids={backend.token_to_id(e) for e in eos}, add_bos=True,
                     bos_token="<s>", eos_token=eos[0])


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 4096


class FakeCache:
    def __init__(self, max_len):
        self.length, self.max_len = 0, max_len


class ScriptedLM(torch.nn.Module):
    """Emits a fixed continuation: the logits after position p favour script[p - prompt_len].

    It checks the cache contract the loop relies on: one prefill of the whole prompt, then one
    token per call, positions continuing from `cache.length`."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.config = FakeConfig()
        self.script = script
        self.calls: list[int] = []
        self.prompt_len = None

    def new_cache(self, batch, max_len):
        assert batch == 1
        return FakeCache(max_len)

    def forward(self, input_ids, cache=None):
        assert cache is not None and input_ids.shape[0] == 1
        T = input_ids.shape[1]
        if self.prompt_len is None:
            self.prompt_len = T
        else:
            assert T == 1, "after prefill the loop must feed one token at a time"
        self.calls.append(T)
        cache.length += T
        assert cache.length <= cache.max_len
        step = cache.length - self.prompt_len
        logits = torch.zeros(1, T, VOCAB)
        logits[0, -1, self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_bos=False)


def run(script_text, stop_strings=(), max_new=100, eos_after=True, should_stop=None, tok=None):
    tok = tok or make_tokenizer()
    script = ids_of(tok, script_text) + ([1] if eos_after else [])
    deltas = []
    model = ScriptedLM(script)
    result = generate(model, tok, tok.encode("hi"), max_new, SamplerSettings(), stop_strings=stop_strings,
                      on_text=deltas.append, should_stop=should_stop)
    return result, deltas, model


def test_stops_on_eos_and_excludes_it():
    result, deltas, model = run("Hello there")
    assert result.finish_reason == "eos"
    assert result.text == "Hello there" and "".join(deltas) == result.text
    assert 1 not in result.token_ids and len(result.token_ids) == len("Hello there")
    assert model.calls[0] == 3 and set(model.calls[1:]) == {1}


def test_stops_at_length():
    result, deltas, _ = run("abcdefgh", max_new=5, eos_after=False)
    assert result.finish_reason == "length" and result.text == "abcde" and len(result.token_ids) == 5


def test_any_eos_id_stops():
    tok = make_tokenizer(eos=("</s>", "<|im_end|>"))
    script = ids_of(tok, "ok") + [tok.backend.token_to_id("<|im_end|>"), 5, 6]
    result = generate(ScriptedLM(script), tok, tok.encode("hi"), 50, SamplerSettings())
    assert result.finish_reason == "eos" and result.text == "ok"


def test_stop_string_is_trimmed_and_never_streamed():
    result, deltas, _ = run("The answer is 42.\nUser: more", stop_strings=["\nUser:"])
    assert result.finish_reason == "stop"
    assert result.text == "The answer is 42."
    assert "".join(deltas) == result.text
    assert not any("\n" in d for d in deltas)


def test_stop_string_split_across_many_tokens_and_false_starts():
    # Each byte is its own token, so "STOP" arrives in four pieces; "ST" appears once as a false start.
    result, deltas, _ = run("a ST b STOP c", stop_strings=["STOP", "zzz"])
    assert result.text == "a ST b " and result.finish_reason == "stop"
    assert "".join(deltas) == "a ST b "
    # The false start "ST" was held back and released only once it could no longer be "STOP".
    released = ""
    for d in deltas:
        released += d
        assert not released.endswith("S")


def test_multibyte_characters_are_never_split():
    text = "héllo 日本 🎉!"
    result, deltas, _ = run(text)
    assert result.text == text and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # 🎉 is 4 bytes = 4 tokens, yet it arrives whole.
    assert any("🎉" in d for d in deltas)


def test_cancel_via_should_stop():
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > 3

    result, deltas, _ = run("abcdefgh", should_stop=should_stop)
    assert result.finish_reason == "cancelled" and result.text == "abc"


def test_stats_are_filled():
    result, _, _ = run("abcd")
    s = result.stats
    assert s.prompt_tokens == 3 and s.generated_tokens == 4
    assert 0 < s.time_to_first_token_s <= s.total_s
    assert s.decode_tokens_per_s > 0
    assert set(s.as_dict()) >= {"prompt_tokens", "generated_tokens", "time_to_first_token_s", "decode_tokens_per_s"}


def test_cache_is_sized_for_prompt_plus_new_tokens_and_context_limit():
    tok = make_tokenizer()
    model = ScriptedLM(ids_of(tok, "x" * 50))
    model.config.max_position_embeddings = 10
    result = generate(model, tok, tok.encode("hi"), 100, SamplerSettings())
    assert result.finish_reason == "length" and len(result.token_ids) == 10 - 3
    too_long = ScriptedLM([5])
    too_long.config.max_position_embeddings = 5
    with pytest.raises(ConfigError, match="context"):
        generate(too_long, tok, [5] * 6, 5, SamplerSettings())


def test_incremental_decoder_matches_full_decode():
    tok = make_tokenizer()
    text = "Ünïcødé ✓ mixed ascii 😀 and more"
    dec = IncrementalDecoder(tok)
    out = "".join(dec.push(i) for i in ids_of(tok, text)) + dec.flush()
    assert out == text


def test_stop_filter_flush_releases_held_prefix():
    f = StopStringFilter(["</answer>"])
    assert f.feed("result </ans") == "result "
    assert f.flush() == "</ans" and not f.stopped


def test_greedy_with_cache_matches_full_recompute(ref_fixtures):
    """The cached loop must pick the same tokens as re-running the whole sequence each step."""
    from engine.models import load_model
    model_dir = ref_fixtures / "hf" / "llama"
    model = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    tok.eos_ids = set()  # random weights: do not let an early EOS shorten the comparison
    prompt = tok.encode("Once upon a time")
    result = generate(model, tok, prompt, 12, SamplerSettings())
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert result.token_ids == seq[len(prompt):]


def test_exl3_fixture_greedy_matches_reference(ref_fixtures):
    """First tokens of greedy decoding on an EXL3 fixture equal the reference implementation's."""
    from engine.models import load_model
    manifest = json.loads((ref_fixtures / "manifest.json").read_text())
    tag = "llama-4.0bpw-mul1-h6"
    entry = manifest["models"][tag]
    model = load_model(ref_fixtures / "exl3" / tag)
    tok = Tokenizer.from_dir(ref_fixtures / "exl3" / tag)
    tok.eos_ids = set()
    result = generate(model, tok, entry["prompt_ids"], 8, SamplerSettings())
    assert result.token_ids == entry["greedy_ids_after_prompt"][:8]
