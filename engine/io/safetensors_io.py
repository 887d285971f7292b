"""Safetensors reading for model folders, written for the files real tools produce.

Why not just `safetensors.safe_open`: the reference EXL3 writer emits unpadded headers, so tensor
data can start at odd byte offsets, and some readers mishandle that and 0-d tensors. We parse the
header ourselves, validate every offset against the file size up front (so a truncated download
fails at open with a clear message, not deep inside a forward pass), and read each tensor lazily
from a memory map into an aligned buffer.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from engine.errors import FormatError, ModelLoadError
from engine.io.safetensors_header import TensorEntry, read_header, weight_files  # noqa: F401 (re-exported)

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
        files = weight_files(self.dir)
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
