"""Safetensors reading for model folders, written for the files real tools produce.

Why not just `safetensors.safe_open`: the reference EXL3 writer emits unpadded headers, so tensor
data can start at odd byte offsets, and some readers mishandle that and 0-d tensors. We parse the
header ourselves, validate every offset against the file size up front (so a truncated download
fails at open with a clear message, not deep inside a forward pass), and read each tensor lazily
from a memory map into an aligned buffer.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import FormatError, ModelLoadError

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "U16": (torch.int16, 2),  # no general uint16 in torch: raw bits kept, callers mask
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
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
        if dtype not in DTYPES:
            raise FormatError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if b < a or b - a != numel * DTYPES[dtype][1]:
            raise FormatError(f"{path.name}: tensor {name} has inconsistent size (shape {list(shape)}, {b - a} bytes)")
        if b > data_size:
            raise FormatError(
                f"{path.name} is truncated: tensor {name} needs {b} data bytes but the file holds {data_size}"
            )
        entries[name] = TensorEntry(path, dtype, shape, base + a, base + b)
    return entries, metadata


class TensorStore:
    """All tensors of a model folder (one file, an index of shards, or loose shards), read lazily."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ModelLoadError(f"model folder not found: {self.dir}")
        self.files = self._find_files()
        self._entries: dict[str, TensorEntry] = {}
        for f in self.files:
            entries, _ = read_header(f)
            for name, e in entries.items():
                if name in self._entries:
                    raise FormatError(f"tensor {name} appears in both {self._entries[name].file.name} and {f.name}")
                self._entries[name] = e
        self._maps: dict[Path, mmap.mmap] = {}

    def _find_files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise FormatError(f"{index.name} is corrupt ({e.__class__.__name__})") from e
            files = sorted({self.dir / v for v in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise ModelLoadError(f"shard {missing[0]} listed in {index.name} is missing from {self.dir}")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")) or any(self.dir.glob("*.pth")):
                raise ModelLoadError(f"{self.dir} holds only pickle weights (.bin/.pt); Trellis reads safetensors only")
            raise ModelLoadError(f"no .safetensors files in {self.dir}")
        return files

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelLoadError(f"tensor {name} is missing from {self.dir}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype_str(self, name: str) -> str:
        return self.entry(name).dtype

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def _map(self, path: Path) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = m
        return m

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Copy one tensor out of the map into fresh (aligned) memory."""
        e = self.entry(name)
        dtype, _ = DTYPES[e.dtype]
        if e.nbytes == 0:
            t = torch.empty(e.shape, dtype=dtype)
        else:
            buf = bytearray(self._map(e.file)[e.start : e.end])
            t = torch.frombuffer(buf, dtype=dtype).reshape(e.shape)
        return t.to(device) if str(device) != "cpu" else t

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temp file in the same folder, fsync, rename) so a crash never leaves half a file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
