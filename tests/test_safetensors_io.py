"""Safetensors reading: sharded, unaligned, 0-d tensors, dtypes, truncation."""
import json
import struct

import pytest
import torch

from engine.errors import FormatError, ModelLoadError
from engine.io.safetensors_io import TensorStore, read_header, write_safetensors


def write_unaligned(path, tensors: dict[str, torch.Tensor]):
    """Write the way the reference does: minified header, no padding, so data starts anywhere."""
    header, blobs, off = {}, [], 0
    tags = {torch.float16: "F16", torch.bfloat16: "BF16", torch.int16: "I16", torch.int32: "I32", torch.float32: "F32", torch.int8: "I8"}
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": tags[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.bytes": torch.tensor([1, -2, 3], dtype=torch.int8),  # 3 bytes: what follows is misaligned
        "b.half": torch.randn(3, 5, generator=g).half(),
        "c.bf16": torch.randn(7, generator=g).bfloat16(),
        "d.marker": torch.tensor(-2082680531, dtype=torch.int32),
        "e.trellis": torch.randint(-32768, 32767, (2, 3, 32), generator=g, dtype=torch.int32).to(torch.int16),
        "f.float": torch.randn(4, generator=g),
    }


def test_unaligned_and_zero_dim(tmp_path, tensors):
    # make the header length odd so some tensors land at odd offsets
    write_unaligned(tmp_path / "model.safetensors", tensors)
    store = TensorStore(tmp_path)
    starts = [store.entry(k).start % 2 for k in store.keys()]
    assert any(starts), "test needs at least one odd offset"
    for k, t in tensors.items():
        got = store.get(k)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t)
    assert store.get("d.marker").dim() == 0


def test_sharded_with_index(tmp_path, tensors):
    names = list(tensors)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: tensors[k] for k in names[:3]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: tensors[k] for k in names[3:]})
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, k in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    store = TensorStore(tmp_path)
    assert sorted(store.keys()) == sorted(names)
    assert len(store.files) == 2
    for k, t in tensors.items():
        assert torch.equal(store.get(k), t)


def test_missing_shard_and_missing_tensor(tmp_path, tensors):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", tensors)
    index = {"weight_map": {"x": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing"):
        TensorStore(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    store = TensorStore(tmp_path)
    with pytest.raises(ModelLoadError, match="nope"):
        store.get("nope")


def test_truncated_file_is_a_format_error(tmp_path, tensors):
    write_unaligned(tmp_path / "model.safetensors", tensors)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(FormatError, match="truncated"):
        TensorStore(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[:20])
    with pytest.raises(FormatError):
        TensorStore(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(FormatError, match="corrupt"):
        read_header(tmp_path / "model.safetensors")


def test_no_weights_and_pickles(tmp_path):
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        TensorStore(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pickle"):
        TensorStore(tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        TensorStore(tmp_path / "nowhere")


def test_reads_reference_files(ref_fixtures):
    store = TensorStore(ref_fixtures / "exl3" / "qwen2-3.0bpw-mul1-h6")
    assert any(store.entry(k).start % 2 for k in store.keys())  # the reference writes unaligned data
    marker = store.get("model.layers.0.self_attn.q_proj.mul1")
    assert marker.dim() == 0 and int(marker) == -2082680531
    assert store.get("model.embed_tokens.weight").dtype == torch.bfloat16
