"""App test fixtures: offscreen Qt, a private TRELLIS_HOME per test, and engine clients that run
either the fake worker (exact timing, crashes on demand) or the real `python -m engine.worker`."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

pytest.importorskip("PySide6", reason="the desktop app needs PySide6 (pip install 'trellis[app]')")
pytest.importorskip("pytestqt", reason="app tests need pytest-qt")

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")


@pytest.fixture(autouse=True)
def trellis_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("TRELLIS_HOME", str(home))
    return home


@pytest.fixture
def make_client(qtbot):
    """make_client(real=False, **env) -> a started EngineClient, closed after the test."""
    from app.engine_client import EngineClient, default_worker_argv
    clients = []

    def make(real: bool = False, start: bool = True, **env):
        argv = default_worker_argv() if real else [sys.executable, str(FAKE_WORKER)]
        c = EngineClient(argv, env={k: str(v) for k, v in env.items()})
        clients.append(c)
        if start:
            with qtbot.waitSignal(c.ready, timeout=60000):
                c.start()
        return c

    yield make
    for c in clients:
        c.close()


def load_model(qtbot, client, path, timeout=60000):
    with qtbot.waitSignal(client.model_changed, timeout=timeout):
        client.load(str(path), max_context=512)
    assert client.model is not None and client.model["model_dir"] == str(path)
