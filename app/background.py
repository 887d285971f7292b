"""Blocking calls (folder scans, hub requests) off the UI thread, with their outcome brought back
to it through a UiMailbox. The thread runs only the caller's function: it never touches Qt (see
app/ui_mailbox.py for the freeze that rule prevents)."""
from __future__ import annotations

import threading
from typing import Callable

from app.ui_mailbox import UiMailbox
from engine.errors import TrellisError


def run_in_background(mailbox: UiMailbox, fn: Callable[[], object], on_done: Callable[[object], None],
                      on_failed: Callable[[Exception], None], name: str = "trellis-background") -> None:
    """fn() on a daemon thread; then on_done(result) or on_failed(exception) on the UI thread.

    Daemon, so a hub request that hangs never keeps the app from quitting."""
    def work() -> None:
        try:
            result = fn()
        except Exception as e:
            mailbox.post(on_failed, e)
        else:
            mailbox.post(on_done, result)

    threading.Thread(target=work, name=name, daemon=True).start()


def failure_line(e: Exception) -> str:
    """What a person is shown for a background call that failed: our errors carry the user's
    sentence; anything else is named, never dropped silently."""
    return str(e) if isinstance(e, TrellisError) else f"{type(e).__name__}: {e}"
