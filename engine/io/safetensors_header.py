"""Safetensors headers without torch: what tensors a file holds and where, validated.

Shared by the tensor reader (engine.io.safetensors_io) and the torch-free tools that only need
names, shapes and sizes (engine.inspect, the app's library). Every offset is checked against the
file size here, so a truncated download fails when it is opened, with a clear message.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import FormatError, ModelLoadError

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U16": 2, "U32": 4, "U64": 8,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype tag, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate one safetensors file's header; returns (entries, metadata)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path.name} is not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise FormatError(f"{path.name} is truncated or not a safetensors file (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path.name} has a corrupt safetensors header ({e.__class__.__name__})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path.name} has a corrupt safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    data_size = size - base
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path.name}: corrupt header entry for tensor {name}") from e
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if b < a or b - a != numel * DTYPE_SIZES[dtype]:
            raise FormatError(f"{path.name}: tensor {name} has inconsistent size (shape {list(shape)}, {b - a} bytes)")
        if b > data_size:
            raise FormatError(
                f"{path.name} is truncated: tensor {name} needs {b} data bytes but the file holds {data_size}"
            )
        entries[name] = TensorEntry(path, dtype, shape, base + a, base + b)
    return entries, metadata


def weight_files(model_dir: Path) -> list[Path]:
    """The .safetensors files of a model folder: the shards its index lists (each must exist), or
    else every *.safetensors file. Empty when there are none: callers say what that means to them."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{index.name} is corrupt ({e.__class__.__name__})") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"shard {missing[0]} listed in {index.name} is missing from {model_dir}")
    return files
