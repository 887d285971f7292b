"""The pipelined generation loop (engine.generate.loop): with a GraphDecoder, each step is queued
with the device's token before the host reads it. Run on the CPU through an eager GraphDecoder
(the same loop a GPU runs, without graphs), it must pick exactly what the plain loop picks, greedy
and seeded sampling alike, also where the host draws again and the queued step is taken back."""
from __future__ import annotations

import pytest

import engine.generate.loop as loop
import engine.generate.sampling as sampling
from engine.generate import SamplerSettings, generate
from engine.generate.graph_decode import GraphDecoder
from tests.test_generate import make_tokenizer
from tests.test_static_cache import tiny_model

pytest.importorskip("transformers")
READ = sampling.PendingToken.result


class Recorder:
    """A GraphDecoder whose steps and token reads are logged in order."""

    def __init__(self, model, events: list):
        self.inner = GraphDecoder(model)
        self.events = events

    def new_cache(self, batch, max_len):
        return self.inner.new_cache(batch, max_len)

    def step(self, ids):
        self.events.append("step")
        return self.inner.step(ids)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model("llama", tmp_path_factory.mktemp("llama"))


def run(model, monkeypatch, settings: SamplerSettings, pipeline: bool, new_tokens: int = 24, stop_strings=(),
        eos=None):
    events: list[str] = []
    decoder = Recorder(model, events)
    monkeypatch.setattr(loop, "graph_decoder", lambda m: decoder)
    monkeypatch.setenv("TRELLIS_PIPELINE", "1" if pipeline else "0")

    def logged_result(self):
        events.append("read")
        return READ(self)

    monkeypatch.setattr(sampling.PendingToken, "result", logged_result)
    tok = make_tokenizer()
    tok.eos_ids = {eos} if eos is not None else set()  # random weights: no early end unless asked
    result = generate(model, tok, tok.encode("hello there"), new_tokens, settings, stop_strings=stop_strings)
    return result, events


SETTINGS = {
    "greedy": SamplerSettings(),
    "sampled": SamplerSettings(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01, seed=7),
    "penalty": SamplerSettings(temperature=0.9, top_p=0.95, repetition_penalty=1.3, seed=3),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_pipelined_loop_picks_what_the_plain_loop_picks(model, monkeypatch, name):
    plain, plain_events = run(model, monkeypatch, SETTINGS[name], pipeline=False)
    piped, events = run(model, monkeypatch, SETTINGS[name], pipeline=True)
    assert piped.token_ids == plain.token_ids and len(plain.token_ids) == 24
    assert piped.text == plain.text and piped.finish_reason == plain.finish_reason == "length"
    # Plain: every step waits for the token before it. Pipelined: the step that needs token t is
    # queued before token t is read, and no step runs twice.
    assert plain_events == ["read"] + ["step", "read"] * 23
    assert events == ["step", "read"] * 23 + ["read"]


def test_a_host_redraw_takes_the_queued_step_back(model, monkeypatch):
    """Top-p looking at two tokens first: most draws need more, the host draws again, and the
    step queued with the device's (meaningless) token is truncated away and run again."""
    monkeypatch.setattr(sampling, "FIRST_LOOK", 2)
    settings = SamplerSettings(temperature=1.5, top_p=0.97, seed=11)
    plain, _ = run(model, monkeypatch, settings, pipeline=False)
    piped, events = run(model, monkeypatch, settings, pipeline=True)
    assert piped.token_ids == plain.token_ids and len(plain.token_ids) == 24
    redone = events.count("step") - 23
    assert redone > 0, "no draw widened: the test does not reach the redraw path"
    # A redone step follows its read directly: step, read, step (again).
    assert events.count("read") == 24


def test_stopping_early_leaves_the_result_as_the_plain_loop(model, monkeypatch):
    greedy = SamplerSettings()
    first, _ = run(model, monkeypatch, greedy, pipeline=False)
    eos = first.token_ids[5]
    cut = first.token_ids.index(eos)
    plain, _ = run(model, monkeypatch, greedy, pipeline=False, eos=eos)
    piped, events = run(model, monkeypatch, greedy, pipeline=True, eos=eos)
    assert piped.token_ids == plain.token_ids == first.token_ids[:cut]
    assert piped.finish_reason == plain.finish_reason == "eos"
    assert events.count("step") == cut + 1  # the step queued with the EOS is the only extra one
    # The decoder's cache is reused by the next generation: it starts clean.
    again, _ = run(model, monkeypatch, greedy, pipeline=True)
    assert again.token_ids == first.token_ids


def test_one_token_and_zero_tokens(model, monkeypatch):
    for n in (0, 1):
        plain, _ = run(model, monkeypatch, SamplerSettings(), pipeline=False, new_tokens=n)
        piped, events = run(model, monkeypatch, SamplerSettings(), pipeline=True, new_tokens=n)
        assert piped.token_ids == plain.token_ids and len(piped.token_ids) == n
        assert "step" not in events
