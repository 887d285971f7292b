"""EngineClient alone: a worker that cannot start, one that dies at once, a clean stop."""
from __future__ import annotations

import sys
import time

import pytest

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


def test_a_killed_engine_is_named_as_killed(qtbot, make_client):
    """SIGKILL from outside (the kernel's out-of-memory killer, say) is a death with its own words."""
    import os
    import signal
    if not hasattr(signal, "SIGKILL"):
        pytest.skip("no SIGKILL on this platform")
    c = make_client()
    with qtbot.waitSignal(c.died, timeout=10000) as sig:
        os.kill(c.pid, signal.SIGKILL)
    assert sig.args[0] == "The engine was killed (perhaps it ran out of memory)." and not c.running
    assert c.pid is None


def test_commands_to_an_engine_that_does_not_read_never_block_the_caller(qtbot):
    """The pipe to the engine holds ~64 KB; 8 MB of commands must still return at once."""
    c = EngineClient([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        c.start()
        t0 = time.perf_counter()
        for _ in range(8):
            c.generate("r", prompt="x" * (1 << 20))
        assert time.perf_counter() - t0 < 2.0
        with qtbot.waitSignal(c.running_changed, timeout=10000):
            c.stop(kill=True)
        assert not c.running
    finally:
        c.close()
