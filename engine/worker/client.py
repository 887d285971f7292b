"""WorkerProcess: start `python -m engine.worker` and talk to it, without Qt and without torch.

For scripts, tests and as the reference for the app's EngineClient: a reader thread turns
stdout lines into protocol events on a queue; when the process ends without being asked to
(kill -9, a driver fault, an OOM kill) the reader puts one `error` event with code
"worker_died" and the exit status, so a caller waiting for events never hangs on a dead pipe.
"""
from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from engine.worker import protocol as p

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerDied(RuntimeError):
    pass


class WorkerProcess:
    def __init__(self, python: str = sys.executable, env: Optional[dict] = None, cwd: Optional[str] = None):
        self._ids = itertools.count(1)
        self._shutting_down = False
        self.events: "queue.Queue[p.Message]" = queue.Queue()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.process = subprocess.Popen([python, "-m", "engine.worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=None, env=env, cwd=cwd or str(REPO_ROOT))
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="worker-reader", daemon=True)
        self._reader.start()
        self.hello: Optional[p.Hello] = None

    def wait_ready(self, timeout: float = 60.0) -> p.Hello:
        event = self.next_event(timeout)
        if not isinstance(event, p.Hello):
            raise WorkerDied(f"expected hello from the worker, got {event}")
        self.hello = event
        return event

    def new_id(self) -> str:
        return f"c{next(self._ids)}"

    def send(self, command: p.Message) -> str:
        """Write a command (giving it an id if it has none); returns the id."""
        if command.id is None:
            command.id = self.new_id()
        line = p.encode(command).encode("utf-8")
        with self._write_lock:
            try:
                self.process.stdin.write(line)
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                raise WorkerDied("the engine process is not running") from None
        return command.id

    def next_event(self, timeout: float = 30.0) -> p.Message:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no event from the worker within {timeout} s") from None

    def iter_events(self, timeout: float = 30.0) -> Iterator[p.Message]:
        while True:
            yield self.next_event(timeout)

    def _read(self) -> None:
        for raw in self.process.stdout:
            try:
                self.events.put(p.decode(raw, p.EVENTS))
            except p.ProtocolError as e:
                self.events.put(p.Error(code=p.ErrorCode.INTERNAL, message=f"unreadable line from the worker: {e}"))
        code = self.process.wait()
        if not self._shutting_down or code != 0:
            self.events.put(p.Error(code=p.ErrorCode.WORKER_DIED, message=describe_exit(code)))

    def close(self, timeout: float = 15.0) -> int:
        """Ask the worker to exit (close its stdin) and wait; kill it if it does not."""
        self._shutting_down = True
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"The engine process stopped unexpectedly (killed by {name}). "
                "Your conversation is kept; start the engine again to continue.")
    if code == 0:
        return "The engine process exited."
    return f"The engine process stopped unexpectedly (exit code {code}). Start the engine again to continue."


def wait_for(worker: WorkerProcess, predicate, timeout: float = 60.0) -> list[p.Message]:
    """Collect events until one satisfies `predicate`; returns all collected, that one last."""
    seen: list[p.Message] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"condition not met within {timeout} s; saw {[e.type for e in seen]}")
        event = worker.next_event(left)
        seen.append(event)
        if predicate(event):
            return seen
