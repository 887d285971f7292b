"""EngineClient alone: a worker that cannot start, one that dies at once, a clean stop."""
from __future__ import annotations

import sys

from app.engine_client import EngineClient


def test_worker_that_cannot_start(qtbot):
    c = EngineClient(["/nonexistent/python-for-trellis"])
    try:
        with qtbot.waitSignal(c.died, timeout=10000) as sig:
            c.start()
        assert "could not be started" in sig.args[0] and not c.running
    finally:
        c.close()


def test_worker_dying_reports_its_last_stderr_line(qtbot):
    code = "import sys; print('loading...', file=sys.stderr); print('RuntimeError: driver fault', file=sys.stderr); sys.exit(7)"
    c = EngineClient([sys.executable, "-c", code])
    try:
        with qtbot.waitSignal(c.died, timeout=10000) as sig:
            c.start()
        assert sig.args[0] == "The engine stopped (exit code 7): RuntimeError: driver fault"
        assert c.last_death == sig.args[0]
    finally:
        c.close()


def test_clean_stop_is_not_a_death(qtbot, make_client):
    c = make_client()
    deaths = []
    c.died.connect(deaths.append)
    with qtbot.waitSignal(c.running_changed, timeout=10000):
        c.stop()
    assert not c.running and deaths == []
    with qtbot.waitSignal(c.ready, timeout=20000):
        c.restart()
    assert c.running
