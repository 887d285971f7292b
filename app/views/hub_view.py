"""Hub browser pane: search Hugging Face (EXL3 first), read a repo's card and its revisions (one
per bpw) with size and fit badge each, and download into the library with pause, resume and cancel.

Network calls (search, card, revisions) run on background threads through engine.hub, which is
torch-free; the UI thread only starts them and gets results through a UiMailbox. A result that
arrives after the user has moved on (a newer search, another repo) is dropped by its sequence
number. Downloads go through the engine (app/downloads.py).
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QSize, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QApplication, QCheckBox, QComboBox, QHBoxLayout, QHeaderView,
                               QLabel, QLineEdit, QPushButton, QSplitter, QStyle, QStyledItemDelegate,
                               QStyleOptionProgressBar, QTableView, QVBoxLayout, QWidget)

from app import hub_info, settings
from app.background import failure_line, run_in_background
from app.downloads import DownloadManager, sentence
from app.engine_client import kernels_caveat
from app.icons import icon
from app.models.hub_models import (DownloadsModel, FractionRole, ItemRole, RevisionsModel, SearchResultsModel,
                                   badge_color)
from app.models.library import human_bytes, human_count
from app.ui_mailbox import UiMailbox
from app.views.library_view import capacity_from_devices


class ProgressDelegate(QStyledItemDelegate):
    """Draws the Progress column of the downloads table as a progress bar."""

    def paint(self, painter, option, index):
        fraction = index.data(FractionRole)
        if fraction is None:
            return super().paint(painter, option, index)
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(3, 4, -3, -4)
        bar.minimum, bar.maximum = 0, 1000
        bar.progress = int(max(0.0, min(1.0, fraction)) * 1000)
        bar.text = index.data(Qt.DisplayRole) or ""
        bar.textVisible = True
        bar.textAlignment = Qt.AlignCenter
        bar.state = option.state
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.CE_ProgressBar, bar, painter, option.widget)

    def sizeHint(self, option, index):
        s = super().sizeHint(option, index)
        return QSize(max(s.width(), 180), s.height())


def _table(model) -> QTableView:
    t = QTableView()
    t.setModel(model)
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setSelectionMode(QAbstractItemView.SingleSelection)
    t.verticalHeader().setVisible(False)
    t.setAlternatingRowColors(True)
    t.setWordWrap(False)
    h = t.horizontalHeader()
    h.setSectionResizeMode(QHeaderView.ResizeToContents)
    h.setSectionResizeMode(0, QHeaderView.Stretch)
    return t


class HubPane(QWidget):
    """Constructor: HubPane(client, library=None). With a LibraryPane, finished downloads trigger
    a library rescan; `convert_requested(repo, revision)` asks for the conversion wizard on an
    unquantized repo."""

    convert_requested = Signal(str, str)
    searched = Signal()               # results (or an error) are shown
    repo_shown = Signal()             # a repo's card and revisions (or an error) are shown

    def __init__(self, client, library=None, parent=None):
        super().__init__(parent)
        self.client = client
        self.library = library
        self._seq = self._search_seq = self._repo_seq = 0   # answers to older requests are dropped
        self._mailbox = UiMailbox(self)
        self.repo: str | None = None
        self.downloads = DownloadManager(client, parent=self)

        # --- search row
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search models, or type a repo id like owner/name")
        self.query.setClearButtonEnabled(True)
        self.query.returnPressed.connect(self.search)
        self.search_button = QPushButton(icon("hub"), "Search")
        self.search_button.clicked.connect(self.search)
        self.architecture = QComboBox()
        self.architecture.setEditable(True)
        self.architecture.addItems(["any architecture", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                    "phi3"])
        self.architecture.setToolTip("Only models of this architecture (config model_type or class name)")
        self.architecture.lineEdit().returnPressed.connect(self.search)
        self.exl3_only = QCheckBox("EXL3 only")
        self.exl3_only.setToolTip("EXL3 repos are listed first anyway; this hides the others")
        self.exl3_only.toggled.connect(lambda *_: self._show_results(getattr(self, "_all_results", [])))
        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.architecture)
        top.addWidget(self.exl3_only)
        top.addWidget(self.search_button)

        # --- results (left)
        self.results = SearchResultsModel(self)
        self.results_view = _table(self.results)
        self.results_view.horizontalHeader().setMinimumSectionSize(60)
        self.results_view.horizontalHeader().setStretchLastSection(False)
        self.results_view.selectionModel().currentRowChanged.connect(self._result_selected)
        self.search_status = QLabel("Search the Hugging Face hub for EXL3 models.")
        self.search_status.setObjectName("muted")
        self.search_status.setWordWrap(True)
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.results_view, 1)
        lv.addWidget(self.search_status)

        # --- card and revisions (right)
        self.card = QLabel("Pick a model to see its card and its revisions.")
        self.card.setObjectName("hubCard")
        self.card.setWordWrap(True)
        self.card.setTextFormat(Qt.RichText)
        self.card.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.card.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.card.setMinimumHeight(90)
        self.revisions = RevisionsModel(self)
        self.revisions_view = _table(self.revisions)
        self.revisions_view.selectionModel().selectionChanged.connect(lambda *_: self._update_buttons())
        self.revisions_view.doubleClicked.connect(lambda *_: self.download_selected())
        self.fit_note = QLabel()
        self.fit_note.setObjectName("muted")
        self.fit_note.setWordWrap(True)
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("primary")
        self.download_button.clicked.connect(self.download_selected)
        self.convert_button = QPushButton("Convert…")
        self.convert_button.setToolTip("Download this unquantized model and convert it to EXL3")
        self.convert_button.clicked.connect(self._convert_selected)
        rrow = QHBoxLayout()
        rrow.addWidget(self.fit_note, 1)
        rrow.addWidget(self.convert_button)
        rrow.addWidget(self.download_button)
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(0, 0, 0, 0)
        rv.addWidget(self.card)
        rv.addWidget(QLabel("Revisions"))
        rv.addWidget(self.revisions_view, 1)
        rv.addLayout(rrow)

        split = QSplitter(Qt.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        split.setSizes([500, 500])
        split.setChildrenCollapsible(False)

        # --- downloads (bottom)
        self.downloads_model = DownloadsModel(self)
        self.downloads_model.set_items(self.downloads.items)
        self.downloads_view = _table(self.downloads_model)
        self.downloads_view.setItemDelegateForColumn(3, ProgressDelegate(self.downloads_view))
        self.downloads_view.horizontalHeader().setSectionResizeMode(3, QHeaderView.Interactive)
        self.downloads_view.setColumnWidth(3, 220)
        self.downloads_view.setMinimumHeight(110)
        self.downloads_view.selectionModel().selectionChanged.connect(lambda *_: self._update_buttons())
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self._pause_or_resume)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop and delete what was downloaded")
        self.cancel_button.clicked.connect(lambda: self._selected_download() and self.downloads.cancel(
            self._selected_download()))
        self.verify_button = QPushButton("Verify")
        self.verify_button.setToolTip("Check every file against the hub's checksums again")
        self.verify_button.clicked.connect(lambda: self._selected_download() and self.downloads.verify(
            self._selected_download()))
        self.reveal_button = QPushButton(icon("folder"), "Reveal")
        self.reveal_button.clicked.connect(self._reveal)
        self.download_status = QLabel()
        self.download_status.setWordWrap(True)
        self.download_status.setObjectName("downloadStatus")
        drow = QHBoxLayout()
        for b in (self.pause_button, self.cancel_button, self.verify_button, self.reveal_button):
            drow.addWidget(b)
        drow.addWidget(self.download_status, 1)

        title = QLabel("Hub")
        title.setObjectName("paneTitle")
        lay = QVBoxLayout(self)
        lay.addWidget(title)
        lay.addLayout(top)
        vsplit = QSplitter(Qt.Vertical)
        vsplit.addWidget(split)
        bottom = QWidget()
        bv = QVBoxLayout(bottom)
        bv.setContentsMargins(0, 6, 0, 0)
        bv.addWidget(QLabel("Downloads"))
        bv.addWidget(self.downloads_view, 1)
        bv.addLayout(drow)
        vsplit.addWidget(bottom)
        vsplit.setStretchFactor(0, 3)
        vsplit.setStretchFactor(1, 1)
        vsplit.setSizes([440, 220])
        vsplit.setChildrenCollapsible(False)
        lay.addWidget(vsplit, 1)

        self.downloads.added.connect(lambda *_: self.downloads_model.set_items(self.downloads.items))
        self.downloads.removed.connect(lambda *_: self.downloads_model.set_items(self.downloads.items))
        self.downloads.changed.connect(self._download_changed)
        self.downloads.finished.connect(self._download_finished)
        client.ready.connect(lambda *_: self._replan())
        self._update_buttons()

    # ------------------------------------------------------------------ background calls
    def _run(self, fn: Callable[[], object], on_done, on_failed) -> int:
        """Run fn off the UI thread; on_done(seq, result) or on_failed(seq, one line) runs on
        this (UI) thread. Returns seq, which callers keep to drop answers to older requests."""
        self._seq += 1
        seq = self._seq
        run_in_background(self._mailbox, fn, lambda value: on_done(seq, value),
                          lambda e: on_failed(seq, failure_line(e)), name="hub-call")
        return seq

    # ------------------------------------------------------------------ search
    def search(self) -> None:
        text = self.query.text().strip()
        self.search_button.setEnabled(False)
        self.search_status.setText("Searching…")
        from engine import hub
        arch = self.architecture.currentText().strip()
        arch = None if not arch or arch == self.architecture.itemText(0) else arch
        self._search_seq = self._run(lambda: hub.search_models(text, architecture=arch, limit=50), self._searched,
                                     self._search_failed)
        if hub_info.looks_like_repo_id(text):
            self.open_repo(text)           # an exact repo id opens at once, found by search or not

    def _searched(self, seq: int, results) -> None:
        if seq != self._search_seq:
            return
        self.search_button.setEnabled(True)
        self._all_results = results
        self._show_results(results)
        self.searched.emit()

    def _show_results(self, results) -> None:
        shown = [r for r in results if r.is_exl3] if self.exl3_only.isChecked() else list(results)
        self.results.set_items(shown)
        n_exl3 = sum(r.is_exl3 for r in shown)
        self.search_status.setText(f"{len(shown)} model{'s' if len(shown) != 1 else ''} ({n_exl3} EXL3)"
                                   if shown else "No models found.")

    def _search_failed(self, seq: int, message: str) -> None:
        if seq != self._search_seq:
            return
        self.search_button.setEnabled(True)
        self.results.set_items([])
        self.search_status.setText(f"Search failed: {message}")
        self.searched.emit()

    def _result_selected(self, current, _previous) -> None:
        r = current.data(ItemRole) if current.isValid() else None
        if r is not None and r.id != self.repo:
            self.open_repo(r.id)

    # ------------------------------------------------------------------ one repo
    def open_repo(self, repo: str) -> None:
        """Show a repo's card and revisions (fetched in the background)."""
        repo = repo.strip()
        self.repo = repo
        self.revisions.set_items([])
        self.card.setText(f"<b>{html.escape(self.repo)}</b><br>Reading the model card and revisions…")
        self.fit_note.setText("")
        context = self._context()
        capacity = self._capacity()
        caveat = kernels_caveat(self.client.hello)

        def fetch():
            card = hub_info.repo_card(repo)
            rows = hub_info.revision_rows(repo, context, capacity, without_kernels=caveat)
            return card, rows
        self._repo_seq = self._run(fetch, self._repo_fetched, self._repo_failed)
        self._update_buttons()

    def _repo_fetched(self, seq: int, value) -> None:
        if seq != self._repo_seq:
            return
        card, rows = value
        self.card.setText(self._card_html(card))
        self.revisions.set_items(rows)
        if rows:
            # preselect the highest bitrate that fits (the best quality this machine can hold)
            fitting = [(r.bits, i) for i, r in enumerate(rows) if r.plan is not None and r.plan.fits and r.bits]
            best = max(fitting)[1] if fitting else None
            self.revisions_view.selectRow(best if best is not None else 0)
        self._update_fit_note()
        self._update_buttons()
        self.repo_shown.emit()

    def _repo_failed(self, seq: int, message: str) -> None:
        if seq != self._repo_seq:
            return
        self.card.setText(f"<b>{html.escape(self.repo or '')}</b><br>"
                          f"<span style='color:{badge_color('bad')}'>{html.escape(sentence(message))}</span>")
        self.revisions.set_items([])
        self._update_buttons()
        self.repo_shown.emit()

    @staticmethod
    def _card_html(c: hub_info.RepoCard) -> str:
        badge = (f"<span style='color:{badge_color('ok')};font-weight:600'>EXL3</span>" if c.is_exl3 else
                 f"<span style='color:{badge_color('info')};font-weight:600'>unquantized</span>")
        facts = [badge]
        if c.architecture:
            facts.append(html.escape(c.architecture))
        if c.parameters:
            facts.append(f"{human_count(c.parameters)} parameters")
        facts.append(f"{c.downloads:,} downloads · {c.likes:,} likes")
        if c.license:
            facts.append(f"license {html.escape(c.license)}")
        out = f"<b style='font-size:12pt'>{html.escape(c.repo)}</b><br>{' · '.join(facts)}"
        if c.base_model:
            out += f"<br>Based on {html.escape(c.base_model)}"
        if c.summary:
            out += f"<p>{html.escape(c.summary)}</p>"
        else:
            out += "<p><i>No model card.</i></p>"
        return out

    # ------------------------------------------------------------------ fit
    def _context(self) -> int:
        return int(settings.qsettings().value("library/context", 4096) or 4096)

    def _capacity(self) -> list[int]:
        return capacity_from_devices(self.client.devices)[0]

    def _replan(self) -> None:
        """New device figures from the engine: plan the shown revisions again (no network)."""
        if self.repo and self.revisions.items:
            self.open_repo(self.repo)

    def _update_fit_note(self) -> None:
        _, where = capacity_from_devices(self.client.devices)
        cap = self._capacity()
        if cap:
            self.fit_note.setText(f"Fit: {self._context():,} tokens of context on the {where} "
                                  f"({human_bytes(sum(cap))} free).")
        else:
            self.fit_note.setText("Fit: start the engine to compare against free memory.")

    # ------------------------------------------------------------------ downloads
    def selected_revision(self):
        rows = self.revisions_view.selectionModel().selectedRows()
        return self.revisions.items[rows[0].row()] if rows else None

    def _selected_download(self):
        rows = self.downloads_view.selectionModel().selectedRows()
        return self.downloads_model.items[rows[0].row()] if rows else None

    def download_selected(self) -> None:
        row = self.selected_revision()
        if row is None or not self.repo:
            return
        if row.error:
            self.download_status.setText(f"Cannot download {row.name}: {row.error}")
            return
        item = self.downloads.start(self.repo, row.name, row.total_bytes)
        self.downloads_view.selectRow(self.downloads.items.index(item))
        self.download_status.setText(item.message)

    def _convert_selected(self) -> None:
        """An unquantized repo: the conversion wizard, starting from this repo and revision."""
        row = self.selected_revision()
        if row is None or not self.repo:
            return
        self.convert_requested.emit(self.repo, row.name)
        if self.library is not None and hasattr(self.library, "open_wizard"):
            self.wizard = self.library.open_wizard(show=False)
            self.wizard.set_hub_source(self.repo, row.name)
            self.wizard.show()

    def _pause_or_resume(self) -> None:
        item = self._selected_download()
        if item is None:
            return
        if item.active:
            self.downloads.pause(item)
        else:
            self.downloads.resume(item)

    def _download_changed(self, item) -> None:
        self.downloads_model.refresh(item)
        if item is self._selected_download() or (item.state in ("failed", "done") and item.message):
            self.download_status.setText(item.message)
        self._update_buttons()

    def _download_finished(self, item) -> None:
        if self.library is not None:
            self.library.rescan()

    def _reveal(self) -> None:
        item = self._selected_download()
        if item is not None and Path(item.local_dir).exists():
            QDesktopServices.openUrl(QUrl.fromLocalFile(item.local_dir))

    def _update_buttons(self) -> None:
        row = self.selected_revision()
        self.download_button.setEnabled(row is not None and not row.error and row.file_count > 0)
        self.convert_button.setVisible(row is not None and not row.bits and row.total_bytes > 0)
        d = self._selected_download()
        self.pause_button.setEnabled(d is not None and d.state != "done")
        self.pause_button.setText("Pause" if d is not None and d.active else "Resume")
        self.cancel_button.setEnabled(d is not None)
        self.cancel_button.setText("Remove" if d is not None and d.state == "done" else "Cancel")
        self.verify_button.setEnabled(d is not None and d.state == "done")
        self.reveal_button.setEnabled(d is not None)

