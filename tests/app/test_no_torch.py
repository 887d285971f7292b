"""The app process must not import torch (the engine process owns it)."""
from __future__ import annotations

import subprocess
import sys

from app.engine_client import REPO_ROOT


def test_app_imports_no_torch():
    code = ("import sys; import app.main, app.main_window, app.views.library_view, app.views.planner_view, "
            "app.views.first_run, app.library_scan; from app.library_scan import scan; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
