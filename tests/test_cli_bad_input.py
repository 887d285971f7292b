"""Bad input through the CLI: each case is exactly one `trellis: error: ...` line, non-zero exit,
no traceback. Broken model folders are made from copies of the reference fixtures."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli import main

TAG = "llama-4.0bpw-mul1-h6"


@pytest.fixture()
def broken_copy(ref_fixtures, tmp_path):
    """A writable copy of an EXL3 fixture folder plus helpers to damage it."""
    src = ref_fixtures / "exl3" / TAG
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps([[0, 5, 6, 7]]))
    return dst, tokens


def rewrite_tensors(model_dir: Path, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def edit_config(model_dir: Path, **changes) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def assert_one_line_error(capsys, code, *needles):
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code != 0, f"expected failure, got exit 0 (stderr: {err!r})"
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert lines[0].startswith("trellis: error: ") and "Traceback" not in err
    assert "internal error" not in lines[0], lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]


def run_logits(model_dir, tokens, tmp_path):
    return main(["logits", "-m", str(model_dir), "--tokens", str(tokens), "--out", str(tmp_path / "out.safetensors")])


def test_truncated_safetensors(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "truncated")
    assert_one_line_error(capsys, main(["inspect", "-m", str(model_dir), "--json"]), "truncated")
    assert not (tmp_path / "out.safetensors").exists()


def test_missing_tensor(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    rewrite_tensors(model_dir, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "post_attention_layernorm")


def test_unsupported_architecture(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    edit_config(model_dir, architectures=["FancyNewForCausalLM"])
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "FancyNewForCausalLM")
    assert_one_line_error(capsys, main(["generate", "-m", str(model_dir), "-p", "hi", "--max-tokens", "2"]),
                          "FancyNewForCausalLM")


def test_both_codebook_markers(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    key = "model.layers.0.self_attn.q_proj"

    def add_mcg(t):
        assert f"{key}.mul1" in t
        t[f"{key}.mcg"] = torch.tensor(-877912083, dtype=torch.int32)

    rewrite_tensors(model_dir, add_mcg)
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "mcg", "mul1")
    assert_one_line_error(capsys, main(["inspect", "-m", str(model_dir)]), "mcg", "mul1")


def test_trellis_shape_disagrees_with_config(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    edit_config(model_dir, intermediate_size=1024)  # the stored MLP trellis is for 768
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "shape")


def test_bad_token_file_and_missing_model(broken_copy, tmp_path, capsys):
    model_dir, tokens = broken_copy
    tokens.write_text(json.dumps([[1, 2, 3], [1, 2]]))
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "length")
    tokens.write_text(json.dumps([[1, 2, 99999]]))
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "99999")
    tokens.write_text("[[1, 2,")
    assert_one_line_error(capsys, run_logits(model_dir, tokens, tmp_path), "JSON")
    tokens.write_text(json.dumps([[1, 2, 3]]))
    assert_one_line_error(capsys, run_logits(tmp_path / "nope", tokens, tmp_path), "not found")
    assert_one_line_error(capsys, main(["ppl", "-m", str(model_dir), "--text", str(tmp_path / "none.txt")]),
                          "not found")


def test_usage_errors_are_one_line_exit_2(capsys):
    assert_one_line_error(capsys, main(["generate", "-p", "hi"]), "--model")
    assert main(["generate", "-p", "hi"]) == 2
    capsys.readouterr()
    assert_one_line_error(capsys, main(["no-such-command"]), "invalid choice")


def test_console_entry_prints_no_traceback(broken_copy, tmp_path):
    """Through a real process: what a user's shell sees."""
    model_dir, tokens = broken_copy
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00")
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "logits", "-m", str(model_dir), "--tokens", str(tokens),
                           "--out", str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("trellis: error: ")
    assert "Traceback" not in proc.stderr
