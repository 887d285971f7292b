"""EngineClient: the only road from the app to the engine process.

The engine (`python -m engine.worker`) speaks JSON lines (engine/worker/protocol.py) over its
stdin/stdout. A QProcess owned by a helper object in its own QThread reads and parses those
lines, so a flood of token events never costs the UI thread more than one queued signal each;
the UI thread only calls methods that post a line and return at once, and gets every answer as a
Qt signal. When the process ends without being asked to, `died(reason)` says why (exit code or
signal, and the last line the engine wrote to stderr) and `restart()` brings a fresh one up.
"""
from __future__ import annotations

import itertools
import os
import sys
from collections import deque
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Qt, QThread, Signal, Slot

from engine.worker import protocol as P

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_worker_argv() -> list[str]:
    return [sys.executable, "-m", "engine.worker"]


def kernels_caveat(hello) -> str:
    """Why the engine's GPU would run models without the CUDA kernels (its Hello says), or "":
    plans for that GPU then count the weights' dense copies."""
    if hello is None or not any(d.device.startswith("cuda") for d in hello.devices):
        return ""
    return hello.kernels_note or ""


def missing_kernels(model: dict | None) -> str | None:
    """Why a loaded model on a GPU runs without the CUDA kernels (the engine's one line), or None
    when it has them or runs on the CPU, where the PyTorch path is the expected one."""
    if not model or not str(model.get("device", "")).startswith("cuda") or model.get("kernels") != "torch":
        return None
    return model.get("kernels_note") or "the CUDA kernels are unavailable"


class _Pipe(QObject):
    """Lives in the client's thread: owns the QProcess and turns its lines into messages."""

    message = Signal(object)          # a decoded protocol event
    bad_line = Signal(str)
    started = Signal(int)
    ended = Signal(int, str, bool)    # exit code, reason, expected

    def __init__(self):
        super().__init__()
        self.proc: QProcess | None = None
        self._buf = b""
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._expected_exit = False

    @Slot(list, dict)
    def start(self, argv: list, env: dict) -> None:
        if self.proc is not None:
            return
        self._buf, self._expected_exit = b"", False
        self._stderr_tail.clear()
        proc = QProcess(self)
        penv = QProcessEnvironment.systemEnvironment()
        for k, v in env.items():
            penv.insert(k, v)
        proc.setProcessEnvironment(penv)
        proc.setWorkingDirectory(str(REPO_ROOT))
        proc.readyReadStandardOutput.connect(self._read_stdout)
        proc.readyReadStandardError.connect(self._read_stderr)
        proc.finished.connect(self._finished)
        proc.errorOccurred.connect(self._error)
        self.proc = proc
        proc.start(argv[0], argv[1:])
        if proc.waitForStarted(10000):
            self.started.emit(int(proc.processId()))

    @Slot(str)
    def write(self, line: str) -> None:
        if self.proc is not None and self.proc.state() == QProcess.Running:
            self.proc.write(line.encode("utf-8"))

    @Slot(bool)
    def stop(self, kill: bool) -> None:
        if self.proc is None:
            return
        self._expected_exit = True
        proc = self.proc          # _finished() clears self.proc from inside waitForFinished
        if kill:
            proc.kill()
        else:
            proc.closeWriteChannel()
            if not proc.waitForFinished(3000) and self.proc is proc:
                proc.kill()
        if self.proc is proc:
            proc.waitForFinished(3000)

    def _read_stdout(self) -> None:
        self._buf += bytes(self.proc.readAllStandardOutput())
        *lines, self._buf = self._buf.split(b"\n")
        for raw in lines:
            if not raw.strip():
                continue
            try:
                self.message.emit(P.decode(raw, P.EVENTS))
            except P.ProtocolError as e:
                self.bad_line.emit(f"{e}: {raw[:200]!r}")

    def _read_stderr(self) -> None:
        text = bytes(self.proc.readAllStandardError()).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.strip():
                self._stderr_tail.append(line.rstrip())

    def _reason(self, code: int, crashed: bool) -> str:
        last = ""
        for line in reversed(self._stderr_tail):
            if not line.startswith((" ", "\t", "Traceback")):
                last = line.strip()
                break
        if crashed:
            head = "The engine was killed" + (" (perhaps it ran out of memory)" if not last else "")
        else:
            head = f"The engine stopped (exit code {code})"
        return f"{head}: {last}" if last else head + "."

    def _finished(self, code: int, status) -> None:
        if self.proc is None:
            return
        self._read_stderr()
        crashed = status == QProcess.CrashExit
        reason = self._reason(code, crashed)
        expected = self._expected_exit
        self.proc.deleteLater()
        self.proc = None
        self.ended.emit(code, reason, expected)

    def _error(self, err) -> None:
        if err == QProcess.FailedToStart and self.proc is not None:
            program = self.proc.program()
            self.proc.deleteLater()
            self.proc = None
            self.ended.emit(-1, f"The engine could not be started ({program} failed to run).", False)


