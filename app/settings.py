"""Where the app keeps things, and the small typed settings it remembers between runs.

TRELLIS_HOME (an environment variable) moves everything — database, settings, default models
folder — to one folder; tests use it so they never touch a real profile."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QSettings, QStandardPaths


def home() -> Path:
    env = os.environ.get("TRELLIS_HOME")
    if env:
        return Path(env)
    base = QStandardPaths.writableLocation(QStandardPaths.AppDataLocation) or str(Path.home() / ".trellis")
    return Path(base)


def qsettings() -> QSettings:
    if os.environ.get("TRELLIS_HOME"):
        return QSettings(str(home() / "settings.ini"), QSettings.IniFormat)
    return QSettings("Trellis", "Trellis")


def database_path() -> Path:
    return home() / "chats.sqlite3"


def default_models_dir() -> Path:
    return home() / "models"


def model_folders() -> list[str]:
    value = qsettings().value("library/folders", [])
    if isinstance(value, str):
        value = [value] if value else []
    folders = [str(v) for v in (value or [])]
    return folders or [str(default_models_dir())]


def set_model_folders(folders: list[str]) -> None:
    s = qsettings()
    s.setValue("library/folders", list(dict.fromkeys(folders)))
    s.sync()


@dataclass(frozen=True)
class SamplerPreset:
    name: str
    temperature: float
    top_k: int
    top_p: float
    min_p: float = 0.0
    repetition_penalty: float = 1.0


PRESETS: dict[str, SamplerPreset] = {p.name: p for p in (
    SamplerPreset("Precise", temperature=0.0, top_k=1, top_p=1.0),
    SamplerPreset("Balanced", temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    SamplerPreset("Creative", temperature=1.0, top_k=0, top_p=0.95, min_p=0.02),
)}
