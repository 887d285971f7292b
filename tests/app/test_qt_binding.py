"""Guard against a Qt binding that corrupts reference counts when signals are emitted.

PySide6 6.12.0 on Python 3.11 drops a reference to `True` on every SignalInstance.emit(); after
a few thousand emits (one streamed answer) the interpreter aborts with "bool_dealloc". The app
emits a signal per token, so such a binding must never be installed: this test fails on it."""
from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal


class _Emitter(QObject):
    text = Signal(str, str, int)
    flag = Signal(bool)


def test_emitting_signals_keeps_refcounts_of_true_and_false():
    e = _Emitter()
    e.text.connect(lambda *a: None)
    e.flag.connect(lambda *a: None)
    before = (sys.getrefcount(True), sys.getrefcount(False))
    for i in range(200):
        e.text.emit("r", "t", i)
        e.flag.emit(i % 2 == 0)
    after = (sys.getrefcount(True), sys.getrefcount(False))
    assert abs(after[0] - before[0]) < 20 and abs(after[1] - before[1]) < 20, (before, after)
