"""StaticKVCache, the cache CUDA-graph decode runs on, against KVCache: run eagerly on the CPU, a
prompt then one token at a time, it must give the same logits for every family the engine loads.

Its one-token path is what a graph captures (device-side position, a fixed attention span with a
device-computed mask); `min_span` is made tiny here so that the span grows several times within
the test, and Gemma's and Mistral's windows are shorter than the sequence.
"""
from __future__ import annotations

import pytest
import torch

from engine.cache.static import StaticKVCache
from engine.errors import TrellisError
from engine.generate import SamplerSettings, generate
from engine.generate.graph_decode import GraphDecoder, graph_decoder, graphs_enabled
from engine.models import load_model

PROMPT, STEPS = 7, 12


def _family_config(family: str):
    """(transformers class name, config) of a tiny model of `family`, every switch on."""
    tf = pytest.importorskip("transformers")
    from tests.test_models_vs_transformers import TINY, _gemma3_text_config

    if family == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 5000.0}
        return "LlamaForCausalLM", tf.LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False)
    if family == "mistral":
        return "MistralForCausalLM", tf.MistralConfig(**TINY, sliding_window=5, tie_word_embeddings=False)
    if family == "qwen2":
        return "Qwen2ForCausalLM", tf.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                                  max_window_layers=1, tie_word_embeddings=False)
    if family == "qwen3":
        return "Qwen3ForCausalLM", tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    if family == "gemma2":
        cfg = tf.Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        return "Gemma2ForCausalLM", cfg
    if family == "gemma3":
        return "Gemma3ForCausalLM", _gemma3_text_config()
    if family == "qwen2_5_vl":
        text = {**TINY, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}}
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[0])
        return "Qwen2_5_VLForConditionalGeneration", tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_5_vl"]


def tiny_model(family: str, tmp_path, device: str = "cpu", dtype=torch.float32):
    """A tiny random model of `family`, saved by transformers and loaded by our loader."""
    from tests.test_models_vs_transformers import _build

    cls_name, cfg = _family_config(family)
    _build(cls_name, cfg, tmp_path)
    return load_model(tmp_path, device=device, dtype=dtype)


def decode_logits(model, cache, ids: torch.Tensor, prompt: int = PROMPT, step=None) -> list[torch.Tensor]:
    """Prefill ids[:, :prompt], then feed the rest one token at a time: logits of each forward."""
    step = step or (lambda x: model(x, cache))
    with torch.inference_mode():
        out = [model(ids[:, :prompt], cache)[:, -1].clone()]
        for t in range(prompt, ids.shape[1]):
            out.append(step(ids[:, t:t + 1])[:, -1].clone())
    return out


def assert_same_logits(ours: list[torch.Tensor], want: list[torch.Tensor], rel: float = 1e-5) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0.5, "test model too quiet to tell anything apart"
    for i, (o, w) in enumerate(zip(ours, want)):
        err = (o - w).abs().max().item()
        assert err <= rel * scale, f"forward {i}: max abs error {err:.3g} vs logits scale {scale:.3g}"


def _ids(model, batch: int = 1, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, PROMPT + STEPS), generator=g).to(model.device)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_matches_kv_cache(family, tmp_path):
    model = tiny_model(family, tmp_path)
    windows = {layer.self_attn.window for layer in model.layers}
    if family in ("mistral", "gemma2", "gemma3"):
        assert max(w for w in windows if w) < PROMPT + STEPS  # the window slides within the test
    ids = _ids(model)
    n = ids.shape[1]
    want = decode_logits(model, model.new_cache(1, n), ids)
    static = model.new_static_cache(1, n, min_span=4)
    spans = []
    ours = decode_logits(model, static, ids, step=lambda x: (spans.append(static.span(1)), model(x, static))[1])
    assert spans[0] == 8 and spans[-1] == n and len(set(spans)) == 3  # 8, 16, then capped at max_len
    assert static.length == n and int(static.position) == n
    assert_same_logits(ours, want)


def test_static_cache_batch_of_two(tmp_path):
    model = tiny_model("gemma3", tmp_path)
    ids = _ids(model, batch=2)
    want = decode_logits(model, model.new_cache(2, ids.shape[1]), ids)
    ours = decode_logits(model, model.new_static_cache(2, ids.shape[1] + 5, min_span=4), ids)
    assert_same_logits(ours, want)


