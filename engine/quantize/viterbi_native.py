"""Build and call the fused C Viterbi (viterbi_cpu.c) on CPU tensors.

torch's elementwise ops make three passes over the 65536 state costs per trellis step; the C
loop makes one, with everything in cache, which is several times faster on a CPU. The library is
compiled on first use with the system C compiler into a per-user cache; if no compiler is
available, `available()` is False and viterbi.py keeps its torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("viterbi_cpu.c")
_lib = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("TRELLIS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trellis")
    return Path(base) / "native"


def _build() -> ctypes.CDLL | None:
    src = _SOURCE.read_bytes()
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
    tag = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"viterbi_cpu_{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            os.replace(tmp, out)  # atomic: concurrent builders never see a half-written file
        except (OSError, subprocess.SubprocessError):
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(out))
    fn = lib.trellis_viterbi_encode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> bool:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("TRELLIS_NO_NATIVE") != "1":
            try:
                _lib = _build()
            except OSError:
                _lib = None
    return _lib is not None


def encode(targets: torch.Tensor, K: int, lut: torch.Tensor, warmup: int, lookahead: int) -> torch.Tensor:
    """targets fp32 [n, 256] (CPU) -> states int32 [n, 256]."""
    assert available()
    t = targets.contiguous().float()
    lut = lut.contiguous().float()
    states = torch.empty(t.shape, dtype=torch.int32)
    threads = max(1, torch.get_num_threads())
    rc = _lib.trellis_viterbi_encode(t.data_ptr(), t.shape[0], K, lut.data_ptr(), warmup, lookahead,
                                     states.data_ptr(), threads)
    if rc != 0:
        raise MemoryError("Viterbi encoder ran out of memory")
    return states
