"""Tensor ops with one dispatch each: the CUDA kernels (csrc/) when the extension is available
and the tensors are fp16 on a CUDA device, the PyTorch reference otherwise.

The reference paths are the specification the kernels are tested against; they run anywhere
(CPU CI never compiles anything). Set TRELLIS_KERNELS=torch to force the reference on a GPU.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import ConfigError, TrellisError, first_line
from engine.formats import exl3 as _fmt
from engine.ops import chain as _chain
from engine.ops import dense_mlp as _dense_mlp
from engine.ops import open_sums as _open
from engine.ops.chain import ChainOut, Deferred
from engine.ops.attention import (PendingRope, capped_softmax_, decode_attention,  # noqa: F401 (re-exported)
                                  decode_attention_serves, rope_qk, rope_qk_store)
from engine.ops.token_pick import argmax, sample_top, sample_top_available, topk  # noqa: F401 (re-exported)
from engine.ops.open_sums import OpenSums
from engine.ops.groups import EXL3Group, can_group, join as join_linears  # noqa: F401 (re-exported)


def _int_setting(name: str, default: int) -> int:
    """An integer knob from the environment; unset or empty means the default, so that `NAME=`
    in a script never silently turns a feature off. A bad value is a ConfigError, which the CLI
    prints as one line."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, not {raw!r}") from None


CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
# Above this many rows the product reconstructs W-hat once and uses cuBLAS (prefill).
FUSED_MAX_ROWS = _int_setting("TRELLIS_FUSED_MAX_ROWS", 64)
# MUL1 layers may use the integer tensor-core path (activations as two int8 passes, about 15
# bits) up to INT8_MAX_ROWS rows. One launch covers 4 rows (a B column per (row, pass)) at about
# the cost of one, so it pays up to 4 rows (8192x28672 at 4 rows: 53 us against 62 for the fp16
# path); 5..8 rows take a second column group with half the tiles per unit and lose (92 against
# 65 us, 78 with two k rows per unit; csrc/PERF_NOTES.md, session 9). TRELLIS_INT8: auto (m <= 4,
# the default), 0 (never), 1 (every m <= 8).
INT8_MAX_ROWS = {"0": 0, "auto": 4, "1": 8}.get(os.environ.get("TRELLIS_INT8", "auto").lower(), 4)
# Fused-product kernel generation: 3 = persistent warps (csrc/exl3_gemv.cuh), 2 = the previous
# one (csrc/exl3_mm.cuh), kept so benchmarks can report the ratio between them.
MM_VERSION = _int_setting("TRELLIS_MM_VERSION", 3)

# Norm, residual, RoPE and gated-activation kernels: on by default; benchmarks turn them off
# (TRELLIS_GLUE=0) to time the same model with the PyTorch ops they replace.
GLUE_KERNELS = os.environ.get("TRELLIS_GLUE", "1") != "0"

# One-token decode attention kernel (csrc/decode_attention.cu) instead of SDPA: on by default;
# TRELLIS_ATTN=sdpa (or a benchmark setting ATTN_KERNEL) keeps SDPA for a same-run ratio.
ATTN_KERNEL = os.environ.get("TRELLIS_ATTN", "kernel").lower() not in ("sdpa", "0", "off")

# The fused product's configuration for K = 4 (TRELLIS_GV_VARIANT = 10 + CFG of csrc/exl3_gemv.cuh,
# or 7, the K = 4 integer path's previous split of its decode between the ALU and FMA pipes, or 8,
# 21 and 22, the decode forms of session 32; a benchmark knob); anything else below 10 means the
# shipped one.
_DEFAULT_VARIANT = _int_setting("TRELLIS_GV_VARIANT", 0)
if _DEFAULT_VARIANT < 10 and _DEFAULT_VARIANT not in (7, 8):
    _DEFAULT_VARIANT = 0

# Which products run their output transform as a kernel of their own after them
# (TRELLIS_GV_SPLIT_FINISH): 1 the block-shared kernel's (17..32 rows of large layers); 2 also the
# per-warp kernel's at 9..32 rows; 3 also its fp16-path products of 1..8 rows (5..8 by default);
# 4 also the integer path's (1..4 rows), so every plain product; 5 (default) also a decode
# chain's product (TRELLIS_CHAIN), whose chain output the finish kernel then writes; 0 none (the
# warp that completes each 128-column block does it, as before session 28). On an H100, decode at
# batch 9-32 ran 10-11% faster with 2 than with 1, 1 was 8-11% faster than 0 at 17-32 (session
# 28), and 3 8% faster than 2 at batch 5 and 8; on the H200, 4 was 3-5% faster than 3 at batch 1
# and 10% at batch 4 (session 29, csrc/PERF_NOTES.md).
GV_SPLIT_FINISH = _int_setting("TRELLIS_GV_SPLIT_FINISH", 5)
# At 5, the chain finish kernel reads what kernels before its product wrote (the input's row sums,
# the residual) before its PDL wait, so that after the wait only the product's sums are a round trip
# away (csrc/exl3_gemv_finish.cuh, gv_finish_chain_kernel). TRELLIS_FINISH_EARLY_READS=0 reads them after
# it, as first written (a same-run baseline).
FINISH_EARLY_READS = os.environ.get("TRELLIS_FINISH_EARLY_READS", "1") != "0"

# Open sums (engine/ops/open_sums.py): a decode product whose reader is another product's prep
# leaves its output as split-k sums, which that prep finishes as it reads them. Which readers
# take them: TRELLIS_OPEN_SUMS = 0 (none, the default), gated (the down projection's prep reads
# gate/up), normed (the next norm's prep reads o_proj and down), 1 (both).
OPEN_SUMS = _open.parse_setting(os.environ.get("TRELLIS_OPEN_SUMS", "0"))

