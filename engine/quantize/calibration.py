"""Calibration token rows for the Hessians: a fixed, seeded mix of text we may ship.

Default mix (by rows): 45% English prose (KJV chapters, engine/data/calibration_kjv.txt), 35%
Python source read from the running interpreter's standard library, 20% uniformly random token
ids (they exercise every embedding row, which text alone does not). A user file or folder
replaces the prose and code. Prose rows are built like upstream: whole articles (chapters)
tokenized and concatenated until a row has exactly `cols` tokens, the rest of the last article
dropped; code rows are consecutive windows of one long token stream.
"""
from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import torch

from engine.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
KJV_FILE = DATA_DIR / "calibration_kjv.txt"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".html", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java"}
# stdlib modules with varied, well-commented code; missing ones are skipped
STDLIB_MODULES = ["argparse.py", "ast.py", "calendar.py", "csv.py", "dataclasses.py", "difflib.py",
                  "fractions.py", "functools.py", "heapq.py", "inspect.py", "json/decoder.py",
                  "json/encoder.py", "pathlib.py", "pprint.py", "shlex.py", "statistics.py",
                  "string.py", "textwrap.py", "typing.py", "zipfile.py", "datetime.py", "random.py"]


def _prose_articles(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if len(line.strip()) > 50]


def _code_text(max_chars: int) -> str:
    """Up to max_chars of stdlib source, taken evenly from every listed module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text(encoding="utf-8", errors="replace") for n in STDLIB_MODULES if (stdlib / n).is_file()]
    if not texts:
        return ""
    per = max(2000, max_chars // len(texts))
    return "\n\n".join(t[:per] for t in texts)


def _user_articles(path: Path) -> list[str]:
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise ConfigError(f"calibration data {path} does not exist")
    articles = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        articles += [a.strip() for a in text.split("\n\n") if len(a.strip()) > 50]
    if not articles:
        raise ConfigError(f"no usable text in calibration data {path}")
    return articles


def _article_rows(tokenizer, articles: list[str], n_rows: int, cols: int, rng: random.Random) -> list[list[int]]:
    rows: list[list[int]] = []
    order = list(range(len(articles)))
    rng.shuffle(order)
    row: list[int] = []
    i = 0
    while len(rows) < n_rows:
        if i >= len(order) * 4:  # text exhausted several times over: allow reuse
            break
        ids = tokenizer.encode(articles[order[i % len(order)]], add_bos=False)
        i += 1
        row += ids
        if len(row) >= cols:
            rows.append(row[:cols])
            row = []
    while len(rows) < n_rows:  # very short corpora: cycle what we have
        rows.append(rows[len(rows) % max(1, len(rows))] if rows else [0] * cols)
    return rows


def _stream_rows(tokenizer, text: str, n_rows: int, cols: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_bos=False)
    if not ids:
        return [[0] * cols for _ in range(n_rows)]
    while len(ids) < n_rows * cols:
        ids = ids + ids
    step = max(cols, (len(ids) - cols) // max(1, n_rows))
    return [ids[i * step: i * step + cols] for i in range(n_rows)]


def random_row_count(rows: int) -> int:
    """How many of `rows` calibration rows are uniformly random token ids (they come last)."""
    return max(1, round(rows * 0.2)) if rows >= 3 else 0


def text_row_indices(rows: int, n: int) -> list[int]:
    """Up to n of the text rows (no random-token rows) among `rows` calibration rows, spread
    evenly over the prose and code parts."""
    n_text = rows - random_row_count(rows) or rows
    n = max(1, min(n, n_text))
    return [(i * n_text) // n for i in range(n)]


def text_rows(ids: torch.Tensor, n: int, tokens: int) -> torch.Tensor:
    """text_row_indices' rows cut to their first `tokens` tokens: a small, representative sample."""
    return ids[text_row_indices(ids.shape[0], n), :tokens].contiguous()


def build_calibration(tokenizer, vocab_size: int, rows: int, cols: int, seed: int = 0,
                      source: str | Path | None = None) -> torch.Tensor:
    """Token ids [rows, cols] (int64), deterministic for a given tokenizer, corpus and seed."""
    if rows < 1 or cols < 16:
        raise ConfigError(f"calibration needs at least 1 row of 16 tokens (got {rows} x {cols})")
    rng = random.Random(seed)
    n_random = random_row_count(rows)
    n_text = rows - n_random
    if source is not None:
        text_rows = _article_rows(tokenizer, _user_articles(Path(source)), n_text, cols, rng)
    else:
        n_code = round(n_text * 0.35 / 0.8)
        n_prose = n_text - n_code
        text_rows = _article_rows(tokenizer, _prose_articles(KJV_FILE), n_prose, cols, rng)
        if n_code:
            text_rows += _stream_rows(tokenizer, _code_text(n_code * cols * 6), n_code, cols)
    g = torch.Generator().manual_seed(seed)
    random_rows = torch.randint(0, vocab_size, (n_random, cols), generator=g)
    out = torch.tensor(text_rows, dtype=torch.int64).reshape(-1, cols)
    return torch.cat([out, random_rows]).clamp_(0, vocab_size - 1)
