"""EXL3 weights: codebooks, trellis bitstreams, tile order, Hadamards and the reference dequant.

This is the bit-exact torch reference that every faster path (CUDA kernels, the CPU dense
cache) is tested against. The spec is shared/design/exl3-format.md; section numbers below refer
to it. Layout conventions: W is input-major (in x out); a layer computes y = x @ W + b.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import FormatError

CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
MARKER_VALUES = {"mcg": MCG_MULTIPLIER - (1 << 32), "mul1": MUL1_MULTIPLIER - (1 << 32)}
# The quantizer normalizes to 3INST's RMS whatever the codebook (section 2).
CODEBOOK_SCALE = 1.24371088
HADAMARD_SIZE = 128
TILE = 16
STEPS = 256  # trellis steps (weights) per 16x16 tile


# --------------------------------------------------------------------------------------------
# Section 2: 16-bit state -> fp16 value


@functools.lru_cache(maxsize=None)
def _codebook_lut_np(codebook: str) -> np.ndarray:
    s = np.arange(65536, dtype=np.uint64)
    if codebook == "mul1":
        x = (s * MUL1_MULTIPLIER) & 0xFFFFFFFF
        t = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        k_inv = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        k_bias = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        # One fused multiply-add, one rounding: exact in float64, then rounded straight to fp16.
        return ((1024.0 + t.astype(np.float64)) * k_inv + k_bias).astype(np.float16)
    if codebook == "3inst":
        x = (s * 89226354 + 64248484) & 0xFFFFFFFF
    elif codebook == "mcg":
        x = (s * MCG_MULTIPLIER) & 0xFFFFFFFF
    else:
        raise ValueError(f"unknown codebook {codebook!r}")
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return (lo + hi).astype(np.float16)  # the exact sum, rounded once (a hardware half add)


def codebook_lut(codebook: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """All 65536 decoded values of a codebook, fp16, indexed by state."""
    return torch.from_numpy(_codebook_lut_np(codebook).copy()).to(device)


# --------------------------------------------------------------------------------------------
# Section 3.4: stream position -> element of a 16x16 tile


def _stream_to_tile() -> torch.Tensor:
    idx = []
    for p in range(STEPS):
        t, j = divmod(p, 8)
        r0, c0 = 2 * (t % 4), t // 4
        row = r0 + (j & 1) + (8 if j & 2 else 0)
        col = c0 + (8 if j & 4 else 0)
        idx.append(row * TILE + col)
    return torch.tensor(idx, dtype=torch.long)


STREAM_TO_TILE = _stream_to_tile()
TILE_TO_STREAM = torch.argsort(STREAM_TO_TILE)


# --------------------------------------------------------------------------------------------
# Sections 3.2-3.3: bitstreams and tail-biting states


def _stream_words(trellis: torch.Tensor) -> torch.Tensor:
    """int16 tile words as stored -> 16-bit stream words in stream order (int32, 0..65535)."""
    u = trellis.to(torch.int32) & 0xFFFF
    pairs = u.reshape(*u.shape[:-1], -1, 2)
    return pairs.flip(-1).reshape(u.shape)  # each stored uint32 is little-endian: swap halves


@functools.lru_cache(maxsize=None)
def _state_gather(K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nbits = STEPS * K
    ends = (torch.arange(STEPS) + 1) * K
    start = (ends - 16) % nbits
    w0 = start // 16
    w1 = (w0 + 1) % (nbits // 16)
    shift = (16 - start % 16).to(torch.int32)  # int32 keeps the shift from promoting to int64
    return w0, w1, shift


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """Packed tiles [..., 16K] (int16) -> 16-bit states [..., 256] (int32), in stream order."""
    K = trellis.shape[-1] // 16
    if trellis.shape[-1] % 16 or not 1 <= K <= 8:
        raise FormatError(f"trellis last dimension {trellis.shape[-1]} is not 16*K for K in 1..8")
    words = _stream_words(trellis)
    w0, w1, shift = (t.to(trellis.device) for t in _state_gather(K))
    combined = (words[..., w0] << 16) | words[..., w1]
    return (combined >> shift) & 0xFFFF


def pack_symbols(states: torch.Tensor, K: int) -> torch.Tensor:
    """States or symbols [..., 256] in stream order -> packed int16 tiles [..., 16K].

    Only the low K bits of each entry are used; for a consistent tail-biting path those bits
    determine every state (section 3.3)."""
    sym = states.to(torch.int64) & ((1 << K) - 1)
    shifts = torch.arange(K - 1, -1, -1, device=sym.device)
    bits = (sym.unsqueeze(-1) >> shifts) & 1  # [..., 256, K], MSB first
    bits = bits.reshape(*sym.shape[:-1], 16 * K, 16)
    weights = 1 << torch.arange(15, -1, -1, device=sym.device)
    words = (bits * weights).sum(-1)  # 16-bit words, stream order
    words = words.reshape(*sym.shape[:-1], -1, 2).flip(-1).reshape(*sym.shape[:-1], 16 * K)
    return (words - ((words >= 32768).to(torch.int64) << 16)).to(torch.int16)


# --------------------------------------------------------------------------------------------
# Section 3.5: dense inner weight W-hat


def to_stream_tiles(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] (multiples of 16) -> [rows/16, cols/16, 256], each tile in stream order."""
    r, c = w.shape
    tiles = w.reshape(r // TILE, TILE, c // TILE, TILE).permute(0, 2, 1, 3).reshape(r // TILE, c // TILE, TILE * TILE)
    return tiles[..., STREAM_TO_TILE.to(w.device)]


def from_stream_tiles(t: torch.Tensor) -> torch.Tensor:
    """Inverse of to_stream_tiles: [ti, tj, 256] in stream order -> [ti*16, tj*16]."""
    ti, tj, _ = t.shape
    tiles = t[..., TILE_TO_STREAM.to(t.device)]  # a gather: faster than scattering by STREAM_TO_TILE
    return tiles.reshape(ti, tj, TILE, TILE).permute(0, 2, 1, 3).reshape(ti * TILE, tj * TILE)


def reconstruct(trellis: torch.Tensor, codebook: str, max_tiles: int = 1 << 16) -> torch.Tensor:
    """The reference's `reconstruct`: W-hat, fp16 [in, out], in the regularized domain.

    Works in row slices so that memory stays bounded on large layers."""
    ti, tj, _ = trellis.shape
    lut = codebook_lut(codebook, trellis.device)
    out = torch.empty(ti * TILE, tj * TILE, dtype=torch.float16, device=trellis.device)
    rows = max(1, max_tiles // max(tj, 1))
    for a in range(0, ti, rows):
        b = min(ti, a + rows)
        out[a * TILE : b * TILE] = from_stream_tiles(lut[unpack_states(trellis[a:b])])
    return out


# --------------------------------------------------------------------------------------------
# Section 3.7: 128-point Hadamard


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    idx = torch.arange(n)
    popcount = torch.zeros(n, n, dtype=torch.long)
    a = idx[:, None] & idx[None, :]
    for b in range(n.bit_length()):
        popcount += (a >> b) & 1
    return (1.0 - 2.0 * (popcount % 2).float()) / (n**0.5)


def hadamard_matrix(n: int = HADAMARD_SIZE, device: str | torch.device = "cpu", dtype=torch.float32) -> torch.Tensor:
    """Normalized natural-order Sylvester Hadamard: symmetric and its own inverse."""
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


def hadamard128(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Apply H128 to every block of 128 along `dim` (computed in fp32, returned in fp32)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % HADAMARD_SIZE:
        raise FormatError(f"Hadamard dimension {n} is not a multiple of {HADAMARD_SIZE}")
    h = hadamard_matrix(HADAMARD_SIZE, x.device)
    if dim == x.dim() - 1:
        return (x.float().reshape(-1, HADAMARD_SIZE) @ h).reshape(x.shape)
    # Along another axis: blocks of 128 along `dim`; one flat matmul is far faster than a
    # batched one over a strided view.
    pre = 1
    for s in x.shape[:dim]:
        pre *= s
    blocks = x.float().reshape(pre, n // HADAMARD_SIZE, HADAMARD_SIZE, -1)
    y = torch.matmul(h, blocks)  # h is symmetric: H @ block == (block^T @ H)^T
    return y.reshape(x.shape)


# --------------------------------------------------------------------------------------------
# Section 1.4 / 1.8: one quantized linear's tensors


@dataclass
class EXL3Tensors:
    """The stored tensors of one EXL3 linear, with the facts derived from them."""

    trellis: torch.Tensor  # int16 [in/16, out/16, 16K]
    suh: torch.Tensor  # fp16 [in]
    svh: torch.Tensor  # fp16 [out]
    codebook: str
    bias: torch.Tensor | None = None  # fp16 [out]
    key: str = ""

    @property
    def K(self) -> int:
        return self.trellis.shape[-1] // 16

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * TILE

    def check_shape(self, in_features: int, out_features: int) -> None:
        """Raise FormatError unless the padded shape matches what the config implies."""
        want = (pad_to_128(in_features), pad_to_128(out_features))
        got = (self.in_features, self.out_features)
        if got != want:
            raise FormatError(
                f"{self.key}: trellis shape {list(self.trellis.shape)} implies {got[0]}x{got[1]} "
                f"but config.json implies {want[0]}x{want[1]}"
            )

    def w_hat(self) -> torch.Tensor:
        return reconstruct(self.trellis, self.codebook)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W = diag(suh) Hk W-hat Hn diag(svh), original basis, [in, out] (section 3.6)."""
        w = hadamard128(self.w_hat(), dim=0)
        w = hadamard128(w, dim=1)
        w = w * self.suh.float()[:, None] * self.svh.float()[None, :]
        return w.to(dtype)

    def to(self, device) -> "EXL3Tensors":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return EXL3Tensors(mv(self.trellis), mv(self.suh), mv(self.svh), self.codebook, mv(self.bias), self.key)


def pad_to_128(n: int) -> int:
    return (n + HADAMARD_SIZE - 1) // HADAMARD_SIZE * HADAMARD_SIZE


def unpack_sign_bits(packed: torch.Tensor) -> torch.Tensor:
    """Legacy `.su`/`.sv` (int16 [n/16]): bit b of word w set -> element 16w+b is -1 (section 3.8)."""
    words = packed.to(torch.int32) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16)) & 1
    return (1.0 - 2.0 * bits.reshape(-1).float()).half()


def is_exl3(store, key: str) -> bool:
    return (
        f"{key}.trellis" in store
        and (f"{key}.suh" in store or f"{key}.su" in store)
        and (f"{key}.svh" in store or f"{key}.sv" in store)
    )


def find_exl3(store, key: str, device="cpu") -> EXL3Tensors | None:
    """Load `key` as an EXL3 linear if its tensors say it is one (section 1.8), validating them."""
    if f"{key}.trellis" not in store:
        return None
    if not is_exl3(store, key):
        raise FormatError(f"{key}: has a .trellis tensor but no input/output scales (.suh/.svh)")
    has_mcg, has_mul1 = f"{key}.mcg" in store, f"{key}.mul1" in store
    if has_mcg and has_mul1:
        raise FormatError(f"{key}: carries both .mcg and .mul1 codebook markers; a tensor may have at most one")
    codebook = "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"
    if codebook != "3inst":
        marker = store.get(f"{key}.{codebook}")
        if marker.numel() != 1 or marker.dtype != torch.int32:
            raise FormatError(f"{key}.{codebook}: codebook marker must be a 0-d int32 tensor")
        if int(marker.reshape(-1)[0]) != MARKER_VALUES[codebook]:
            warnings.warn(
                f"{key}: {codebook} marker value {int(marker.reshape(-1)[0]) & 0xFFFFFFFF:#x} is not the locked "
                "constant; this file predates exllamav3 v0.0.9 and decodes with the locked multiplier"
            )
    if store.dtype_str(f"{key}.trellis") not in ("I16", "U16"):
        raise FormatError(f"{key}.trellis: dtype {store.dtype_str(f'{key}.trellis')}, expected int16")
    shape = store.shape(f"{key}.trellis")
    if len(shape) != 3 or shape[2] % 16 or not 1 <= shape[2] // 16 <= 8:
        raise FormatError(f"{key}.trellis: shape {list(shape)} is not [in/16, out/16, 16*K] with K in 1..8")
    trellis = store.get(f"{key}.trellis", device)
    n_in, n_out = shape[0] * TILE, shape[1] * TILE
    suh = store.get(f"{key}.suh", device).half() if f"{key}.suh" in store else unpack_sign_bits(store.get(f"{key}.su")).to(device)
    svh = store.get(f"{key}.svh", device).half() if f"{key}.svh" in store else unpack_sign_bits(store.get(f"{key}.sv")).to(device)
    if suh.shape != (n_in,) or svh.shape != (n_out,):
        raise FormatError(
            f"{key}: scales of shape {list(suh.shape)}/{list(svh.shape)} do not match trellis {list(shape)}"
        )
    bias = None
    if f"{key}.bias" in store:
        bias = store.get(f"{key}.bias", device)
        if bias.numel() > n_out:
            raise FormatError(f"{key}.bias: {bias.numel()} values for {n_out} outputs")
    return EXL3Tensors(trellis, suh, svh, codebook, bias, key)


# --------------------------------------------------------------------------------------------
# Section 4.1: the quantized linear forward


def exl3_matmul_reference(x: torch.Tensor, t: EXL3Tensors, w_hat: torch.Tensor | None = None) -> torch.Tensor:
    """y = had(x * suh) @ W-hat @ had * svh + bias, in fp32. `x` is zero-extended to `in`."""
    if x.shape[-1] < t.in_features:
        x = torch.nn.functional.pad(x, (0, t.in_features - x.shape[-1]))
    w_hat = t.w_hat() if w_hat is None else w_hat
    xh = hadamard128(x.float() * t.suh.float())
    y = hadamard128(xh @ w_hat.float()) * t.svh.float()
    if t.bias is not None:
        y[..., : t.bias.numel()] += t.bias.float()
    return y
