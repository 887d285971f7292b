"""The engine process and the threads that serve its pipes, for EngineClient.

Three daemon threads: one reads stdout and decodes the protocol's JSON lines, one keeps the last
lines of stderr (the reason a person is shown when the engine dies), one writes commands to stdin
so that a slow engine never blocks the UI thread. None of them touches Qt: everything they learn
goes to the UI thread through a UiMailbox (app/ui_mailbox.py says why).
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Callable

from app.ui_mailbox import UiMailbox
from engine.worker import protocol as P

log = logging.getLogger(__name__)

# A polite stop closes stdin and waits this long for the engine to finish before killing it.
STOP_GRACE_S = 3.0


def exit_reason(code: int, crashed: bool, stderr_tail) -> str:
    """One sentence for a person: how the engine ended, and the last line it wrote to stderr
    (tracebacks skipped, so the error line itself is what shows)."""
    last = ""
    for line in reversed(stderr_tail):
        if not line.startswith((" ", "\t", "Traceback")):
            last = line.strip()
            break
    if crashed:
        head = "The engine was killed" + (" (perhaps it ran out of memory)" if not last else "")
    else:
        head = f"The engine stopped (exit code {code})"
    return f"{head}: {last}" if last else head + "."


def _crashed(code: int) -> bool:
    """Ended by a signal (POSIX) or by an unhandled exception code (Windows NTSTATUS)."""
    return code < 0 or (os.name == "nt" and code >= 0xC0000000)


class EngineProcess:
    """One run of the engine. Its outcome reaches the UI thread as on_message(message) per
    protocol line and, once, on_ended(self, exit code, reason, expected)."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, mailbox: UiMailbox,
                 on_message: Callable[[P.Message], None], on_ended: Callable[..., None]):
        """Starts the process; raises OSError when it cannot be started."""
        self.argv = list(argv)
        self.expected_exit = False
        self._mailbox = mailbox
        self._on_message, self._on_ended = on_message, on_ended
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._commands: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        flags = subprocess.CREATE_NO_WINDOW if os.name == "nt" else 0
        self.popen = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, cwd=str(cwd), env={**os.environ, **env},
                                      creationflags=flags)
        self._stderr_reader = self._thread(self._read_stderr, "stderr")
        self._thread(self._write_stdin, "stdin")
        self._thread(self._read_stdout, "stdout")

    def _thread(self, target, pipe: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"engine-{pipe}-{self.popen.pid}", daemon=True)
        t.start()
        return t

    # ------------------------------------------------------------------ UI thread
    def write(self, line: str) -> None:
        self._commands.put(line.encode("utf-8"))

    def stop(self, kill: bool = False) -> None:
        """Ask it to end (stdin closed; killed if still there after STOP_GRACE_S), or kill it now.
        Returns at once; on_ended says when it is gone."""
        self.expected_exit = True
        if kill:
            self.kill()
            return
        self._commands.put(None)
        threading.Thread(target=self._kill_after, args=(STOP_GRACE_S,), daemon=True).start()

    def stop_and_wait(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Blocking stop, for when the app quits: stdin closed, then killed if need be."""
        self.expected_exit = True
        self._commands.put(None)
        self._kill_after(timeout_s)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine (pid %d) did not exit after kill", self.popen.pid)

    def kill(self) -> None:
        try:
            self.popen.kill()
        except OSError:               # already gone
            pass

    # ------------------------------------------------------------------ pipe threads
    def _kill_after(self, seconds: float) -> None:
        try:
            self.popen.wait(seconds)
        except subprocess.TimeoutExpired:
            self.kill()

    def _write_stdin(self) -> None:
        stdin = self.popen.stdin
        while True:
            data = self._commands.get()
            if data is None:
                break
            try:
                stdin.write(data)
                stdin.flush()
            except OSError:           # the engine is gone; its end is reported by the reader
                break
        try:
            stdin.close()
        except OSError:
            pass

    def _read_stderr(self) -> None:
        for raw in self.popen.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if line.strip():
                self._stderr_tail.append(line)

    def _read_stdout(self) -> None:
        for raw in self.popen.stdout:
            if not raw.strip():
                continue
            try:
                message = P.decode(raw.rstrip(b"\r\n"), P.EVENTS)
            except P.ProtocolError as e:
                log.warning("engine wrote a line that is not protocol: %s: %r", e, raw[:200])
                continue
            self._mailbox.post(self._on_message, message)
        code = self.popen.wait()
        self._stderr_reader.join(2.0)           # its last lines are the reason a person is shown
        self._commands.put(None)                # let the writer end
        reason = exit_reason(code, _crashed(code), list(self._stderr_tail))
        self._mailbox.post(self._on_ended, self, code, reason, self.expected_exit)
