"""A conversion as the app runs it: the request, where it stands on disk, and two ways to run it.

The conversion job (engine/convert.py) keeps all its state in its work folder (`job.json`, the
finished modules), so it survives the app: stopped or killed, it continues from the last finished
module when started again with `-r` and the same settings. The app remembers which jobs it started
(`conversions.json` in the Trellis home) so the wizard can offer to resume the unfinished ones.

Two runners with one interface (signals `progress(ConvertProgress)` and `finished(ok, text)`):
- `EngineConvert` sends the worker's `convert` command (the engine relays the job's progress);
- `ProcessConvert` starts `trellis convert --progress-json` itself in a QProcess. It is used when
  the engine is not running, and it sees every module's report.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QObject, QProcess, Signal

from app import settings
from engine.worker import protocol as P

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ConversionRequest:
    in_dir: str
    out_dir: str
    work_dir: str
    bits: float = 4.0
    head_bits: int = 6
    cal_rows: int = 250
    cal_cols: int = 2048
    calibration: Optional[str] = None     # a text file or folder; None = the built-in mix
    codebook: str = "mul1"

    def cli_args(self) -> list[str]:
        args = ["convert", "-i", self.in_dir, "-o", self.out_dir, "-w", self.work_dir, "-b", f"{self.bits:g}",
                "-hb", str(self.head_bits), "--codebook", self.codebook, "--cal-rows", str(self.cal_rows),
                "--cal-cols", str(self.cal_cols), "-r", "--progress-json"]
        if self.calibration:
            args += ["--calibration", self.calibration]
        return args


@dataclass
class ConvertProgress:
    stage: str = ""                 # "start" | "measure" | "module" | "compile" | "done" | "" (relayed by the engine)
    fraction: Optional[float] = None
    index: Optional[int] = None     # modules finished
    total: Optional[int] = None
    module: str = ""
    eta_s: Optional[float] = None
    elapsed_s: Optional[float] = None
    report: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- state on disk

def registry_path() -> Path:
    return settings.home() / "conversions.json"


def _read_registry() -> list[dict]:
    try:
        data = json.loads(registry_path().read_text())
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def _write_registry(items: list[dict]) -> None:
    path = registry_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(items, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def remember(req: ConversionRequest) -> None:
    items = [i for i in _read_registry() if i.get("out_dir") != req.out_dir]
    _write_registry(items + [asdict(req)])


def forget(out_dir: str) -> None:
    _write_registry([i for i in _read_registry() if i.get("out_dir") != out_dir])


def discard(req: ConversionRequest) -> None:
    """Forget a job and delete its work folder (only a folder that holds a conversion job)."""
    forget(req.out_dir)
    work = Path(req.work_dir)
    if (work / "job.json").is_file():
        shutil.rmtree(work, ignore_errors=True)


def modules_done(work_dir: str | Path) -> Optional[int]:
    """Modules finished by the job in `work_dir`, or None when it holds no job."""
    try:
        job = json.loads((Path(work_dir) / "job.json").read_text())
        return int(job.get("done", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def unfinished() -> list[tuple[ConversionRequest, int]]:
    """Jobs the app started whose work folder still holds a job and whose output is not there."""
    out = []
    for item in _read_registry():
        try:
            req = ConversionRequest(**item)
        except TypeError:
            continue
        done = modules_done(req.work_dir)
        if done is not None and not (Path(req.out_dir) / "config.json").exists():
            out.append((req, done))
    return out


# ---------------------------------------------------------------------------- runners

class _Runner(QObject):
    progress = Signal(object)       # ConvertProgress
    finished = Signal(bool, str)    # ok, output folder or the one-line reason

    def start(self, req: ConversionRequest) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        raise NotImplementedError


class ProcessConvert(_Runner):
    """`trellis convert ... --progress-json` in a QProcess: JSON lines on stdout, the one-line
    error on stderr."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.proc: Optional[QProcess] = None
        self._buf = b""
        self._err: list[str] = []
        self._stopping = False
        self.req: Optional[ConversionRequest] = None

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self, req: ConversionRequest) -> None:
        self.req, self._buf, self._err, self._stopping = req, b"", [], False
        proc = QProcess(self)
        proc.setWorkingDirectory(str(REPO_ROOT))
        proc.readyReadStandardOutput.connect(self._read)
        proc.readyReadStandardError.connect(self._read_err)
        proc.finished.connect(self._done)
        proc.errorOccurred.connect(self._error)
        self.proc = proc
        proc.start(sys.executable, ["-c", "import sys; from engine.cli import main; sys.exit(main())",
                                    *req.cli_args()])

    def stop(self) -> None:
        """Stop the process; the work folder keeps every finished module."""
        if self.proc is None:
            return
        self._stopping = True
        proc = self.proc
        proc.terminate()
        if not proc.waitForFinished(5000):
            proc.kill()
            proc.waitForFinished(3000)

    def _read(self) -> None:
        if self.proc is None:
            return
        self._buf += bytes(self.proc.readAllStandardOutput())
        *lines, self._buf = self._buf.split(b"\n")
        for raw in lines:
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(e, dict) or e.get("event") != "progress":
                continue
            total = e.get("total") or 0
            index = e.get("index")
            self.progress.emit(ConvertProgress(
                stage=str(e.get("stage", "")), index=index, total=total or None,
                fraction=(index / total) if total and isinstance(index, int) else None,
                module=str(e.get("module") or ""), eta_s=e.get("eta_s"), elapsed_s=e.get("elapsed_s"),
                report=e.get("report") or {}))

    def _read_err(self) -> None:
        if self.proc is None:
            return
        text = bytes(self.proc.readAllStandardError()).decode("utf-8", "replace")
        self._err += [line.strip() for line in text.splitlines() if line.strip()]
        del self._err[:-20]

    def _done(self, code: int, _status) -> None:
        if self.proc is None:
            return
        self._read()
        self._read_err()
        self.proc.deleteLater()
        self.proc = None
        if self._stopping:
            self.finished.emit(False, "stopped")
        elif code == 0:
            self.finished.emit(True, self.req.out_dir)
        else:
            last = next((l for l in reversed(self._err) if not l.startswith(("File ", "Traceback"))), "")
            self.finished.emit(False, last or f"the converter stopped (exit code {code})")

    def _error(self, err) -> None:
        if err == QProcess.FailedToStart and self.proc is not None:
            self.proc.deleteLater()
            self.proc = None
            self.finished.emit(False, "the converter could not be started")


