"""The engine process's command loop: read commands from stdin, write events to stdout.

The main thread only reads and dispatches, so `status` and `cancel` are answered at once even
while a model loads or a generation runs. Model work (load, unload, generate) goes through one
EngineQueue thread in arrival order; convert, download and plan run as background tasks
(convert and plan as child processes: a conversion is a resumable job with its own process,
and the planner's CLI is its stable contract). Every failure becomes an `error` event; the loop
itself never dies from a bad command.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, IO, Optional

from engine.worker import protocol as p
from engine.worker.host import ModelHost, WorkerError
from engine.worker.jobs import EngineQueue, Job

ENGINE_VERSION = "0.1.0"


class ProgressClock:
    """Turns fractions into progress events with an ETA (linear extrapolation), rate-limited so
    a fast loop cannot flood the pipe.

    Rate limiting never loses the newest state: an event that comes too soon after the last one
    is held (a newer one replaces it) and sent when the interval is over, by a timer, or by
    `flush()`, which the task calls before its result or error, so what a client shows last is
    what the task said last. The final event (fraction 1.0) is sent at once and drops any held,
    older one, so nothing stale can arrive after it."""

    def __init__(self, emit: Callable[[p.Progress], None], command_id: Optional[str], task: str,
                 min_interval_s: float = 0.1):
        self.emit, self.command_id, self.task = emit, command_id, task
        self.start = time.monotonic()
        self.min_interval_s = min_interval_s
        self.last_sent = float("-inf")
        self.fraction: Optional[float] = None
        self.message = ""
        # One lock orders every send: a held event flushed by the timer thread cannot pass a
        # later event sent by the task's thread.
        self._lock = threading.Lock()
        self._held: Optional[p.Progress] = None
        self._timer: Optional[threading.Timer] = None

    def __call__(self, fraction: Optional[float], message: str = "", eta_s: Optional[float] = None) -> None:
        """`eta_s` from the task itself (it knows its remaining work better) wins over extrapolation."""
        now = time.monotonic()
        final = fraction is not None and fraction >= 1.0
        eta = None
        if fraction is not None and 0 < fraction < 1:
            eta = round((now - self.start) * (1 - fraction) / fraction, 2)
        elif final:
            eta = 0.0
        if eta_s is not None and not final:
            eta = round(float(eta_s), 2)
        event = p.Progress(id=self.command_id, task=self.task,
                           fraction=None if fraction is None else round(float(fraction), 4),
                           eta_s=eta, message=message)
        with self._lock:
            self.fraction, self.message = fraction, message
            wait = self.last_sent + self.min_interval_s - now
            if final or wait <= 0:
                self._held = None
                self._cancel_timer()
                self._send(event, now)
                return
            self._held = event
            if self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Send the held event, if any, now."""
        with self._lock:
            self._cancel_timer()
            if self._held is not None:
                event, self._held = self._held, None
                self._send(event, time.monotonic())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _send(self, event: p.Progress, now: float) -> None:
        self.last_sent = now
        self.emit(event)


@dataclass
class Task:
    """A background task (convert, download, plan) that cancel can reach."""

    id: str
    kind: str
    cancel_event: threading.Event = field(default_factory=threading.Event)
    process: Optional[subprocess.Popen] = None
    clock: Optional[ProgressClock] = None

    def cancel(self) -> None:
        self.cancel_event.set()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()


