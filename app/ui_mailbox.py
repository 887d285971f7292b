"""The one road from a background thread to the UI thread: a mailbox the UI thread empties.

Why not queued signals: PySide keeps the GIL while it runs Qt code. A background thread that
emits or connects a signal holds the GIL and waits for one of Qt's signal-slot mutexes (a small
pool, shared by all objects). The UI thread, destroying an object in its event loop (GIL let go),
holds such a mutex and then asks for the GIL to look up a Python override (`disconnectNotify`).
Neither can move, and the app freezes. The test suite froze this way (py-spy: the UI thread in
~QPropertyAnimation -> Sbk_GetPyOverride -> GilState::acquire, the engine client's thread in
QObject::connectImpl -> QBasicMutex::lockInternal).

So background threads here never call Qt. `post()` appends to a deque and writes one byte to a
socket pair; a QSocketNotifier, made on the UI thread, wakes that thread to run what was posted,
in order. Sockets rather than a pipe because QSocketNotifier watches only sockets on Windows.
"""
from __future__ import annotations

import socket
import sys
import time
from collections import deque
from typing import Callable

from PySide6.QtCore import QObject, QSocketNotifier

# The UI thread runs posted calls for at most this long per wake-up, then lets the event loop
# paint and handle input before it takes the rest: a flood of tokens never freezes the window.
_SLICE_S = 0.008


class UiMailbox:
    """Calls posted from any thread, run on the UI thread in the order they were posted.

    The notifier is a child of `owner`: when the owner is destroyed, nothing more is delivered,
    as with a queued signal to a deleted receiver. `post()` stays safe to call after that."""

    def __init__(self, owner: QObject):
        self._calls: deque[tuple[Callable, tuple]] = deque()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._closed = False
        self._notifier = QSocketNotifier(self._rsock.fileno(), QSocketNotifier.Read, owner)
        self._notifier.activated.connect(self._deliver)

    def post(self, fn: Callable, *args) -> None:
        """Any thread: fn(*args) will run on the UI thread. Touches no Qt object."""
        if self._closed:
            return
        self._calls.append((fn, args))
        self._wake()

    def close(self) -> None:
        """UI thread: drop what is pending and deliver nothing more."""
        if self._closed:
            return
        self._closed = True
        self._calls.clear()
        try:
            self._notifier.setEnabled(False)
        except RuntimeError:          # the owner, and with it the notifier, is already gone
            pass
        self._rsock.close()
        self._wsock.close()

    def _wake(self) -> None:
        try:
            self._wsock.send(b"\0")
        except OSError:               # buffer full (a wake-up is pending anyway) or closed
            pass

    def _deliver(self, *_) -> None:
        if self._closed:
            return
        try:
            while self._rsock.recv(4096):
                pass
        except OSError:               # nothing more to read (BlockingIOError) or closed
            pass
        deadline = time.perf_counter() + _SLICE_S
        while self._calls and not self._closed:
            fn, args = self._calls.popleft()
            try:
                fn(*args)
            except Exception:         # report it as a failing slot would, and deliver the rest
                sys.excepthook(*sys.exc_info())
            if self._calls and time.perf_counter() > deadline:
                self._wake()          # come back after the event loop has turned
                return
