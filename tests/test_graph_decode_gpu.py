"""CUDA-graph decode on the GPU (pytest -m gpu): replayed steps give the eager forward's logits
(the EXL3 fixture through the kernels, and a tiny model of every family), generate() gives the
same tokens with graphs as without, and the worker's host keeps one cache for its generations."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.generate import SamplerSettings, generate  # noqa: E402
from engine.generate.graph_decode import GraphDecoder, graph_decoder  # noqa: E402
from engine.models import load_model  # noqa: E402
from tests.gpu_layers import replayed_logits, same_top  # noqa: E402
from tests.test_static_cache import FAMILIES, assert_same_logits, decode_logits, tiny_model  # noqa: E402

TAG = "llama-4.0bpw-mul1-h6"


@pytest.fixture(scope="module")
def fixture_model(ref_fixtures):
    return load_model(ref_fixtures / "exl3" / TAG, device="cuda")  # fp16, EXL3 kernels when they build


def _three_ways(model, ids: torch.Tensor, prompt: int, max_len: int):
    """Logits per forward: graph replays, the eager forward over a static cache, and over KVCache."""
    decoder = GraphDecoder(model)
    replayed = decode_logits(model, decoder.new_cache(ids.shape[0], max_len), ids, prompt, step=decoder.step)
    assert decoder.disabled is None, decoder.disabled
    eager = decode_logits(model, model.new_static_cache(ids.shape[0], max_len), ids, prompt)
    plain = decode_logits(model, model.new_cache(ids.shape[0], max_len), ids, prompt)
    return decoder, replayed, eager, plain


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("batch", [1, 2])
def test_replay_equals_eager_on_exl3_fixture(fixture_model, batch):
    """250 prompt tokens then 12 steps: the span goes 256 -> 300 (max_len), two graphs."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, fixture_model.config.vocab_size, (batch, 262), generator=g).cuda()
    decoder, replayed, eager, plain = _three_ways(fixture_model, ids, prompt=250, max_len=300)
    assert sorted(decoder.graphs) == [(batch, 256), (batch, 300)]
    # Same kernels and shapes, but the fused product adds split partial sums with fp32 atomics in
    # whatever order warps finish, so fp16 outputs may differ in the last bit (H200: 1e-3 of the
    # logit scale after two layers).
    assert_same_logits(replayed, eager, rel=1e-2)
    for r, p in zip(replayed, plain):              # another attention kernel: fp16 rounding apart
        assert _rel_rms(r, p) < 1e-2
        assert same_top(r, p)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_equals_eager_every_family(family, tmp_path):
    model = tiny_model(family, tmp_path, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 19), generator=g).cuda()
    decoder, replayed, eager, plain = _three_ways(model, ids, prompt=7, max_len=19)
    assert list(decoder.graphs) == [(1, 19)]
    assert_same_logits(replayed, eager, rel=1e-5)
    assert_same_logits(replayed, plain, rel=1e-4)


def _replayed_with_and_without_the_kernel(model, ids, monkeypatch, served=lambda out, kwargs: out is not None):
    """Graph-replayed logits with the decode-attention kernel on and off (ops.ATTN_KERNEL), and per
    setting what each call of ops.decode_attention reported: served(its output, its kwargs)."""
    from engine import ops

    calls = []
    real = ops.decode_attention

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(served(out, kwargs))
        return out

    monkeypatch.setattr(ops, "decode_attention", counting)
    logits, reports = {}, {}
    for kernel in (True, False):
        monkeypatch.setattr(ops, "ATTN_KERNEL", kernel)
        calls.clear()
        logits[kernel] = replayed_logits(model, ids)
        reports[kernel] = list(calls)
    return logits, reports