# Decode chains (engine/ops/chain.py): a kernel's output stage writes the next product's input,
# so no prep kernel runs between them. Which links: TRELLIS_CHAIN = 0 (none), 1 (all), or a comma
# list of attn, gated, normed. The default follows the settings above: at split finish 5 (and no
# open sums, which product links turn off) all links, which with the finish kernel writing them
# decoded Llama-3.1-8B 4% faster than the attention link alone, Qwen3-8B 3% and Gemma-2-9B 1%
# (H200, session 30); below 5 the attention link alone (the decode attention kernel writes
# o_proj's input), because the products' own tails writing the product-to-product links (gated,
# normed) made decode slower, each alone and together (sessions 7, 12 and 30; csrc/PERF_NOTES.md).
CHAIN = _chain.parse_setting(os.environ.get("TRELLIS_CHAIN", "1" if GV_SPLIT_FINISH >= 5 and not OPEN_SUMS else "attn"))
# Decode steps of how many rows chain (batch decode, speculative decoding's checks): up to 4
# (TRELLIS_CHAIN_ROWS, default 4; 1 for one row only), the integer path's one group; beyond one
# row only where the finish kernel writes the links (split finish 5), and not the attention link
# (one sequence). Batch 2 / 4 decode of Llama-3.1-8B shapes ran 2-8% / 2-5% faster than with
# one-row chains only (H100 and H200, session 31).
CHAIN_ROWS = max(1, min(4, _int_setting("TRELLIS_CHAIN_ROWS", 4)))

# From how many k-row quads per resident warp a one-group product takes four k rows per unit
# (TRELLIS_GV_FOUR_ROW_UNITS, default 3; 0 never; csrc/PERF_NOTES.md, session 12). Set on the
# extension when it loads; benchmarks and tests that change it restore this.
FOUR_ROW_UNITS = _int_setting("TRELLIS_GV_FOUR_ROW_UNITS", 3)

# Where a product takes the compact ring, which fits two blocks in an SM of 100 KB (csrc/
# exl3_gemv_geom.cuh; the shipped rings are sized for the H200's 228 KB): TRELLIS_GV_COMPACT = 3
# (default) wherever two shipped blocks do not fit on an SM (RTX 30/40/50, some A100 products;
# never on an H200), 0 only where the shipped block cannot launch at all, 1 always (a test knob;
# session 23's GPU run checked the compact kernels so), 2 never.
GV_COMPACT = _int_setting("TRELLIS_GV_COMPACT", 3)
# Small products on the compact ring on every GPU: a product of one group of rows (up to 4 on the
# integer path, 8 on the fp16 one) that would take one k row per unit with fewer than this many
# units per resident warp (TRELLIS_GV_LEAN_UNITS; 0 never; not in setting 2).
# On the H200 Llama-3.1-8B's q/k/v and o_proj products ran 8% and 13% faster on that ring, and its
# decode 2.7% faster (sessions 24 and 26, csrc/PERF_NOTES.md).
GV_LEAN_UNITS = _int_setting("TRELLIS_GV_LEAN_UNITS", 16)
# The most groups of rows a product may have and still take the rule above
# (TRELLIS_GV_LEAN_GROUPS). 4, which reaches the fp16 path's 32 rows, decoded batches of 16 and 32
# 2% and 0.3% slower than 1 on an H100 (session 27, csrc/PERF_NOTES.md).
GV_LEAN_GROUPS = _int_setting("TRELLIS_GV_LEAN_GROUPS", 1)
# How a product's grid meets the SM count where the min-units cap leaves it short of two blocks
# per SM (TRELLIS_GV_GRID_FILL): 0 as the cap gives it (before session 33), 1 (default) every
# resident block where the cap gives between one and two per SM (Llama-3.1-8B's one-row q/k/v and
# down projection), 2 every resident block always (csrc/exl3_mm.cuh, gemv_grid_fill).
GV_GRID_FILL = _int_setting("TRELLIS_GV_GRID_FILL", 1)
# Whether products (per-warp and block-shared kernels) pad their shared memory so that an SM
# holds no more of their blocks than the grid is sized for (TRELLIS_GV_BLOCK_CAP, default 1; 0 lets
# the block scheduler pack three to an SM where they fit: csrc/exl3_mm.cuh, gemv_block_cap).
GV_BLOCK_CAP = _int_setting("TRELLIS_GV_BLOCK_CAP", 1)

# A norm over a norm (Gemma's post-attention or post-feedforward norm, then the residual add and
# the next pre-norm; PendingNorm.pre_weight) computed in one decode prep: one norm kernel fewer
# per Gemma block, two per layer. Off by default: its GPU tests pass, but Gemma 2 decoded no faster
# with it at context 0 and 4% slower at 4,096 (session 24, csrc/PERF_NOTES.md);
# TRELLIS_PREP_DOUBLE_NORM=1 turns it on. Off, the inner norm runs as its own kernel and the outer
# one in the prep.
PREP_DOUBLE_NORM = os.environ.get("TRELLIS_PREP_DOUBLE_NORM", "0") == "1"

# Gemma 2's prefill attention: tanh, the cap, the mask and the softmax of each chunk of scores in
# one kernel (csrc/capped_softmax.cu) instead of four PyTorch passes over them: on by default (a
# 4,096-token Gemma 2 prefill 1.3x, 8,192 1.5x as fast; session 24); TRELLIS_CAPPED_SOFTMAX=0
# keeps the passes.
CAPPED_SOFTMAX = os.environ.get("TRELLIS_CAPPED_SOFTMAX", "1") != "0"

# Decode products prep their own input (csrc/exl3_gemv.cuh, self prep): TRELLIS_SELF_PREP=1.
SELF_PREP = os.environ.get("TRELLIS_SELF_PREP", "0") == "1"

# Which fp16-path products read their activations from one copy per block instead of one per warp
# (csrc/exl3_gemv_sa.cuh, sa_applies): TRELLIS_GV_SHARED 0 none, 2 all, 3 (default) where that
# measured faster (by rows and layer size, session 39), 1 the rule before (a benchmark baseline).
# Tests that change it restore this.
GV_SHARED = _int_setting("TRELLIS_GV_SHARED", 3)
# Whether block-shared products of 17..32 rows at K <= 4 take Hopper's warpgroup MMA where the
# device has it (compute capability 9.0; csrc/exl3_gemv_sa.cuh, kSaWgmma): TRELLIS_GV_WGMMA=0 keeps
# the synchronous MMAs (the baseline). Tests that change it restore this.
GV_WGMMA = _int_setting("TRELLIS_GV_WGMMA", 1)

# Decode attention merges its splits' partials in one pass (TRELLIS_ATTN_MERGE=2: the max first,
# then the sums, as before session 15; a benchmark knob, csrc/decode_attention.cu).
ATTN_MERGE_ONLINE = os.environ.get("TRELLIS_ATTN_MERGE", "1") != "2"