class EngineConvert(_Runner):
    """The worker's `convert` command; progress relayed by the engine as fraction, module and ETA."""

    def __init__(self, client, parent=None):
        super().__init__(parent)
        self.client = client
        self.command_id: Optional[str] = None
        self._stopping = False
        self.req: Optional[ConversionRequest] = None
        client.progress.connect(self._progress)
        client.result.connect(self._result)
        client.error.connect(self._error)
        client.died.connect(self._died)

    @property
    def running(self) -> bool:
        return self.command_id is not None

    def start(self, req: ConversionRequest) -> None:
        self.req, self._stopping = req, False
        self.command_id = self.client.send(P.Convert(
            input_dir=req.in_dir, output_dir=req.out_dir, bits=req.bits, head_bits=req.head_bits,
            work_dir=req.work_dir, resume=True, codebook=req.codebook, cal_rows=req.cal_rows, cal_cols=req.cal_cols,
            calibration=req.calibration or None))

    def stop(self) -> None:
        if self.command_id:
            self._stopping = True
            self.client.cancel(self.command_id)

    def _progress(self, cmd_id: str, prog) -> None:
        if cmd_id and cmd_id == self.command_id:
            # The engine relays the job's module name, or its stage name between modules.
            stage = prog.message if prog.message in ("start", "measure", "compile", "done") else ""
            module = "" if stage else prog.message
            self.progress.emit(ConvertProgress(stage=stage, fraction=prog.fraction, module=module, eta_s=prog.eta_s))

    def _result(self, cmd_id: str, command: str, data) -> None:
        if cmd_id and cmd_id == self.command_id and command == "convert":
            self.command_id = None
            self.finished.emit(True, str(data.get("output_dir") or self.req.out_dir))

    def _error(self, err) -> None:
        if err.id and err.id == self.command_id:
            self.command_id = None
            stopped = self._stopping or err.code == P.ErrorCode.CANCELLED
            self.finished.emit(False, "stopped" if stopped else err.message)

    def _died(self, reason: str) -> None:
        if self.command_id:
            self.command_id = None
            self.finished.emit(False, f"the engine stopped ({reason})")
