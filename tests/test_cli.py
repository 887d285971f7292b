"""CLI contracts (architecture page) on the reference fixtures: inspect, logits, ppl, generate,
import-gguf, and the no-argument app start."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.cli import main
from tests.conftest import EXL3_TAGS


def manifest(ref_fixtures):
    return json.loads((ref_fixtures / "manifest.json").read_text())


def run_json(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- inspect

@pytest.mark.parametrize("tag", EXL3_TAGS)
def test_inspect_exl3_fixtures(ref_fixtures, capsys, tag):
    entry = manifest(ref_fixtures)["models"][tag]
    info = run_json(capsys, ["inspect", "-m", str(ref_fixtures / "exl3" / tag), "--json"])
    cfg = json.loads((ref_fixtures / "exl3" / tag / "config.json").read_text())
    assert info["quantized"] and info["quant_method"] == "exl3"
    assert info["architecture"] == cfg["architectures"][0]
    assert info["bpw"] == pytest.approx(entry["bits"], abs=0.01)  # computed from trellis shapes
    assert info["bpw"] < info["bpw_with_scales"] < info["bpw"] + 0.2
    assert info["head_bits"] == entry["head_bits"] and info["head"] == "exl3"
    assert info["codebooks"] == [entry["codebook"]]
    assert info["vision"] is False
    files = {f["name"]: f["bytes"] for f in info["files"]}
    assert files["model.safetensors"] == (ref_fixtures / "exl3" / tag / "model.safetensors").stat().st_size
    assert info["total_bytes"] == sum(files.values())
    # Same logical parameter count as the unquantized source (dims here are multiples of 128).
    src = run_json(capsys, ["inspect", "-m", str(ref_fixtures / entry["source"]), "--json"])
    assert info["parameters"] == src["parameters"]


def test_inspect_dense_fixture(ref_fixtures, capsys):
    info = run_json(capsys, ["inspect", "-m", str(ref_fixtures / "hf" / "llama"), "--json"])
    tensors = load_file(str(ref_fixtures / "hf" / "llama" / "model.safetensors"))
    assert info["parameters"] == sum(t.numel() for t in tensors.values())
    assert not info["quantized"] and info["bpw"] == 16.0 and info["codebooks"] == []
    assert info["head"] == "tied" and info["num_layers"] == 2
    assert main(["inspect", "-m", str(ref_fixtures / "hf" / "qwen2")]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out


def test_inspect_module_is_torch_free(ref_fixtures):
    code = ("import sys, engine.inspect as i; i.inspect_model(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'engine.inspect imported torch'")
    subprocess.run([sys.executable, "-c", code, str(ref_fixtures / "exl3" / EXL3_TAGS[0])], check=True, timeout=60)


# ---------------------------------------------------------------- logits

def rel_rms(a, b):
    return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())


def top1(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@pytest.mark.parametrize("tag", EXL3_TAGS)
def test_logits_match_reference(ref_fixtures, tmp_path, capsys, tag):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(manifest(ref_fixtures)["token_ids"]))
    out = tmp_path / "logits.safetensors"
    assert main(["logits", "-m", str(ref_fixtures / "exl3" / tag), "--tokens", str(ids), "--out", str(out)]) == 0
    ours = load_file(str(out))["logits"]
    ref = load_file(str(ref_fixtures / "exl3" / f"{tag}.ref.safetensors"))["logits"]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 96, 512)
    assert rel_rms(ours, ref) < 1e-2
    assert top1(ours, ref) >= 0.98


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_on_dense_fixtures(ref_fixtures, tmp_path, arch):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(manifest(ref_fixtures)["token_ids"]))
    out = tmp_path / "logits.safetensors"
    assert main(["logits", "-m", str(ref_fixtures / "hf" / arch), "--tokens", str(ids), "--out", str(out),
                 "--device", "cpu", "--dtype", "float32"]) == 0
    ours = load_file(str(out))["logits"]
    ref = load_file(str(ref_fixtures / "hf" / f"{arch}.hf_logits.safetensors"))["logits"]
    # The fixture was made on a GPU (transformers 5.17); ours equals local transformers exactly, and
    # the two differ by about 0.9% relative RMS, so the bound is the same as for EXL3.
    assert rel_rms(ours, ref) < 1e-2 and top1(ours, ref) >= 0.98


# ---------------------------------------------------------------- ppl

def test_ppl_against_reference(ref_fixtures, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a small model that learned to count. " * 12)
    tag = EXL3_TAGS[0]
    hf = str(ref_fixtures / "hf" / "llama")
    res = run_json(capsys, ["ppl", "-m", str(ref_fixtures / "exl3" / tag), "--text", str(text), "--ref", hf,
                            "--seqlen", "64", "--windows", "3", "--json"])
    assert res["windows"] == 3 and res["tokens"] == 3 * 63
    assert math.isfinite(res["ppl"]) and res["ppl"] > 1
    assert res["ppl"] == pytest.approx(math.exp(res["nll"]))
    assert res["kl_div"] > 0 and 0 <= res["top1_agreement"] <= 1
    # A model against itself: no divergence, full agreement, same perplexity.
    same = run_json(capsys, ["ppl", "-m", hf, "--text", str(text), "--ref", hf, "--seqlen", "64", "--windows", "3", "--json"])
    assert same["kl_div"] == pytest.approx(0, abs=1e-6) and same["top1_agreement"] == 1.0
    assert same["ppl"] == pytest.approx(same["ref_ppl"])
    # The quantized model diverges from its source more than the source does from itself.
    assert res["kl_div"] > same["kl_div"] + 1e-3


def test_ppl_short_text_and_plain_output(ref_fixtures, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("a short text")
    assert main(["ppl", "-m", str(ref_fixtures / "hf" / "qwen2"), "--text", str(text)]) == 0
    assert capsys.readouterr().out.startswith("perplexity ")


# ---------------------------------------------------------------- generate

def test_generate_json_and_streaming(ref_fixtures, capsys):
    model = str(ref_fixtures / "hf" / "llama")
    res = run_json(capsys, ["generate", "-m", model, "-p", "Once upon a time", "--raw", "--max-tokens", "6", "--json"])
    assert res["finish_reason"] in ("length", "eos") and 1 <= len(res["token_ids"]) <= 6
    assert res["stats"]["prompt_tokens"] == 5  # BOS + 4 tokens, as in the manifest
    # Streaming mode prints the same text for the same greedy run.
    assert main(["generate", "-m", model, "-p", "Once upon a time", "--raw", "--max-tokens", "6", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == res["text"] + "\n"
    assert "tokens/s" in err
    # Chat mode goes through the template: a different prompt length.
    chat = run_json(capsys, ["generate", "-m", model, "-p", "hi", "--max-tokens", "2", "--json"])
    assert chat["stats"]["prompt_tokens"] > 5


def test_generate_sampling_is_seeded(ref_fixtures, capsys):
    model = str(ref_fixtures / "hf" / "llama")
    argv = ["generate", "-m", model, "-p", "Once", "--raw", "--max-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "3", "--json"]
    assert run_json(capsys, argv)["token_ids"] == run_json(capsys, argv)["token_ids"]
    # min-p at 1 keeps only the most likely token: the greedy answer, whatever the temperature
    greedy = run_json(capsys, argv[:8] + ["--temperature", "0", "--json"])["token_ids"]
    assert run_json(capsys, argv[:8] + ["--temperature", "1.5", "--min-p", "1", "--json"])["token_ids"] == greedy
    assert main(argv[:8] + ["--temperature", "1.0", "--min-p", "2"]) == 1
    assert "min_p" in capsys.readouterr().err


def test_generate_refuses_image_for_text_model(ref_fixtures, tmp_path, capsys):
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n")
    code = main(["generate", "-m", str(ref_fixtures / "hf" / "llama"), "-p", "what is this?", "--image", str(image)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "vision" in err


# ---------------------------------------------------------------- no arguments → app

def test_no_arguments_without_app_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "app.main", None)  # makes `import app.main` raise ImportError
    assert main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install" in err and "[app]" in err


def test_no_arguments_without_qt_says_how_to_install(monkeypatch, capsys):
    import types

    def app_main():
        raise ModuleNotFoundError("No module named 'PySide6'", name="PySide6")

    monkeypatch.setitem(sys.modules, "app.main", types.SimpleNamespace(main=app_main))
    assert main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[app]" in err


def test_help_lists_builtin_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "logits", "ppl", "inspect", "import-gguf"):
        assert cmd in out


# ---------------------------------------------------------------- import-gguf

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for q/k (the importer must undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_fixture_as_gguf(model_dir, path):
    """Write the dense llama fixture the way llama.cpp's converter would (F32 tensors)."""
    import gguf
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in tensors.items():
        if name in names:
            gname = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{per_layer[rest]}"
        if name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, cfg["num_key_value_heads"])
        w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_import_gguf_roundtrip(ref_fixtures, tmp_path, capsys):
    from engine.tokenizer import Tokenizer
    src = ref_fixtures / "hf" / "llama"
    gguf_file = tmp_path / "tiny.gguf"
    write_fixture_as_gguf(src, gguf_file)
    out = tmp_path / "imported"
    assert main(["import-gguf", str(gguf_file), str(out)]) == 0
    capsys.readouterr()
    # Tensors come back exactly (bf16 source → F32 GGUF → bf16), q/k un-permuted.
    original = load_file(str(src / "model.safetensors"))
    imported = load_file(str(out / "model.safetensors"))
    assert set(imported) == set(original)
    for name, t in original.items():
        assert torch.equal(imported[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 512
    # The rebuilt tokenizer encodes like the original one; the chat template came along.
    ours, theirs = Tokenizer.from_dir(out), Tokenizer.from_dir(src)
    text = "Once upon a time, 42 cats sat."
    assert ours.encode(text, add_bos=False) == theirs.encode(text, add_bos=False)
    assert ours.bos_id == 0 and 1 in ours.eos_ids
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    # Same logits as the source model.
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(manifest(ref_fixtures)["token_ids"][:1]))
    for d, name in ((src, "a"), (out, "b")):
        assert main(["logits", "-m", str(d), "--tokens", str(ids), "--out", str(tmp_path / f"{name}.safetensors")]) == 0
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["logits"], load_file(str(tmp_path / "b.safetensors"))["logits"])
    # Importing again into a non-empty folder is refused with one line.
    assert main(["import-gguf", str(gguf_file), str(out)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_import_gguf_rejects_non_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["import-gguf", str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GGUF" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- bench

def test_bench_wraps_the_benchmarks(capsys):
    """`trellis bench sampling` runs the sampler benchmark (CPU here): a JSON line per preset."""
    assert main(["bench", "sampling", "--device", "cpu", "--vocab", "3000", "--calls", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["preset"] for r in rows} >= {"balanced", "greedy", "temperature-only"}
    assert all(r["us"] > 0 and r["device"] == "cpu" for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where there is no GPU")
@pytest.mark.parametrize("which", ["generate", "attention"])
def test_bench_without_a_gpu_says_so(capsys, which):
    assert main(["bench", which]) == 1
    assert json.loads(capsys.readouterr().out) == {"bench": which, "error": "no CUDA device"}
