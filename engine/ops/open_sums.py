"""Open sums: a decode product's output handed to its reader before the output transform.

The fused product splits k over warps: each adds its partial sums into an fp32 workspace z, and
the warp that completes a 128-column block applies the output transform (had128 / sqrt(128),
svh, bias) and writes y. That completion (a fence, a counter, a second read of z) sits on the
product's tail, and the kernel after it then reads y again. Measured on the H200 it is 2-3 us of
every small product (csrc/PERF_NOTES.md, session 11).

Where the next kernel is a product's prep anyway (o_proj -> the post-attention norm of gate/up,
gate/up -> act(gate) * up of down, down -> the next layer's input norm of q/k/v), the product
can stop at its sums: the prep reads z and applies the transform as it reads (kernels.h,
OpenSums), and the reader's product zeroes z once that prep is done (MmArgs::zero_after).

A product's open output is an `OpenSums` (a column range of one `Region`). It is read once: by
a product whose prep takes it (`take`), or by `value()`, which finishes it with a kernel of its
own. The workspace buffers z lives in are pooled: a buffer holding unread sums is not handed to
another product, and one whose sums were dropped unread is zeroed before it is used again.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from engine.ops.settings import parse_kinds
from engine import ops  # a cycle (ops imports this module first): used at call time only

# Rows a product may leave open: the per-warp kernel's range (the shared-activation kernel for
# 17..32 rows neither reads nor zeroes open sums).
MAX_ROWS = 8

# Which readers take open sums (ops.OPEN_SUMS): "gated", the down projection's prep reading
# gate/up; "normed", the prep of the next norm's product reading o_proj or down.
KINDS = frozenset({"gated", "normed"})


def parse_setting(value: str) -> frozenset[str]:
    """TRELLIS_OPEN_SUMS: 0 (none), 1 (all), or a comma list of KINDS."""
    return parse_kinds("TRELLIS_OPEN_SUMS", value, KINDS)


class WorkspacePool:
    """Per device, the fp32 workspaces of the fused product. Every product leaves the buffer it
    used zero again, except one whose sums stay open: that buffer is held until they are read."""

    def __init__(self, least: int):
        self.least = least
        self.buffers: dict[torch.device, list[torch.Tensor]] = {}
        self.held: set[int] = set()   # data_ptr of buffers with unread open sums
        self.dirty: set[int] = set()  # buffers whose open sums were dropped unread

    def get(self, device: torch.device, numel: int, avoid: torch.Tensor | None = None) -> torch.Tensor:
        """A zero buffer of at least numel floats, not held and not `avoid` (the buffer whose open
        sums the caller's product zeroes while it adds into the one returned)."""
        bufs = self.buffers.setdefault(device, [])
        skip = self.held | ({avoid.data_ptr()} if avoid is not None else set())
        for i, buf in enumerate(bufs):
            if buf.data_ptr() in skip:
                continue
            if buf.numel() < numel:  # grown, never shrunk
                self.dirty.discard(buf.data_ptr())
                buf = bufs[i] = torch.zeros(max(numel, self.least), dtype=torch.float32, device=device)
            if buf.data_ptr() in self.dirty:
                buf.zero_()
                self.dirty.discard(buf.data_ptr())
            return buf
        buf = torch.zeros(max(numel, self.least), dtype=torch.float32, device=device)
        bufs.append(buf)
        return buf

    def hold(self, buf: torch.Tensor) -> None:
        self.held.add(buf.data_ptr())

    def release(self, buf_ptr: int, dirty: bool = False) -> None:
        self.held.discard(buf_ptr)
        if dirty:
            self.dirty.add(buf_ptr)


POOL = WorkspacePool(32 * 131072)


@dataclass(eq=False)
class Region:
    """One product's open sums: z [rows, out] fp32 at the start of a pooled buffer, with the
    output transform's svh and bias over all of its columns."""

    z: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    buffer: torch.Tensor
    read: bool = False
    finished: torch.Tensor | None = None  # y [rows, out] fp16, once value() ran
    _finalizer: object = field(default=None, repr=False)

    def __post_init__(self):
        POOL.hold(self.buffer)
        # Sums nobody reads leave the buffer dirty: it is zeroed before its next use.
        self._finalizer = weakref.finalize(self, POOL.release, self.buffer.data_ptr(), True)

    def mark_read(self) -> None:
        if self.read:
            raise RuntimeError("open sums are read once")
        self.read = True
        self._finalizer.detach()
        POOL.release(self.buffer.data_ptr())


@dataclass(eq=False)
class OpenSums:
    """Columns [col0, col0 + cols) of a Region, as the output of shape lead + (cols,) in dtype."""

    region: Region
    col0: int
    cols: int
    lead: tuple[int, ...]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.lead, self.cols))

    @property
    def device(self) -> torch.device:
        return self.region.z.device

    @property
    def is_cuda(self) -> bool:
        return self.region.z.is_cuda

    @property
    def rows(self) -> int:
        return self.region.z.shape[0]

    def sums(self) -> torch.Tensor:
        return self.region.z[:, self.col0:self.col0 + self.cols]

    def post(self) -> list[torch.Tensor]:
        """[svh, bias] of these columns (an empty tensor for no bias), as exl3_gemm's open_post."""
        c = slice(self.col0, self.col0 + self.cols)
        bias = self.region.bias
        return [self.region.svh[c], bias[c] if bias is not None else self.region.svh.new_empty(0)]

    def value(self) -> torch.Tensor:
        """The finished output (one had128 kernel, then z zeroed): for readers that do not take
        open sums."""
        r = self.region
        if r.finished is None:
            r.mark_read()
            r.finished = ops.extension().had128(r.z, None, r.svh, r.bias)
            r.z.zero_()
        return r.finished[:, self.col0:self.col0 + self.cols].reshape(self.shape).to(self.dtype)


