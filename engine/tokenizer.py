"""Text ↔ token ids for a model folder, with the model's BOS/EOS conventions and chat template.

Built on the `tokenizers` library reading `tokenizer.json`. The special-token rules are spread over
three files in HF checkpoints, and getting them wrong silently degrades output quality:
- BOS: `tokenizer_config.json:add_bos_token` when present; else whether tokenizer.json's
  post-processor adds it; else the Llama-family convention (Llama, Mistral, Gemma prepend BOS).
- EOS: the union of `generation_config.json:eos_token_id` (int or list — chat models list their
  end-of-turn token there) and the tokenizer's own `eos_token`.
We always encode without the library's special-token handling and add BOS ourselves, so the
rule above is the only one in force.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from engine.chat_template import FALLBACK_CHAT_TEMPLATE, load_chat_template, render_chat_template
from engine.errors import ModelLoadError
from engine.io.json_files import read_json_object

# model_type values whose checkpoints expect a BOS token when the tokenizer config is silent.
BOS_BY_DEFAULT_MODEL_TYPES = {"llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "gemma3_text"}


def _read_json(path: Path) -> dict:
    """Optional settings files: absent means empty."""
    return read_json_object(path) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass
class Tokenizer:
    backend: _HFTokenizer
    bos_id: int | None = None
    eos_ids: set[int] = field(default_factory=set)
    add_bos: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json (Trellis needs the fast-tokenizer file)")
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ModelLoadError(f"{tok_file}: cannot be read as a tokenizer ({str(e).splitlines()[0]})") from None
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        return cls.from_parts(backend, tok_cfg, gen_cfg, model_cfg,
                              chat_template=load_chat_template(model_dir, tok_cfg))

    @classmethod
    def from_parts(cls, backend: _HFTokenizer, tokenizer_config: dict, generation_config: dict,
                   model_config: dict, chat_template: str | None = None) -> "Tokenizer":
        """Apply the BOS/EOS rules to already-parsed files (tests build tokenizers in memory)."""
        text_cfg = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else {}

        def token_id(text: str | None) -> int | None:
            return backend.token_to_id(text) if text is not None else None

        bos_token = _token_text(tokenizer_config.get("bos_token"))
        eos_token = _token_text(tokenizer_config.get("eos_token"))
        bos_id = token_id(bos_token)
        if bos_id is None:
            for cfg in (generation_config, model_config, text_cfg):
                ids = _as_id_list(cfg.get("bos_token_id"))
                if ids:
                    bos_id = ids[0]
                    break
        if bos_id is not None and bos_token is None:
            bos_token = backend.id_to_token(bos_id)

        eos_ids = set(_as_id_list(generation_config.get("eos_token_id")))
        if not eos_ids:
            eos_ids = set(_as_id_list(model_config.get("eos_token_id")) or _as_id_list(text_cfg.get("eos_token_id")))
        if token_id(eos_token) is not None:
            eos_ids.add(token_id(eos_token))
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(min(eos_ids))

        add_bos = tokenizer_config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _post_processor_adds_bos(backend, bos_id)
            if not add_bos:
                model_type = model_config.get("model_type") or text_cfg.get("model_type")
                add_bos = model_type in BOS_BY_DEFAULT_MODEL_TYPES
        add_bos = bool(add_bos and bos_id is not None)

        return cls(backend=backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
                   bos_token=bos_token, eos_token=eos_token,
                   pad_token=_token_text(tokenizer_config.get("pad_token")),
                   unk_token=_token_text(tokenizer_config.get("unk_token")),
                   chat_template=chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; `add_bos=None` follows the model's convention.

        Special-token text inside `text` (e.g. `<|im_start|>` from a rendered chat template)
        becomes the special token, as HF does."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        template = self.chat_template or FALLBACK_CHAT_TEMPLATE
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token or "", "unk_token": self.unk_token or ""}
        context.update(variables)
        return render_chat_template(template, messages, add_generation_prompt, **context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """Render and encode a conversation. Templates that write the BOS text themselves
        (most do) must not get a second BOS prepended, so BOS is added only when missing."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **variables))


def _post_processor_adds_bos(backend: _HFTokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    try:
        ids = backend.encode("a", add_special_tokens=True).ids
    except Exception:
        return False
    return bool(ids) and ids[0] == bos_id
