"""Reading the small JSON files of a model folder (config, tokenizer and generation settings).

Torch-free, so the app's tools share it. A broken file is the user's to fix, so every failure is a
ConfigError whose message names the file and the place in it."""
from __future__ import annotations

import json
from pathlib import Path

from engine.errors import ConfigError


def read_json_object(path: Path) -> dict:
    """Parse `path`, which must hold one JSON object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value
