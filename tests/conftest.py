"""Shared test fixtures. Paths to ../shared/fixtures skip (with a reason) when absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The GPU tests compare the products' debug variants (probes, configurations, earlier forms) with
# the shipped kernels: build those too (engine/ops/build.py). CPU runs never build anything.
os.environ.setdefault("TRELLIS_DEBUG_VARIANTS", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TRELLIS_SHARED", ROOT.parent / "shared"))
REF_FIXTURES = SHARED / "fixtures" / "exl3-ref"
EXL3_TAGS = ["llama-4.0bpw-mul1-h6", "llama-2.5bpw-mcg-h4", "llama-3.0bpw-3inst-h8", "qwen2-3.0bpw-mul1-h6"]


@pytest.fixture(scope="session")
def ref_fixtures() -> Path:
    if not (REF_FIXTURES / "manifest.json").exists():
        pytest.skip(f"reference fixtures not found at {REF_FIXTURES} (they ship in ../shared, beside the repo)")
    return REF_FIXTURES
