"""What the hub browser shows about a repo, gathered off the UI thread. Torch-free and Qt-free.

engine.hub answers search, refs and file listings; this module adds the two things the browser
needs on top: a model card summary (the README's front matter and first paragraph, plus the
config's architecture) and, per revision, the total size and a planner verdict. EXL3 repos
publish one branch per bitrate, so each revision is planned with its own config.json and its
own safetensors bytes (exact weights) instead of an estimate from the main branch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from engine import hub
from engine import plan as planner
from engine.errors import TrellisError

README_LIMIT = 256 * 1024        # a card larger than this is cut (we only show a summary)
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class RepoCard:
    repo: str
    architecture: str = ""
    parameters: Optional[int] = None
    downloads: int = 0
    likes: int = 0
    license: str = ""
    base_model: str = ""
    tags: list[str] = field(default_factory=list)
    summary: str = ""              # first paragraph of the README, plain text
    is_exl3: bool = False


@dataclass
class RevisionRow:
    name: str
    kind: str                      # "branch" | "tag"
    commit: str
    bits: Optional[float] = None
    head_bits: Optional[int] = None
    total_bytes: int = 0
    file_count: int = 0
    plan: Optional[planner.Plan] = None
    needs_bytes: Optional[int] = None  # planner total when there is no capacity to compare with
    error: str = ""


def looks_like_repo_id(text: str) -> bool:
    return bool(REPO_ID_RE.match(text.strip()))


def _front_matter(text: str) -> tuple[dict, str]:
    """(simple YAML keys, body). Only `key: value` and `key:` + `- item` lists are read: enough
    for license, base_model and tags without a YAML dependency."""
    if not text.startswith("---"):
        return {}, text
    end = text.find("\n---", 3)
    if end < 0:
        return {}, text
    meta: dict = {}
    key = None
    for line in text[3:end].splitlines():
        if re.match(r"^\s*-\s+", line) and key:
            meta.setdefault(key, [])
            if isinstance(meta[key], list):
                meta[key].append(line.split("-", 1)[1].strip().strip("'\""))
        elif m := re.match(r"^([A-Za-z_][\w\-]*):\s*(.*)$", line):
            key, value = m.group(1), m.group(2).strip().strip("'\"")
            meta[key] = value if value else []
    return meta, text[end + 4:]


def card_summary(readme: str, max_chars: int = 600) -> tuple[dict, str]:
    """(front matter, first real paragraph as plain text) of a model card."""
    meta, body = _front_matter(readme)
    paragraph: list[str] = []
    in_code = False
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if not s:
            if paragraph:
                break
            continue
        if s.startswith(("#", "<", "|", "![", "[![", "---")):
            if paragraph:
                break
            continue
        paragraph.append(s)
    text = " ".join(paragraph)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)          # images
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)      # links -> their text
    text = re.sub(r"[*_`]{1,3}([^*_`]+)[*_`]{1,3}", r"\1", text)
    if len(text) > max_chars:
        text = text[: max_chars - 1].rsplit(" ", 1)[0] + "…"
    return meta, text


def repo_card(repo: str) -> RepoCard:
    """Card summary of a repo (main branch). RepoNotFound when it does not exist."""
    info = hub.repo_details(repo)
    card = RepoCard(repo=repo, architecture=info.architecture, downloads=info.downloads, likes=info.likes,
                    tags=info.tags, parameters=info.parameters, is_exl3=info.is_exl3)
    readme = hub.read_text(repo, info.commit, "README.md", README_LIMIT) if info.commit else None
    if readme:
        meta, card.summary = card_summary(readme)
        lic = meta.get("license", "")
        card.license = lic if isinstance(lic, str) else ", ".join(lic)
        base = meta.get("base_model", "")
        card.base_model = base if isinstance(base, str) else ", ".join(base)
    return card


def revision_plan(config: dict, name: str, bits: Optional[float], weight_bytes: int, context: int,
                  capacity: list[int], without_kernels: str = "") -> tuple[Optional[planner.Plan], Optional[int]]:
    """(plan against capacity, or None; bytes needed). The safetensors total of the revision is
    used as the weights (exact); the config gives the shapes for cache and activations.
    without_kernels: why the engine's GPU lacks the CUDA kernels ("" when it has them)."""
    spec = planner.spec_from_config(config, name=name, bits=bits)
    if weight_bytes:
        spec.weight_bytes = weight_bytes
        spec.weights_exact = True
    ctx = max(1, min(context, spec.max_context or context))
    if capacity:
        p = planner.plan(spec, planner.PlanRequest(context=ctx, gpu_bytes=capacity, without_kernels=without_kernels))
        return p, p.total
    p = planner.plan(spec, planner.PlanRequest(context=ctx, without_kernels=without_kernels))
    return None, p.total


def revision_rows(repo: str, context: int, capacity: list[int], on_row: Optional[Callable[[RevisionRow], None]] = None,
                  without_kernels: str = "") -> list[RevisionRow]:
    """Every branch and tag with its size and fit. One failing revision becomes a row with an
    error; a repo that does not exist raises RepoNotFound (one line for the user)."""
    rows = []
    for rev in hub.list_revisions(repo):
        row = RevisionRow(name=rev.name, kind=rev.kind, commit=rev.commit, bits=rev.bits)
        try:
            commit, files = hub.repo_files(repo, rev.commit or rev.name)
            weights = sum(f.size for f in files if f.path.endswith(".safetensors"))
            row.total_bytes = sum(f.size for f in files)
            row.file_count = len(files)
            if any(f.path == "config.json" for f in files):
                text = hub.read_text(repo, commit, "config.json", 4 << 20)
                config = json.loads(text) if text else {}
                quant = config.get("quantization_config") if isinstance(config, dict) else None
                if isinstance(quant, dict) and quant.get("quant_method") == "exl3":
                    row.bits = float(quant.get("bits", row.bits or 0)) or row.bits
                    row.head_bits = int(quant["head_bits"]) if "head_bits" in quant else None
                if weights:
                    row.plan, row.needs_bytes = revision_plan(config, f"{repo}@{rev.name}", row.bits, weights,
                                                              context, capacity, without_kernels)
        except (TrellisError, ValueError) as e:
            row.error = str(e)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows
