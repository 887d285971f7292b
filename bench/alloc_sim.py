"""Does measured bit allocation beat the heuristic? A CPU simulation, without converting.

For each target bpw, the allocations (engine.quantize.allocation: `allocate_bits`, the
reference's heuristic with one K per group, and `allocate_measured` on sensitivities from
engine.quantize.sensitivity, one K per linear as the converter does; `--per-group` adds the
measured allocation with one K per group) are applied to the unquantized model as *simulated*
quantization: every linear gets the quantizer-shaped noise of
engine.quantize.sensitivity.quantization_noise at the codebook error D(K) of its K, all at once,
with the same noise seeds for every allocation. Then KL(clean ‖ noisy) per token is measured on
held-out text (Jane Austen, never used for calibration or for the sensitivities), and on the
sensitivity sample itself (`kld_on_sample`, where `predicted` = Σ s·D(K) should match if the
per-linear KLDs add up). JSON lines on stdout.

    python -m bench.alloc_sim --eval-text /tmp/austen.txt            # SmolLM2 from the starter GGUF

What it shows: whether the sensitivities carry over to a model where everything is perturbed at
once and to other text, and how much KLD the measured allocation saves at equal bits. What it
does not show: the real converter's absolute KLD (the shaped noise is 1.2-1.7x gentler than the
real trellis+LDLQ error per linear; at integer bpw the heuristic is uniform K, to compare with
real conversions at that K). On a CPU the defaults take about 15 minutes per bpw (1 thread).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from bench.convert_quality import eval_windows
from engine.formats.exl3 import pad_to_128
from engine.quantize.allocation import (CODEBOOK_MSE, QGroup, allocate_bits, allocate_measured, average_bits,
                                        measured_k_range, predicted_kld)
from engine.quantize.block_runner import ModelRunner
from engine.quantize.calibration import build_calibration, text_row_indices, text_rows
from engine.quantize.sensitivity import (SAMPLE, HessianStream, decoder_groups, measure_sensitivities, probe_mse,
                                         quantization_noise)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def qgroups(runner: ModelRunner, sgroups) -> list[QGroup]:
    """The converter's QGroups (padded numel, priorities) for the loaded model."""
    out = []
    for order, g in enumerate(sgroups):
        numel = sum(pad_to_128(runner.linear(g.layer, s.name).in_features) * pad_to_128(runner.linear(g.layer, s.name).out_features)
                    for s in g.slots)
        out.append(QGroup(g.name, g.layer, g.slots[0].priority, numel, order))
    return out


@torch.no_grad()
def eval_logprobs(model, windows: list[list[int]]) -> list[torch.Tensor]:
    vocab = model.config.vocab_size
    return [torch.log_softmax(model(torch.tensor([w], device=model.device))[0, :-1, :vocab].float(), dim=-1)
            for w in windows]


@torch.no_grad()
def kld(model, windows, ref: list[torch.Tensor]) -> float:
    total, n = 0.0, 0
    for w, r, logp in zip(windows, ref, eval_logprobs(model, windows)):
        total += float((r.exp() * (r - logp)).sum(dtype=torch.float64))
        n += r.shape[0]
    return total / n


@torch.no_grad()
def apply_noise(runner, sgroups, bits, hessians, seed, shaped) -> dict:
    """Perturb every linear at D(K), K from `bits` keyed by tensor or by group; returns the
    original weights for restore()."""
    saved = {}
    for g in sgroups:
        for s in g.slots:
            lin = runner.linear(g.layer, s.name)
            saved[(g.layer, s.name)] = lin.weight
            k = bits.get(f"{g.layer_key}.{s.name}", bits.get(g.name))
            noise = quantization_noise(lin.weight, hessians[g.layer].get(s.qmap), CODEBOOK_MSE[k],
                                       f"{g.layer_key}.{s.name}", s.qmap, seed, shaped)
            lin.weight = (lin.weight.float() + noise).to(lin.weight.dtype)
    return saved