def test_static_cache_bookkeeping():
    cache = StaticKVCache(1, 1, 2, 8, 40, torch.float32, "cpu", min_span=4)
    assert cache.span(1) == 4 and cache.span(6) == 6  # one token: a bucket; a prefill: exactly
    cache.advance(4)
    assert cache.span(1) == 8 and int(cache.position) == 4
    k = torch.randn(1, 2, 1, 8)
    keys, _ = cache.update(0, k, k)
    assert keys.shape[2] == 8 and torch.equal(keys[:, :, 4:5], k)
    assert cache.mask(1, None).tolist() == [[True] * 5 + [False] * 3]
    assert cache.mask(1, 2).tolist() == [[False] * 3 + [True] * 2 + [False] * 3]
    cache.advance(30)
    assert cache.span(1) == 40  # capped at max_len
    cache.truncate(10)
    assert cache.length == 10 and int(cache.position) == 10
    cache.reset()
    assert cache.length == 0 and int(cache.position) == 0
    cache.advance(40)
    with pytest.raises(TrellisError, match="context full"):
        cache.check_room(1, 1)


def test_graph_decoder_runs_eagerly_off_cuda(tmp_path):
    """Off CUDA the decoder's steps are the eager forward over the same static cache; its cache
    is kept while big enough."""
    model = tiny_model("qwen2", tmp_path)
    assert not graphs_enabled(model) and graph_decoder(model) is None
    decoder = GraphDecoder(model)
    assert decoder.disabled
    ids = _ids(model)
    cache = decoder.new_cache(1, ids.shape[1])
    ours = decode_logits(model, cache, ids, step=decoder.step)
    assert cache.length == ids.shape[1] and not decoder.graphs
    assert_same_logits(ours, decode_logits(model, model.new_cache(1, ids.shape[1]), ids))
    assert decoder.new_cache(1, 5) is cache and cache.length == 0
    assert decoder.new_cache(1, ids.shape[1] + 1) is not cache
    with pytest.raises(ValueError, match="batch, 1"):
        decoder.step(ids[:, :2])


def test_generate_through_the_decoder_equals_plain_generate(tmp_path, monkeypatch):
    """generate() wired to a GraphDecoder (eager off CUDA) gives the same tokens as without."""
    import engine.generate.loop as loop
    from tests.test_generate import make_tokenizer

    model = tiny_model("gemma3", tmp_path)
    tok = make_tokenizer()
    prompt = tok.encode("hello there")
    plain = generate(model, tok, prompt, 16, SamplerSettings())
    decoder = GraphDecoder(model)
    monkeypatch.setattr(loop, "graph_decoder", lambda m: decoder)
    through = generate(model, tok, prompt, 16, SamplerSettings())
    assert decoder.cache is not None and decoder.cache.length > len(prompt)
    assert through.token_ids == plain.token_ids and plain.token_ids


def test_graphs_enabled_switch(monkeypatch):
    class OnCuda:
        device = torch.device("cuda")

        def new_static_cache(self, batch, max_len):
            raise AssertionError("not called")

    monkeypatch.delenv("TRELLIS_CUDA_GRAPHS", raising=False)
    assert graphs_enabled(OnCuda())
    monkeypatch.setenv("TRELLIS_CUDA_GRAPHS", "0")
    assert not graphs_enabled(OnCuda())
    monkeypatch.setenv("TRELLIS_CUDA_GRAPHS", "1")
    assert graphs_enabled(OnCuda())
    assert not graphs_enabled(torch.nn.Linear(2, 2))  # no device attribute, no static cache


def test_rope_rows_are_the_rotary_at_the_position(tmp_path, monkeypatch):
    """A one-token step reads cos/sin from the cache's table: the same bits as the rotary computes
    for that position (Llama 3 scaling here), in each dtype asked for."""
    model = tiny_model("llama", tmp_path)
    cache = model.new_static_cache(1, 40)
    for dtype in (torch.float32, torch.float16, torch.float32):
        for p in (0, 7, 39):
            cache.position.fill_(p)
            cos, sin = cache.rope_rows(model.rotary, dtype)
            want_cos, want_sin = model.rotary(torch.tensor([p]), dtype)
            assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert len(cache._rope_tables) == 1  # one table per rotary, remade for another dtype
    import engine.cache.static as static

    monkeypatch.setattr(static, "ROPE_TABLE_CHUNK", 16)  # built in chunks, the last one short
    chunked = model.new_static_cache(1, 40)
    chunked.position.fill_(37)
    assert torch.equal(torch.cat(chunked.rope_rows(model.rotary, torch.float32)),
                       torch.cat(model.rotary(torch.tensor([37]), torch.float32)))
    assert torch.equal(chunked._rope_tables[id(model.rotary)][:, 0], model.rotary(torch.arange(40), torch.float32)[0])
