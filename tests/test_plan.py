"""VRAM planner: exact weight bytes from headers, KV cache arithmetic of spec §6, largest context,
advice, the CLI's contract, and clear errors on bad input."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from engine import plan as P
from engine.errors import ConfigError, FormatError

LLAMA_70B = dict(architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                 vocab_size=128256, max_position_embeddings=131072,
                 quantization_config=dict(quant_method="exl3", bits=4.0, head_bits=6))


def _payload_bytes(path):
    """Tensor bytes of a safetensors file = file size - 8 - header length."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def test_weights_of_fixture_are_read_exactly_from_headers(ref_fixtures):
    d = ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6"
    spec = P.spec_from_dir(d)
    assert spec.weights_exact and spec.bits == 4.0 and spec.head_bits == 6
    assert spec.weight_bytes == _payload_bytes(d / "model.safetensors")
    assert spec.embedding_bytes == 512 * 256 * 2
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.max_context) == (2, 2, 64, 2048)


def test_config_estimate_agrees_with_headers_for_fixture(ref_fixtures):
    for tag in ("llama-4.0bpw-mul1-h6", "llama-2.5bpw-mcg-h4", "qwen2-3.0bpw-mul1-h6"):
        d = ref_fixtures / "exl3" / tag
        exact = P.spec_from_dir(d).weight_bytes
        estimate = P.spec_from_config(json.loads((d / "config.json").read_text())).weight_bytes
        assert abs(estimate - exact) / exact < 0.02, (tag, estimate, exact)


def test_kv_cache_bytes_fp16_and_quantized(ref_fixtures):
    spec = P.spec_from_dir(ref_fixtures / "hf" / "qwen2")
    values_per_token = spec.num_layers * spec.num_kv_heads * spec.head_dim     # 2 * 2 * 64
    assert P.kv_cache_bytes(spec, 1024) == 1024 * values_per_token * 2 * 2
    # 4-bit K and V: per 32 values, 4 uint32 words + one fp16 scale = 18 bytes
    assert P.kv_cache_bytes(spec, 1024, k_bits=4, v_bits=4) == 1024 * values_per_token // 32 * 18 * 2
    # 8-bit K, 2-bit V, and pages of 256 tokens: 300 tokens cost 512
    assert P.kv_cache_bytes(spec, 300, batch=3, k_bits=8, v_bits=2) == \
        3 * 512 * values_per_token // 32 * ((32 + 2) + (8 + 2))


def test_large_model_estimate_matches_published_size():
    """Llama-3.1-70B at 4.0 bpw, head 6: decoder+head about 33 GB (spec §7)."""
    spec = P.spec_from_config(LLAMA_70B, "70b")
    decoder_and_head = spec.weight_bytes - spec.embedding_bytes
    assert 31 * P.GiB < decoder_and_head < 34.5 * P.GiB
    assert 69e9 < spec.parameters < 72e9
    assert not spec.weights_exact


def test_largest_context_is_the_boundary():
    spec = P.spec_from_config(LLAMA_70B, "70b")
    req = P.PlanRequest(context=4096, gpu_bytes=[48 * P.GiB])
    best = P.largest_context(spec, req)
    assert best % 256 == 0 and 4096 < best < spec.max_context
    at = P.plan(spec, P.PlanRequest(context=best, gpu_bytes=[48 * P.GiB]))
    over = P.plan(spec, P.PlanRequest(context=best + 256, gpu_bytes=[48 * P.GiB]))
    assert at.fits and not over.fits
    # a quantized cache makes more context fit
    q = P.largest_context(spec, P.PlanRequest(context=4096, k_bits=4, v_bits=4, gpu_bytes=[48 * P.GiB]))
    assert q > best


def test_parts_add_up_and_advice_says_what_to_do():
    spec = P.spec_from_config(LLAMA_70B, "70b")
    ok = P.plan(spec, P.PlanRequest(context=4096, gpu_bytes=[48 * P.GiB]))
    assert ok.total == ok.weights + ok.kv_cache + ok.activations + ok.overhead
    assert ok.fits and ok.headroom > 0 and ok.advice.startswith("Fits")
    too_long = P.plan(spec, P.PlanRequest(context=65536, gpu_bytes=[48 * P.GiB]))
    assert not too_long.fits and "lower the context" in too_long.advice and "4-bit KV cache" in too_long.advice
    too_small = P.plan(spec, P.PlanRequest(context=4096, gpu_bytes=[24 * P.GiB]))
    assert not too_small.fits and "weights alone" in too_small.advice and "bpw" in too_small.advice
    unknown = P.plan(spec, P.PlanRequest(context=4096))
    assert unknown.fits is None and unknown.largest_context is None and "GiB" in unknown.advice


