"""Find and describe the models in the library folders, off the UI thread.

A folder is a model when it holds config.json; GGUF files are listed too (they can be imported).
Each model is described by engine.inspect (torch-free: safetensors headers only) and planned by
engine.plan for the fit badge. A broken folder becomes a row that says what is wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine import plan as planner
from engine.errors import TrellisError

MAX_DEPTH = 3


@dataclass
class LibraryEntry:
    path: str
    name: str
    kind: str                      # "exl3" | "hf" | "gguf" | "broken"
    architecture: str = ""
    parameters: int = 0
    bpw: float | None = None
    head_bits: float | None = None
    size_bytes: int = 0
    vision: bool = False
    context_length: int = 0
    error: str = ""
    spec: planner.ModelSpec | None = field(default=None, repr=False)


def describe(folder: Path) -> LibraryEntry:
    from engine.inspect import inspect_model
    try:
        info = inspect_model(folder)
    except TrellisError as e:
        return LibraryEntry(str(folder), folder.name, "broken", error=str(e))
    except (OSError, ValueError) as e:
        return LibraryEntry(str(folder), folder.name, "broken", error=f"cannot read: {e}")
    entry = LibraryEntry(str(folder), folder.name, "exl3" if info.quant_method == "exl3" else "hf",
                         architecture=info.architecture or info.model_type or "?", parameters=info.parameters,
                         bpw=info.bpw, head_bits=info.head_bits, size_bytes=info.total_bytes, vision=info.vision,
                         context_length=info.context_length or 0)
    try:
        entry.spec = planner.spec_from_dir(folder)
    except TrellisError as e:
        entry.error = str(e)
    return entry


def find_models(folders: list[str]) -> list[Path]:
    out: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        try:
            if (d / "config.json").is_file():
                out.append(d)
                return
            children = sorted(d.iterdir())
        except OSError:
            return
        for c in children:
            if c.name.startswith("."):
                continue
            if c.is_file() and c.suffix.lower() == ".gguf":
                out.append(c)
            elif c.is_dir() and depth < MAX_DEPTH:
                walk(c, depth + 1)

    for f in folders:
        p = Path(f).expanduser()
        if p.is_dir():
            walk(p, 0)
    return out


def scan(folders: list[str]) -> list[LibraryEntry]:
    entries = []
    for p in find_models(folders):
        if p.is_file():
            entries.append(LibraryEntry(str(p), p.stem, "gguf", architecture="GGUF", size_bytes=p.stat().st_size))
        else:
            entries.append(describe(p))
    return entries


def fit(entry: LibraryEntry, context: int, capacity_bytes: list[int], without_kernels: str = "") -> planner.Plan | None:
    if entry.spec is None or not capacity_bytes:
        return None
    ctx = min(context, entry.spec.max_context) if entry.spec.max_context else context
    return planner.plan(entry.spec, planner.PlanRequest(context=ctx, gpu_bytes=capacity_bytes,
                                                        without_kernels=without_kernels))