def restore(runner, saved) -> None:
    for (layer, name), w in saved.items():
        runner.linear(layer, name).weight = w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/alloc/smol2"), help="unquantized HF folder")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF to import into --model if missing (default: the starter)")
    ap.add_argument("--eval-text", required=True, type=Path, help="held-out text (bench/eval_text.py makes Austen)")
    ap.add_argument("--bits", default="2.0,3.0,4.0,5.0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sens-rows", type=int, default=None, help="calibration rows for the sensitivities (default: as the converter)")
    ap.add_argument("--sens-tokens", type=int, default=None)
    ap.add_argument("--cal-rows", type=int, default=64, help="calibration rows for the Hessians (the converter: 250)")
    ap.add_argument("--cal-cols", type=int, default=512, help="tokens per calibration row (the converter: 2048)")
    ap.add_argument("--noise", default="shaped", choices=["shaped", "iid"], help="noise model for sensitivities and simulation")
    ap.add_argument("--seeds", default="0", help="noise seeds for the simulation, comma-separated")
    ap.add_argument("--holdout", action="store_true", help="leave the sample rows out of the Hessians")
    ap.add_argument("--per-group", action="store_true",
                    help="also try measured allocation with one K per group (q/k/v, o, gate/up, down) instead of per linear")
    ap.add_argument("--k-min", type=int, default=None,
                    help="lowest K of the measured allocation (default: the converter's, measured_k_range)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from engine.models import load_model
    from engine.tokenizer import Tokenizer
    device = torch.device(args.device)
    if not (args.model / "config.json").exists():
        from engine.gguf_import import import_gguf
        from engine.starter import starter_gguf
        import_gguf(args.gguf or starter_gguf(), args.model)
    tok = Tokenizer.from_dir(args.model)
    model = load_model(args.model, device=device, dtype=torch.float32)
    runner = ModelRunner(model)
    vocab = model.config.vocab_size
    rows, tokens = SAMPLE["cuda" if device.type == "cuda" else "cpu"]
    rows, tokens = args.sens_rows or rows, args.sens_tokens or tokens
    # the converter's calibration set (KJV prose, stdlib code, random ids); the sample is its text rows
    cal_ids = build_calibration(tok, vocab, args.cal_rows, args.cal_cols, 0)
    cal = text_rows(cal_ids, rows, tokens).to(device)
    # the quality bench's windows: the first N full windows of the text
    windows = eval_windows(tok, args.eval_text.read_text(encoding="utf-8"), args.windows, args.seqlen)
    ref = [r.to(device) for r in eval_logprobs(model, windows)]
    cal_windows = cal.tolist()  # the sensitivity sample: predicted vs simulated there checks additivity
    cal_ref = eval_logprobs(model, cal_windows)
    layer_keys = [f"model.layers.{i}" for i in range(runner.num_layers)]
    sgroups = decoder_groups(layer_keys)               # the heuristic's groups (q/k/v, o, gate/up, down)
    group_units = qgroups(runner, sgroups)
    tgroups = decoder_groups(layer_keys, per_tensor=True)  # one per linear, as the converter measures
    linear_units = qgroups(runner, tgroups)
    shaped = args.noise == "shaped"
    t0 = time.time()
    chunk = max(1, (16384 if device.type == "cuda" else 4096) // args.cal_cols)
    if args.holdout:
        keep = sorted(set(range(cal_ids.shape[0])) - set(text_row_indices(cal_ids.shape[0], rows)))
        cal_ids = cal_ids[keep]
    stream = HessianStream(runner, cal_ids, [slice(a, a + chunk) for a in range(0, cal_ids.shape[0], chunk)], device)
    hessians = {i: stream(i) for i in range(runner.num_layers)}
    del stream
    hess_s = round(time.time() - t0, 1)
    emit({"event": "setup", "model": str(args.model), "layers": runner.num_layers, "groups": len(group_units), "linears": len(linear_units),
          "sens_sample": [rows, tokens], "hessians": [args.cal_rows, args.cal_cols, hess_s], "eval": [len(windows), args.seqlen], "noise": args.noise,
          "threads": args.threads, "device": str(device)})
    seeds = [int(s) for s in args.seeds.split(",")]
    # (sensitivity groups, allocation units): "measured" is what the converter does, one K per linear
    variants = {"measured": (tgroups, linear_units)}
    if args.per_group:
        variants["measured_per_group"] = (sgroups, group_units)
    for bpw in [float(b) for b in args.bits.split(",")]:
        allocs = {"heuristic": (allocate_bits(group_units, bpw, runner.num_layers), group_units, None)}
        for name, (sg, un) in variants.items():
            t0 = time.time()
            sens = measure_sensitivities(runner, cal, sg, probe_mse(bpw), 0, shaped, hessians.__getitem__)
            top = sorted(sens.items(), key=lambda kv: -kv[1])
            emit({"event": "sensitivity", "variant": name, "bits": bpw, "probe_mse": probe_mse(bpw),
                  "seconds": round(time.time() - t0, 1), "top": [[k, round(v, 3)] for k, v in top[:6]],
                  "bottom": [[k, round(v, 4)] for k, v in top[-4:]], "sensitivity": {k: round(v, 5) for k, v in sens.items()}})
            k_min, k_max = measured_k_range(bpw)
            allocs[name] = (allocate_measured(un, sens, bpw, k_min if args.k_min is None else args.k_min, k_max), un, sens)
        row = {"event": "result", "bits": bpw}
        for name, (bits, un, sens) in allocs.items():
            klds, sample_klds = [], []
            for seed in seeds:
                saved = apply_noise(runner, sgroups, bits, hessians, 1000 + seed, shaped)
                try:
                    klds.append(kld(model, windows, ref))
                    sample_klds.append(kld(model, cal_windows, cal_ref))
                finally:
                    restore(runner, saved)
            row[name] = {"kld": round(sum(klds) / len(klds), 5), "kld_per_seed": [round(k, 5) for k in klds],
                         "kld_on_sample": round(sum(sample_klds) / len(sample_klds), 5),
                         "avg_bits": round(average_bits(un, bits), 4), "K_hist": dict(sorted(Counter(bits.values()).items()))}
            if sens is not None:
                row[name]["predicted"] = round(predicted_kld(un, sens, bits), 5)
        for name in variants:
            row[f"{name}_vs_heuristic"] = round(row[name]["kld"] / row["heuristic"]["kld"], 4)
        emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