# Decode attention (head dim 64 or 128) walks its keys on the tensor cores, through shared-memory
# stages that cp.async fills ahead, from spans of this many cache slots on (TRELLIS_ATTN_MMA_SLOTS;
# 0: never, the scalar walk of before session 19; csrc/decode_attention.cu).
ATTN_MMA_SLOTS = _int_setting("TRELLIS_ATTN_MMA_SLOTS", 1)
# Up to how many slots the tensor-core walk takes one split (the extension's default; benchmarks
# and tests that change it restore this).
ATTN_MMA_ONE_SPLIT = 256
# Head dim 256 (Gemma) on the tensor-core walk too, in steps of 8 keys: on by default (Gemma 2
# decode 2.8% faster at context 0, 4.9% at 4,096; session 24); TRELLIS_ATTN_MMA_D256=0 keeps the
# scalar walk for head dim 256.
ATTN_MMA_D256 = os.environ.get("TRELLIS_ATTN_MMA_D256", "1") != "0"
# At head dim 256 the tensor-core walk can also write o_proj's input (engine/ops/chain.py, the attn
# link), but Gemma 2 decoded 2-2.5% slower with that than with o_proj's own prep (session 24), so
# it is off unless TRELLIS_ATTN_CHAIN_D256=1. Head dim 128 chains wherever TRELLIS_CHAIN has attn.
ATTN_CHAIN_D256 = os.environ.get("TRELLIS_ATTN_CHAIN_D256", "0") == "1"

# Decode attention over short caches gives each warp one load of 16 keys while that takes at most
# this many splits (TRELLIS_ATTN_ONE_LOAD_SPLITS=0: about 32 keys per warp always, as before
# session 16).
ATTN_ONE_LOAD_SPLITS = _int_setting("TRELLIS_ATTN_ONE_LOAD_SPLITS", 10)

# fp16 Hadamards (the prefill's input and output transforms) run in 64-row tiles in shared memory
# (TRELLIS_HAD_TILES=0: a warp per 128-block, as before session 17; the same bits).
HAD_TILES = os.environ.get("TRELLIS_HAD_TILES", "1") != "0"
# ... the plain and gated transforms' resident blocks looping over tiles with the next one's loads
# in flight (TRELLIS_HAD_PIPELINE=0: a block per tile, as before session 18; the same bits).
HAD_PIPELINE = os.environ.get("TRELLIS_HAD_PIPELINE", "1") != "0"

# A grouped prefill product's norm and member input transforms in two kernels (norm_had128: the
# norm's statistics, then one pass writing every member's input) instead of the norm's pass and one
# transform per member; the same bits. TRELLIS_NORM_HAD=0 runs them apart, as before session 18.
NORM_HAD = os.environ.get("TRELLIS_NORM_HAD", "1") != "0"

_ext = None
_ext_error: Exception | None = None


def kernels_enabled() -> bool:
    return os.environ.get("TRELLIS_KERNELS", "auto").lower() not in ("torch", "0", "off", "none")


def extension():
    """The compiled extension (built on first use), or raise KernelBuildError."""
    global _ext, _ext_error
    if _ext is None:
        if _ext_error is not None:
            raise _ext_error
        from engine.ops.build import load_extension

        try:
            _ext = load_extension()
        except Exception as e:
            _ext_error = e
            # Said once, where the user of the CLI or the worker's log sees it: what follows runs
            # the PyTorch path, which a GPU user would otherwise only notice as slowness.
            print(f"trellis: {first_line(e)}; the PyTorch path runs instead (slower, and with a dense fp16 "
                  "copy of the weights beside them, 16 / bpw times their EXL3 size)", file=sys.stderr, flush=True)
            raise
        # Programmatic dependent launch of the product (sm_90+): TRELLIS_PDL=0 turns it off.
        _ext.set_pdl(os.environ.get("TRELLIS_PDL", "1") != "0")
        # Fewest units per warp of the product's grid (benchmark knob; csrc/PERF_NOTES.md).
        _ext.set_gemv_min_units(_int_setting("TRELLIS_GV_MIN_UNITS", 8))
        _ext.set_gemv_grid_fill(GV_GRID_FILL)
        _ext.set_gemv_block_cap(GV_BLOCK_CAP)
        # From how many k-row pairs per resident warp a product takes two k rows per unit
        # (TRELLIS_GV_TWO_ROW_UNITS; 8 was the default before session 10, csrc/PERF_NOTES.md).
        _ext.set_gemv_two_row_units(_int_setting("TRELLIS_GV_TWO_ROW_UNITS", 6))
        _ext.set_gemv_four_row_units(FOUR_ROW_UNITS)
        _ext.set_gemv_compact(GV_COMPACT)
        _ext.set_gemv_lean_units(GV_LEAN_UNITS)
        _ext.set_gemv_lean_groups(GV_LEAN_GROUPS)
        # When the kernel after a product may launch: 2 (default) once each of its warps leaves
        # its main loop, so the next kernel's prologue overlaps the product's tail; 1 at the
        # product's (and decode attention's) start, measured slower; 0 when it ends
        # (csrc/PERF_NOTES.md, sessions 5 and 6).
        _ext.set_early_trigger(_int_setting("TRELLIS_EARLY_TRIGGER", 2))
        # Whether decode products (m = 1, MUL1 integer path) prep their own input instead of a
        # prep kernel running before each (SELF_PREP, TRELLIS_SELF_PREP).
        _ext.set_self_prep(SELF_PREP)
        _ext.set_attn_merge_online(ATTN_MERGE_ONLINE)
        _ext.set_attn_mma_slots(ATTN_MMA_SLOTS)
        _ext.set_attn_mma_d256(ATTN_MMA_D256)
        _ext.set_attn_one_load_splits(ATTN_ONE_LOAD_SPLITS)
        _ext.set_gemv_shared_acts(GV_SHARED)
        _ext.set_gemv_wgmma(GV_WGMMA)
        _ext.set_gemv_split_finish(GV_SPLIT_FINISH)
        _ext.set_finish_early_reads(FINISH_EARLY_READS)
        # The block-shared kernel's grid (TRELLIS_GV_SA_GRID): 1 (default) as few k slices as shared
        # memory allows, never more blocks than fit at once; 0 the rule before session 28.
        _ext.set_gemv_sa_grid(_int_setting("TRELLIS_GV_SA_GRID", 1))
        # Its units (TRELLIS_GV_SA_TILES): 1 (default) two tiles per unit at 25..32 rows of layers of
        # fewer than 4096 x 18432 weights at K <= 4, 0 four tiles everywhere (as before session 37),
        # 2 two tiles at every K, shape and 17..32 rows (benchmarks).
        _ext.set_gemv_sa_tiles(_int_setting("TRELLIS_GV_SA_TILES", 1))
        # Workspace rows a product's finishing warp reads per round trip (TRELLIS_FINISH_ROWS=1: row by
        # row, the earlier order, for a same-run baseline).
        _ext.set_gemv_finish_rows(_int_setting("TRELLIS_FINISH_ROWS", 8))
        _ext.set_had_tiles(HAD_TILES)
        _ext.set_had_pipeline(HAD_PIPELINE)
        if _DEFAULT_VARIANT:
            if _configured_variant(_ext):
                _ext.set_mm_debug_variant(_DEFAULT_VARIANT)
            else:
                print(f"trellis: TRELLIS_GV_VARIANT={_DEFAULT_VARIANT} ignored: these kernels were built without "
                      "debug variants (TRELLIS_DEBUG_VARIANTS=1 builds them)", file=sys.stderr, flush=True)
    return _ext


