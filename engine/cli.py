"""`trellis` command line: generate, logits, ppl, inspect, import-gguf, plus the subcommands other
parts register (convert, serve, plan, bench).

The CLI is a product surface that scripts and benchmarks depend on (contracts in
docs/architecture). Two promises hold for every subcommand:
- bad input gives exactly one line `trellis: error: <reason>` on stderr and a non-zero exit
  (1 for errors, 2 for usage), never a traceback (set TRELLIS_DEBUG=1 to see one);
- torch is imported only by subcommands that run a model, so `trellis inspect` and `--help`
  stay fast.

Registering a subcommand: list a module in COMMAND_MODULES that defines `register(subparsers)`;
it adds its parser and `set_defaults(func=handler)`, where `handler(args)` returns an exit code
(None means 0) and may raise TrellisError for a one-line failure.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from engine.errors import ConfigError, ModelLoadError, TrellisError

COMMAND_MODULES = ["engine.starter", "engine.convert_cli", "engine.worker.serve_cli", "engine.plan_cli", "bench.cli"]
PROG = "trellis"
APP_INSTALL_HINT = "the desktop app is not installed; install it with `pip install -e '.[app]'` (PySide6), or see `trellis --help`"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we print one line and point at --help."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return code


# ---------------------------------------------------------------- shared model options

def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, type=Path, help="model folder (HF or EXL3)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run (auto: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype (auto: float32 on CPU, float16 on CUDA)")


def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    return name


def resolve_dtype(name: str):
    import torch
    return None if name == "auto" else getattr(torch, name)


def load_model_from_args(args, model_dir: Path | None = None):
    from engine.models import load_model
    model_dir = model_dir or args.model
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model folder not found: {model_dir}")
    return load_model(model_dir, device=resolve_device(args.device), dtype=resolve_dtype(args.dtype))


def _model_device(model):
    from engine.generate.loop import _model_device as device_of
    return device_of(model)


# ---------------------------------------------------------------- generate

def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    add_model_options(p)
    p.add_argument("-p", "--prompt", required=True, help="the user message (or the raw text with --raw)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--image", action="append", default=[], type=Path, help="image file for vision models (repeatable)")
    p.add_argument("--stats", action="store_true", help="print speed statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, finish_reason, stats) instead of streaming")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from engine.generate import SamplerSettings, generate
    from engine.inspect import inspect_model
    from engine.tokenizer import Tokenizer

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    sampler = SamplerSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed).validate()
    if args.image:
        missing = [str(f) for f in args.image if not f.is_file()]
        if missing:
            raise ModelLoadError(f"image file not found: {missing[0]}")
        info = inspect_model(args.model)
        if not info.vision:
            raise ConfigError(f"{info.architecture} in {args.model} is a text-only model; --image needs a vision model")
        raise ConfigError("image input is not supported by `trellis generate` yet")
    tokenizer = Tokenizer.from_dir(args.model)
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        prompt_ids = tokenizer.encode_chat(messages)
    model = load_model_from_args(args)

    def stream(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = generate(model, tokenizer, prompt_ids, args.max_tokens, sampler, stop_strings=args.stop,
                      on_text=None if args.json else stream)
    if args.json:
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                          "token_ids": result.token_ids, "stats": result.stats.as_dict()}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if args.stats:
        s = result.stats
        print(f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated ({result.finish_reason}), "
              f"first token {s.time_to_first_token_s:.3f} s, {s.decode_tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- logits

def register_logits(sub) -> None:
    p = sub.add_parser("logits", help="score token-id rows without cache and save the logits")
    add_model_options(p)
    p.add_argument("--tokens", required=True, type=Path, help="JSON file: a list of equal-length token-id lists")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors (tensor `logits` [rows, len, vocab] fp32)")
    p.set_defaults(func=cmd_logits)


def read_token_rows(path: Path) -> list[list[int]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"token file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if (not isinstance(rows, list) or not rows or
            not all(isinstance(r, list) and r and all(isinstance(t, int) and not isinstance(t, bool) for t in r) for r in rows)):
        raise ConfigError(f"{path}: expected a non-empty list of non-empty token-id lists")
    if len({len(r) for r in rows}) != 1:
        raise ConfigError(f"{path}: token rows differ in length ({sorted({len(r) for r in rows})})")
    return rows


def _check_ids(rows: list[list[int]], vocab_size: int, source) -> None:
    bad = [t for r in rows for t in r if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"{source}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def cmd_logits(args) -> int:
    import torch
    from engine.io.safetensors_io import write_safetensors

    rows = read_token_rows(args.tokens)
    model = load_model_from_args(args)
    vocab = model.config.vocab_size
    _check_ids(rows, vocab, args.tokens)
    device = _model_device(model)
    out = []
    with torch.inference_mode():
        for row in rows:  # one row at a time keeps peak memory at one [len, vocab] block
            logits = model(torch.tensor([row], dtype=torch.long, device=device))
            out.append(logits[0, :, :vocab].float().cpu())
    write_safetensors(args.out, {"logits": torch.stack(out).contiguous()})
    return 0


# ---------------------------------------------------------------- ppl

def register_ppl(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity on a text file (and KL / top-1 agreement against a reference model)")
    add_model_options(p)
    p.add_argument("--text", required=True, type=Path, help="UTF-8 text file")
    p.add_argument("--ref", type=Path, default=None, help="reference model folder (same tokenizer/vocab)")
    p.add_argument("--windows", type=int, default=None, help="most windows to score (default: all)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_ppl)


def cmd_ppl(args) -> int:
    from engine.evaluate import score_windows, split_windows
    from engine.tokenizer import Tokenizer

    if args.seqlen < 2:
        raise ConfigError(f"--seqlen must be at least 2 (got {args.seqlen})")
    if args.windows is not None and args.windows < 1:
        raise ConfigError(f"--windows must be at least 1 (got {args.windows})")
    try:
        text = args.text.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(f"text file not found: {args.text}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{args.text}: not UTF-8 text") from None
    tokenizer = Tokenizer.from_dir(args.model)
    windows = split_windows(tokenizer.encode(text), args.seqlen, args.windows)
    if not windows:
        raise ConfigError(f"{args.text}: too little text to score (needs at least 2 tokens)")
    model = load_model_from_args(args)
    ref = load_model_from_args(args, args.ref) if args.ref is not None else None
    vocab = model.config.vocab_size
    _check_ids(windows, vocab, args.text)
    if ref is not None and ref.config.vocab_size != vocab:
        raise ConfigError(f"vocab sizes differ: model {vocab}, reference {ref.config.vocab_size}")

    scores = score_windows(model, windows, ref)
    scored = scores["tokens"]
    result = {"model": str(args.model), "ppl": scores["ppl"], "nll": scores["nll"],
              "tokens": scored, "windows": len(windows), "seqlen": args.seqlen}
    if ref is not None:
        result.update({"ref": str(args.ref), **{k: scores[k] for k in ("ref_ppl", "kl_div", "top1_agreement")}})
    if args.json:
        print(json.dumps(result))
    else:
        line = f"perplexity {result['ppl']:.4f} over {scored} tokens ({len(windows)} windows of <= {args.seqlen})"
        if ref is not None:
            line += (f"; reference {result['ref_ppl']:.4f}, KL {result['kl_div']:.6f}, "
                     f"top-1 agreement {result['top1_agreement']:.4f}")
        print(line)
    return 0


# ---------------------------------------------------------------- inspect

def register_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="describe a model folder: architecture, size, bits per weight")
    p.add_argument("-m", "--model", required=True, type=Path, help="model folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from engine.inspect import format_model_info, inspect_model
    info = inspect_model(args.model)
    print(json.dumps(info.to_dict(), indent=2) if args.json else format_model_info(info))
    return 0


# ---------------------------------------------------------------- import-gguf

def register_import_gguf(sub) -> None:
    p = sub.add_parser("import-gguf", help="turn a GGUF file into an unquantized HF model folder")
    p.add_argument("gguf", type=Path, help="the .gguf file")
    p.add_argument("out", type=Path, help="output model folder (must not exist or be empty)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=cmd_import_gguf)


def cmd_import_gguf(args) -> int:
    import torch
    from engine.gguf_import import import_gguf

    def progress(done: int, total: int, what: str) -> None:
        if done == total or done % 25 == 0:
            print(f"\r[{done}/{total}] {what:<40}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    out = import_gguf(args.gguf, args.out, dtype=getattr(torch, args.dtype), progress=progress, overwrite=args.overwrite)
    print(out)
    return 0


# ---------------------------------------------------------------- entry point

BUILTIN_COMMANDS = [register_generate, register_logits, register_ppl, register_inspect, register_import_gguf]


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=PROG, description="Run EXL3-quantized language models locally. "
                                                          "Without a command, starts the desktop app.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in BUILTIN_COMMANDS:
        register(sub)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # that part is not built (yet): its subcommand is simply absent
            raise
        module.register(sub)
    return parser


def start_app() -> int:
    try:
        from app.main import main as app_main
    except ImportError:
        return fail(APP_INSTALL_HINT)
    try:
        return app_main() or 0
    except ImportError as e:  # app.main imports Qt lazily, so a missing PySide6 shows up here
        if (e.name or "").split(".")[0] in ("PySide6", "shiboken6"):
            return fail(APP_INSTALL_HINT)
        raise


def _error_message(e: BaseException) -> str | None:
    """The one line for errors a user can cause; None for anything else (a bug)."""
    if isinstance(e, TrellisError):
        return str(e)
    if isinstance(e, FileNotFoundError):
        return f"file not found: {e.filename or e}"
    if isinstance(e, PermissionError):
        return f"permission denied: {e.filename or e}"
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON: {e}"
    if isinstance(e, OSError):
        return f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}"
    try:
        from safetensors import SafetensorError
        if isinstance(e, SafetensorError):
            return f"corrupt safetensors file: {e}"
    except ImportError:
        pass
    if type(e).__name__ == "OutOfMemoryError":
        return f"out of memory: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = bool(os.environ.get("TRELLIS_DEBUG"))
    try:
        if not argv:
            return start_app()
        args = build_parser().parse_args(argv)
        if not getattr(args, "func", None):
            return fail("no command given (see `trellis --help`)", 2)
        return int(args.func(args) or 0)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else fail(str(e.code), 2))
    except KeyboardInterrupt:
        return fail("interrupted")
    except BrokenPipeError:  # `trellis generate ... | head`: the reader left; not an error
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as e:
        if debug:
            raise
        message = _error_message(e)
        if message is None:
            message = f"internal error: {type(e).__name__}: {e} (run with TRELLIS_DEBUG=1 for a traceback)"
        return fail(message)


if __name__ == "__main__":
    sys.exit(main())
