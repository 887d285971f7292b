"""Quantizer pieces: bit allocation, Hessians, block LDL, regularization, LDLQ, calibration."""
from __future__ import annotations

import json

import pytest
import torch

from engine.formats.exl3 import hadamard128
from engine.quantize.allocation import QGroup, allocate_bits, average_bits
from engine.quantize.hessian import HessianAccumulator
from engine.quantize.ldlq import block_ldl
from engine.quantize.linear import LinearSpec, quantize_linears
from engine.quantize.regularize import random_signs, regularize, rotate_hessian


def _llama_groups(layers, hidden, inter, q, kv):
    groups, order = [], 0
    for i in range(layers):
        sizes = {"qkv": hidden * (q + 2 * kv), "o": q * hidden, "gu": 2 * hidden * inter, "d": inter * hidden}
        for name, n in sizes.items():
            groups.append(QGroup(f"model.layers.{i}.{name}", i, 2 if name in ("qkv", "o") else 1, n, order))
            order += 1
    return groups


def test_allocation_matches_spec_worked_example_llama8b():
    groups = _llama_groups(32, 4096, 14336, 4096, 1024)
    bits = allocate_bits(groups, 3.5, 32)
    assert average_bits(groups, bits) <= 3.5
    assert round(average_bits(groups, bits), 2) == 3.5
    assert all(bits[f"model.layers.{i}.o"] == 4 for i in range(32))
    assert bits["model.layers.0.qkv"] == 5 and all(bits[f"model.layers.{i}.qkv"] == 4 for i in range(1, 32))
    mlp4 = sorted(i for i in range(32) if bits[f"model.layers.{i}.gu"] == 4)
    assert mlp4 == [0, 1, 2, 3, 4, 5, 26, 27, 28, 29, 30, 31]
    assert all(bits[f"model.layers.{i}.gu"] == bits[f"model.layers.{i}.d"] for i in range(32))
    b225 = allocate_bits(groups, 2.25, 32)
    assert b225["model.layers.0.qkv"] == 4 and b225["model.layers.5.o"] == 3
    assert {i for i in range(32) if b225[f"model.layers.{i}.d"] == 3} == {0, 31}


@pytest.mark.parametrize("tag", ["llama-4.0bpw-mul1-h6", "llama-2.5bpw-mcg-h4", "llama-3.0bpw-3inst-h8",
                                 "qwen2-3.0bpw-mul1-h6"])
def test_allocation_matches_reference_files(ref_fixtures, tag):
    qc = json.loads((ref_fixtures / "exl3" / tag / "quantization_config.json").read_text())
    groups = _llama_groups(2, 256, 768, 256, 128)
    bits = allocate_bits(groups, qc["bits"], 2)
    names = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "up_proj": "gu",
             "gate_proj": "gu", "down_proj": "d"}
    for key, entry in qc["tensor_storage"].items():
        if "bits_per_weight" not in entry or key == "lm_head":
            continue
        layer = key.split(".")[2]
        group = names[key.rsplit(".", 1)[-1]]
        assert bits[f"model.layers.{layer}.{group}"] == entry["bits_per_weight"], key


def test_hessian_drops_nonfinite_rows_and_pads():
    acc = HessianAccumulator(128)
    x = torch.randn(10, 100)
    x[3, 5] = float("nan")
    acc.add(x)
    assert acc.count == 9 and acc.dropped == 1
    H = acc.finalize()
    keep = torch.cat([x[:3], x[4:]])
    want = keep.T @ keep / 9
    d = want.diagonal().sum() / 128  # mean over the padded diagonal
    assert torch.allclose(H[:100, :100], want + 0.025 * d * torch.eye(100), atol=1e-5)
    assert torch.allclose(H[100:, 100:], 0.025 * d * torch.eye(28), atol=1e-7)
    assert HessianAccumulator(16).finalize() is None


def test_block_ldl_reconstructs_hessian():
    a = torch.randn(64, 48, dtype=torch.float64)
    H = (a.T @ a + 0.1 * torch.eye(48, dtype=torch.float64)).float()
    L = block_ldl(H, block=16)
    assert torch.all(L.reshape(3, 16, 3, 16)[torch.arange(3), :, torch.arange(3)] == 0)
    assert torch.all(torch.triu(L.reshape(3, 16, 3, 16).permute(0, 2, 1, 3).abs().sum((2, 3))) == 0)
    U = (L + torch.eye(48)).double()
    # D = U⁻¹ H U⁻ᵀ must be block diagonal
    D = torch.linalg.solve(U, torch.linalg.solve(U, H.double()).T).T
    off = D.clone()
    for i in range(3):
        off[16 * i:16 * i + 16, 16 * i:16 * i + 16] = 0
    assert off.abs().max() < 1e-6 * D.abs().max()


