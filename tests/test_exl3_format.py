"""The EXL3 decoder against the spec's vectors and the reference implementation's own W-hat."""
import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import FormatError
from engine.formats import exl3
from engine.io.safetensors_io import TensorStore
from tests.conftest import EXL3_TAGS

LUT_SHA256 = {
    "3inst": "ad88de2dcff5bb05fff2faec37cceceb43aa1c2e8203f9d81a6fbd6dd3393eea",
    "mcg": "95383563929baa9d1ae5de0be22490284382673620bdd85929feea7bdbef04a9",
    "mul1": "bc48d02cb1c14939dc47b90f870dd689d63e3b1ab69a157e65538db68677a6c8",
}
LUT_SPOTS = {  # state -> fp16 bit pattern (spec section 2)
    "3inst": {0x0000: 0x3A25, 0x0001: 0xBB5B, 0xFFFF: 0xB110},
    "mcg": {0x0000: 0x3F60, 0x0001: 0x304E, 0xFFFF: 0x3ACD},
    "mul1": {0x0000: 0xC2E8, 0x0001: 0x3921, 0xFFFF: 0xB936},
}
LUT_STATS = {"3inst": (1.243711, 10598), "mcg": (1.244112, 10746), "mul1": (1.000312, 913)}

# (K, codebook) -> (W-hat[0, 0:4], first 32 hex digits of sha256(W-hat)) from spec section 3.9
SPEC_VECTORS = {
    (2, "mul1"): ([0.032012939453125, 0.7626953125, -0.2183837890625, 0.783203125], "1914bea82d5cd60f97b4aea254478825"),
    (3, "mul1"): ([-0.7529296875, -1.166015625, 2.2109375, -0.73291015625], "48849d9fba099a027ceb284cbdba86c0"),
    (4, "mul1"): ([0.329833984375, 0.884765625, -0.5771484375, -0.31298828125], "42fabcf512221c8c22ff3a77090b71fa"),
    (4, "mcg"): ([-1.673828125, -1.662109375, -0.0015869140625, -0.185546875], "bf22ab00ceb21f89b724032328998e04"),
    (4, "3inst"): ([0.06396484375, 0.1484375, 0.36865234375, -0.32080078125], "7ac1753a126fa4bb9d1c47bb40c834cb"),
    (5, "mul1"): ([-0.259033203125, -1.064453125, -0.7529296875, -0.69873046875], "66652d9b71021205211fa7f79becff27"),
}


def spec_trellis(K: int) -> torch.Tensor:
    i = np.arange(2 * 2 * 16 * K, dtype=np.int64)
    return torch.from_numpy(((i * 40503 + 12345) % 65536).astype(np.uint16).view(np.int16).copy()).reshape(2, 2, 16 * K)


def fp16_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().astype("<f2").tobytes()).hexdigest()


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_codebook_lut_matches_spec(codebook):
    lut = exl3.codebook_lut(codebook)
    assert lut.dtype == torch.float16 and lut.shape == (65536,)
    assert fp16_sha(lut) == LUT_SHA256[codebook]
    bits = lut.view(torch.int16).to(torch.int32) & 0xFFFF
    for state, pattern in LUT_SPOTS[codebook].items():
        assert int(bits[state]) == pattern
    rms, distinct = LUT_STATS[codebook]
    assert abs(lut.float().pow(2).mean().sqrt().item() - rms) < 1e-5
    assert len(torch.unique(lut)) == distinct
    assert torch.isfinite(lut).all()


@pytest.mark.parametrize("K,codebook", sorted(SPEC_VECTORS))
def test_reconstruct_spec_vectors(K, codebook):
    w = exl3.reconstruct(spec_trellis(K), codebook)
    head, digest = SPEC_VECTORS[(K, codebook)]
    assert w.shape == (32, 32)
    assert w[0, :4].tolist() == head
    assert fp16_sha(w)[:32] == digest


def test_states_of_spec_tile():
    tr = spec_trellis(2)
    assert [int(x) & 0xFFFF for x in tr[0, 0, :4]] == [0x3039, 0xCE70, 0x6CA7, 0x0ADE]
    states = exl3.unpack_states(tr)[0, 0]
    assert states[:6].tolist() == [0xEAAF, 0xAABC, 0xAAF3, 0xABCE, 0xAF39, 0xBCE7]
    assert int(states[255]) == 0xBAAB


@pytest.mark.parametrize("K", range(1, 9))
def test_states_are_tail_biting_and_pack_round_trips(K):
    g = torch.Generator().manual_seed(K)
    tr = torch.randint(-32768, 32768, (3, 2, 16 * K), generator=g, dtype=torch.int32).to(torch.int16)
    states = exl3.unpack_states(tr)
    # high 16-K bits of state p == low 16-K bits of state p-1, cyclically
    prev = torch.roll(states, 1, dims=-1)
    mask = (1 << (16 - K)) - 1
    assert torch.equal(states >> K, prev & mask)
    assert torch.equal(exl3.pack_symbols(states, K), tr)


