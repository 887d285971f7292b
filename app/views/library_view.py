"""Library pane: the models in the chosen folders, with a fit badge each, and what to do with them."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QFileDialog, QHBoxLayout, QHeaderView, QLabel,
                               QMessageBox, QProgressBar, QPushButton, QSpinBox, QTableView, QVBoxLayout, QWidget)

from app import library_scan, settings
from app.background import run_in_background
from app.engine_client import REPO_ROOT, EngineClient, kernels_caveat, missing_kernels
from app.icons import icon
from app.models.library import LibraryModel
from app.ui_mailbox import UiMailbox


def _scan_failed(e: Exception) -> list:
    """A scan never kills the app: its failure becomes a broken row that says what happened."""
    return [library_scan.LibraryEntry("", "scan failed", "broken", error=str(e))]


def capacity_from_devices(devices) -> tuple[list[int], str]:
    """Free memory per GPU from the engine, or the CPU's free memory when there is no GPU."""
    gpus = [d.free_bytes for d in devices if d.device.startswith("cuda") and d.free_bytes]
    if gpus:
        return gpus, "GPU"
    cpu = [d.free_bytes for d in devices if d.device == "cpu" and d.free_bytes]
    return cpu[:1], "CPU"


class GgufImport(QObject):
    """Import a GGUF into an HF folder in a separate process (the conversion needs torch)."""

    finished = Signal(bool, str)        # ok, output folder or the error line
    progress = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.proc: QProcess | None = None
        self.out_dir = ""

    def start(self, gguf: str, out_dir: str) -> None:
        self.out_dir = out_dir
        self.proc = QProcess(self)
        self.proc.setWorkingDirectory(str(REPO_ROOT))
        self.proc.setProcessChannelMode(QProcess.MergedChannels)
        self.proc.readyRead.connect(self._read)
        self.proc.finished.connect(self._done)
        self._last = ""
        self.proc.start(sys.executable, ["-m", "app.gguf_job", gguf, out_dir])

    def _read(self) -> None:
        for line in bytes(self.proc.readAll()).decode("utf-8", "replace").splitlines():
            if line.strip():
                self._last = line.strip()
                self.progress.emit(self._last)

    def _done(self, code: int, _status) -> None:
        self._read()
        self.finished.emit(code == 0, self.out_dir if code == 0 else (self._last or f"import failed (exit {code})"))
        self.proc.deleteLater()
        self.proc = None


