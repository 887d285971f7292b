"""The one window: a side bar of panes, a banner for engine trouble, a status line.

It owns the long-lived objects (Store, EngineClient, ChatSession) and hands them to the panes."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QMainWindow, QPushButton,
                               QStackedWidget, QVBoxLayout, QWidget)

from app import settings
from app.chat_session import ChatSession
from app.engine_client import EngineClient, missing_kernels
from app.icons import icon
from app.store import Store
from app.views.chat_view import ChatPane
from app.views.library_view import LibraryPane
from app.views.planner_view import PlannerPane
from app.views.first_run import FirstRunPane
from app.views.hub_view import HubPane

PANES = ("Chat", "Library", "Hub", "Planner")


class EngineBanner(QFrame):
    """Shown when the engine process ends unexpectedly: why, and a restart button."""

    def __init__(self, client: EngineClient, parent=None):
        super().__init__(parent)
        self.setObjectName("banner")
        self.client = client
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.restart = QPushButton(icon("restart", "#ffffff"), "Restart engine")
        self.restart.clicked.connect(self._restart)
        lay = QHBoxLayout(self)
        warn = QLabel()
        warn.setPixmap(icon("warning", "#ffffff").pixmap(20, 20))
        lay.addWidget(warn)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.restart)
        self.setVisible(False)
        client.died.connect(self.show_reason)
        client.ready.connect(lambda *_: self.setVisible(False))

    def show_reason(self, reason: str) -> None:
        self.label.setText(f"{reason}  Your chats are saved; restart the engine and load the model again.")
        self.setVisible(True)

    def _restart(self) -> None:
        self.label.setText("Restarting the engine…")
        self.client.restart()


class MainWindow(QMainWindow):
    def __init__(self, client: EngineClient | None = None, store: Store | None = None, start_engine: bool = True):
        super().__init__()
        self.setWindowTitle("Trellis")
        self.setWindowIcon(icon("trellis"))
        self.store = store or Store(settings.database_path())
        self.client = client or EngineClient()
        self.session = ChatSession(self.store, self.client, self)

        self.banner = EngineBanner(self.client)
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.sidebar.setIconSize(QSize(22, 22))
        self.sidebar.setFixedWidth(132)
        for name, ic in zip(PANES, ("chat", "library", "hub", "planner")):
            QListWidgetItem(icon(ic), name, self.sidebar)
        self.chat = ChatPane(self.session)
        self.library = LibraryPane(self.client)
        self.hub = HubPane(self.client, self.library)
        self.planner = PlannerPane(self.client, self.library)
        self.first_run = FirstRunPane(self.client, self.library)
        self.stack = QStackedWidget()
        for w in (self.chat, self.library, self.hub, self.planner, self.first_run):
            self.stack.addWidget(w)
        self.sidebar.currentRowChanged.connect(self.stack.setCurrentIndex)
        self.library.chat_requested.connect(lambda: self.show_pane("Chat"))
        self.library.plan_requested.connect(self._plan_model)
        self.first_run.done.connect(lambda: self.show_pane("Chat"))

        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.setSpacing(0)
        body.addWidget(self.sidebar)
        body.addWidget(self.stack, 1)
        central = QWidget()
        v = QVBoxLayout(central)
        v.setContentsMargins(0, 0, 0, 0)
        v.setSpacing(0)
        v.addWidget(self.banner)
        v.addLayout(body, 1)
        self.setCentralWidget(central)

        self.engine_label = QLabel("Engine: starting…")
        self.model_label = QLabel("No model loaded")
        self.statusBar().addWidget(self.engine_label)
        self.statusBar().addPermanentWidget(self.model_label)
        self.client.ready.connect(self._on_ready)
        self.client.died.connect(lambda r: self.engine_label.setText("Engine: stopped"))
        self.client.model_changed.connect(self._on_model)

        self._shortcuts()
        self._restore()
        if start_engine:
            self.client.start()
        if not self.library.has_models() and not self.store.list_conversations():
            self.stack.setCurrentWidget(self.first_run)
            self.sidebar.blockSignals(True)
            self.sidebar.setCurrentRow(-1)
            self.sidebar.blockSignals(False)

    # ------------------------------------------------------------------ wiring
    def show_pane(self, name: str) -> None:
        self.sidebar.setCurrentRow(PANES.index(name))
        self.stack.setCurrentIndex(PANES.index(name))

    def _plan_model(self, path: str) -> None:
        self.planner.set_model(path)
        self.show_pane("Planner")

    def _regenerate_last(self) -> None:
        path = self.store.path(self.session.conv_id) if self.session.conv_id else []
        if path and path[-1].role == "assistant":
            self.session.regenerate(path[-1].id)

    def _on_ready(self, hello) -> None:
        devs = ", ".join(d.name or d.device for d in hello.devices) or "CPU"
        self.engine_label.setText(f"Engine ready · {devs}")

    def _on_model(self, model) -> None:
        if model:
            bits = model.get("bits_per_weight")
            text = f"{model.get('name')}" + (f" · {bits:.2f} bpw" if bits else "") + f" · {model.get('device', '')}"
            tip = ""
            why = missing_kernels(model)
            if why:
                # Without its kernels a GPU runs the PyTorch path: many times slower, and with
                # dense weights. Said where the user looks, with the engine's reason on hover.
                text += " · without CUDA kernels (slow)"
                tip = (f"{why}\nThe engine runs the PyTorch path instead: much slower, and it keeps a dense "
                       "fp16 copy of the weights, 16 / bpw times their size in the model folder, beside them.")
            self.model_label.setText(text)
            self.model_label.setToolTip(tip)
        else:
            self.model_label.setText("No model loaded")
            self.model_label.setToolTip("")

    def _shortcuts(self) -> None:
        def add(seq, fn, text):
            a = QAction(text, self)
            a.setShortcut(QKeySequence(seq))
            a.triggered.connect(fn)
            self.addAction(a)
        add("Ctrl+N", lambda: (self.show_pane("Chat"), self.chat.new_chat()), "New chat")
        add("Ctrl+F", lambda: (self.show_pane("Chat"), self.chat.search.setFocus()), "Search chats")
        add("Ctrl+1", lambda: self.show_pane("Chat"), "Chat")
        add("Ctrl+2", lambda: self.show_pane("Library"), "Library")
        add("Ctrl+3", lambda: self.show_pane("Hub"), "Hub")
        add("Ctrl+4", lambda: self.show_pane("Planner"), "Planner")
        add("Ctrl+Shift+E", lambda: self.chat.export("md"), "Export chat")
        add("Ctrl+R", self._regenerate_last, "Regenerate the last answer")
        add("Ctrl+.", self.session.stop, "Stop generating")
        add("Ctrl+Q", self.close, "Quit")

    # ------------------------------------------------------------------ window state
    def _restore(self) -> None:
        s = settings.qsettings()
        geo = s.value("window/geometry")
        if geo is not None:
            self.restoreGeometry(geo)
        else:
            self.resize(1180, 760)
        state = s.value("window/state")
        if state is not None:
            self.restoreState(state)
        self.show_pane(PANES[min(int(s.value("window/pane", 0) or 0), len(PANES) - 1)])

    def closeEvent(self, e) -> None:
        s = settings.qsettings()
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("window/pane", max(0, self.sidebar.currentRow()))
        s.sync()
        if self.session.streaming:
            self.session.stop()
        self.client.close()
        self.client.blockSignals(True)     # queued engine events must not reach panes of a closed store
        self.store.close()
        super().closeEvent(e)