def test_tile_order_is_a_permutation_with_spec_prefix():
    order = exl3.STREAM_TO_TILE
    assert sorted(order.tolist()) == list(range(256))
    first = [(int(i) // 16, int(i) % 16) for i in order[:10]]
    assert first == [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8), (2, 0), (3, 0)]


def test_hadamard_is_orthonormal_and_self_inverse():
    h = exl3.hadamard_matrix()
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    assert torch.equal(h, h.T)
    x = torch.randn(3, 256)
    assert torch.allclose(exl3.hadamard128(exl3.hadamard128(x)), x, atol=1e-5)
    with pytest.raises(FormatError):
        exl3.hadamard128(torch.randn(2, 100))


def test_legacy_sign_bits():
    packed = torch.tensor([0b101, -32768], dtype=torch.int16)
    signs = exl3.unpack_sign_bits(packed)
    assert signs.shape == (32,)
    assert signs[0] == -1 and signs[1] == 1 and signs[2] == -1 and signs[31] == -1 and signs[16] == 1


@pytest.mark.parametrize("tag", EXL3_TAGS)
def test_reconstruct_matches_reference_what_bit_for_bit(ref_fixtures, tag):
    ref = load_file(str(ref_fixtures / "exl3" / f"{tag}.ref.safetensors"))
    store = TensorStore(ref_fixtures / "exl3" / tag)
    keys = [k[5:] for k in ref if k.startswith("what.")]
    assert len(keys) >= 6
    for key in keys:
        t = exl3.find_exl3(store, key)
        assert t is not None
        w = t.w_hat()
        assert w.shape == ref[f"what.{key}"].shape
        assert torch.equal(w.view(torch.int16), ref[f"what.{key}"].view(torch.int16)), key


def test_fixture_codebooks_detected(ref_fixtures):
    expect = {"llama-4.0bpw-mul1-h6": "mul1", "llama-2.5bpw-mcg-h4": "mcg", "llama-3.0bpw-3inst-h8": "3inst"}
    for tag, cb in expect.items():
        store = TensorStore(ref_fixtures / "exl3" / tag)
        assert exl3.find_exl3(store, "model.layers.0.mlp.down_proj").codebook == cb


def test_forward_equals_dense_weight():
    g = torch.Generator().manual_seed(0)
    K = 3
    t = exl3.EXL3Tensors(
        trellis=torch.randint(-32768, 32768, (16, 8, 16 * K), generator=g, dtype=torch.int32).to(torch.int16),
        suh=(torch.randn(256, generator=g) * 0.1).half(),
        svh=(torch.randn(128, generator=g) * 0.1).half(),
        codebook="mul1",
        bias=torch.randn(128, generator=g).half(),
    )
    x = torch.randn(5, 256, generator=g)
    y = exl3.exl3_matmul_reference(x, t)
    y_dense = x @ t.dense_weight() + t.bias.float()
    assert torch.allclose(y, y_dense, rtol=1e-4, atol=1e-4)
    t.check_shape(256, 128)
    t.check_shape(200, 100)  # padding up to 128 is implied
    with pytest.raises(FormatError):
        t.check_shape(512, 128)


class DictStore(dict):
    def get(self, k, device="cpu"):
        return self[k]

    def shape(self, k):
        return tuple(self[k].shape)

    def dtype_str(self, k):
        return {torch.int16: "I16", torch.int32: "I32", torch.float16: "F16"}[self[k].dtype]


def make_store(**extra):
    s = DictStore(
        {
            "l.trellis": torch.zeros(8, 8, 32, dtype=torch.int16),
            "l.suh": torch.ones(128, dtype=torch.float16),
            "l.svh": torch.ones(128, dtype=torch.float16),
        }
    )
    s.update(extra)
    return s


def test_find_exl3_validation():
    assert exl3.find_exl3(DictStore(), "l") is None
    t = exl3.find_exl3(make_store(), "l")
    assert t.codebook == "3inst" and t.K == 2
    mul1 = torch.tensor(exl3.MARKER_VALUES["mul1"], dtype=torch.int32)
    mcg = torch.tensor(exl3.MARKER_VALUES["mcg"], dtype=torch.int32)
    assert exl3.find_exl3(make_store(**{"l.mul1": mul1}), "l").codebook == "mul1"
    with pytest.raises(FormatError, match="both"):
        exl3.find_exl3(make_store(**{"l.mul1": mul1, "l.mcg": mcg}), "l")
    with pytest.warns(UserWarning, match="locked"):
        exl3.find_exl3(make_store(**{"l.mcg": torch.tensor(12345, dtype=torch.int32)}), "l")
    with pytest.raises(FormatError):
        exl3.find_exl3(make_store(**{"l.trellis": torch.zeros(8, 8, 30, dtype=torch.int16)}), "l")
    with pytest.raises(FormatError):
        exl3.find_exl3(make_store(**{"l.svh": torch.ones(64, dtype=torch.float16)}), "l")
    legacy = DictStore(
        {
            "l.trellis": torch.zeros(8, 8, 32, dtype=torch.int16),
            "l.su": torch.zeros(8, dtype=torch.int16),
            "l.sv": torch.full((8,), -1, dtype=torch.int16),
        }
    )
    t = exl3.find_exl3(legacy, "l")
    assert torch.all(t.suh == 1) and torch.all(t.svh == -1)