def test_regularization_is_exactly_invertible():
    w = torch.zeros(256, 384)
    w[:200, :300] = torch.randn(200, 300) * 0.02
    w[7] *= 30  # an outlier input channel
    reg = regularize(w, random_signs(256, 1), random_signs(384, 2))
    back = hadamard128(hadamard128(reg.w, dim=0), dim=1) * reg.su[:, None] * reg.sv[None, :]
    assert torch.allclose(back, w, atol=1e-5)
    assert torch.all(reg.sv[300:] == 0)  # zero (padding) columns get svh = 0
    # every nonzero row is scaled to the codebook RMS (1.2437); 56 zero padding rows stay zero
    assert abs(float(reg.w.square().mean().sqrt()) - 1.2437 * (200 / 256) ** 0.5) < 0.01
    H = torch.eye(256)
    Hr = rotate_hessian(H, reg.su)
    assert torch.allclose(Hr, Hr.T, atol=1e-5)


def _layer_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(128, 128, generator=g) * 0.02
    mix = torch.randn(128, 128, generator=g) / 128 ** 0.5 + torch.eye(128)
    X = (torch.randn(2000, 128, generator=g) @ mix) * torch.linspace(0.2, 3.0, 128)
    acc = HessianAccumulator(128)
    acc.add(X)
    return W, X, acc.finalize()


def test_ldlq_lowers_output_error_and_outputs_have_reference_layout():
    W, X, H = _layer_problem()
    b = torch.randn(128)
    (with_h,) = quantize_linears([LinearSpec("l", W, 3, "a", b)], {"a": H}, "mul1", seed=1, effort="fast")
    (no_h,) = quantize_linears([LinearSpec("l", W, 3, "a", b)], {"a": None}, "mul1", seed=1, effort="fast")

    def out_err(q):
        y, yq = X @ W.T, X @ q.dense_weight().T
        return float((y - yq).norm() / y.norm())

    assert out_err(with_h) < 0.9 * out_err(no_h)
    assert out_err(with_h) < 0.2
    t = with_h.tensors()
    assert list(t) == ["l.suh", "l.svh", "l.bias", "l.mul1", "l.trellis"]
    assert t["l.trellis"].shape == (8, 8, 48) and t["l.trellis"].dtype == torch.int16
    assert t["l.suh"].shape == (128,) and t["l.svh"].shape == (128,) and t["l.bias"].dtype == torch.float16
    assert t["l.mul1"].dtype == torch.int32 and t["l.mul1"].dim() == 0 and int(t["l.mul1"]) == -2082680531
    assert torch.equal(t["l.bias"].float(), b.half().float())
    assert 0 < with_h.proxy_err < 0.1


def test_quantization_is_deterministic_for_a_seed():
    W, _, H = _layer_problem(1)
    a = quantize_linears([LinearSpec("l", W, 4, "a")], {"a": H}, "3inst", seed=5, effort="fast")[0]
    b = quantize_linears([LinearSpec("l", W, 4, "a")], {"a": H}, "3inst", seed=5, effort="fast")[0]
    assert "l.mul1" not in a.tensors() and "l.mcg" not in a.tensors()
    assert torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)


def test_calibration_rows_are_deterministic_and_mixed():
    from engine.quantize.calibration import build_calibration
    from engine.tokenizer import Tokenizer
    from tests.conftest import REF_FIXTURES
    if not (REF_FIXTURES / "hf" / "llama").is_dir():
        pytest.skip("fixture tokenizer not available")
    tok = Tokenizer.from_dir(REF_FIXTURES / "hf" / "llama")
    a = build_calibration(tok, 512, 10, 64, seed=3)
    b = build_calibration(tok, 512, 10, 64, seed=3)
    assert a.shape == (10, 64) and a.dtype == torch.int64 and torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 512
    assert len({tuple(r) for r in a.tolist()}) == 10  # no duplicate rows
    c = build_calibration(tok, 512, 10, 64, seed=4)
    assert not torch.equal(a[-2:], c[-2:])  # random rows follow the seed


def test_calibration_from_user_folder(tmp_path):
    from engine.errors import ConfigError
    from engine.quantize.calibration import build_calibration
    from engine.tokenizer import Tokenizer
    from tests.conftest import REF_FIXTURES
    if not (REF_FIXTURES / "hf" / "llama").is_dir():
        pytest.skip("fixture tokenizer not available")
    tok = Tokenizer.from_dir(REF_FIXTURES / "hf" / "llama")
    (tmp_path / "a.txt").write_text("\n\n".join(f"Paragraph {i}: " + "the quick brown fox jumps " * 12 for i in range(40)))
    ids = build_calibration(tok, 512, 5, 32, source=tmp_path)
    assert ids.shape == (5, 32)
    text_rows = tok.decode(ids[0].tolist())
    assert "quick brown fox" in text_rows
    with pytest.raises(ConfigError):
        build_calibration(tok, 512, 5, 32, source=tmp_path / "missing")