def test_two_gpus_add_capacity_and_overhead():
    spec = P.spec_from_config(LLAMA_70B, "70b")
    one = P.plan(spec, P.PlanRequest(context=4096, gpu_bytes=[24 * P.GiB]))
    two = P.plan(spec, P.PlanRequest(context=4096, gpu_bytes=[24 * P.GiB, 24 * P.GiB]))
    assert two.capacity == 2 * one.capacity and two.overhead > one.overhead and two.fits


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a model folder"):
        P.spec_from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        P.spec_from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    with pytest.raises(ConfigError, match="no .safetensors"):
        P.spec_from_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 40) + b'{"a": {"dtype": "F16", "shape"')
    with pytest.raises(FormatError):
        P.spec_from_dir(tmp_path)
    header = json.dumps({"w": {"dtype": "F16", "shape": [4096], "data_offsets": [0, 8192]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    with pytest.raises(FormatError, match="truncated"):
        P.spec_from_dir(tmp_path)
    with pytest.raises(ConfigError):
        P.parse_cache_bits("9,4")
    with pytest.raises(ConfigError):
        P.parse_cache_bits("a,b")
    assert P.parse_cache_bits("8,4") == (8, 4) and P.parse_cache_bits("fp16") == (None, None)
    with pytest.raises(ConfigError):
        P.plan(P.spec_from_config(LLAMA_70B), P.PlanRequest(context=0))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.plan_cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_json_and_errors(ref_fixtures, tmp_path):
    d = ref_fixtures / "exl3" / "qwen2-3.0bpw-mul1-h6"
    r = _cli("-m", str(d), "--context", "1024", "--cache-bits", "4,4", "--gpu-mem", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["weights"] == _payload_bytes(d / "model.safetensors")
    assert out["kv_cache"] == 1024 * 2 * 2 * 64 // 32 * 18 * 2
    assert out["fits"] is True and out["largest_context"] == 2048 and out["cache_bits"] == "4,4"
    assert "torch" not in r.stderr
    bad = _cli("-m", str(tmp_path), "--context", "10")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "not a model folder" in bad.stderr
    bad = _cli("-m", str(d), "--context", "10", "--gpu-mem", "lots")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--gpu-mem" in bad.stderr


def test_planner_imports_no_torch():
    code = "import sys, engine.plan, engine.plan_cli; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_cli_plans_a_hub_repo_from_the_fake_hub(ref_fixtures, monkeypatch, tmp_path):
    """`trellis plan -m owner/name`: config.json and file sizes come from the hub (HF_ENDPOINT)."""
    from tests.fakehub import FakeHub
    folder = ref_fixtures / "exl3" / "llama-2.5bpw-mcg-h4"
    with FakeHub() as hub:
        hub.add_repo("turbo/tiny-exl3", {"main": {"README.md": b"x"}, "2.5bpw": FakeHub.read_folder(folder)})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))     # keep the user's hub cache clean
        r = _cli("-m", "turbo/tiny-exl3", "--revision", "2.5bpw", "--context", "512", "--gpu-mem", "1", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["weights"] == (folder / "model.safetensors").stat().st_size and out["weights_exact"]
        assert out["model"] == "turbo/tiny-exl3" and out["fits"] is True
        bad = _cli("-m", "turbo/does-not-exist", "--context", "512")
        assert bad.returncode != 0 and "Traceback" not in bad.stderr and "turbo/does-not-exist" in bad.stderr


def test_soft_capped_attention_adds_its_score_chunks():
    """Gemma 2's prefill attention runs by hand (capped_attention), holding fp16 scores and
    probabilities of a chunk of queries: the planner counts them, up to the same budget the
    engine uses; a Llama-shaped model with the same numbers does not."""
    from engine.models.layers import CAPPED_SCORES_BYTES

    assert P.CAPPED_SCORES_BYTES == CAPPED_SCORES_BYTES
    gemma = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584, num_hidden_layers=42,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14336,
                 vocab_size=256000, max_position_embeddings=8192)
    llama = {**gemma, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    g, l = P.spec_from_config(gemma, "g"), P.spec_from_config(llama, "l")
    assert g.softcapped_attention and not l.softcapped_attention
    assert not P.spec_from_config({**gemma, "attn_logit_softcapping": None}, "g").softcapped_attention
    extra = P.activation_bytes(g, 8192) - P.activation_bytes(l, 8192)
    assert extra == P.CAPPED_SCORES_BYTES  # 2,048 queries x 16 heads x 8,192 keys x 4 bytes is more
    short = P.activation_bytes(g, 100) - P.activation_bytes(l, 100)
    assert short == 100 * 16 * 100 * 4  # the whole square when it is smaller


def test_a_gpu_without_kernels_counts_the_dense_copies():
    """Without the CUDA kernels an EXL3 model's linears load a dense fp16 copy beside their
    trellis: every parameter but the embedding and the norms, two bytes each. The advice says why
    the weights are that large; an unquantized model changes nothing."""
    spec = P.spec_from_config(LLAMA_70B, name="llama-70b")
    h, layers, vocab = 8192, 80, spec.vocab_size
    assert P.dense_copy_bytes(spec) == 2 * (spec.parameters - vocab * h - (2 * layers + 1) * h)
    assert 138e9 < P.dense_copy_bytes(spec) < 140e9  # ~70.6 B parameters, 1.05 B of them the embedding
    req = P.PlanRequest(context=4096, gpu_bytes=[80 * P.GiB])
    plain = P.plan(spec, req)
    dense = P.plan(spec, P.PlanRequest(context=4096, gpu_bytes=[80 * P.GiB], without_kernels="nvcc not found"))
    assert dense.weights == plain.weights + P.dense_copy_bytes(spec) and dense.total > plain.total
    assert plain.fits and not dense.fits and "bpw" not in dense.advice.split(".")[0]  # no lower-bpw hint: copies dominate
    assert "dense fp16 copies" in dense.advice and "nvcc not found" in dense.advice and "would take" in dense.advice
    fp16 = P.spec_from_config({k: v for k, v in LLAMA_70B.items() if k != "quantization_config"}, name="fp16")
    assert P.dense_copy_bytes(fp16) == 0
    assert P.plan(fp16, P.PlanRequest(context=4096, without_kernels="x")).weights == fp16.weight_bytes