@contextmanager
def debug_variant(variant: int):
    """Run the products inside with a timing probe or configuration of the fused kernel (csrc/
    exl3_gemv.cuh: 1-3 probes, 10 + CFG configurations), then go back to the configured one."""
    ext = extension()
    if not ext.debug_variant_built(variant):
        raise TrellisError(f"debug variant {variant} is not in these kernels: build them with "
                           "TRELLIS_DEBUG_VARIANTS=1 (the GPU tests and benchmarks set it)")
    ext.set_mm_debug_variant(variant)
    try:
        yield ext
    finally:
        ext.set_mm_debug_variant(_configured_variant(ext))


def _configured_variant(ext) -> int:
    """TRELLIS_GV_VARIANT where this build has it (10 takes shipped kernels, so every build does)."""
    return _DEFAULT_VARIANT if ext.debug_variant_built(_DEFAULT_VARIANT) else 0


def kernels_settled() -> bool:
    """Whether the extension was already loaded, or failed to, in this process: the next
    extension() call then costs nothing."""
    return _ext is not None or _ext_error is not None


@dataclass(frozen=True)
class KernelStatus:
    """What runs a model's ops on a device: "cuda" (the kernels) or "torch" (the PyTorch path), and
    on a CUDA device without the kernels, why, in one line. Reported to the app, because there the
    PyTorch path is many times slower and keeps dense fp16 weights."""

    kernels: str
    note: str = ""


def kernel_status(device: torch.device | str) -> KernelStatus:
    """The ops' path on `device`, building the kernels if needed (minutes, once per GPU kind)."""
    if torch.device(device).type != "cuda":
        return KernelStatus("torch")
    if not kernels_enabled():
        return KernelStatus("torch", f"TRELLIS_KERNELS={os.environ.get('TRELLIS_KERNELS', '')} is set")
    if kernels_available(device):
        return KernelStatus("cuda")
    return KernelStatus("torch", first_line(_ext_error) if _ext_error is not None else "no CUDA device is available")


def kernels_available(device: torch.device | str | None = None) -> bool:
    """True when CUDA kernels can serve tensors on `device` (building them if needed)."""
    if not kernels_enabled() or not torch.cuda.is_available():
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    try:
        extension()
    except Exception:
        return False
    return True


def _use_cuda(*tensors: torch.Tensor | None) -> bool:
    for t in tensors:
        if t is not None and (not t.is_cuda or t.dtype != torch.float16):
            return False
    return _kernels_ready()


def _kernels_ready() -> bool:
    if _ext is not None:  # hot path: one check per call, nothing else
        return kernels_enabled()
    return kernels_enabled() and kernels_available()


