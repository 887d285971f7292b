"""EngineQueue: one thread that owns the model and runs engine jobs in arrival order.

Why one thread: the model, its cache and the GPU stream are not safe to use from two threads,
and until the continuous-batching generator exists, generations run one after another. The
command loop (or the HTTP server) only enqueues, so it stays free to answer status and cancel
while a job runs. A job is a callable given a `should_stop` function; cancelling a queued job
removes it (its `on_dropped` callback runs), cancelling the running one makes `should_stop`
return True.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Job:
    run: Callable[[Callable[[], bool]], None]
    request_id: Optional[str] = None          # set for cancellable jobs (generations)
    on_dropped: Optional[Callable[[], None]] = None  # cancelled before it started, or queue stopped
    enqueued_at: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)


class EngineQueue:
    def __init__(self, name: str = "engine"):
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Optional[Job] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                dropped = job
            else:
                self._jobs.append(job)
                self._cond.notify()
                return
        if dropped.on_dropped:
            dropped.on_dropped()

    def has_request(self, request_id: str) -> bool:
        with self._cond:
            return (self._running is not None and self._running.request_id == request_id) or any(
                j.request_id == request_id for j in self._jobs)

    def cancel(self, request_id: str) -> Optional[str]:
        """Returns "queued" or "running" for the job found, None when there is none."""
        with self._cond:
            for job in self._jobs:
                if job.request_id == request_id:
                    self._jobs.remove(job)
                    break
            else:
                job = None
                if self._running is not None and self._running.request_id == request_id:
                    self._running.cancelled.set()
                    return "running"
        if job is None:
            return None
        job.cancelled.set()
        if job.on_dropped:
            job.on_dropped()
        return "queued"

    def snapshot(self) -> tuple[Optional[str], list[str]]:
        """(request id of the running generation, queued request ids in order)."""
        with self._cond:
            running = self._running.request_id if self._running is not None else None
            return running, [j.request_id for j in self._jobs if j.request_id is not None]

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None or bool(self._jobs)

    def stop(self, timeout: float = 10.0) -> None:
        """Drop queued jobs, ask the running one to stop, and wait for the thread."""
        with self._cond:
            self._stopping = True
            dropped = list(self._jobs)
            self._jobs.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._cond.notify_all()
        for job in dropped:
            if job.on_dropped:
                job.on_dropped()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._running = self._jobs.popleft()
            try:
                job.run(job.cancelled.is_set)
            except Exception:  # a job reports its own errors; this is a bug, keep serving
                traceback.print_exc(file=sys.stderr)
            finally:
                with self._cond:
                    self._running = None