class Worker:
    def __init__(self, out: IO[str], host: Optional[ModelHost] = None):
        self._out = out
        self._out_lock = threading.Lock()
        self.host = host or ModelHost()
        self.engine = EngineQueue()
        self.tasks: dict[str, Task] = {}
        self._tasks_lock = threading.Lock()
        self._state = "idle"
        self._task_counter = 0

    # ------------------------------------------------------------------ output

    def emit(self, message: p.Message) -> None:
        line = p.encode(message)
        with self._out_lock:
            try:
                self._out.write(line)
                self._out.flush()
            except (BrokenPipeError, ValueError):
                pass  # the client went away; stdin EOF will end the loop

    def error(self, command: Optional[p.Message], code: str, message: str, request_id: Optional[str] = None) -> None:
        self.emit(p.Error(id=command.id if command else None, code=code, message=message, request_id=request_id,
                          command=command.type if command else None))

    # ------------------------------------------------------------------ main loop

    def run(self, stdin: IO[bytes]) -> None:
        self.emit(p.Hello(engine_version=ENGINE_VERSION, pid=os.getpid(), devices=self.host.devices(),
                          kernels_note=self.host.kernels_note()))
        for raw in stdin:
            if not raw.strip():
                continue
            if not self.handle_line(raw):
                break
        self.close()

    def handle_line(self, raw) -> bool:
        """Dispatch one line; False once the worker should exit."""
        try:
            cmd = p.decode(raw, p.COMMANDS)
        except p.ProtocolError as e:
            guess_id = _guess_id(raw)
            self.emit(p.Error(id=guess_id, code=p.ErrorCode.BAD_COMMAND, message=str(e)))
            return True
        try:
            return self.handle(cmd)
        except WorkerError as e:
            self.error(cmd, e.code, str(e), getattr(cmd, "request_id", None))
        except Exception as e:  # a bug: report it, keep serving
            traceback.print_exc(file=sys.stderr)
            self.error(cmd, p.ErrorCode.INTERNAL, f"internal error in {cmd.type}: {type(e).__name__}: {e}")
        return True

    def handle(self, cmd: p.Message) -> bool:
        if isinstance(cmd, p.Shutdown):
            self.emit(p.Result(id=cmd.id, command="shutdown"))
            return False
        handler = {p.Load: self.on_load, p.Unload: self.on_unload, p.Generate: self.on_generate,
                   p.Cancel: self.on_cancel, p.Status: self.on_status, p.Plan: self.on_plan,
                   p.Convert: self.on_convert, p.Download: self.on_download}[type(cmd)]
        handler(cmd)
        return True

    def close(self) -> None:
        """Stop everything this process started: the running generation, tasks, child processes."""
        with self._tasks_lock:
            tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        self.engine.stop(timeout=10.0)
        for task in tasks:
            if task.process is not None:
                try:
                    task.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    task.process.kill()

    # ------------------------------------------------------------------ model jobs

    def on_load(self, cmd: p.Load) -> None:
        def run(should_stop):
            self._state = "loading"
            clock = ProgressClock(self.emit, cmd.id, p.TaskKind.LOAD)
            try:
                info = self.host.load(cmd, clock)
                clock.flush()
                self.emit(p.Result(id=cmd.id, command="load", data=_asdict(info)))
            except WorkerError as e:
                clock.flush()
                self.error(cmd, e.code, str(e))
            finally:
                clock.flush()       # before any error the job queue reports for an unexpected failure
                self._state = "idle"
        self.engine.submit(Job(run=run, on_dropped=lambda: self.error(
            cmd, p.ErrorCode.CANCELLED, "load cancelled: the worker is shutting down")))

    def on_unload(self, cmd: p.Unload) -> None:
        def run(should_stop):
            self.host.unload()
            self.emit(p.Result(id=cmd.id, command="unload"))
        self.engine.submit(Job(run=run))

    def on_generate(self, cmd: p.Generate) -> None:
        rid = cmd.rid
        if not rid:
            raise WorkerError("generate needs a request_id (or an id)", p.ErrorCode.BAD_COMMAND)
        if self.engine.has_request(rid):
            raise WorkerError(f"request {rid} is already queued or running", p.ErrorCode.BAD_COMMAND)
        if cmd.messages is None and cmd.prompt is None:
            raise WorkerError("generate needs messages or a prompt", p.ErrorCode.BAD_COMMAND)
        enqueued = time.monotonic()

        def run(should_stop):
            queue_s = time.monotonic() - enqueued
            self._state = "generating"
            steps = [0]

            def counting_stop() -> bool:
                # generate() asks once per sampled token, so the count is the tokens so far.
                steps[0] += 1
                return should_stop()

            def on_text(delta: str) -> None:
                self.emit(p.Token(id=cmd.id, request_id=rid, text=delta, tokens=steps[0]))

            try:
                outcome = self.host.generate(cmd, on_text, counting_stop)
                outcome.stats.queue_s = round(queue_s, 4)
                reason = p.FinishReason.CANCELLED if should_stop() else outcome.finish_reason
                self.emit(p.Done(id=cmd.id, request_id=rid, finish_reason=reason, text=outcome.text,
                                 stats=outcome.stats))
            except WorkerError as e:
                self.error(cmd, e.code, str(e), rid)
            finally:
                self._state = "idle"

        def dropped():
            self.emit(p.Done(id=cmd.id, request_id=rid, finish_reason=p.FinishReason.CANCELLED,
                             stats=p.GenerationStats(queue_s=round(time.monotonic() - enqueued, 4))))
        self.engine.submit(Job(run=run, request_id=rid, on_dropped=dropped))

    def on_cancel(self, cmd: p.Cancel) -> None:
        where = self.engine.cancel(cmd.target)
        if where is None:
            with self._tasks_lock:
                task = self.tasks.get(cmd.target)
            if task is not None:
                task.cancel()
                where = "task"
        if where is None:
            raise WorkerError(f"nothing to cancel with id {cmd.target!r}", p.ErrorCode.NOT_FOUND)
        self.emit(p.Result(id=cmd.id, command="cancel", data={"target": cmd.target, "was": where}))

    def on_status(self, cmd: p.Status) -> None:
        running, queued = self.engine.snapshot()
        with self._tasks_lock:
            tasks = [p.TaskInfo(id=t.id, task=t.kind, fraction=t.clock.fraction if t.clock else None,
                                message=t.clock.message if t.clock else "") for t in self.tasks.values()]
        state = self._state if (running or self._state == "loading") else "idle"
        self.emit(p.StatusReport(id=cmd.id, state=state, model=self.host.info, devices=self.host.devices(),
                                 running=running, queue=queued, tasks=tasks))

    # ------------------------------------------------------------------ background tasks

    def _start_task(self, cmd: p.Message, kind: str, body: Callable[[Task], None]) -> None:
        with self._tasks_lock:
            self._task_counter += 1
            task_id = cmd.id or f"{kind}-{self._task_counter}"
            if task_id in self.tasks:
                raise WorkerError(f"a task with id {task_id!r} is already running", p.ErrorCode.BAD_COMMAND)
            task = Task(id=task_id, kind=kind)
            task.clock = ProgressClock(self.emit, cmd.id, kind)
            self.tasks[task_id] = task

        def run():
            # A task body calls task.clock.flush() before its result; an error flushes here, so a
            # held progress event is never lost and never arrives after the task's last word.
            try:
                body(task)
            except WorkerError as e:
                task.clock.flush()
                self.error(cmd, e.code, str(e))
            except Exception as e:
                task.clock.flush()
                traceback.print_exc(file=sys.stderr)
                self.error(cmd, p.ErrorCode.INTERNAL, f"internal error in {kind}: {type(e).__name__}: {e}")
            finally:
                with self._tasks_lock:
                    self.tasks.pop(task_id, None)
        threading.Thread(target=run, name=f"task-{task_id}", daemon=True).start()

    def on_plan(self, cmd: p.Plan) -> None:
        args = ["plan", "-m", cmd.model, "--context", str(cmd.context), "--batch", str(cmd.batch), "--json"]
        if cmd.cache_bits:
            args += ["--cache-bits", ",".join(str(b) for b in cmd.cache_bits)]
        if cmd.revision:
            args += ["--revision", cmd.revision]

        def body(task: Task):
            proc = subprocess.run(trellis_command(args), capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise WorkerError(_last_line(proc.stderr or proc.stdout) or "the planner failed",
                                  p.ErrorCode.PLAN_FAILED)
            try:
                plan = json.loads(proc.stdout)
            except ValueError:
                raise WorkerError("the planner's output was not JSON", p.ErrorCode.PLAN_FAILED) from None
            self.emit(p.Result(id=cmd.id, command="plan", data=plan if isinstance(plan, dict) else {"plan": plan}))
        self._start_task(cmd, "plan", body)

    def on_convert(self, cmd: p.Convert) -> None:
        if not cmd.input_dir or not cmd.output_dir:
            raise WorkerError("convert needs input_dir and output_dir", p.ErrorCode.BAD_COMMAND)
        args = convert_args(cmd)

        def body(task: Task):
            # The converter writes progress as JSON lines on stdout and its one-line errors on stderr.
            task.process = subprocess.Popen(trellis_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            stdin=subprocess.DEVNULL, text=True, bufsize=1)
            errors: list[str] = []
            drain = threading.Thread(target=lambda: errors.extend(task.process.stderr), daemon=True)
            drain.start()
            for line in task.process.stdout:
                if not line.strip():
                    continue
                fraction, message, eta = parse_progress_line(line, with_eta=True)
                task.clock(fraction, message, eta)
            code = task.process.wait()
            drain.join(5)
            last = _last_line("".join(errors))
            if task.cancel_event.is_set():
                raise WorkerError("conversion cancelled (resume it later with the same work folder)",
                                  p.ErrorCode.CANCELLED)
            if code != 0:
                raise WorkerError(_last_line(last) or f"conversion failed (exit code {code})",
                                  p.ErrorCode.CONVERT_FAILED)
            task.clock(1.0, "conversion finished")      # final: sent at once, nothing held after it
            self.emit(p.Result(id=cmd.id, command="convert", data={"output_dir": cmd.output_dir}))
        self._start_task(cmd, "convert", body)

    def on_download(self, cmd: p.Download) -> None:
        if not cmd.repo:
            raise WorkerError("download needs a repo", p.ErrorCode.BAD_COMMAND)

        def body(task: Task):
            from engine import hub
            try:
                local = hub.download(cmd.repo, revision=cmd.revision, files=cmd.files, local_dir=cmd.local_dir,
                                     progress=lambda f, msg: task.clock(f, msg), cancel=task.cancel_event)
            except hub.DownloadCancelled:
                raise WorkerError("download cancelled (start it again to resume)", p.ErrorCode.CANCELLED) from None
            except hub.HubOffline as e:
                raise WorkerError(str(e), p.ErrorCode.OFFLINE) from None
            except hub.HubError as e:
                raise WorkerError(str(e), p.ErrorCode.DOWNLOAD_FAILED) from None
            task.clock.flush()
            self.emit(p.Result(id=cmd.id, command="download", data={"local_dir": str(local)}))
        self._start_task(cmd, "download", body)


# ---------------------------------------------------------------------- helpers

def convert_args(cmd: p.Convert) -> list[str]:
    """`trellis convert` arguments for a Convert command (engine/convert_cli.py defines them)."""
    args = ["convert", "-i", cmd.input_dir, "-o", cmd.output_dir, "-b", str(cmd.bits)]
    if cmd.head_bits is not None:
        args += ["-hb", str(cmd.head_bits)]
    if cmd.work_dir:
        args += ["-w", cmd.work_dir]
    if cmd.resume:
        args += ["-r"]
    if cmd.codebook:
        args += ["--codebook", cmd.codebook]
    for flag, value in (("--cal-rows", cmd.cal_rows), ("--cal-cols", cmd.cal_cols),
                        ("--calibration", cmd.calibration), ("--device", cmd.device)):
        if value is not None and value != "":
            args += [flag, str(value)]
    return args + ["--progress-json"]


def trellis_command(args: list[str]) -> list[str]:
    """`trellis ARGS` with this interpreter, so the child uses the same environment."""
    return [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())", *args]


_FRACTION_RE = re.compile(r"(\d+)\s*(?:/|of)\s*(\d+)")
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def parse_progress_line(line: str, with_eta: bool = False):
    """A progress line from a child process -> (fraction, message[, eta_s]). JSON lines carry
    `fraction` or `index`/`done` of `total`, and maybe `eta_s` (the converter's --progress-json);
    text lines may say "i/n", "i of n" or "p%"; anything else is a message without a fraction."""
    text = line.strip()
    fraction, message, eta = None, text, None
    obj = None
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
    if isinstance(obj, dict):
        fraction = obj.get("fraction")
        if fraction is None and obj.get("total"):
            fraction = obj.get("done", obj.get("index", 0)) / obj["total"]
        fraction = float(fraction) if isinstance(fraction, (int, float)) else None
        message = str(obj.get("message") or obj.get("module") or obj.get("stage") or "")
        eta = obj.get("eta_s") if isinstance(obj.get("eta_s"), (int, float)) else None
    elif (m := _FRACTION_RE.search(text)) and int(m.group(2)) > 0:
        fraction = min(1.0, int(m.group(1)) / int(m.group(2)))
    elif m := _PERCENT_RE.search(text):
        fraction = min(1.0, float(m.group(1)) / 100.0)
    return (fraction, message, eta) if with_eta else (fraction, message)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _guess_id(raw) -> Optional[str]:
    try:
        obj = json.loads(raw)
        value = obj.get("id") if isinstance(obj, dict) else None
        return value if isinstance(value, str) else None
    except ValueError:
        return None


def _asdict(obj) -> dict:
    import dataclasses
    return dataclasses.asdict(obj)