def _zeroed(cache: dict, device: torch.device, numel: int, least: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-device buffer of at least `numel` zeros, kept across calls: the kernels that use one
    leave it zero again, so no memset is launched per call. Grown (never shrunk) when too small."""
    buf = cache.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, least), dtype=dtype, device=device)
        cache[device] = buf
    return buf


def workspace(device: torch.device, numel: int, avoid: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scratch for the fused product's split-k partial sums, all zero (the product's output
    stage clears what it read). Not a buffer holding unread open sums, nor `avoid`."""
    return _open.POOL.get(device, numel, avoid)


def workspaces() -> list[torch.Tensor]:
    """Every pooled workspace buffer (tests check they are left zero)."""
    return [b for bufs in _open.POOL.buffers.values() for b in bufs]


def block_counters(device: torch.device, numel: int) -> torch.Tensor:
    """int32 per 128-column block: how much of the block the version-3 product has finished, so
    the warp that completes a block can apply the output transform itself (no extra kernel)."""
    return _zeroed(_counters, device, numel, 4096, torch.int32)


_counters: dict = {}


# ------------------------------------------------------------------------------------------
# Attention settings (the ops: engine/ops/attention.py)

# The decode attention kernel also does the step's RoPE and KV-cache write (PendingRope), so no
# RoPE kernel runs between the q/k/v product and it: on by default; TRELLIS_ATTN_ROPE=0 keeps the
# RoPE kernel (benchmarks' same-run ratio).
ATTN_ROPE = os.environ.get("TRELLIS_ATTN_ROPE", "1") != "0"
# The kernel can also take the per-head q/k norms that come before that RoPE (Qwen3, Gemma 3): two
# norm kernels fewer per layer, the same bits. On by default (Qwen3-8B-shaped decode 1% faster at
# context 0, 2.5% at 4,096; session 23); TRELLIS_ATTN_HEAD_NORMS=0 runs the norms as norm kernels
# before the attention kernel, which still does the RoPE.
ATTN_HEAD_NORMS = os.environ.get("TRELLIS_ATTN_HEAD_NORMS", "1") != "0"
# A sliding-window layer's decode step walks only its window's slots of the cache span, not the
# whole span behind a mask (Gemma 2 and 3, Mistral-style windows; the larger the context past the
# window, the more it saves). On by default (Gemma 2 decode at 7,680 slots 1.2% faster; session
# 24); TRELLIS_ATTN_WINDOW=0 walks the whole span.
ATTN_WINDOW = os.environ.get("TRELLIS_ATTN_WINDOW", "1") != "0"


# ------------------------------------------------------------------------------------------
# EXL3


def exl3_reconstruct(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """W-hat [in, out] fp16, bit-exact on both paths."""
    out = trellis.shape[1] * 16
    if trellis.is_cuda and out % 128 == 0 and kernels_enabled() and kernels_available():
        return extension().exl3_reconstruct(trellis.contiguous(), CODEBOOK_IDS[codebook])
    return _fmt.reconstruct(trellis, codebook)


def hadamard128(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Blockwise normalized 128-point Hadamard. fp16 CUDA input → CUDA kernel, fp16 out (one
    rounding after an fp32 transform); anything else → reference (fp32 out)."""
    if dim in (-1, x.dim() - 1) and _use_cuda(x) and x.shape[-1] % 128 == 0:
        return extension().had128(x.contiguous(), None, None, None)
    return _fmt.hadamard128(x, dim)


def exl3_gemm(x: "torch.Tensor | OpenSums", t, *, mode: str = "auto", ksplit: int = 0, int8: bool | None = None,
              version: int | None = None, up: "torch.Tensor | OpenSums | None" = None, act: str = "silu",
              chain: ChainOut | None = None, open_out: bool = False) -> "torch.Tensor | OpenSums":
    """y = x @ W (+ bias) for an EXL3 linear `t` (EXL3Tensors-like: trellis, suh, svh,
    codebook, bias). x [..., in] (zero-extended if shorter than the padded `in`); returns
    [..., out_padded] in x's dtype on the CUDA path, fp32 on the reference path.

    mode: "auto" (fused kernel up to FUSED_MAX_ROWS rows, else reconstruct + cuBLAS), "fused",
    "dense", or "torch" (the reference, wherever the tensors are). int8: MUL1 integer path for
    m <= 8 (None: up to INT8_MAX_ROWS rows). up: the input is gated_act(x, up, act) instead of x; the fused
    kernel computes it in its activation prep (a gated MLP's down projection, one launch fewer).
    chain: what the output stage also writes for the next product (1..4 rows, fused; chain.py).
    Open sums (open_sums.py): x and up may be the open output of the product before, which this
    product's prep finishes as it reads it; open_out returns this product's output as OpenSums
    where it may stay open (else the finished tensor)."""
    in_f = t.trellis.shape[0] * 16
    version = MM_VERSION if version is None else version
    fused = mode == "fused" or (mode == "auto" and x.shape[:-1].numel() <= FUSED_MAX_ROWS)
    if isinstance(x, OpenSums) or isinstance(up, OpenSums):
        if (isinstance(x, OpenSums) and (up is None or isinstance(up, OpenSums)) and fused and version == 3
                and chain is None and ksplit == 0 and _open.enabled() and _open.readable(x, up, in_f)
                and act in _ACT_IDS and _use_cuda(t.suh, t.svh) and t.trellis.device == x.device):
            return _open_product(x, up, act, t, int8, open_out)
        x, up = as_tensor(x), (as_tensor(up) if up is not None else None)
    if up is not None:
        if act not in _ACT_IDS:
            raise ValueError(f"unsupported activation {act!r}")
        # the fused product's prep, or at prefill the input transform, computes act(x) * up
        if not (GLUE_KERNELS and (version == 3 or not fused) and mode != "torch" and x.shape == up.shape
                and x.shape[-1] == in_f and _use_cuda(x, up, t.suh, t.svh) and t.trellis.is_cuda):
            x, up = gated_act(x, up, act), None
    if x.shape[-1] < in_f:
        x = F.pad(x, (0, in_f - x.shape[-1]))
    if mode == "torch" or not _use_cuda(x, t.suh, t.svh) or not t.trellis.is_cuda:
        _no_chain(chain)
        return _fmt.exl3_matmul_reference(x, t)
    lead = x.shape[:-1]
    if chain is not None and not (fused and version == 3 and lead.numel() <= 4):
        _no_chain(chain)
    x2 = _kernel_rows(x, in_f)
    rows = x2.shape[0]
    out_f = t.trellis.shape[1] * 16
    bias = _padded_bias(t, out_f)
    ext = extension()
    if fused:
        ws = workspace(x.device, min(rows, 32) * out_f)
        use_i8 = rows <= INT8_MAX_ROWS if int8 is None else int8
        leave_open = (open_out and version == 3 and chain is None and ksplit == 0
                      and _open.can_leave_open(rows, t, x.device))
        counters = block_counters(x.device, out_f // 128) if version == 3 and not leave_open else None
        up2 = None if up is None else _kernel_rows(up, in_f)
        y = ext.exl3_gemm(x2, t.suh, t.svh, t.trellis, bias, CODEBOOK_IDS[t.codebook], ws, ksplit, int(use_i8),
                          version, counters, [], up2, _ACT_IDS[act] if up2 is not None else 0, None, 0.0, None, None,
                          [], *_chain_args(chain), [], None, leave_open)
        if leave_open:
            return _open.wrap(y, t.svh, bias, ws, [(0, out_f)], tuple(lead), x.dtype)[0]
    else:
        if up is None:
            xh = ext.had128(x2, t.suh, None, None)
        else:  # one pass over gate and up instead of gated_act's output and then had128 over it
            xh = ext.gated_had128(x2, _kernel_rows(up, in_f), _ACT_IDS[act], t.suh)
        y = _dense_product(xh, t, bias)
    return y.reshape(*lead, out_f)


def _dense_product(xh: torch.Tensor, t, bias: torch.Tensor | None) -> torch.Tensor:
    """The prefill product (reconstruct W-hat, cuBLAS, output transform) of an input already
    transformed (had128(x * suh), [rows, in])."""
    ext = extension()
    z = torch.matmul(xh, ext.exl3_reconstruct(t.trellis, CODEBOOK_IDS[t.codebook]))
    return ext.had128(z, None, t.svh, bias)


def _dense_group_sums(xs: list[torch.Tensor], g: EXL3Group) -> torch.Tensor:
    """The grouped prefill product before its output transform: [rows, out] fp16, member i's
    columns xs[i] @ W-hat_i, xs[i] = had128(x * suh_i) (_member_inputs). Each member's product goes
    straight into its columns (cuBLAS takes the row stride), not into a tensor of its own and then
    a concatenation: 8% less time for gate/up at 4,096 rows (csrc/PERF_NOTES.md, session 17)."""
    w_hat = extension().exl3_reconstruct(g.trellis, CODEBOOK_IDS[g.codebook])
    z = torch.empty(xs[0].shape[0], w_hat.shape[1], dtype=torch.float16, device=xs[0].device)
    for x, (a, b) in zip(xs, g.bounds):
        torch.matmul(x, w_hat[:, a:b], out=z[:, a:b])
    return z


def _member_inputs(x: "torch.Tensor | PendingNorm", g: EXL3Group) -> list[torch.Tensor]:
    """Each member's transformed prefill input had128(x * suh_i), [rows, in]. A pending norm is
    computed in the same pass (norm_had128: the norm's statistics, then one read of the row for
    every member), and its residual stream recorded; the bits are those of the norm's kernel and
    then one transform per member, which TRELLIS_NORM_HAD=0 runs (bench.prefill's cuda-normsep).
    Both callers settle a norm over a norm first (settle_pre), so only its outer norm is here."""
    in_f = g.trellis.shape[0] * 16
    ext = extension()
    if isinstance(x, PendingNorm) and NORM_HAD and x.fusable(in_f) and not isinstance(x.x, OpenSums):
        res = None if x.residual is None else x.residual.reshape(-1, in_f)
        outs = ext.norm_had128(x.x.reshape(-1, in_f), x.weight, x.eps, res, g.suh)
        x.sum = x.x if res is None else outs[1].view(x.x.shape)
        return list(outs[0])
    xc = _kernel_rows(as_tensor(x), in_f).contiguous()
    return [ext.had128(xc, g.suh[i], None, None) for i in range(len(g.bounds))]


def _open_product(x: OpenSums, up: OpenSums | None, act: str, t, int8: bool | None,
                  open_out: bool) -> "torch.Tensor | OpenSums":
    """exl3_gemm of an open input (x, or act(x) * up from one gate/up region): the prep finishes
    the sums as it reads them and the product zeroes them."""
    rows, out_f = x.rows, t.trellis.shape[1] * 16
    xs, us, post, zero = _open.take(x, up)
    ws = workspace(x.device, rows * out_f, avoid=zero)
    use_i8 = rows <= INT8_MAX_ROWS if int8 is None else int8
    leave_open = open_out and _open.can_leave_open(rows, t, x.device)
    bias = _padded_bias(t, out_f)
    counters = None if leave_open else block_counters(x.device, out_f // 128)
    y = extension().exl3_gemm(xs, t.suh, t.svh, t.trellis, bias, CODEBOOK_IDS[t.codebook], ws, 0, int(use_i8), 3,
                              counters, [], us, _ACT_IDS[act] if us is not None else 0, None, 0.0, None, None,
                              [], [], 0, 0, post, zero, leave_open)
    if leave_open:
        return _open.wrap(y, t.svh, bias, ws, [(0, out_f)], x.lead, x.dtype)[0]
    return y.reshape(*x.lead, out_f)


def _no_chain(chain: ChainOut | None) -> None:
    """A chain output asked of a path that cannot write it would leave the next input unwritten."""
    if chain is not None:
        raise ValueError("a chain output needs the fused product of a decode step's rows on the GPU")


def _chain_args(chain: ChainOut | None) -> tuple:
    return ([], 0, 0) if chain is None else (chain.tensors, chain.mode, chain.act)


def _padded_bias(t, out_f: int) -> torch.Tensor | None:
    bias = t.bias
    if bias is not None and bias.numel() != out_f:
        bias = F.pad(bias, (0, out_f - bias.numel()))
    return bias


def _kernel_rows(x: torch.Tensor, in_f: int) -> torch.Tensor:
    """x as the [rows, in] matrix the product kernels read: unit column stride, rows 8-byte aligned."""
    x2 = x.reshape(-1, in_f)
    if x2.stride(-1) != 1 or x2.stride(0) % 4 or x2.data_ptr() % 8:
        x2 = x2.contiguous()
    return x2


def exl3_gemm_group(x: "torch.Tensor | PendingNorm | OpenSums", g: EXL3Group, *, mode: str = "auto",
                    int8: bool | None = None, chain: ChainOut | None = None,
                    open_out: bool = False) -> "list[torch.Tensor] | list[OpenSums]":
    """[x @ W_i (+ bias_i) for each member i of the group], each [..., out_i padded]. On the GPU
    one prep and one product launch serve every member (the prep writes each member's
    activations, int8 steps and sums); prefills reconstruct the joined W-hat once. Elsewhere
    each member's reference product. int8 as in exl3_gemm. x may be a PendingNorm: the fused
    product's prep then computes the norm (and the residual sum) itself, and with PREP_DOUBLE_NORM
    a norm over a norm too (PendingNorm.pre_weight; elsewhere settle_pre runs the inner one first);
    where its x is a Deferred product, that product's output stage writes this one's input
    (chain.py). chain: what this product's output stage writes for the next one (1..4 rows, fused).
    x (or the norm's x) may be open sums, and open_out leaves this product's outputs open where it
    may (open_sums.py)."""
    in_f = g.trellis.shape[0] * 16
    rows = x.shape[:-1].numel()
    fused = mode == "fused" or (mode == "auto" and rows <= FUSED_MAX_ROWS)
    norm = None
    if (isinstance(x, PendingNorm) and x.pre_weight is not None
            and not (fused and g.trellis.is_cuda and x.fusable(in_f, pre_ok=True))):
        x.settle_pre()  # only the fused product's prep (prep_frag) takes a norm over a norm
    open_ok = fused and chain is None and _open.enabled() and g.trellis.is_cuda and _use_cuda(g.suh, g.svh)
    if isinstance(x, PendingNorm) and isinstance(x.x, OpenSums):
        if open_ok and x.fusable(in_f) and x.x.device == g.trellis.device:
            return _open_group(x.x, x, g, int8, open_out)
        x.x = x.x.value()
    if isinstance(x, OpenSums):
        if open_ok and _open.readable(x, None, in_f) and x.device == g.trellis.device:
            return _open_group(x, None, g, int8, open_out)
        x = x.value()
    if isinstance(x, PendingNorm) and isinstance(x.x, Deferred):
        y = _chain.chain_into_group(x, g, chain) if fused and (int8 is None or int8) else None
        if y is not None:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            return [y[..., a:b] for a, b in g.bounds]
        x.x = x.x.value()
    if (isinstance(x, PendingNorm) and not fused and mode != "torch" and chain is None and g.trellis.is_cuda
            and x.fusable(in_f) and _use_cuda(g.suh, g.svh)):
        return _dense_group(x, g)  # a prefill: the norm in the members' input pass
    if isinstance(x, PendingNorm):
        if fused and x.fusable(in_f, pre_ok=True) and g.trellis.is_cuda:
            norm, x = x, x.x
        else:
            x = x.value()
    if x.shape[-1] < in_f:
        x = F.pad(x, (0, in_f - x.shape[-1]))
    if mode == "torch" or not _use_cuda(x, g.suh, g.svh) or not g.trellis.is_cuda or (chain is not None and not fused):
        _no_chain(chain)
        return [_fmt.exl3_matmul_reference(x, t) for t in g.members]
    if not fused:
        return _dense_group(x, g)
    lead = x.shape[:-1]
    out_f = g.trellis.shape[1] * 16
    ws = workspace(x.device, min(rows, 32) * out_f)
    leave_open = open_out and chain is None and _open.can_leave_open(rows, g, x.device)
    counters = None if leave_open else block_counters(x.device, out_f // 128)
    use_i8 = rows <= INT8_MAX_ROWS if int8 is None else int8
    y = extension().exl3_gemm(_kernel_rows(x, in_f), g.suh, g.svh, g.trellis, g.bias, CODEBOOK_IDS[g.codebook], ws, 0,
                              int(use_i8), 3, counters, g.seg_cols, None, 0, *_norm_args(norm, in_f), [],
                              *_chain_args(chain), [], None, leave_open, *_pre_norm_args(norm))
    if leave_open:
        return _open.wrap(y, g.svh, g.bias, ws, g.bounds, tuple(lead), x.dtype)
    y = y.reshape(*lead, out_f)
    return [y[..., a:b] for a, b in g.bounds]


def _dense_group(x: "torch.Tensor | PendingNorm", g: EXL3Group) -> list[torch.Tensor]:
    """exl3_gemm_group at prefill: the members' inputs, their products with the joined W-hat, and
    the joined output transform, split into the members' outputs."""
    y = extension().had128(_dense_group_sums(_member_inputs(x, g), g), None, g.svh, g.bias)
    y = y.reshape(*x.shape[:-1], g.trellis.shape[1] * 16)
    return [y[..., a:b] for a, b in g.bounds]


def _norm_args(norm: "PendingNorm | None", in_f: int) -> tuple:
    """exl3_gemm's (norm_w, eps, residual, residual_out) for a prep that computes `norm`, whose
    sum (the residual stream) is then residual_out."""
    if norm is None:
        return (None, 0.0, None, None)
    res = None if norm.residual is None else norm.residual.reshape(-1, in_f)
    res_out = None if res is None else torch.empty_like(res)
    norm.sum = norm.x if res_out is None else res_out.view(norm.x.shape)
    return (norm.weight, norm.eps, res, res_out)


def _pre_norm_args(norm: "PendingNorm | None") -> tuple:
    """exl3_gemm's (pre_norm_w, pre_eps): the norm before `norm`'s residual add, if it has one."""
    if norm is None or norm.pre_weight is None:
        return (None, 0.0)
    return (norm.pre_weight, norm.pre_eps)


def _open_group(x: OpenSums, norm: "PendingNorm | None", g: EXL3Group, int8: bool | None,
                open_out: bool) -> "list[torch.Tensor] | list[OpenSums]":
    """exl3_gemm_group of open sums x (under `norm` if given): the prep finishes them as it reads
    them and the product zeroes them."""
    in_f, out_f, rows = g.trellis.shape[0] * 16, g.trellis.shape[1] * 16, x.rows
    xs, _, post, zero = _open.take(x, None)
    ws = workspace(x.device, rows * out_f, avoid=zero)
    leave_open = open_out and _open.can_leave_open(rows, g, x.device)
    use_i8 = rows <= INT8_MAX_ROWS if int8 is None else int8
    counters = None if leave_open else block_counters(x.device, out_f // 128)
    y = extension().exl3_gemm(xs, g.suh, g.svh, g.trellis, g.bias, CODEBOOK_IDS[g.codebook], ws, 0, int(use_i8), 3,
                              counters, g.seg_cols, None, 0, *_norm_args(norm, in_f), [], [], 0, 0, post, zero,
                              leave_open)
    if leave_open:
        return _open.wrap(y, g.svh, g.bias, ws, g.bounds, x.lead, x.dtype)
    y = y.reshape(*x.lead, out_f)
    return [y[..., a:b] for a, b in g.bounds]


def exl3_linear_group(x: torch.Tensor, g: EXL3Group, out_features: list[int]) -> list[torch.Tensor]:
    """A model's grouped linears (q/k/v, gate/up): exl3_gemm_group, each output trimmed to its
    logical width, in x's dtype."""
    return [(y if y.shape[-1] == n else y[..., :n]).to(x.dtype) for y, n in zip(exl3_gemm_group(x, g), out_features)]


def open_linear_group(x: "torch.Tensor | PendingNorm", g: EXL3Group, out_features: list[int],
                      kind: str = "gated") -> "list[torch.Tensor] | list[OpenSums]":
    """exl3_linear_group whose outputs may stay open sums (open_sums.py) for a reader of `kind`
    whose prep finishes them: where that kind is on and no member's output is trimmed."""
    if _open.wanted(kind) and all(b - a == n for (a, b), n in zip(g.bounds, out_features)):
        ys = exl3_gemm_group(x, g, open_out=True)
        return ys if isinstance(ys[0], OpenSums) else [y.to(x.dtype) for y in ys]
    return exl3_linear_group(x, g, out_features)


def open_linear(x: "torch.Tensor | OpenSums", t, out_features: int, *, up: "torch.Tensor | OpenSums | None" = None,
                act: str = "silu", kind: str = "normed") -> "torch.Tensor | OpenSums":
    """exl3_linear whose output may stay open sums (open_sums.py) for a reader of `kind` whose
    prep finishes them: where that kind is on and the output is not trimmed."""
    if _open.wanted(kind) and t.trellis.shape[1] * 16 == out_features:
        y = exl3_gemm(x, t, up=up, act=act, open_out=True)
        return y if isinstance(y, OpenSums) else y.to(x.dtype)
    return exl3_linear(x, t, out_features, up=up, act=act)


def exl3_linear(x: torch.Tensor, t, out_features: int | None = None, *, up: torch.Tensor | None = None,
                act: str = "silu") -> torch.Tensor:
    """A model's quantized linear: exl3_gemm, trimmed to the logical width, in x's dtype. With
    `up`, of gated_act(x, up, act) (fused into the product's prep on the GPU)."""
    y = exl3_gemm(x, t, up=up, act=act)
    if out_features is not None and y.shape[-1] != out_features:
        y = y[..., :out_features]
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------
# Norms, activations, RoPE, residuals


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm: fp32 statistics, cast to x's dtype, then times weight."""
    if GLUE_KERNELS and _use_cuda(x, weight) and x.shape[-1] % 2 == 0:
        return extension().rms_norm(x.contiguous(), weight.contiguous(), eps, None)[0]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add fused into the norm."""
    if GLUE_KERNELS and _use_cuda(x, residual, weight) and x.shape[-1] % 2 == 0 and x.shape == residual.shape:
        y, s = extension().rms_norm(x.contiguous(), weight.contiguous(), eps, residual.contiguous())
        return y, s
    s = x + residual
    return rms_norm(s, weight, eps), s


@dataclass
class PendingNorm:
    """rms_norm(x + residual) * weight (residual optional), not computed yet. A grouped product on
    the GPU that reads it (q/k/v, gate/up) computes the norm in its activation prep, which saves
    the norm's own launch; anything else calls value(). `sum` is x + residual, the residual
    stream a layer goes on with, once either has run.

    With pre_weight, x is first normed on its own, rms_norm(x) * pre_weight (pre_eps): a Gemma
    block's post-norm before the residual add (RMSNorm.pending folds one pending norm into the
    next). The fused decode product's prep takes both norms where PREP_DOUBLE_NORM is on;
    everything else runs the inner norm first (settle_pre)."""
    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    pre_weight: torch.Tensor | None = None
    pre_eps: float = 0.0

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def settle_pre(self) -> None:
        """The inner norm of a norm over a norm, computed now (its own kernel on the GPU), for a
        reader that takes one norm: this stays pending as a plain one."""
        if self.pre_weight is not None:
            self.x = rms_norm(as_tensor(self.x), self.pre_weight, self.pre_eps)
            self.pre_weight = None

    def value(self) -> torch.Tensor:
        if isinstance(self.x, (Deferred, OpenSums)):
            self.x = self.x.value()
        self.settle_pre()
        if self.normed is None:
            if self.residual is None:
                self.normed, self.sum = rms_norm(self.x, self.weight, self.eps), self.x
            else:
                self.normed, self.sum = add_rms_norm(self.x, self.residual, self.weight, self.eps)
        return self.normed

    def fusable(self, in_features: int, pre_ok: bool = False) -> bool:
        """Whether a product's prep can compute it: fp16 CUDA, contiguous, unpadded width. A norm
        over a norm only where the reader's prep takes both (pre_ok: the fused decode product's)
        and PREP_DOUBLE_NORM is on; it needs a residual and a plain tensor x."""
        if isinstance(self.x, Deferred):
            return False
        if self.pre_weight is not None:
            if not (pre_ok and PREP_DOUBLE_NORM and self.residual is not None and isinstance(self.x, torch.Tensor)
                    and _use_cuda(self.pre_weight) and self.pre_weight.is_contiguous()
                    and self.pre_weight.shape == (in_features,)):
                return False
        if isinstance(self.x, OpenSums):
            # the prep finishes them (open_sums.py); the residual stream it writes needs a residual
            if self.residual is None or not _open.readable(self.x, None, in_features):
                return False
            rows = [self.residual]
        else:
            rows = [self.x] if self.residual is None else [self.x, self.residual]
        return (self.normed is None and GLUE_KERNELS and _use_cuda(self.weight, *rows)
                and self.x.shape[-1] == in_features and self.weight.is_contiguous()
                and all(t.shape == self.x.shape and t.is_contiguous() and t.data_ptr() % 8 == 0 for t in rows))


def as_tensor(x: "torch.Tensor | PendingNorm | Deferred | OpenSums") -> torch.Tensor:
    return x.value() if isinstance(x, (PendingNorm, Deferred, OpenSums)) else x


def as_sum(p: PendingNorm) -> torch.Tensor:
    """The residual stream x + residual of a PendingNorm (computing the norm if nothing has)."""
    if p.sum is None:
        p.value()
    return p.sum


# The sampler's top-k (k <= 64) by our two-launch kernel (csrc/token_pick.cu, topk_small) instead
# of torch.topk (~58 us for one 128k row on the H200); TRELLIS_TOPK=torch keeps torch's, for a
# same-run comparison.
TOPK_KERNEL = os.environ.get("TRELLIS_TOPK", "kernel").lower() != "torch"


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


_ACT_IDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_fast": 1, "gelu_tanh": 1, "gelu": 2}
GATED_ACTIVATIONS = tuple(_ACT_IDS)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up (SwiGLU / GeGLU glue)."""
    if act not in _ACT_IDS:
        raise ValueError(f"unsupported activation {act!r}")
    if GLUE_KERNELS and _use_cuda(gate, up) and gate.shape == up.shape:
        return extension().gated_act(gate, up, _ACT_IDS[act])
    a = _ACT_IDS[act]
    g = F.silu(gate) if a == 0 else F.gelu(gate, approximate="tanh" if a == 1 else "none")
    return g * up


# Decode chains (engine/ops/chain.py) and the prefill MLP's hand-off (dense_mlp.py), for the models.
defer_linear = _chain.defer_linear
gated_chain = _chain.gated_chain
attention_into_chain = _chain.attention_into_chain
dense_gated_mlp = _dense_mlp.dense_gated_mlp

__all__ = [
    "exl3_gemm", "exl3_linear", "exl3_gemm_group", "exl3_linear_group", "EXL3Group", "join_linears",
    "can_group", "defer_linear", "gated_chain", "attention_into_chain", "dense_gated_mlp", "Deferred",
    "exl3_reconstruct",
    "OpenSums", "open_linear", "open_linear_group", "workspaces", "PendingRope", "decode_attention",
    "hadamard128", "rms_norm", "add_rms_norm",
    "residual_add", "gated_act", "GATED_ACTIVATIONS", "rope_qk", "rope_qk_store", "capped_softmax_",
    "argmax", "topk", "sample_top", "sample_top_available", "kernels_available", "kernels_enabled",
    "kernel_status", "KernelStatus", "kernels_settled",
    "extension",
]
