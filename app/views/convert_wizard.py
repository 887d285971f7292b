"""Conversion wizard: source (a library folder or a hub repo) → target bpw with a live estimate of
the output size and a fit badge, head bits, calibration → output and work folders → run with
progress per module and ETA.

The conversion is a job whose only state is its work folder (engine/convert.py), so closing the
wizard, or the app, loses nothing: the job stops after asking, and the next wizard lists it under
"Unfinished conversions" with a Resume button (app/convert_job.py remembers the settings; the
converter checks that they still match the work folder). The run goes through the engine's
`convert` command (user calibration data included) when the engine runs, and through
`trellis convert` in a QProcess when it does not.
"""
from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Optional

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QButtonGroup, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QLabel, QLineEdit, QListWidget, QListWidgetItem, QMessageBox, QProgressBar,
                               QPushButton, QRadioButton, QSpinBox, QVBoxLayout, QWidget, QWizard, QWizardPage)

from app import convert_job as J
from app.background import failure_line, run_in_background
from app.convert_job import ConversionRequest, ConvertProgress
from app.engine_client import kernels_caveat
from app.models.hub_models import badge_color
from app.ui_mailbox import UiMailbox
from engine import plan as planner
from engine.errors import TrellisError

HEAD_BITS = ["6", "8", "5", "4", "3", "16"]


def target_name(source: Path, bits: float, head_bits: int) -> str:
    return f"{source.name}-exl3-{bits:g}bpw-h{head_bits}"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n > 2**29 else f"{n / 2**20:.1f} MiB"


def _duration(s: float) -> str:
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h} h {m:02d} min" if h else (f"{m} min {sec:02d} s" if m else f"{sec} s")


def _restyle(w: QWidget) -> None:
    w.style().unpolish(w)
    w.style().polish(w)