class EngineClient(QObject):
    """Commands go out as methods (each returns the command id); answers come back as signals."""

    ready = Signal(object)                 # Hello
    token = Signal(str, str, int)          # request id, text delta, tokens so far
    done = Signal(str, object)             # request id, Done
    error = Signal(object)                 # protocol Error
    progress = Signal(str, object)         # command id, Progress
    result = Signal(str, str, object)      # command id, command, data dict
    status_report = Signal(object)         # StatusReport
    died = Signal(str)                     # reason a person can read
    running_changed = Signal(bool)
    model_changed = Signal(object)         # ModelInfo dict or None

    _start = Signal(list, dict)
    _write = Signal(str)
    _stop = Signal(bool)
    _stop_blocking = Signal(bool)

    def __init__(self, argv: list[str] | None = None, env: dict | None = None, parent=None):
        super().__init__(parent)
        self.argv = argv or default_worker_argv()
        self.env = dict(env or {})
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env.setdefault("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])))
        self._ids = itertools.count(1)
        self.hello: P.Hello | None = None
        self.model: dict | None = None
        self.devices: list[P.DeviceMemory] = []
        self.running = False
        self.last_death: str | None = None
        self._pending: dict[str, str] = {}     # command id -> command type
        self._thread = QThread()
        self._thread.setObjectName("EngineClient")
        self._pipe = _Pipe()
        self._pipe.moveToThread(self._thread)
        self._start.connect(self._pipe.start)
        self._write.connect(self._pipe.write)
        self._stop.connect(self._pipe.stop)
        self._stop_blocking.connect(self._pipe.stop, Qt.BlockingQueuedConnection)
        self._pipe.message.connect(self._on_message)
        self._pipe.ended.connect(self._on_ended)
        self._pipe.started.connect(lambda pid: self._set_running(True))
        self._thread.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.last_death = None
        self._start.emit(self.argv, self.env)

    def restart(self) -> None:
        self.start()

    def stop(self, kill: bool = False) -> None:
        """Ask the engine to exit (closing its stdin) and wait for it, off the UI thread."""
        self._stop.emit(kill)

    def close(self) -> None:
        """Stop the process and the thread; call once, when the app quits."""
        if self._thread.isRunning():
            self._stop_blocking.emit(False)
            self._thread.quit()
            self._thread.wait(5000)

    def _set_running(self, running: bool) -> None:
        if running != self.running:
            self.running = running
            self.running_changed.emit(running)

    # ------------------------------------------------------------------ commands
    def send(self, msg: P.Message) -> str:
        if msg.id is None:
            msg.id = str(next(self._ids))
        self._pending[msg.id] = msg.type
        self._write.emit(P.encode(msg))
        return msg.id

    def load(self, model_dir: str, max_context: int = 0, cache_bits: list[int] | None = None,
             device: str = "auto") -> str:
        return self.send(P.Load(model_dir=str(model_dir), max_context=max_context, cache_bits=cache_bits, device=device))

    def unload(self) -> str:
        return self.send(P.Unload())

    def generate(self, request_id: str, messages: list[dict] | None = None, prompt: str | None = None,
                 sampler: P.SamplerParams | None = None, max_tokens: int = 512, images: list[str] | None = None) -> str:
        return self.send(P.Generate(request_id=request_id, messages=messages, prompt=prompt,
                                    sampler=sampler or P.SamplerParams(), max_tokens=max_tokens, images=list(images or [])))

    def cancel(self, target: str) -> str:
        return self.send(P.Cancel(target=target))

    def status(self) -> str:
        return self.send(P.Status())

    def plan(self, model: str, context: int, batch: int = 1, cache_bits: list[int] | None = None) -> str:
        return self.send(P.Plan(model=model, context=context, batch=batch, cache_bits=cache_bits))

    def convert(self, input_dir: str, output_dir: str, bits: float, head_bits: int | None = None,
                work_dir: str | None = None) -> str:
        return self.send(P.Convert(input_dir=input_dir, output_dir=output_dir, bits=bits, head_bits=head_bits,
                                   work_dir=work_dir))

    def download(self, repo: str, revision: str = "main", local_dir: str | None = None) -> str:
        return self.send(P.Download(repo=repo, revision=revision, local_dir=local_dir))

    # ------------------------------------------------------------------ events
    def _on_message(self, m: P.Message) -> None:
        if isinstance(m, P.Token):
            self.token.emit(m.request_id, m.text, m.tokens)
        elif isinstance(m, P.Done):
            self.done.emit(m.request_id, m)
        elif isinstance(m, P.Progress):
            self.progress.emit(m.id or "", m)
        elif isinstance(m, P.Result):
            self._pending.pop(m.id or "", None)
            if m.command == "load":
                self.model = dict(m.data)
                self.model_changed.emit(self.model)
            elif m.command == "unload":
                self.model = None
                self.model_changed.emit(None)
            self.result.emit(m.id or "", m.command, m.data)
        elif isinstance(m, P.Error):
            cmd = self._pending.pop(m.id or "", None)
            if m.command is None and cmd is not None:
                m.command = cmd
            self.error.emit(m)
        elif isinstance(m, P.StatusReport):
            if m.devices:
                self.devices = m.devices
            self.status_report.emit(m)
        elif isinstance(m, P.Hello):
            self.hello = m
            self.devices = m.devices
            self.ready.emit(m)

    def _on_ended(self, code: int, reason: str, expected: bool) -> None:
        self._set_running(False)
        self.hello = None
        self._pending.clear()
        if self.model is not None:
            self.model = None
            self.model_changed.emit(None)
        if not expected:
            self.last_death = reason
            self.died.emit(reason)
