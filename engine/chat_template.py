"""Chat templates: find a model's Jinja template and render it the way Hugging Face does.

Models ship their prompt format as a Jinja template (in `tokenizer_config.json` under
`chat_template`, or in a separate `chat_template.jinja`). Rendering must match transformers'
behaviour closely, because a template rendered differently produces prompts the model was never
trained on: same Jinja options (trim_blocks, lstrip_blocks), same helper globals
(`raise_exception`, `strftime_now`), and a sandbox because templates come from downloaded files.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ConfigError

# Used when a model has no template of its own (base models, tiny test models). ChatML is the
# most widely trained-on convention, so it is the least surprising guess.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ConfigError):
    """The chat template failed to render (syntax error, or it called raise_exception)."""


def _raise_exception(message: str) -> None:
    # Templates use this to reject conversations they cannot format (e.g. roles out of order).
    raise TemplateError(f"chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes the prompt text; HF overrides it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template has a syntax error: {e}") from None


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render `messages` (dicts with `role` and `content`) with `template`.

    `variables` become template variables (bos_token, eos_token, tools, ...)."""
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {e}") from None
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as e:
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None


def _pick_named_template(value: Any) -> str | None:
    """tokenizer_config may hold a string or a list of {name, template}; pick 'default'."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
    return None


def load_chat_template(model_dir: str | Path, tokenizer_config: dict | None = None) -> str | None:
    """The model's own template, or None when it has none.

    `chat_template.jinja` wins over tokenizer_config.json, as in transformers (newer checkpoints
    move the template into its own file and leave the config entry out)."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        try:
            found = _pick_named_template(json.loads(json_file.read_text(encoding="utf-8")).get("chat_template"))
        except (json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"{json_file}: not valid JSON ({e})") from None
        if found:
            return found
    if tokenizer_config is not None:
        return _pick_named_template(tokenizer_config.get("chat_template"))
    return None
