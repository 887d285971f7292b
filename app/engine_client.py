"""EngineClient: the only road from the app to the engine process.

The engine (`python -m engine.worker`) speaks JSON lines (engine/worker/protocol.py) over its
stdin/stdout. Background threads (app/engine_process.py) read and decode those lines and write
commands, so a flood of token events or a slow engine never blocks the UI thread; what they read
comes to the UI thread through a UiMailbox and goes out from here as Qt signals. The UI thread
only calls methods that queue a line and return at once. When the process ends without being
asked to, `died(reason)` says why (exit code or signal, and the last line the engine wrote to
stderr) and `restart()` brings a fresh one up.
"""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.engine_process import EngineProcess
from app.ui_mailbox import UiMailbox
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
        self._mailbox = UiMailbox(self)
        self._process: EngineProcess | None = None   # until its end has been delivered here

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine unless one is running; `ready` follows its hello, `died` a failure."""
        if self._process is not None:
            return
        self.last_death = None
        try:
            self._process = EngineProcess(self.argv, self.env, REPO_ROOT, self._mailbox,
                                          self._on_message, self._on_ended)
        except OSError:
            reason = f"The engine could not be started ({self.argv[0]} failed to run)."
            self._mailbox.post(self._on_ended, None, -1, reason, False)
            return
        self._set_running(True)

    def restart(self) -> None:
        self.start()

    def stop(self, kill: bool = False) -> None:
        """Ask the engine to exit (closing its stdin; killed after a grace period), or kill it.
        Returns at once: running_changed(False) says when it is gone."""
        if self._process is not None:
            self._process.stop(kill)

    def close(self) -> None:
        """Stop the process and wait for it (a few seconds at most); call once, when the app
        quits. Nothing is delivered after this."""
        if self._process is not None:
            self._process.stop_and_wait()
            self._process = None
        self.running = False
        self._mailbox.close()

    @property
    def pid(self) -> int | None:
        """The engine's process id while this client holds one."""
        return self._process.popen.pid if self._process is not None else None

    def _set_running(self, running: bool) -> None:
        if running != self.running:
            self.running = running
            self.running_changed.emit(running)

    # ------------------------------------------------------------------ commands
    def send(self, msg: P.Message) -> str:
        if msg.id is None:
            msg.id = str(next(self._ids))
        self._pending[msg.id] = msg.type
        if self._process is not None:
            self._process.write(P.encode(msg))
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

    def _on_ended(self, process: EngineProcess | None, code: int, reason: str, expected: bool) -> None:
        if process is not self._process:       # a run this client has already let go of
            return
        self._process = None
        self._set_running(False)
        self.hello = None
        self._pending.clear()
        if self.model is not None:
            self.model = None
            self.model_changed.emit(None)
        if not expected:
            self.last_death = reason
            self.died.emit(reason)
