"""Tokens/s of the whole generation loop (engine.generate.generate) on a synthetic EXL3 model:
what a chat gets, the sampler, detokenizing and streaming included, with the loop pipelined
(each step queued with the device's token before the host reads it) and not
(TRELLIS_PIPELINE=0), interleaved in one process.

    python -m bench.generate --model-dir /tmp/l8b --tokens 256 --passes 3

The synthetic model has no tokenizer; a stand-in turns ids into characters (the loop's streaming
and stop-string work run on its text as on any other). Prints one JSON line per (preset,
pipelined, pass).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from bench.decode import add_model_args, load, model_dir_of


class StandInTokenizer:
    """ids -> text without a vocabulary: each id is one printable character."""
    eos_ids: set = set()

    def decode(self, ids) -> str:
        return "".join(chr(0x21 + i % 94) for i in ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="generation loop tokens/s, pipelined and not")
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--presets", nargs="+", default=["greedy", "balanced"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "generate", "error": "no CUDA device"}))
        return 1
    from bench.sampling import PRESETS
    from engine.generate import SamplerSettings, generate

    model, _ = load(model_dir_of(args), "cuda")
    tok = StandInTokenizer()
    prompt = list(range(1, args.prompt + 1))
    presets = {name: PRESETS[name] for name in args.presets}
    streamed: list[str] = []
    generate(model, tok, prompt, 8, SamplerSettings())  # captures the graphs outside the timing
    for p in range(args.passes):
        for name, settings in presets.items():
            for pipelined in (True, False):
                os.environ["TRELLIS_PIPELINE"] = "1" if pipelined else "0"
                streamed.clear()
                result = generate(model, tok, prompt, args.tokens, settings, on_text=streamed.append)
                print(json.dumps({"bench": "generate", "preset": name, "pipelined": pipelined, "pass": p,
                                  "tokens": result.stats.generated_tokens,
                                  "decode_tokens_per_s": round(result.stats.decode_tokens_per_s, 1),
                                  "streamed_chars": sum(map(len, streamed))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
