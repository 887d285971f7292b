"""Background threads reach the UI thread only through UiMailbox, and never call Qt themselves.

The rule exists because PySide holds the GIL inside Qt calls: a background thread that emits or
connects a signal can deadlock with the UI thread destroying an object (the suite froze that way
once; app/ui_mailbox.py tells the whole story)."""
from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QWidget

from app.background import run_in_background
from app.ui_mailbox import UiMailbox
from .conftest import load_model

APP_DIR = Path(__file__).resolve().parents[2] / "app"


def test_posts_from_many_threads_arrive_on_the_ui_thread_in_order(qtbot):
    owner = QObject()
    box = UiMailbox(owner)
    got: dict[int, list[int]] = {t: [] for t in range(4)}
    where: set[bool] = set()

    def record(t: int, i: int) -> None:
        where.add(threading.current_thread() is threading.main_thread())
        got[t].append(i)

    threads = [threading.Thread(target=lambda t=t: [box.post(record, t, i) for i in range(3000)]) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    qtbot.waitUntil(lambda: sum(map(len, got.values())) == 12000, timeout=10000)
    assert where == {True}
    assert all(seq == list(range(3000)) for seq in got.values())


def test_a_flood_is_delivered_in_slices_so_the_event_loop_keeps_turning(qtbot):
    """20,000 posted calls of ~0.02 ms each are ~0.4 s of work: a 5 ms timer must fire in between."""
    owner = QObject()
    box = UiMailbox(owner)
    done, ticks = [], []

    def work(i: int) -> None:
        sum(range(2000))
        done.append(i)

    for i in range(20000):
        box.post(work, i)
    timer = QTimer()
    timer.setInterval(5)
    timer.timeout.connect(lambda: ticks.append(len(done)))
    timer.start()
    qtbot.waitUntil(lambda: len(done) == 20000, timeout=20000)
    timer.stop()
    assert done == list(range(20000))
    assert any(0 < n < 20000 for n in ticks), "the timer never fired while the flood was delivered"


def test_nothing_is_delivered_after_close_or_after_the_owner_is_gone(qtbot):
    for ending in ("close", "delete"):
        owner = QWidget()
        box = UiMailbox(owner)
        got = []
        box.post(got.append, "before")
        qtbot.waitUntil(lambda: got == ["before"], timeout=5000)
        if ending == "close":
            box.close()
        else:
            owner.deleteLater()
            qtbot.waitUntil(lambda: not _alive(owner), timeout=5000)
        box.post(got.append, "after")           # must not raise
        qtbot.wait(50)
        assert got == ["before"], ending


def _alive(obj) -> bool:
    import shiboken6
    return shiboken6.isValid(obj)


@pytest.mark.qt_no_exception_capture
def test_a_failing_call_is_reported_and_the_rest_still_run(qtbot, monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: reported.append(exc[0]))
    owner = QObject()                       # the mailbox delivers only while its owner lives
    box = UiMailbox(owner)
    got = []
    box.post(lambda: 1 / 0)
    box.post(got.append, "next")
    qtbot.waitUntil(lambda: got == ["next"], timeout=5000)
    assert reported == [ZeroDivisionError]


def test_run_in_background_brings_result_or_exception_to_the_ui_thread(qtbot):
    owner = QObject()
    box = UiMailbox(owner)
    out = []
    on_main = lambda kind: lambda v: out.append((kind, v, threading.current_thread() is threading.main_thread()))  # noqa: E731
    run_in_background(box, lambda: 6 * 7, on_main("done"), on_main("failed"))
    run_in_background(box, lambda: int("x"), on_main("done"), on_main("failed"))
    qtbot.waitUntil(lambda: len(out) == 2, timeout=5000)
    assert ("done", 42, True) in out
    failed = [o for o in out if o[0] == "failed"]
    assert isinstance(failed[0][1], ValueError) and failed[0][2]


def _is_qt(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    kinds = [owner if isinstance(owner, type) else type(owner)] if owner is not None else []
    mods = [getattr(fn, "__module__", None) or ""] + [c.__module__ for k in kinds for c in k.__mro__]
    return any(m.startswith(("PySide6", "shiboken6")) for m in mods)


def test_the_app_s_background_threads_call_no_qt(qtbot, make_client, tmp_path):
    """Every C function a background thread calls while the engine client streams, the library
    scans and a background call runs is recorded: none may belong to Qt."""
    qt_calls: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call" and threading.current_thread() is not threading.main_thread() and _is_qt(arg):
            qt_calls.append(f"{threading.current_thread().name}: {getattr(arg, '__qualname__', arg)}")

    threading.setprofile(profile)
    try:
        from app.main_window import MainWindow
        c = make_client(FAKE_TOKENS=40, FAKE_DELAY=0.001)
        w = MainWindow(client=c, start_engine=False)
        qtbot.addWidget(w)
        model_dir = tmp_path / "m"
        model_dir.mkdir()
        (model_dir / "config.json").write_text("{}")
        load_model(qtbot, c, model_dir)
        with qtbot.waitSignal(c.done, timeout=20000):
            c.generate("r1", messages=[{"role": "user", "content": "hello"}])
        with qtbot.waitSignal(w.library.scanned, timeout=20000):
            w.library.rescan()
        with qtbot.waitSignal(c.running_changed, timeout=10000):
            c.stop()
    finally:
        threading.setprofile(None)
    assert qt_calls == []


def test_the_app_starts_no_qt_threads():
    """Qt threads run Python with Qt's locks in reach; the app's threads are plain Python ones."""
    offenders = [f"{p.relative_to(APP_DIR)}: {m.group(0)}" for p in sorted(APP_DIR.rglob("*.py"))
                 for m in re.finditer(r"\b(QThread|QThreadPool|QRunnable|moveToThread)\b", p.read_text())]
    assert offenders == []