class LibraryPane(QWidget):
    chat_requested = Signal()
    plan_requested = Signal(str)
    scanned = Signal()

    def __init__(self, client: EngineClient, parent=None):
        super().__init__(parent)
        self.client = client
        self.model = LibraryModel(self)
        self._mailbox = UiMailbox(self)
        self._scan_seq = 0                # only the newest scan may fill the table
        self._load_id: str | None = None

        self.folders = QComboBox()
        self.folders.setMinimumWidth(320)
        self.folders.setToolTip("Folders Trellis reads models from (other apps' folders are read in place)")
        add = QPushButton(icon("folder"), "Add folder…")
        add.clicked.connect(self._add_folder)
        remove = QPushButton("Remove folder")
        remove.clicked.connect(self._remove_folder)
        rescan = QPushButton(icon("restart"), "Rescan")
        rescan.clicked.connect(self.rescan)
        self.context = QSpinBox()
        self.context.setRange(256, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setValue(int(settings.qsettings().value("library/context", 4096)))
        self.context.setToolTip("Context length used for the fit badge and when loading")
        self.context.valueChanged.connect(self._context_changed)
        top = QHBoxLayout()
        top.addWidget(QLabel("Folders"))
        top.addWidget(self.folders, 1)
        top.addWidget(add)
        top.addWidget(remove)
        top.addWidget(rescan)
        top.addSpacing(16)
        top.addWidget(QLabel("Context"))
        top.addWidget(self.context)

        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.table.setAlternatingRowColors(True)
        self.table.doubleClicked.connect(lambda *_: self.primary_action())
        self.table.selectionModel().selectionChanged.connect(lambda *_: self._update_buttons())

        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self.primary_action)
        self.unload_button = QPushButton("Unload")
        self.unload_button.clicked.connect(lambda: self.client.unload())
        self.plan_button = QPushButton(icon("planner"), "Plan…")
        self.plan_button.clicked.connect(lambda: self.selected() and self.plan_requested.emit(self.selected().path))
        self.reveal_button = QPushButton("Reveal")
        self.reveal_button.clicked.connect(self.reveal)
        self.delete_button = QPushButton("Delete…")
        self.delete_button.clicked.connect(self.delete_selected)
        self.convert_button = QPushButton("Convert…")
        self.convert_button.setToolTip("Quantize an unquantized model to EXL3")
        self.convert_button.clicked.connect(lambda: self.open_wizard())
        self.wizard = None
        self.status = QLabel()
        self.status.setObjectName("libraryStatus")
        self.status.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.progress.setMaximumWidth(220)
        actions = QHBoxLayout()
        for b in (self.load_button, self.unload_button, self.convert_button, self.plan_button, self.reveal_button,
                  self.delete_button):
            actions.addWidget(b)
        actions.addWidget(self.progress)
        actions.addWidget(self.status, 1)

        lay = QVBoxLayout(self)
        title = QLabel("Library")
        title.setObjectName("paneTitle")
        lay.addWidget(title)
        lay.addLayout(top)
        lay.addWidget(self.table, 1)
        lay.addLayout(actions)

        self.importer = GgufImport(self)
        self.importer.progress.connect(lambda t: self.status.setText(t))
        self.importer.finished.connect(self._import_done)
        client.progress.connect(self._on_progress)
        client.result.connect(self._on_result)
        client.error.connect(self._on_error)
        client.model_changed.connect(self._on_model_changed)
        client.died.connect(self._engine_died)
        client.ready.connect(lambda *_: self._refresh_fits())
        self._fill_folders()
        self.rescan()

    # ------------------------------------------------------------------ folders
    def _fill_folders(self) -> None:
        self.folders.clear()
        self.folders.addItems(settings.model_folders())

    def add_folder(self, path: str) -> None:
        folders = settings.model_folders() + [path]
        settings.set_model_folders(folders)
        self._fill_folders()
        self.rescan()

    def _add_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a models folder", str(Path.home()))
        if path:
            self.add_folder(path)

    def _remove_folder(self) -> None:
        cur = self.folders.currentText()
        settings.set_model_folders([f for f in settings.model_folders() if f != cur])
        self._fill_folders()
        self.rescan()

    # ------------------------------------------------------------------ scanning
    def rescan(self) -> None:
        self.status.setText("Reading model folders…")
        self._scan_seq += 1
        seq, folders = self._scan_seq, settings.model_folders()
        run_in_background(self._mailbox, lambda: library_scan.scan(folders), lambda entries: self._scanned(seq, entries),
                          lambda e: self._scanned(seq, _scan_failed(e)), name="library-scan")

    def _scanned(self, seq: int, entries: list) -> None:
        # Two rescans in a row (adding two folders) run at once; only the newest may fill the table.
        if seq != self._scan_seq:
            return
        self._entries = entries
        self._refresh_fits()
        n = len(entries)
        self.status.setText(f"{n} model{'s' if n != 1 else ''}" if n else
                            "No models yet: add a folder that holds models, or import the starter model.")
        self._update_buttons()
        self.scanned.emit()

    def _refresh_fits(self) -> None:
        entries = getattr(self, "_entries", [])
        cap, where = capacity_from_devices(self.client.devices)
        caveat = kernels_caveat(self.client.hello) if where == "GPU" else ""
        fits = {}
        for e in entries:
            try:
                fits[e.path] = library_scan.fit(e, self.context.value(), cap, caveat)
            except Exception:
                fits[e.path] = None
        self.model.set_entries(entries, fits)
        self.model.set_loaded((self.client.model or {}).get("model_dir"))

    def _context_changed(self, v: int) -> None:
        settings.qsettings().setValue("library/context", v)
        self._refresh_fits()

    def has_models(self) -> bool:
        return bool(library_scan.find_models(settings.model_folders()))

    # ------------------------------------------------------------------ actions
    def selected(self):
        rows = self.table.selectionModel().selectedRows()
        return self.model.entries[rows[0].row()] if rows else None

    def select_path(self, path: str) -> bool:
        for i, e in enumerate(self.model.entries):
            if e.path == str(path):
                self.table.selectRow(i)
                return True
        return False

    def _update_buttons(self) -> None:
        e = self.selected()
        kind = e.kind if e else None
        self.load_button.setEnabled(kind in ("exl3", "hf", "gguf"))
        self.load_button.setText({"gguf": "Import", "hf": "Load"}.get(kind, "Load"))
        self.load_button.setToolTip("Unquantized models load as they are; convert them to EXL3 with "
                                    "`trellis convert` to save memory" if kind == "hf" else "")
        for b in (self.plan_button, self.reveal_button, self.delete_button):
            b.setEnabled(e is not None)
        self.convert_button.setEnabled(kind in (None, "hf"))
        self.unload_button.setEnabled(self.client.model is not None)

    def primary_action(self) -> None:
        e = self.selected()
        if e is None:
            return
        if e.kind == "broken":
            self.status.setText(f"{e.name}: {e.error}")
        elif e.kind == "gguf":
            self.import_gguf(e.path)
        else:
            self.load(e.path)

    def load(self, path: str) -> None:
        if not self.client.running:
            self.status.setText("The engine is not running: restart it from the banner.")
            return
        if not (Path(path) / "config.json").is_file():
            self.status.setText(f"Could not load: {Path(path).name} is not a model folder (it has no config.json).")
            return
        entry = next((x for x in self.model.entries if x.path == path), None)
        ctx = self.context.value()
        if entry is not None and entry.context_length:
            ctx = min(ctx, entry.context_length)
        self._load_id = self.client.load(path, max_context=ctx)
        self.status.setText(f"Loading {Path(path).name}…")
        self.progress.setRange(0, 0)
        self.progress.setVisible(True)

    def reveal(self) -> None:
        e = self.selected()
        if e:
            target = Path(e.path) if Path(e.path).is_dir() else Path(e.path).parent
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(target)))

    def delete_selected(self, confirm: bool = True) -> None:
        e = self.selected()
        if e is None:
            return
        if e.path == (self.client.model or {}).get("model_dir"):
            self.status.setText("Unload the model before deleting it.")
            return
        if confirm and QMessageBox.question(
                self, "Delete model", f"Delete {e.path} from disk? This cannot be undone.") != QMessageBox.Yes:
            return
        p = Path(e.path)
        try:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        except OSError as err:
            self.status.setText(f"Could not delete {p.name}: {err.strerror or err}")
            return
        self.rescan()

    def open_wizard(self, show: bool = True):
        """The conversion wizard, preset to the selected unquantized model."""
        from app.views.convert_wizard import ConvertWizard
        sources = [(f"{e.name}  ({e.architecture})", e.path) for e in self.model.entries if e.kind == "hf"]
        sel = self.selected()
        cap, _ = capacity_from_devices(self.client.devices)
        self.wizard = ConvertWizard(self.client, sources, settings.model_folders()[0], cap, self.context.value(), self)
        if sel is not None and sel.kind == "hf":
            self.wizard.source.combo.setCurrentIndex(self.wizard.source.combo.findData(sel.path))
        self.wizard.converted.connect(lambda *_: self.rescan())
        if show:
            self.wizard.show()
        return self.wizard

    def import_gguf(self, path: str, out_dir: str | None = None) -> None:
        if self.importer.proc is not None:
            self.status.setText("An import is already running.")
            return
        out = out_dir or str(Path(settings.model_folders()[0]) / Path(path).stem)
        self.status.setText(f"Importing {Path(path).name}…")
        self.progress.setRange(0, 0)
        self.progress.setVisible(True)
        self.importer.start(path, out)

    def _import_done(self, ok: bool, text: str) -> None:
        self.progress.setVisible(False)
        self.status.setText(f"Imported to {text}" if ok else f"Import failed: {text}")
        self.rescan()

    # ------------------------------------------------------------------ engine answers
    def _on_progress(self, cmd_id: str, prog) -> None:
        if cmd_id == self._load_id and prog.fraction is not None:
            self.progress.setRange(0, 100)
            self.progress.setValue(int(prog.fraction * 100))
            if prog.message:
                self.status.setText(prog.message)

    def _on_result(self, cmd_id: str, command: str, data) -> None:
        if cmd_id == self._load_id and command == "load":
            self._load_id = None
            self.progress.setVisible(False)
            why = missing_kernels(data)
            self.status.setText(f"Loaded {data.get('name', '')} on {data.get('device', '?')}" +
                                (f", without CUDA kernels (slow): {why}" if why else "."))
            self.chat_requested.emit()

    def _on_error(self, err) -> None:
        if (err.id is not None and err.id == self._load_id) or err.command == "load":
            self._load_failed(err.message)

    def _engine_died(self, reason: str) -> None:
        if self._load_id is not None:     # no answer will come: stop the spinner and say why
            self._load_failed(reason)

    def _load_failed(self, why: str) -> None:
        self._load_id = None
        self.progress.setVisible(False)
        self.status.setText(f"Could not load: {why}")

    def _on_model_changed(self, model) -> None:
        self.model.set_loaded((model or {}).get("model_dir"))
        self._update_buttons()