def _hub_config(repo: str, revision: str) -> dict:
    """config.json of a hub repo revision, with its total size, checking that it has safetensors
    weights to convert (runs on a background thread)."""
    from engine import hub
    commit, files = hub.repo_files(repo, revision)
    if not any(f.path.endswith(".safetensors") for f in files):
        raise hub.HubError(f"{repo}@{revision} has no .safetensors weights to convert")
    text = hub.read_text(repo, commit, "config.json", 4 << 20)
    if text is None:
        raise hub.HubError(f"{repo}@{revision} has no config.json: it is not a model")
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise hub.HubError(f"{repo}@{revision}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise hub.HubError(f"{repo}@{revision}: config.json is not a JSON object")
    cfg["_size_bytes"] = sum(f.size for f in files)
    return cfg


# ---------------------------------------------------------------------------- pages

class SourcePage(QWizardPage):
    def __init__(self, sources: list[tuple[str, str]]):
        super().__init__()
        self.setTitle("Model to convert")
        self.setSubTitle("An unquantized Hugging Face model: a folder in your library, or a repo on the hub "
                         "(downloaded into the library first).")
        self.hub_config: Optional[dict] = None
        self.hub_error = ""
        self._seq = 0
        self._mailbox = UiMailbox(self)

        # unfinished jobs
        self.unfinished = QListWidget()
        self.resume_button = QPushButton("Resume")
        self.resume_button.setObjectName("primary")
        self.resume_button.clicked.connect(self._resume_clicked)
        self.unfinished_box = QWidget()
        ub = QVBoxLayout(self.unfinished_box)
        ub.setContentsMargins(0, 0, 0, 8)
        ub.addWidget(QLabel("<b>Unfinished conversions</b> — they continue where they stopped:"))
        urow = QHBoxLayout()
        urow.addWidget(self.unfinished, 1)
        self.discard_button = QPushButton("Discard…")
        self.discard_button.setToolTip("Delete this job's work folder (the finished modules are lost)")
        self.discard_button.clicked.connect(self._discard_clicked)
        ubuttons = QVBoxLayout()
        ubuttons.addWidget(self.resume_button)
        ubuttons.addWidget(self.discard_button)
        ubuttons.addStretch(1)
        urow.addLayout(ubuttons)
        ub.addLayout(urow)

        self.local_radio = QRadioButton("A model folder")
        self.hub_radio = QRadioButton("A Hugging Face repo")
        self.local_radio.setChecked(True)
        group = QButtonGroup(self)
        group.addButton(self.local_radio)
        group.addButton(self.hub_radio)
        self.combo = QComboBox()
        self.combo.setEditable(True)
        self.combo.lineEdit().setPlaceholderText("a folder with config.json and .safetensors")
        for label, path in sources:
            self.combo.addItem(label, path)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.repo = QLineEdit()
        self.repo.setPlaceholderText("owner/name")
        self.revision = QLineEdit("main")
        self.revision.setMaximumWidth(120)
        self.lookup = QPushButton("Look up")
        self.lookup.clicked.connect(self.fetch_hub_config)
        self.repo.returnPressed.connect(self.fetch_hub_config)
        self.info = QLabel()
        self.info.setWordWrap(True)

        local_row = QHBoxLayout()
        local_row.addWidget(self.combo, 1)
        local_row.addWidget(browse)
        hub_row = QHBoxLayout()
        hub_row.addWidget(self.repo, 1)
        hub_row.addWidget(QLabel("revision"))
        hub_row.addWidget(self.revision)
        hub_row.addWidget(self.lookup)
        self.local_widgets = QWidget()
        self.local_widgets.setLayout(local_row)
        self.hub_widgets = QWidget()
        self.hub_widgets.setLayout(hub_row)
        for w in (self.local_widgets, self.hub_widgets):
            w.layout().setContentsMargins(18, 0, 0, 0)

        lay = QVBoxLayout(self)
        lay.addWidget(self.unfinished_box)
        lay.addWidget(self.local_radio)
        lay.addWidget(self.local_widgets)
        lay.addWidget(self.hub_radio)
        lay.addWidget(self.hub_widgets)
        lay.addWidget(self.info)
        lay.addStretch(1)
        self.combo.currentIndexChanged.connect(lambda *_: self.completeChanged.emit())
        self.combo.editTextChanged.connect(lambda *_: self.completeChanged.emit())
        self.local_radio.toggled.connect(self._mode_changed)
        self.repo.textChanged.connect(self._hub_edited)
        self.revision.textChanged.connect(self._hub_edited)
        self._mode_changed()
        self.refresh_unfinished()

    # -- unfinished jobs
    def refresh_unfinished(self) -> None:
        self.unfinished.clear()
        for req, done in J.unfinished():
            text = (f"{Path(req.in_dir).name} → {Path(req.out_dir).name}  ·  {req.bits:g} bpw  ·  "
                    f"{done} module{'s' if done != 1 else ''} done")
            item = QListWidgetItem(text)
            item.setData(Qt.UserRole, req)
            item.setToolTip(f"work folder: {req.work_dir}")
            self.unfinished.addItem(item)
        if self.unfinished.count():
            self.unfinished.setCurrentRow(0)
            rows = min(self.unfinished.count(), 3)
            frame = 2 * self.unfinished.frameWidth() + 8
            self.unfinished.setFixedHeight(self.unfinished.sizeHintForRow(0) * rows + frame)
        self.unfinished_box.setVisible(self.unfinished.count() > 0)

    def _resume_clicked(self) -> None:
        item = self.unfinished.currentItem()
        if item is not None:
            self.wizard().resume_job(item.data(Qt.UserRole))

    def _discard_clicked(self, confirm: bool = True) -> None:
        item = self.unfinished.currentItem()
        if item is None:
            return
        req = item.data(Qt.UserRole)
        if confirm and self.wizard().confirm_close and QMessageBox.question(
                self, "Discard the conversion?", f"Delete {req.work_dir}? The finished modules are lost.") \
                != QMessageBox.Yes:
            return
        J.discard(req)
        self.refresh_unfinished()

    # -- source
    def is_hub(self) -> bool:
        return self.hub_radio.isChecked()

    def _mode_changed(self, *_):
        self.local_widgets.setEnabled(not self.is_hub())
        self.hub_widgets.setEnabled(self.is_hub())
        self.completeChanged.emit()

    def _hub_edited(self, *_):
        self.hub_config, self.hub_error = None, ""
        self.completeChanged.emit()

    def hub_source(self) -> tuple[str, str]:
        return self.repo.text().strip(), self.revision.text().strip() or "main"

    def fetch_hub_config(self) -> None:
        from app.hub_info import looks_like_repo_id
        repo, rev = self.hub_source()
        self.hub_config, self.hub_error = None, ""
        if not looks_like_repo_id(repo):
            self.hub_error = "A hub repo id looks like owner/name."
            self.completeChanged.emit()
            return
        self._seq += 1
        seq = self._seq
        self.info.setText(f"Reading {repo}@{rev} from the hub…")
        run_in_background(self._mailbox, lambda: _hub_config(repo, rev), lambda cfg: self._fetched(seq, cfg, ""),
                          lambda e: self._fetched(seq, None, failure_line(e)), name="hub-config")

    def _fetched(self, seq: int, cfg, err: str) -> None:
        if seq != self._seq:
            return
        self.hub_config, self.hub_error = cfg, (err[:1].upper() + err[1:] if err else "")
        self.completeChanged.emit()

    def path(self) -> str:
        """The local source folder (for a hub repo: where it will be downloaded)."""
        if self.is_hub():
            repo, rev = self.hub_source()
            name = repo.split("/")[-1] + ("" if rev == "main" else f"-{rev}")
            return str(Path(self.wizard().models_dir) / name) if self.wizard() else name
        i = self.combo.currentIndex()
        text = self.combo.currentText()
        if i >= 0 and self.combo.itemText(i) == text and self.combo.itemData(i):
            return self.combo.itemData(i)
        return text

    def config(self) -> dict | None:
        if self.is_hub():
            return self.hub_config
        try:
            cfg = json.loads((Path(self.path()) / "config.json").read_text())
            return cfg if isinstance(cfg, dict) else None
        except (OSError, ValueError):
            return None

    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Model folder", str(Path.home()))
        if d:
            self.combo.setEditText(d)

    def validatePage(self) -> bool:
        return self.isComplete()          # QWizard.next() alone does not ask isComplete

    def isComplete(self) -> bool:
        if self.is_hub():
            if self.hub_error:
                self.info.setText(f"<span style='color:{badge_color('bad')}'>{html.escape(self.hub_error)}</span>")
                return False
            if self.hub_config is None:
                if not self.info.text().startswith("Reading"):
                    self.info.setText("Type a repo id and press Look up." if self.repo.text().strip() else "")
                return False
        cfg = self.config()
        if cfg is None:
            self.info.setText("Choose a folder with a config.json (a Hugging Face model folder)."
                              if self.path() else "")
            return False
        q = cfg.get("quantization_config") or {}
        if isinstance(q, dict) and q.get("quant_method") == "exl3":
            self.info.setText("This model is already EXL3; pick the unquantized original.")
            return False
        if not self.is_hub() and not any(Path(self.path()).glob("*.safetensors")):
            self.info.setText("This folder has no .safetensors weights to convert.")
            return False
        arch = (cfg.get("architectures") or ["?"])[0]
        layers = cfg.get("num_hidden_layers", "?")
        text = f"{arch}, {layers} layer{'' if layers == 1 else 's'}"
        if self.is_hub():
            text += f" · {_size(int(cfg.get('_size_bytes', 0)))} to download first"
        self.info.setText(text)
        return True


class TargetPage(QWizardPage):
    def __init__(self, capacity: list[int], context: int, without_kernels: str = ""):
        super().__init__()
        self.capacity, self.context = capacity, context
        self.without_kernels = without_kernels  # the engine's GPU lacks the CUDA kernels: weights count dense
        self.setTitle("Target size and calibration")
        self.setSubTitle("Bits per weight trade size for quality: about 4 is close to the original; below 3 "
                         "quality falls quickly.")
        self.bits = QDoubleSpinBox()
        self.bits.setRange(1.0, 8.0)
        self.bits.setSingleStep(0.25)
        self.bits.setDecimals(2)
        self.bits.setValue(4.0)
        self.bits.setSuffix(" bpw")
        self.head = QComboBox()
        self.head.addItems(HEAD_BITS)
        self.head.setToolTip("Bits of the output head (16 keeps it unquantized)")
        self.calibration = QComboBox()
        self.calibration.addItem("Built-in mix (prose and code)", "")
        self.calibration.addItem("My own text (a file or a folder of .txt/.md)", "user")
        self.cal_path = QLineEdit()
        self.cal_path.setPlaceholderText("text file or folder")
        cal_file = QPushButton("File…")
        cal_file.clicked.connect(lambda: self._pick_calibration(folder=False))
        cal_dir = QPushButton("Folder…")
        cal_dir.clicked.connect(lambda: self._pick_calibration(folder=True))
        self.cal_row = QWidget()
        cr = QHBoxLayout(self.cal_row)
        cr.setContentsMargins(0, 0, 0, 0)
        cr.addWidget(self.cal_path, 1)
        cr.addWidget(cal_file)
        cr.addWidget(cal_dir)
        self.cal_rows = QSpinBox()
        self.cal_rows.setRange(1, 4096)
        self.cal_rows.setValue(250)
        self.cal_cols = QSpinBox()
        self.cal_cols.setRange(16, 8192)
        self.cal_cols.setSingleStep(256)
        self.cal_cols.setValue(2048)
        size_row = QHBoxLayout()
        size_row.addWidget(self.cal_rows)
        size_row.addWidget(QLabel("rows ×"))
        size_row.addWidget(self.cal_cols)
        size_row.addWidget(QLabel("tokens"))
        size_row.addStretch(1)
        self.estimate = QLabel()
        self.estimate.setObjectName("verdict")
        self.estimate.setWordWrap(True)
        self.advice = QLabel()
        self.advice.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("Bits per weight", self.bits)
        form.addRow("Head bits", self.head)
        form.addRow("Calibration", self.calibration)
        form.addRow("", self.cal_row)
        form.addRow("Calibration size", size_row)
        form.addRow(self.estimate)
        form.addRow(self.advice)
        self.bits.valueChanged.connect(self.update_estimate)
        self.head.currentTextChanged.connect(self.update_estimate)
        self.calibration.currentIndexChanged.connect(self._calibration_changed)
        self.cal_path.textChanged.connect(lambda *_: self.completeChanged.emit())
        self._calibration_changed()

    def _pick_calibration(self, folder: bool) -> None:
        path = (QFileDialog.getExistingDirectory(self, "Calibration folder", str(Path.home())) if folder else
                QFileDialog.getOpenFileName(self, "Calibration text", str(Path.home()),
                                            "Text (*.txt *.md);;All files (*)")[0])
        if path:
            self.cal_path.setText(path)

    def _calibration_changed(self, *_):
        self.cal_row.setVisible(self.calibration.currentData() == "user")
        self.completeChanged.emit()

    def calibration_path(self) -> Optional[str]:
        return self.cal_path.text().strip() or None if self.calibration.currentData() == "user" else None

    def initializePage(self) -> None:
        self.update_estimate()

    def validatePage(self) -> bool:
        return self.isComplete()          # QWizard.next() alone does not ask isComplete

    def isComplete(self) -> bool:
        if self.calibration.currentData() == "user":
            p = self.cal_path.text().strip()
            if not p or not Path(p).exists():
                self.advice.setText("Choose the calibration text: a file, or a folder of .txt/.md files."
                                    if not p else f"{p} does not exist.")
                return False
        return True

    def update_estimate(self) -> None:
        cfg = self.wizard().source.config() if self.wizard() else None
        try:
            spec = planner.spec_from_config(cfg or {}, name="target", bits=self.bits.value(),
                                            head_bits=int(self.head.currentText()))
        except TrellisError as e:
            self.estimate.setText(str(e))
            return
        size = f"Output ≈ {_size(spec.weight_bytes)}"
        if not self.capacity:
            self.estimate.setText(size + " (no free memory known for a fit check)")
            self.estimate.setProperty("fits", True)
            self.advice.setText("")
            _restyle(self.estimate)
            return
        ctx = min(self.context, spec.max_context or self.context)
        plan = planner.plan(spec, planner.PlanRequest(context=ctx, gpu_bytes=self.capacity,
                                                      without_kernels=self.without_kernels))
        self.estimate.setText(f"{size} · {'fits' if plan.fits else 'does not fit'} "
                              f"({_size(plan.total)} of {_size(plan.capacity)} at {ctx:,} tokens of context)")
        self.estimate.setProperty("fits", bool(plan.fits))
        self.advice.setText(plan.advice)
        _restyle(self.estimate)


class OutputPage(QWizardPage):
    def __init__(self, models_dir: str):
        super().__init__()
        self.models_dir = models_dir
        self.setTitle("Where to put it")
        self.setSubTitle("The work folder holds the job's progress: an interrupted conversion continues from "
                         "there.")
        self.output = QLineEdit()
        self.work = QLineEdit()
        self.notice = QLabel()
        self.notice.setWordWrap(True)
        self.notice.setObjectName("notice")
        self.notice.setVisible(False)
        form = QFormLayout(self)
        form.addRow("Output folder", self.output)
        form.addRow("Work folder", self.work)
        form.addRow(self.notice)
        self.output.textChanged.connect(self._changed)
        self.work.textChanged.connect(self._changed)

    def initializePage(self) -> None:
        w = self.wizard()
        if w.preset is not None:
            self.output.setText(w.preset.out_dir)
            self.work.setText(w.preset.work_dir)
            return
        src = Path(w.source.path())
        name = target_name(src, w.target.bits.value(), int(w.target.head.currentText()))
        out = Path(self.models_dir) / name
        self.output.setText(str(out))
        self.work.setText(str(out.parent / f".{name}.work"))    # hidden: the library does not list it

    def _changed(self, *_):
        done = J.modules_done(self.work.text().strip()) if self.work.text().strip() else None
        self.notice.setVisible(done is not None)
        if done is not None:
            self.notice.setText(f"This work folder holds an unfinished conversion ({done} module"
                                f"{'s' if done != 1 else ''} done): it continues from there. Settings that differ "
                                "from that job are refused by the converter.")
        self.completeChanged.emit()

    def validatePage(self) -> bool:
        return self.isComplete()          # QWizard.next() alone does not ask isComplete

    def isComplete(self) -> bool:
        text = self.output.text().strip()
        if not text:
            return False
        out = Path(text)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            self.notice.setText(f"{out} already exists and is not empty: choose another output folder.")
            self.notice.setVisible(True)
            return False
        return True


class RunPage(QWizardPage):
    def __init__(self, client):
        super().__init__()
        self.client = client
        self.setTitle("Converting")
        self.setSubTitle("You can close this window: the job stops and can be resumed later from this wizard.")
        self.finished_ok = False
        self.runner: Optional[J._Runner] = None
        self.download_id: Optional[str] = None
        self.request: Optional[ConversionRequest] = None
        self.started_at = 0.0
        self.resumed_from: Optional[int] = None
        self.stage = QLabel("Starting…")
        self.stage.setObjectName("verdict")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setTextVisible(True)
        self.bar.setFormat("%p%")
        self.message = QLabel("Starting…")
        self.message.setWordWrap(True)
        self.eta = QLabel()
        self.eta.setObjectName("muted")
        self.log = QListWidget()
        self.log.setObjectName("convertLog")
        self.cancel_button = QPushButton("Stop (resume later)")
        self.cancel_button.clicked.connect(self.stop)
        lay = QVBoxLayout(self)
        lay.addWidget(self.stage)
        lay.addWidget(self.bar)
        lay.addWidget(self.message)
        lay.addWidget(self.eta)
        lay.addWidget(self.log, 1)
        lay.addWidget(self.cancel_button, 0, Qt.AlignLeft)
        client.progress.connect(self._download_progress)
        client.result.connect(self._download_result)
        client.error.connect(self._download_error)
        client.died.connect(self._engine_died)

    # -- start
    def initializePage(self) -> None:
        w = self.wizard()
        if self.running:          # never two converters on one work folder
            return
        self.finished_ok = False
        self.bar.setValue(0)
        self.log.clear()
        self._last_logged = None
        self.eta.setText("")
        self.resumed_from = None
        self.request = w.request()
        self.cancel_button.setEnabled(True)
        self.cancel_button.setVisible(True)
        if w.source.is_hub() and w.preset is None and not (Path(self.request.in_dir) / "config.json").exists():
            self._download_first()
        else:
            self._convert()

    def _download_first(self) -> None:
        from engine.worker import protocol as P
        if not self.client.running:
            self._fail("the engine is not running, and it downloads hub models: restart it, then try again")
            return
        repo, rev = self.wizard().source.hub_source()
        self.stage.setText(f"Downloading {repo}@{rev}")
        self.message.setText("Starting the download…")
        self.download_id = self.client.send(P.Download(repo=repo, revision=rev, local_dir=self.request.in_dir))
        QTimer.singleShot(0, self.sync_buttons)

    def _convert(self) -> None:
        req = self.request
        J.remember(req)
        use_engine = self.client.running
        self.runner = J.EngineConvert(self.client, self) if use_engine else J.ProcessConvert(self)
        self.runner.progress.connect(self._progress)
        self.runner.finished.connect(self._finished)
        self.started_at = time.monotonic()
        self.stage.setText(f"Converting {Path(req.in_dir).name} to {req.bits:g} bpw")
        self.message.setText("Starting the converter…")
        self.runner.start(req)
        QTimer.singleShot(0, self.sync_buttons)     # after QWizard has set up this page's buttons

    def sync_buttons(self) -> None:
        """Back is off while a job runs: going back and forward again would start a second one."""
        w = self.wizard()
        if w is not None and w.currentPage() is self:
            w.button(QWizard.BackButton).setEnabled(not self.running)

    def isComplete(self) -> bool:
        return self.finished_ok

    @property
    def running(self) -> bool:
        return self.download_id is not None or (self.runner is not None and self.runner.running)

    def stop(self) -> None:
        if self.download_id:
            self.client.cancel(self.download_id)
        if self.runner is not None and self.runner.running:
            self.message.setText("Stopping… the work folder keeps what is done.")
            self.runner.stop()

    # -- download (hub source)
    def _download_progress(self, cmd_id: str, prog) -> None:
        if cmd_id and cmd_id == self.download_id:
            if prog.fraction is not None:
                self.bar.setValue(int(prog.fraction * 1000))
            self.message.setText(prog.message)

    def _download_result(self, cmd_id: str, command: str, data) -> None:
        if cmd_id and cmd_id == self.download_id:
            self.download_id = None
            self.log.addItem(f"Downloaded to {data.get('local_dir', self.request.in_dir)} (checksums verified)")
            self.bar.setValue(0)
            self._convert()

    def _download_error(self, err) -> None:
        if err.id and err.id == self.download_id:
            self.download_id = None
            self._fail(f"download failed: {err.message}")

    def _engine_died(self, reason: str) -> None:
        if self.download_id:
            self.download_id = None
            self._fail(f"the engine stopped during the download ({reason}); the bytes are kept, try again")

    # -- conversion
    def _progress(self, p: ConvertProgress) -> None:
        if p.stage == "measure":
            # Before the first module: how much each group of layers affects the output (bit allocation).
            self.stage.setText("Measuring layer sensitivities")
            self.message.setText("Deciding how many bits each group of layers gets…")
            return
        if p.fraction is not None:
            self.bar.setValue(int(p.fraction * 1000))
        if p.stage == "start" and p.index:
            self.resumed_from = p.index
            self.log.addItem(f"Resumed: {p.index} of {p.total} modules were already done")
        if p.index is not None and p.total:
            where = {"compile": "Writing the output folder", "done": "Finished"}.get(
                p.stage, f"Module {min(p.index + 1, p.total)} of {p.total}")
            self.stage.setText(where)
        elif p.stage == "compile":
            self.stage.setText("Writing the output folder")
        if p.module:
            more = p.index is None or (p.total and p.index < p.total)
            # Events name the module that just finished; the next one is being quantized.
            self.message.setText(f"{p.module} done · working on the next module…" if more else f"{p.module} done")
        elif p.stage == "start":
            self.message.setText("Loading the model and the calibration data…")
        elif p.stage == "compile":
            self.message.setText("Writing the output folder…")
        # Through the engine (the usual path) a finished module arrives with stage "" and no report.
        if p.module and p.stage in ("module", "") and p.module != getattr(self, "_last_logged", None):
            self._last_logged = p.module
            r = p.report or {}
            if r.get("K") == 16:
                bits = " · kept at 16 bits"
            elif isinstance(r.get("sqnr_db"), (int, float)):
                bits = f" · SQNR {r['sqnr_db']:.1f} dB"
            else:
                bits = ""
            secs = f" in {r['seconds']:.1f} s" if isinstance(r.get("seconds"), (int, float)) else ""
            self.log.addItem(f"✓ {p.module}{secs}{bits}")
            self.log.scrollToBottom()
        if p.eta_s is not None and p.stage not in ("compile", "done"):
            self.eta.setText(f"About {_duration(p.eta_s)} left · {_duration(time.monotonic() - self.started_at)} "
                             "so far")
        elif p.stage in ("compile", "done"):
            self.eta.setText("")
        elif p.eta_s is None and p.stage in ("start", "module"):
            self.eta.setText("Estimating the time left…")

    def _finished(self, ok: bool, text: str) -> None:
        self.cancel_button.setEnabled(False)
        self.sync_buttons()
        if ok:
            J.forget(self.request.out_dir)
            self.finished_ok = True
            self.cancel_button.setVisible(False)
            self.bar.setValue(1000)
            self.stage.setText("Finished")
            self.eta.setText(f"Took {_duration(time.monotonic() - self.started_at)}")
            self.message.setText(f"Done: {text}")
            self.completeChanged.emit()
            self.wizard().converted.emit(text)
        elif text == "stopped":
            done = J.modules_done(self.request.work_dir) or 0
            self.stage.setText("Stopped")
            self.message.setText(f"Conversion cancelled: the work folder keeps the {done} finished module"
                                 f"{'s' if done != 1 else ''}. Resume it later from this wizard.")
            self.eta.setText("")
        else:
            self._fail(text)

    def _fail(self, text: str) -> None:
        self.cancel_button.setEnabled(False)
        self.sync_buttons()
        self.stage.setText("Stopped")
        text = text.strip()
        self.message.setText(f"Conversion stopped: {text[:1].upper() + text[1:]}")
        self.eta.setText("")


# ---------------------------------------------------------------------------- the wizard

class ConvertWizard(QWizard):
    """ConvertWizard(client, sources, models_dir, capacity, context=4096, parent=None).

    `sources` are (label, folder) pairs of unquantized library models; `capacity` is free memory
    per GPU in bytes (library_view.capacity_from_devices) for the fit badge. `converted(out_dir)`
    is emitted when a conversion finishes."""

    converted = Signal(str)

    def __init__(self, client, sources: list[tuple[str, str]], models_dir: str, capacity: list[int],
                 context: int = 4096, parent=None):
        super().__init__(parent)
        self.client = client
        self.models_dir = models_dir
        self.preset: Optional[ConversionRequest] = None
        self.confirm_close = True
        self.setWindowTitle("Convert to EXL3")
        self.setWizardStyle(QWizard.ModernStyle)
        self.setOption(QWizard.NoBackButtonOnLastPage, False)
        self.source = SourcePage(sources)
        self.target = TargetPage(capacity, context, kernels_caveat(getattr(client, "hello", None)))
        self.output = OutputPage(models_dir)
        self.run = RunPage(client)
        for p in (self.source, self.target, self.output, self.run):
            self.addPage(p)
        self.resize(700, 520)

    def request(self) -> ConversionRequest:
        if self.preset is not None:
            return self.preset
        return ConversionRequest(
            in_dir=self.source.path(), out_dir=self.output.output.text().strip(),
            work_dir=self.output.work.text().strip() or self.output.output.text().strip() + ".work",
            bits=round(self.target.bits.value(), 2), head_bits=int(self.target.head.currentText()),
            cal_rows=self.target.cal_rows.value(), cal_cols=self.target.cal_cols.value(),
            calibration=self.target.calibration_path())

    def set_hub_source(self, repo: str, revision: str = "main") -> None:
        """Start from a hub repo (the hub browser's "Convert…"): it is looked up at once."""
        self.source.hub_radio.setChecked(True)
        self.source.repo.setText(repo)
        self.source.revision.setText(revision)
        self.source.fetch_hub_config()

    def resume_job(self, req: ConversionRequest) -> None:
        """Fill every page from an unfinished job's settings and run it (it continues)."""
        self.preset = req
        self.source.local_radio.setChecked(True)
        self.source.combo.setEditText(req.in_dir)
        self.target.bits.setValue(req.bits)
        self.target.head.setCurrentText(str(req.head_bits))
        self.target.cal_rows.setValue(req.cal_rows)
        self.target.cal_cols.setValue(req.cal_cols)
        self.target.calibration.setCurrentIndex(1 if req.calibration else 0)
        self.target.cal_path.setText(req.calibration or "")
        while self.currentPage() is not self.run:
            before = self.currentPage()
            self.next()
            if self.currentPage() is before:     # a page refused (e.g. the source folder is gone)
                self.preset = None
                break

    # -- closing stops the job (it can be resumed) after asking
    def reject(self) -> None:
        if self.run.running:
            if self.confirm_close and QMessageBox.question(
                    self, "Stop the conversion?", "Closing stops the conversion. Everything finished so far is "
                    "kept in the work folder, and this wizard offers to resume it next time.") != QMessageBox.Yes:
                return
            self.run.stop()
        super().reject()
