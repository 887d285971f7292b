"""`trellis plan`: print the VRAM plan for a local model folder or a Hugging Face repo id.

Torch-free. GPU memory comes from --gpu-mem, else from `nvidia-smi` when present (free memory of
each GPU), else the plan is printed without a verdict."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from engine.errors import ConfigError, TrellisError
from engine import plan as planner


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="will a model fit in GPU memory at a given context?")
    p.add_argument("-m", "--model", required=True, help="model folder or Hugging Face repo id")
    p.add_argument("--context", type=int, required=True, help="context length in tokens")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--cache-bits", default=None, help="KV cache bits K,V (2..8 each); default fp16")
    p.add_argument("--gpu-mem", default=None,
                   help="free GPU memory in GiB; several GPUs as a comma list (default: ask nvidia-smi)")
    p.add_argument("--revision", default=None, help="hub revision (branch) for a repo id")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def gpu_free_bytes_from_smi() -> list[int]:
    """Free memory per GPU from nvidia-smi, [] when there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [int(float(x)) * planner.MiB for x in out.split() if x.strip()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def parse_gpu_mem(text: str | None) -> list[int]:
    if text is None:
        return gpu_free_bytes_from_smi()
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--gpu-mem must be GiB numbers such as 24 or 24,24, not {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--gpu-mem must be positive, not {text!r}")
    return [int(v * planner.GiB) for v in values]


def spec_from_hub(repo_id: str, revision: str | None = None) -> planner.ModelSpec:
    """config.json from the hub; weight bytes from the repo's file sizes when the hub lists them."""
    import os
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    try:
        from huggingface_hub import HfApi, hf_hub_download
        cfg_path = hf_hub_download(repo_id, "config.json", revision=revision, endpoint=endpoint)
        cfg = json.loads(Path(cfg_path).read_text())
    except Exception as e:  # network, missing repo, bad JSON: all one line for the user
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"cannot read config.json of {repo_id!r} from the hub: {reason}") from None
    spec = planner.spec_from_config(cfg, name=repo_id)
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True)
        sizes = [s.size for s in (info.siblings or []) if s.rfilename.endswith(".safetensors") and s.size]
        if sizes:
            spec.weight_bytes = int(sum(sizes))
            spec.weights_exact = True
    except Exception:
        pass   # the estimate from config.json stands
    return spec


def load_spec(model: str, revision: str | None = None) -> planner.ModelSpec:
    path = Path(model).expanduser()
    if path.exists():
        return planner.spec_from_dir(path)
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return spec_from_hub(model, revision)
    raise ConfigError(f"{model} is neither a model folder nor a Hugging Face repo id (owner/name)")


def format_text(p: planner.Plan) -> str:
    big = p.total >= planner.GiB
    g = lambda b: f"{b / planner.GiB:8.2f} GiB" if big else f"{b / planner.MiB:8.1f} MiB"
    lines = [f"{p.model}: context {p.context:,} x {p.batch}, KV cache {p.cache_bits}",
             f"  weights     {g(p.weights)}{'' if p.weights_exact else '  (estimated from config)'}",
             f"  KV cache    {g(p.kv_cache)}",
             f"  activations {g(p.activations)}",
             f"  overhead    {g(p.overhead)}",
             f"  total       {g(p.total)}"]
    if p.capacity is not None:
        lines.append(f"  capacity    {g(p.capacity)}  -> {'fits' if p.fits else 'does NOT fit'}")
        lines.append(f"  largest context that fits: {p.largest_context:,} (model max {p.model_max_context:,})")
    lines.append(p.advice)
    return "\n".join(lines)


def run(args) -> int:
    try:
        k_bits, v_bits = planner.parse_cache_bits(args.cache_bits)
        gpus = parse_gpu_mem(args.gpu_mem)
        spec = load_spec(args.model, args.revision)
        result = planner.plan(spec, planner.PlanRequest(context=args.context, batch=args.batch,
                                                        k_bits=k_bits, v_bits=v_bits, gpu_bytes=gpus))
    except TrellisError as e:
        print(f"trellis plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_text(result))
    return 0


def main(argv=None) -> int:
    """Run `plan` alone (handy before engine/cli.py lists this module)."""
    import argparse
    parser = argparse.ArgumentParser(prog="trellis")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
