"""Batch-1 decode speed on a synthetic EXL3 model (anchors.md §2), torch path and CUDA path.

    python -m bench.decode --shape llama3-8b --bits 4 --model-dir /tmp/l8b

Loop as the reference measured it: one token per forward, argmax, host sync each token. Paths:
  torch       load_model as is (its QuantLinear keeps a reconstructed dense fp16 weight)
  cuda        EXL3 linears routed through the kernels (engine.ops), eager PyTorch around them
  cuda-graph  the same, each decode step a CUDA-graph replay of the model's own forward over a
              static cache (engine.generate.graph_decode, what generate() uses on CUDA), so no
              host work is left per token but the sync that reads the token
  cuda-graph-noglue  the same with norms, residual adds, RoPE and the gated activation as the
              PyTorch ops the glue kernels replace (the previous version, for a same-run ratio)
  cuda-graph-nopdl   cuda-graph without programmatic dependent launch of the products
  cuda-graph-nogroup cuda-graph with one product per linear (q/k/v and gate/up not grouped)
  cuda-graph-int8    cuda-graph with the MUL1 integer path up to 4 rows (TRELLIS_INT8=auto)
  cuda-graph-fp16    cuda-graph with the fp16 path only (TRELLIS_INT8=0)
  cuda-graph-sdpa    cuda-graph with SDPA for decode attention instead of our kernel
  cuda-graph-noattnrope  cuda-graph with the RoPE kernel before decode attention (TRELLIS_ATTN_ROPE=0)
  cuda-graph-noprep  timing probe, wrong tokens: cuda-graph with the activation preps not launched,
              what the preps cost a step as it runs (the bound on fusing them away)
  cuda-graph-sepprep / cuda-graph-selfprep  cuda-graph with a prep kernel before every product /
              with the decode products prepping their own input (TRELLIS_SELF_PREP picks the
              default); both without decode chains, as is -noprep
  cuda-graph-fourrows<N>  cuda-graph with four k rows per unit in products of at least N k-row
              quads per resident warp (TRELLIS_GV_FOUR_ROW_UNITS picks the default)
  cuda-graph-leanN  cuda-graph with products that would take one k row per unit taking the
              compact ring below N units per resident warp (TRELLIS_GV_LEAN_UNITS picks the
              default; lean0: never)
  cuda-graph-leangroupsN  cuda-graph with that rule for products of up to N groups of rows
              (TRELLIS_GV_LEAN_GROUPS picks the default, 1)
  cuda-graph-splitN  cuda-graph with split-finish setting N (which products' output stage is a
              kernel of its own; TRELLIS_GV_SPLIT_FINISH picks the default, 5, where that kernel
              writes the decode chains; cuda-graph-split4+chainattn: the defaults before session 30)
  cuda-graph-chainrowsN  cuda-graph with decode steps of up to N rows (2..4: --batch) chaining
              through the finish kernel (TRELLIS_CHAIN_ROWS picks the default, 4)
  cuda-graph-earlyreads / -noearlyreads  cuda-graph with the chain finish kernel reading the input's
              row sums and the residual before / after its PDL wait (TRELLIS_FINISH_EARLY_READS
              picks the default, before)
  cuda-graph-torchargmax  cuda-graph with each token picked by torch.argmax (two launches) instead
              of ops.argmax (one kernel), as before session 13
  cuda-graph-sample / -sampleold  cuda-graph with each token drawn with the app's balanced preset
              by sample_next / by the sampler before session 12 (batch 1)
  cuda-graph-pipelined  cuda-graph with each step queued with the device's token before the host
              reads it (engine.generate.loop's pipelined loop: sampling.pick_next, PendingToken;
              batch 1); cuda-graph-sample+pipelined draws with the balanced preset
  cuda-graph-X+Y+...  the settings of cuda-graph-X, -Y, ... together (e.g.
              cuda-graph-nochain+noattnrope+fourrows0: the defaults before session 12)
  cuda-graph-launchonly / -notail / -nofinish  timing probes, wrong tokens: the K = 4 products
              launched but returning at once / without their split-k tail (no atomics, count or
              output stage) / without count and output stage (csrc/exl3_gemv.cuh, VAR 4-6)
  cuda-graph-torchtopk  the sampler's top-k by torch.topk instead of ops.topk's kernel (with
              cuda-graph-sample: cuda-graph-sample+torchtopk)
  cuda-graph-attnmerge2  decode attention merging its splits' partials in two passes (the max,
              then the sums), as before session 15
  cuda-graph-attnmmaN  decode attention walking its keys on the tensor cores from spans of N slots
              (shipped: 1, every span; attnmma0: never, the scalar walk of before session 19)
  cuda-graph-attnmmaonesplitN  the tensor-core walk taking one split for spans of at most N slots
              (shipped: 256; attnmmaonesplit0: a split per 16 keys of each warp from the start)
  cuda-graph-attnoneloadN  decode attention giving each warp one load of 16 keys while that takes
              at most N splits (shipped: 10; attnoneload0: about 32 keys per warp always, as
              before session 16)
  cuda-graph-alu  right tokens: the K = 4 integer products with their state extraction all on
              the ALU pipe, as before session 15 (VAR 7; shipped: one window on the FMA pipe)
  cuda-graph-a12  right tokens: every K = 4 product decoding with the lane's previous word masked
              once, the integer path's words by shared loads (VAR 8)
  cuda-graph-s31dec  right tokens: the integer products with session 31's decode (two masks, the
              words by shared loads; VAR 22; shipped since session 32: A12 and ldmatrix)
  cuda-graph-c0tail  right tokens: MUL1's constant term added by the integer products' k-row-0
              warps, which gather the input's chunk sums at their flush, as before session 36
              (VAR 41; shipped: the finish kernel gathers them before its PDL wait)
  cuda-graph-noopen / -open / -opengated / -opennormed  cuda-graph with open sums
              (engine/ops/open_sums.py) for no reader / every reader / the down projection's
              prep only / the norms' preps only (TRELLIS_OPEN_SUMS picks the default, none)
  cuda-graph-chain / cuda-graph-nochain  cuda-graph with / without decode chains
              (engine/ops/chain.py: each product's output stage writes the next one's input, no
              prep kernels between them; TRELLIS_CHAIN picks the default); -chainattn /
              -chaingated / -chainnormed: one link only
--breakdown adds, per graph path and context, kernels per token and their summed time against the wall time.
--batch N decodes N sequences together (tokens_per_s counts all of them).
Prints one JSON line per (path, batch, context).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time
from pathlib import Path

import torch


# Open-sums paths: their TRELLIS_OPEN_SUMS setting.
OPEN_PATHS = {"cuda-graph-noopen": "0", "cuda-graph-open": "1", "cuda-graph-opengated": "gated",
              "cuda-graph-opennormed": "normed"}

# Decode-chain paths: their TRELLIS_CHAIN setting. The prep probes run without chains.
CHAIN_PATHS = {"cuda-graph-nochain": "0", "cuda-graph-chain": "1", "cuda-graph-chainattn": "attn",
               "cuda-graph-chaingated": "gated", "cuda-graph-chainnormed": "normed", "cuda-graph-noprep": "0",
               "cuda-graph-sepprep": "0", "cuda-graph-selfprep": "0", **{p: "0" for p in OPEN_PATHS}}

# Timing probes of the products' fixed cost (csrc/exl3_gemv.cuh, VAR 4-6; wrong tokens).
PROBE_VARIANTS = {"cuda-graph-launchonly": 4, "cuda-graph-notail": 5, "cuda-graph-nofinish": 6,
                  # right results: the K = 4 integer path's decode extraction all on the ALU pipe;
                  # the previous word masked once with shared loads (A12); session 31's decode
                  "cuda-graph-alu": 7, "cuda-graph-a12": 8, "cuda-graph-s31dec": 22,
                  # right tokens: MUL1's constant term on the integer products' tails (VAR 41)
                  "cuda-graph-c0tail": 41}


def ensure_model(model_dir: Path, shape: str, bits: float, codebook: str) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from bench.synth import SHAPES, write_synth_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    write_synth_model(model_dir, SHAPES[shape], bits, codebook=codebook, device=dev)
    print(json.dumps({"bench": "synth", "dir": str(model_dir), "seconds": round(time.time() - t0, 1)}), flush=True)
    return model_dir


def model_label(model_dir: Path, shape: str) -> str:
    """The shape a benchmark row names: the one bench.synth wrote the folder for (an existing
    --model-dir need not be --shape's, which is only what a missing folder is made as)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return shape
    return str(config.get("trellis_synth_shape") or config.get("model_type") or shape)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic model's options, as bench.decode, bench.prefill and bench.generate take them
    (model_dir_of makes the model the first time)."""
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--model-dir", default="/tmp/trellis-synth-llama3-8b")


def model_dir_of(args: argparse.Namespace) -> Path:
    """The model folder (made first if missing); args.shape becomes the shape it holds, so rows
    label the model they timed."""
    model_dir = ensure_model(Path(args.model_dir), args.shape, args.bits, args.codebook)
    args.shape = model_label(model_dir, args.shape)
    return model_dir


def load(model_dir: Path, path: str):
    from engine.models import load_model
    from engine.ops.model_patch import route_quant_linears

    t0 = time.time()
    if path == "torch":  # the baseline: QuantLinear keeps a reconstructed dense weight
        os.environ["TRELLIS_KERNELS"] = "torch"
    try:
        model = load_model(model_dir, device="cuda")
    finally:
        os.environ.pop("TRELLIS_KERNELS", None)
    if path != "torch":
        route_quant_linears(model)
    torch.cuda.synchronize()
    return model, time.time() - t0


def load_kind(loaded: dict, model_dir: Path, path: str):
    """(model, load seconds) for a benchmark path: one model per kind (torch: dense weights; any
    other path: the kernels'), kept in `loaded` so that paths of one kind time the same weights
    and only a change of kind loads again (the previous model freed first)."""
    kind = "torch" if path == "torch" else "cuda"
    if kind not in loaded:
        loaded.clear()
        torch.cuda.empty_cache()
        loaded[kind] = load(model_dir, kind)
    return loaded[kind]


def bandwidth_floor(model_dir: Path) -> dict:
    """The fastest batch-1 decode this GPU allows, measured in this run rather than taken from a
    datasheet: every weight file's bytes but the embedding table (a token reads one row of it),
    at the speed of a large device-to-device copy (read and write bytes both counted, as DRAM
    moves them)."""
    from bench.linear import time_calls
    from engine.inspect import read_safetensors_header
    from engine.io.safetensors_header import weight_files

    files = weight_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    embed = sum(t.nbytes for f in files for t in read_safetensors_header(f) if t.name == "model.embed_tokens.weight")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / (time_calls(lambda i: dst.copy_(src), 20, 3) / 1e6)
    read = total - embed
    return {"bytes_per_token_GB": round(read / 1e9, 3), "copy_TBps": round(copy_bps / 1e12, 3),
            "floor_tokens_per_s": round(copy_bps / read, 1)}


def decode_eager(model, context: int, tokens: int, batch: int = 1) -> float:
    """Tokens/s of the model's own forward with its KV cache (one token per sequence per forward)."""
    cache = model.new_cache(batch, context + tokens + 8)
    return _timed_decode(lambda ids: model(ids, cache), cache, context, tokens, batch)


def decode_graph(model, context: int, tokens: int, batch: int = 1) -> float:
    """Tokens/s of the engine's CUDA-graph decode (engine.generate.graph_decode), as generate() runs it."""
    from engine.generate.graph_decode import GraphDecoder

    decoder = GraphDecoder(model)  # directly, whatever TRELLIS_CUDA_GRAPHS says
    cache = decoder.new_cache(batch, context + tokens + 8)
    tps = _timed_decode(decoder.step, cache, context, tokens, batch)
    if decoder.disabled:  # it fell back to eager steps: that is not this path's number
        raise RuntimeError(f"capture failed: {decoder.disabled}")
    return tps


# How a step's token is picked: ops.argmax (one kernel on CUDA, what greedy generation runs), or
# torch.argmax for path cuda-graph-torchargmax (what every path used before session 13).
# Paths cuda-graph-sample / -sampleold: the token drawn as generate() draws it with the app's
# balanced preset (bench.sampling), by sample_next / by the sampler before session 12.
PICK = {"torch_argmax": False, "sampler": None, "pipelined": False}


def pick_tokens(logits: torch.Tensor) -> torch.Tensor:
    """ids [B, 1]: the pick from the last position of logits [B, T, vocab]."""
    from engine import ops

    last = logits[:, -1]
    if PICK["sampler"] is not None:  # batch 1, as the generation loop: one id to the host and back
        draw, settings, gen = PICK["sampler"]
        return torch.tensor([[draw(last[0], settings, gen)]], dtype=torch.long, device=last.device)
    return torch.argmax(last, -1, keepdim=True) if PICK["torch_argmax"] else ops.argmax(last)[:, None]


def _timed_decode(step, cache, context: int, tokens: int, batch: int = 1) -> float:
    """Tokens/s over all `batch` sequences (each step adds one token to each)."""
    if context:
        cache.advance(context)  # the cache content does not change the work done
    if PICK["pipelined"]:
        return _timed_pipelined(step, cache, context, tokens, batch)
    ids = torch.ones(batch, 1, dtype=torch.long, device=cache.device)
    with torch.inference_mode():
        for _ in range(3):
            ids = pick_tokens(step(ids))
            int(ids[0, 0])
        cache.truncate(context)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            ids = pick_tokens(step(ids))
            int(ids[0, 0])  # host sync per step, like the reference's loop
        dt = time.perf_counter() - t0
    return batch * tokens / dt


def _timed_pipelined(step, cache, context: int, tokens: int, batch: int) -> float:
    """_timed_decode as the generation loop pipelines it: step t+1 is queued with the device's
    token t before the host reads token t (what engine.generate.loop runs with graphs)."""
    from engine.generate.sampling import SamplerSettings, pick_next

    if batch != 1:
        raise ValueError("the pipelined loop decodes one sequence")
    settings, gen = PICK["sampler"][1:] if PICK["sampler"] is not None else (SamplerSettings(), None)

    def run(n: int) -> None:  # n steps
        pending = pick_next(step(torch.ones(1, 1, dtype=torch.long, device=cache.device))[0, -1], settings, gen)
        for _ in range(n - 1):
            logits = step(pending.ids)
            token = pending.result()
            if pending.redrawn:  # as the loop does: the queued step is taken back and rerun
                cache.truncate(cache.length - 1)
                logits = step(torch.tensor([[token]], dtype=torch.long, device=cache.device))
            pending = pick_next(logits[0, -1], settings, gen)
        pending.result()

    with torch.inference_mode():
        run(3)
        cache.truncate(context)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(tokens)
        dt = time.perf_counter() - t0
    return tokens / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="decode tokens/s on a synthetic EXL3 model (batch 1 unless --batch)")
    add_model_args(ap)
    ap.add_argument("--paths", nargs="+", default=["torch", "cuda", "cuda-graph"],
                    help="torch (dense fp16), cuda (eager kernels), cuda-graph, cuda-graph-noglue (norms, RoPE and "
                         "activations as PyTorch ops: the previous version, for a same-run ratio), cuda-graph-nopdl, "
                         "cuda-graph-nogroup (one product per linear), cuda-graph-int8 / cuda-graph-fp16 (the MUL1 "
                         "integer path up to 4 rows on / off), cuda-graph-sdpa (SDPA for decode attention), cuda-graph-noattnrope "
                         "(a RoPE kernel before decode attention), cuda-graph-attnnorms / -noattnnorms (Qwen3's q/k norms "
                         "in decode attention / as kernels of their own, with the RoPE), cuda-graph-attnmmad256 / "
                         "-noattnmmad256 (head dim 256 on the tensor-core / scalar walk), cuda-graph-attnchaind256 / "
                         "-noattnchaind256 (at head dim 256 the attention kernel writes o_proj's input / o_proj "
                         "preps its own), cuda-graph-doublenorm / "
                         "-nodoublenorm (Gemma's post-norms in the next product's prep / as kernels of their own), "
                         "cuda-graph-attnwindow / -noattnwindow (sliding-window layers walk their window's slots / "
                         "the whole span), "
                         "cuda-graph-noprep (timing probe: activation preps not launched), cuda-graph-sepprep / -selfprep (a prep "
                         "kernel before every product / decode products prep their own input), cuda-graph-chainattn / "
                         "-chaingated / -chainnormed (one decode-chain link), cuda-graph-chain / "
                         "-nochain (decode chains on / off: products writing the next one's input, or a prep kernel "
                         "before every product), cuda-graph-noopen / -open / -opengated / -opennormed (open sums), "
                         "cuda-graph-fourrows<N> (four k rows per unit from N quads per warp), cuda-graph-split<N> (split-finish "
                         "setting N), cuda-graph-chainrows<N> (decode steps of up to N rows chaining), "
                         "cuda-graph-earlyreads / -noearlyreads (the chain finish kernel's reads before / "
                         "after its PDL wait), cuda-graph-lean<N> (the compact ring "
                         "below N units per warp), cuda-graph-torchargmax (tokens "
                         "picked by torch.argmax), cuda-graph-sample / -sampleold (tokens drawn with the balanced preset), "
                         "cuda-graph-pipelined (each step queued before the host reads the token before it), "
                         "cuda-graph-X+Y (both settings), "
                         "cuda-graph-launchonly / -notail / -nofinish (timing probes of the products' fixed cost)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 4096])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", nargs="+", type=int, default=[1],
                    help="sequences decoded together (tokens_per_s counts all of them)")
    ap.add_argument("--profile", action="store_true", help="print the top CPU ops of 3 eager tokens per path")
    ap.add_argument("--breakdown", action="store_true",
                    help="cuda-graph path: GPU kernels per token, their summed time against the wall time, top kernels")
    ap.add_argument("--floor", action="store_true",
                    help="also print the batch-1 bandwidth floor measured in this run: the bytes a token reads "
                         "over a device copy's speed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "decode", "error": "no CUDA device"}))
        return 1
    from engine import ops
    from engine.ops import chain, open_sums

    model_dir = model_dir_of(args)
    if args.floor:
        print(json.dumps({"bench": "decode_floor", "shape": args.shape, "bits": args.bits,
                          **bandwidth_floor(model_dir)}), flush=True)
    loaded = {}
    int8_default, attn_default, attn_rope_default = ops.INT8_MAX_ROWS, ops.ATTN_KERNEL, ops.ATTN_ROPE
    attn_norms_default, double_norm_default, window_default = ops.ATTN_HEAD_NORMS, ops.PREP_DOUBLE_NORM, ops.ATTN_WINDOW
    chain_d256_default = ops.ATTN_CHAIN_D256
    topk_default, merge_default = ops.TOPK_KERNEL, ops.ATTN_MERGE_ONLINE
    self_prep_default, chain_default, open_default = ops.SELF_PREP, ops.CHAIN, ops.OPEN_SUMS
    chain_rows_default = ops.CHAIN_ROWS
    for path in args.paths:
        model, load_s = load_kind(loaded, model_dir, path)
        graph = path.startswith("cuda-graph")
        # "cuda-graph-a+b+c": the settings of cuda-graph-a, -b and -c together
        names = {path.split("+")[0]} | {"cuda-graph-" + m for m in path.split("+")[1:]}

        def pick(table: dict, default):
            return next((v for k, v in table.items() if k in names), default)

        def pick_number(stem: str, default: int) -> int:  # N of a path "cuda-graph-<stem>N"
            found = [int(m.group(1)) for m in (re.fullmatch(rf"cuda-graph-{stem}(\d+)", n) for n in names) if m]
            return found[0] if found else default

        ops.GLUE_KERNELS = "cuda-graph-noglue" not in names
        PICK["torch_argmax"] = "cuda-graph-torchargmax" in names
        PICK["sampler"] = None
        PICK["pipelined"] = "cuda-graph-pipelined" in names
        if names & {"cuda-graph-sample", "cuda-graph-sampleold"}:
            from bench.sampling import PRESETS, previous_sample_next
            from engine.generate.sampling import sample_next

            settings = PRESETS["balanced"]
            PICK["sampler"] = (previous_sample_next if "cuda-graph-sampleold" in names else sample_next,
                               settings, settings.make_generator())
        ops.TOPK_KERNEL = topk_default and "cuda-graph-torchtopk" not in names
        ops.INT8_MAX_ROWS = pick({"cuda-graph-int8": 4, "cuda-graph-fp16": 0}, int8_default)
        ops.ATTN_KERNEL = attn_default and "cuda-graph-sdpa" not in names
        ops.ATTN_ROPE = attn_rope_default and "cuda-graph-noattnrope" not in names
        ops.ATTN_HEAD_NORMS = pick({"cuda-graph-attnnorms": True, "cuda-graph-noattnnorms": False}, attn_norms_default)
        ops.PREP_DOUBLE_NORM = pick({"cuda-graph-doublenorm": True, "cuda-graph-nodoublenorm": False},
                                    double_norm_default)
        ops.ATTN_WINDOW = pick({"cuda-graph-attnwindow": True, "cuda-graph-noattnwindow": False}, window_default)
        ops.ATTN_CHAIN_D256 = pick({"cuda-graph-attnchaind256": True, "cuda-graph-noattnchaind256": False},
                                   chain_d256_default)
        ops.OPEN_SUMS = open_sums.parse_setting(pick(OPEN_PATHS, "")) if names & OPEN_PATHS.keys() else open_default
        ops.CHAIN = chain.parse_setting(pick(CHAIN_PATHS, "")) if names & CHAIN_PATHS.keys() else chain_default
        ops.CHAIN_ROWS = pick_number("chainrows", chain_rows_default)
        if path != "torch":
            from engine.models.layers import fuse_projections, split_projections

            if "cuda-graph-nogroup" in names:
                split_projections(model)
            else:
                fuse_projections(model)
            ops.extension().set_pdl("cuda-graph-nopdl" not in names)
            ops.extension().set_prep_skip("cuda-graph-noprep" in names)
            ops.extension().set_mm_debug_variant(pick(PROBE_VARIANTS, ops._DEFAULT_VARIANT))
            ops.extension().set_gemv_four_row_units(pick_number("fourrows", ops.FOUR_ROW_UNITS))
            ops.extension().set_gemv_lean_units(pick_number("lean", ops.GV_LEAN_UNITS))
            ops.extension().set_gemv_lean_groups(pick_number("leangroups", ops.GV_LEAN_GROUPS))
            ops.extension().set_gemv_split_finish(pick_number("split", ops.GV_SPLIT_FINISH))
            ops.extension().set_finish_early_reads(
                pick({"cuda-graph-earlyreads": True, "cuda-graph-noearlyreads": False}, ops.FINISH_EARLY_READS))
            ops.extension().set_self_prep(
                pick({"cuda-graph-sepprep": False, "cuda-graph-noprep": False, "cuda-graph-selfprep": True}, self_prep_default))
            ops.extension().set_attn_merge_online(merge_default and "cuda-graph-attnmerge2" not in names)
            ops.extension().set_attn_mma_slots(pick_number("attnmma", ops.ATTN_MMA_SLOTS))
            ops.extension().set_attn_mma_d256(
                pick({"cuda-graph-attnmmad256": True, "cuda-graph-noattnmmad256": False}, ops.ATTN_MMA_D256))
            ops.extension().set_attn_mma_one_split(pick_number("attnmmaonesplit", ops.ATTN_MMA_ONE_SPLIT))
            ops.extension().set_attn_one_load_splits(pick_number("attnoneload", ops.ATTN_ONE_LOAD_SPLITS))
        for batch, ctx in itertools.product(args.batch, args.contexts):
            try:
                run = decode_graph if graph else decode_eager
                tps = run(model, ctx, args.tokens, batch)
                row = {"bench": "decode", "shape": args.shape, "bits": args.bits, "path": path, "context": ctx,
                       "tokens_per_s": round(tps, 1), "load_s": round(load_s, 1),
                       "gpu_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
                if batch != 1:
                    row["batch"] = batch
            except Exception as e:  # report and go on: one failing path must not hide the others
                row = {"bench": "decode", "path": path, "context": ctx, "batch": batch,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
        if args.profile and not graph:
            profile_eager(model, path)
        if args.breakdown and graph:
            for ctx in args.contexts:
                print(json.dumps({"path": path, **graph_breakdown(model, ctx)}), flush=True)
    return 0


def graph_breakdown(model, context: int = 0, tokens: int = 8) -> dict:
    """Where a graph-replayed token's GPU time goes, with `context` tokens already cached: how
    many kernels it runs, their summed duration against the wall time per token (the difference
    is launch gaps and ramps between kernels, which a graph does not remove), and the kernels
    that take the most time. Per context, because attention's share grows with the cache."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from engine.generate.graph_decode import GraphDecoder

    decoder = GraphDecoder(model)
    cache = decoder.new_cache(1, context + 64 + tokens)  # the decoder keeps it: step() appends to it
    if context:
        cache.advance(context)  # the cache content does not change the work done
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        for _ in range(3):
            ids = pick_tokens(decoder.step(ids))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(tokens):
                ids = pick_tokens(decoder.step(ids))
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total = {}
    for e in kernels:
        name = e.name[:60]
        us, n = total.get(name, (0.0, 0))
        total[name] = (us + e.time_range.elapsed_us(), n + 1)
    busy = sum(us for us, _ in total.values())
    if os.environ.get("TRELLIS_TIMELINE"):  # one token's kernels in order, for gap analysis
        last = sorted(kernels, key=lambda e: e.time_range.start)[-(len(kernels) // tokens):]
        t0 = last[0].time_range.start
        with open(os.environ["TRELLIS_TIMELINE"], "w") as f:
            json.dump([[e.name[:80], round(e.time_range.start - t0, 2), round(e.time_range.elapsed_us(), 2)] for e in last], f)
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:12]
    return {"bench": "decode_breakdown", "context": context, "tokens": tokens, "kernels_per_token": round(len(kernels) / tokens, 1),
            "kernel_us_per_token": round(busy / tokens, 1), "wall_us_per_token": round(wall * 1e6 / tokens, 1),
            "top": [{"kernel": k, "us_per_token": round(us / tokens, 1), "per_token": round(n / tokens, 1)}
                    for k, (us, n) in top],
            "by_site": sites_of_layer(kernels, len(model.layers), tokens),
            "critical_path": layer_critical_path(
                [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in kernels], tokens)}


def sites_of_layer(kernels, layers: int, tokens: int) -> dict:
    """Mean duration (us) of the preps and the products by their place in a decoder layer. Each
    layer runs them in the same order (q/k/v, o, gate/up, down), so the i-th call of a token sits
    at site i % (calls per layer); calls past layers * that (the head's) are left out."""
    out = {}
    for key, label in (("prep_frag", "prep"), ("exl3_gemv", "product")):
        calls = sorted((e for e in kernels if key in e.name), key=lambda e: e.time_range.start)
        per_token = len(calls) // tokens
        per_layer = per_token // layers if layers else 0
        if not per_layer:
            continue
        sums = [0.0] * per_layer
        counts = [0] * per_layer
        for i, e in enumerate(calls):
            j = i % per_token
            if j < per_layer * layers:
                sums[j % per_layer] += e.time_range.elapsed_us()
                counts[j % per_layer] += 1
        out[label] = [round(s / max(1, n), 2) for s, n in zip(sums, counts)]
    return out


def layer_critical_path(kernels: list[tuple[str, float, float]], tokens: int, anchor: str = "attention") -> dict:
    """Where a decode layer's time goes on the critical path: each kernel's end minus the latest end
    before it (under PDL a kernel starts before its predecessor ends, so its own duration
    overstates what it adds), averaged over the last token's full layers by the kernel's place in
    the layer, which starts at its attention kernel (all layers but the last, whose window would
    run into the head). kernels: (name, start, duration) in us, every token's. Why: sessions 31
    and 32 read this off a timeline file by hand."""
    per_token = len(kernels) // tokens if tokens else 0
    last = sorted(kernels, key=lambda k: k[1])[-per_token:] if per_token else []
    starts = [i for i, k in enumerate(last) if anchor in k[0]]
    if len(starts) < 2:
        return {}
    period = starts[1] - starts[0]
    if any(b - a != period for a, b in zip(starts, starts[1:])):
        return {"error": "layers of different kernel counts"}
    full = starts[:-1]  # the last layer's window would run into the head
    ends, latest = [], float("-inf")
    for _, start, dur in last:
        latest = max(latest, start + dur)
        ends.append(latest)
    sites = []
    for j in range(period):
        shares = [ends[a + j] - ends[a + j - 1] for a in full if a + j >= 1]
        durs = [last[a + j][2] for a in full]
        sites.append({"kernel": last[starts[0] + j][0][:60], "critical_us": round(sum(shares) / max(1, len(shares)), 2),
                      "us": round(sum(durs) / max(1, len(durs)), 2)})
    layer = sum(site["critical_us"] for site in sites)
    return {"layers": len(full), "layer_us": round(layer, 1), "sites": sites}


def profile_eager(model, path: str) -> None:
    """Where an eager decode token's host time goes (top ops by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(1, 64)
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(ids, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ids = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
                int(ids)
    print(f"profile {path}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    raise SystemExit(main())