def test_decode_attention_kernel_serves_replayed_steps(fixture_model, monkeypatch):
    """The captured one-token steps take the decode-attention kernel (not a quiet fallback to
    SDPA), and give SDPA's logits."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, fixture_model.config.vocab_size, (1, 40), generator=g).cuda()
    logits, served = _replayed_with_and_without_the_kernel(fixture_model, ids, monkeypatch)
    assert any(served[True]) and not any(served[False])
    for a, b in zip(logits[True], logits[False]):
        assert _rel_rms(a, b) < 1e-2
        assert same_top(a, b)


@pytest.mark.parametrize("window_walk", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gemma2_soft_capped_steps_take_the_kernel(head_dim, window_walk, tmp_path, monkeypatch):
    """Gemma 2's decode steps (soft-capped scores, a sliding window on alternate layers) run on
    the decode-attention kernel in fp16, and replay the logits of capped_attention (the kernel
    switched off, the path every capped step took before session 20). With ops.ATTN_WINDOW the
    sliding layers walk only their 36-slot window of the 256-slot span, found from the position
    on the device at each replay, as the position passes the window."""
    monkeypatch.setattr(ops, "ATTN_WINDOW", window_walk)
    tf = pytest.importorskip("transformers")
    from tests.test_models_vs_transformers import TINY, _build

    cfg = tf.Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=head_dim, query_pre_attn_scalar=24,
                          sliding_window=36, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    _build("Gemma2ForCausalLM", cfg, tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.float16)
    assert {layer.self_attn.softcap for layer in model.layers} == {2.0}
    g = torch.Generator().manual_seed(head_dim)
    ids = torch.randint(0, model.config.vocab_size, (1, 44), generator=g).cuda()
    logits, served = _replayed_with_and_without_the_kernel(
        model, ids, monkeypatch, served=lambda out, kwargs: out is not None and kwargs.get("softcap") == 2.0)
    assert served[True] and all(served[True]) and not any(served[False])
    for a, b in zip(logits[True], logits[False]):
        assert _rel_rms(a, b) < 1e-2
        assert same_top(a, b)


def test_attention_kernel_does_the_decode_steps_rope(fixture_model, monkeypatch):
    """With TRELLIS_ATTN_ROPE (the default) a decode step runs no RoPE kernel: the attention
    kernel rotates q and k and writes the cache. Replayed steps give the logits of the step with
    the RoPE kernel, and the cache holds the same values (to the products' split-k atomics,
    whose order varies from run to run)."""
    from engine import ops
    from tests.gpu_layers import kernels_run

    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, fixture_model.config.vocab_size, (1, 40), generator=g).cuda()
    logits, caches = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(ops, "ATTN_ROPE", fused)
        cache = fixture_model.new_static_cache(1, 64)
        with torch.inference_mode():
            fixture_model(ids[:, :30], cache)
            ran = kernels_run(lambda: fixture_model(ids[:, 30:31], cache), "rope_kernel")
        assert bool(ran) != fused, ran
        caches[fused] = [k[:, :, :31].clone() for k in cache.keys + cache.values]
        logits[fused] = replayed_logits(fixture_model, ids)
    for a, b in zip(caches[True], caches[False]):
        assert _rel_rms(a[:, :, 30].float(), b[:, :, 30].float()) < 1e-2  # the decode step's token
        assert _rel_rms(a[:, :, :30].float(), b[:, :, :30].float()) < 1e-2
    for a, b in zip(logits[True], logits[False]):
        assert _rel_rms(a, b) < 1e-2
        assert same_top(a, b)


def _same_greedy_tokens(model, prompt: list[int], got: list[int], want: list[int]) -> bool:
    """got is want, or first differs from it where the two tokens' logits (an eager forward over
    the common prefix) are within 1e-2 of the logits' scale: graph replays and eager steps round
    differently (split-k atomics in any order, attention over the span or the cache's length),
    and test_replay_equals_eager_on_exl3_fixture bounds their logits' difference by that much."""
    if got == want:
        return True
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i == min(len(got), len(want)):
        return False  # one stopped early: not a near tie
    ids = torch.tensor([prompt + want[:i]], device=model.device)
    with torch.inference_mode():
        logits = model(ids, model.new_cache(1, ids.shape[1]))[0, -1].float()
    return bool((logits[got[i]] - logits[want[i]]).abs() <= 1e-2 * logits.abs().max())


def test_generate_with_graphs_equals_without(ref_fixtures, fixture_model, monkeypatch):
    from engine.tokenizer import Tokenizer

    manifest = json.loads((ref_fixtures / "manifest.json").read_text())
    prompt = manifest["models"][TAG]["prompt_ids"]
    tok = Tokenizer.from_dir(ref_fixtures / "exl3" / TAG)
    monkeypatch.setenv("TRELLIS_CUDA_GRAPHS", "0")
    assert graph_decoder(fixture_model) is None
    without = generate(fixture_model, tok, prompt, 40, SamplerSettings())
    monkeypatch.delenv("TRELLIS_CUDA_GRAPHS")
    with_graphs = generate(fixture_model, tok, prompt, 40, SamplerSettings())
    decoder = graph_decoder(fixture_model)
    assert decoder is not None and decoder.disabled is None and decoder.graphs
    assert len(without.token_ids) > 8
    assert _same_greedy_tokens(fixture_model, prompt, with_graphs.token_ids, without.token_ids)
    captured, cache = dict(decoder.graphs), decoder.cache
    again = generate(fixture_model, tok, prompt, 40, SamplerSettings())
    assert _same_greedy_tokens(fixture_model, prompt, again.token_ids, without.token_ids)
    assert decoder.cache is cache and decoder.graphs == captured  # reused, nothing recaptured


def test_worker_host_reserves_the_graph_cache(ref_fixtures):
    from engine.worker import protocol as p
    from engine.worker.host import ModelHost

    host = ModelHost()
    host.load(p.Load(model_dir=str(ref_fixtures / "exl3" / TAG), max_context=512, device="cuda:0"))
    decoder = graph_decoder(host.model)
    cache = decoder.cache
    assert cache is not None and cache.max_len == 512
    texts = []
    out = host.generate(p.Generate(request_id="r1", prompt="The", max_tokens=12), texts.append, lambda: False)
    assert decoder.cache is cache and decoder.graphs and decoder.disabled is None
    assert out.stats.generated_tokens > 0 and "".join(texts) == out.text
    host.unload()



@pytest.mark.parametrize("case", ["greedy", "sampled", "widening"])
def test_pipelined_generation_equals_the_plain_loop(ref_fixtures, fixture_model, tmp_path, monkeypatch, case):
    """With graphs, generate() queues each step with the device's token before reading it; it must
    pick what the host-synchronous loop picks. Greedy runs on the EXL3 fixture. The draws run on a
    tiny fp32 model: on a random model's flat distribution over 512 tokens a draw moves to the
    next token when the logits change in the last fp16 bit, and the EXL3 products' atomics make
    such changes from run to run. In "widening" top-p looks at 16 candidates first and a 0.995
    cut needs more on most draws, so the host draws again and the queued step is taken back."""
    import engine.generate.sampling as sampling
    from engine.tokenizer import Tokenizer

    manifest = json.loads((ref_fixtures / "manifest.json").read_text())
    prompt = manifest["models"][TAG]["prompt_ids"]
    tok = Tokenizer.from_dir(ref_fixtures / "exl3" / TAG)
    tok.eos_ids = set()
    if case == "greedy":
        model, settings = fixture_model, SamplerSettings()
    else:
        model = tiny_model("llama", tmp_path, device="cuda", dtype=torch.float32)
        prompt = [i % model.config.vocab_size for i in prompt]
        settings = (SamplerSettings(temperature=1.0, top_p=0.9, min_p=0.02, seed=5) if case == "sampled"
                    else SamplerSettings(temperature=1.2, top_p=0.995, seed=9))
    if case == "widening":
        monkeypatch.setattr(sampling, "FIRST_LOOK", 16)
    redraws = []
    read = sampling.PendingToken.result

    def counted(self):
        token = read(self)
        redraws.append(self.redrawn)
        return token

    monkeypatch.setattr(sampling.PendingToken, "result", counted)
    def same(got: list[int], want: list[int]) -> bool:
        # Greedy on the EXL3 fixture: the products' atomics add in any order, so a near tie may go
        # either way from run to run (it did once: session 18's call 1, token 38 of 40). The
        # fp32 model's draws must repeat exactly.
        return _same_greedy_tokens(model, prompt, got, want) if case == "greedy" else got == want

    monkeypatch.setenv("TRELLIS_PIPELINE", "0")
    plain = generate(model, tok, prompt, 40, settings)
    assert same(generate(model, tok, prompt, 40, settings).token_ids, plain.token_ids), "the plain loop is not repeatable"
    monkeypatch.setenv("TRELLIS_PIPELINE", "1")
    redraws.clear()
    piped = generate(model, tok, prompt, 40, settings)
    assert graph_decoder(model).disabled is None
    assert same(piped.token_ids, plain.token_ids) and len(plain.token_ids) == 40
    if case == "widening":
        assert any(redraws), "no draw widened: the test does not reach the redraw path"


@pytest.mark.parametrize("window", [None, 5])
def test_static_cache_mask_on_the_gpu(window):
    """The additive one-token mask (one where() instead of zeros, not and masked_fill): 0 where
    the slot may be attended, -inf elsewhere, in the cache dtype."""
    from engine.cache.static import StaticKVCache

    cache = StaticKVCache(1, 1, 1, 64, 300, torch.float16, "cuda", min_span=16)
    for length in (0, 3, 15, 16, 200):
        cache.reset()
        cache.advance(length)
        got = cache.mask(1, window)
        keys = torch.arange(cache.span(1), device="cuda")
        allowed = (keys <= length) & ((keys > length - window) if window else True)
        want = torch.zeros(keys.shape, dtype=torch.float16, device="cuda").masked_fill_(~allowed, float("-inf"))
        assert got.dtype == torch.float16 and torch.equal(got, want[None, :])