def wrap(z: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None, buffer: torch.Tensor,
         bounds: list[tuple[int, int]], lead: tuple[int, ...], dtype: torch.dtype) -> list[OpenSums]:
    """A product's open output z (a view at the start of `buffer`) as one OpenSums per column range."""
    region = Region(z, svh, bias, buffer)
    return [OpenSums(region, a, b - a, lead, dtype) for a, b in bounds]


def enabled() -> bool:
    """Open sums are on and the settings they need hold (the version-3 fused product, its prep
    kernel; no decode-chain link that hands a product's output on its own way: attention -> o_proj
    hands on none)."""
    return (bool(ops.OPEN_SUMS) and not (ops.CHAIN - {"attn"}) and ops.GLUE_KERNELS and ops.MM_VERSION == 3
            and ops.FUSED_MAX_ROWS >= 1)


def wanted(kind: str) -> bool:
    """Whether a product whose reader is of this kind (KINDS) should leave its output open."""
    return enabled() and kind in ops.OPEN_SUMS


def can_leave_open(rows: int, t, device: torch.device) -> bool:
    """Whether a product of t (EXL3Tensors or EXL3Group) over `rows` rows may return open sums:
    the fused per-warp product on the GPU (the caller checks that no output is trimmed)."""
    return (enabled() and 1 <= rows <= MAX_ROWS and t.trellis.is_cuda and t.trellis.device == device
            and ops._use_cuda(t.suh, t.svh))


def readable(x: OpenSums, up: "OpenSums | None", in_f: int) -> bool:
    """Whether a product's prep can read x (and up) as open sums: unread, the product's width,
    at most MAX_ROWS rows, one region for both (gate/up)."""
    if x.region.read or x.cols != in_f or x.rows > MAX_ROWS:  # value() marks them read too
        return False
    return up is None or (up.region is x.region and up.cols == in_f)


def take(x: OpenSums, up: "OpenSums | None") -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], torch.Tensor]:
    """Mark x's region read by the product about to launch: (x sums, up sums, open_post, the
    region to zero after the prep). The caller's product must not add into that buffer."""
    r = x.region
    r.mark_read()
    post = x.post() + (up.post() if up is not None else [])
    return x.sums(), (up.sums() if up is not None else None), post, r.buffer[:r.z.numel()]
