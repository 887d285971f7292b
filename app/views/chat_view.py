"""Chat pane: conversation list on the left; transcript, composer and context meter on the right.

Layout and wiring only: every action goes to ChatSession (rules) or Store (list edits)."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QKeySequence, QPixmap, QShortcut
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListView,
                               QMenu, QMessageBox, QPlainTextEdit, QProgressBar, QPushButton, QSplitter, QToolButton,
                               QVBoxLayout, QWidget)

from app import attachments
from app.chat_session import ChatSession
from app.icons import icon
from app.models.conversations import ConversationIdRole, ConversationListModel
from app.settings import PRESETS
from app.views.transcript import Transcript


class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter breaks the line; pasted or dropped images become attachments."""

    submitted = Signal()
    escaped = Signal()
    images_given = Signal(list)       # file paths
    image_pasted = Signal(object)     # QImage

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setPlaceholderText("Message the model…  (Enter sends, Shift+Enter new line, Esc stops)")
        self.setAcceptDrops(True)
        self.setObjectName("composer")

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        if e.key() == Qt.Key_Escape:
            self.escaped.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, source):
        return source.hasImage() or source.hasUrls() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source):
        if source.hasUrls() and all(u.isLocalFile() for u in source.urls()):
            self.images_given.emit([u.toLocalFile() for u in source.urls()])
        elif source.hasImage():
            self.image_pasted.emit(source.imageData())
        else:
            super().insertFromMimeData(source)

    def dragEnterEvent(self, e):
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            e.acceptProposedAction()
        else:
            super().dragEnterEvent(e)

    def dragMoveEvent(self, e):
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            e.acceptProposedAction()
        else:
            super().dragMoveEvent(e)

    def dropEvent(self, e):
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            self.insertFromMimeData(e.mimeData())
            e.acceptProposedAction()
        else:
            super().dropEvent(e)


class ChatPane(QWidget):
    def __init__(self, session: ChatSession, parent=None):
        super().__init__(parent)
        self.session = session
        self.store = session.store
        self.attached: list[str] = []
        self.editing: int | None = None
        self.list_model = ConversationListModel(self.store, self)

        # left: conversations
        self.search = QLineEdit(placeholderText="Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.list_model.set_search)
        self.new_button = QPushButton(icon("plus"), "New chat")
        self.new_button.clicked.connect(self.new_chat)
        self.conv_list = QListView()
        self.conv_list.setModel(self.list_model)
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.ElideRight)
        self.conv_list.setUniformItemSizes(True)
        self.conv_list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.conv_list.customContextMenuRequested.connect(self._conv_menu)
        self.conv_list.clicked.connect(lambda ix: self.open_conversation(ix.data(ConversationIdRole)))
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(8, 8, 4, 8)
        lv.addWidget(self.new_button)
        lv.addWidget(self.search)
        lv.addWidget(self.conv_list, 1)

        # right: header, system prompt, transcript, notices, attachments, composer, meter
        self.title = QLabel("New chat")
        self.title.setObjectName("chatTitle")
        self.preset = QComboBox()
        self.preset.addItems(list(PRESETS))
        self.preset.setToolTip("Sampler preset: Precise is greedy; Creative samples widely")
        self.preset.currentTextChanged.connect(self._preset_changed)
        self.system_button = QToolButton(text="System prompt")
        self.system_button.setCheckable(True)
        self.export_button = QToolButton(text="Export")
        self.export_button.setPopupMode(QToolButton.InstantPopup)
        menu = QMenu(self.export_button)
        menu.addAction("Markdown…", lambda: self.export("md"))
        menu.addAction("JSON…", lambda: self.export("json"))
        self.export_button.setMenu(menu)
        header = QHBoxLayout()
        header.addWidget(self.title, 1)
        header.addWidget(QLabel("Preset"))
        header.addWidget(self.preset)
        header.addWidget(self.system_button)
        header.addWidget(self.export_button)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("System prompt for this chat (how the assistant should behave)")
        self.system_edit.setMaximumHeight(90)
        self.system_edit.setVisible(False)
        self.system_button.toggled.connect(self.system_edit.setVisible)
        self.system_edit.textChanged.connect(self._system_changed)

        self.transcript = Transcript(self.store)
        self.transcript.action.connect(self._on_action)
        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setVisible(False)
        self.edit_banner = QLabel()
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.setVisible(False)
        self.thumbs = QHBoxLayout()
        self.thumbs.addStretch(1)
        self.thumbs_box = QWidget()
        self.thumbs_box.setLayout(self.thumbs)
        self.thumbs_box.setVisible(False)

        self.composer = Composer()
        self.composer.setMaximumHeight(110)
        self.composer.submitted.connect(self.submit)
        self.composer.escaped.connect(self.escape)
        self.composer.images_given.connect(self.attach_files)
        self.composer.image_pasted.connect(self._attach_qimage)
        self.attach_button = QToolButton()
        self.attach_button.setIcon(icon("image"))
        self.attach_button.setToolTip("Attach images (or drop / paste them)")
        self.attach_button.clicked.connect(self._pick_images)
        self.send_button = QPushButton(icon("send", on_accent=True), "Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.clicked.connect(self._send_or_stop)
        comp = QHBoxLayout()
        comp.addWidget(self.attach_button, 0, Qt.AlignBottom)
        comp.addWidget(self.composer, 1)
        comp.addWidget(self.send_button, 0, Qt.AlignBottom)

        self.meter = QProgressBar()
        self.meter.setObjectName("contextMeter")
        self.meter.setTextVisible(False)
        self.meter.setMaximumHeight(6)
        self.meter_label = QLabel()
        self.meter_label.setObjectName("meterLabel")
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 8, 8, 8)
        rv.addLayout(header)
        rv.addWidget(self.system_edit)
        rv.addWidget(self.transcript, 1)
        rv.addWidget(self.notice)
        rv.addWidget(self.edit_banner)
        rv.addWidget(self.thumbs_box)
        rv.addLayout(comp)
        rv.addWidget(self.meter)
        rv.addWidget(self.meter_label)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        split.setSizes([240, 760])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(split)

        esc = QShortcut(QKeySequence(Qt.Key_Escape), self, context=Qt.WidgetWithChildrenShortcut)
        esc.activated.connect(self.escape)

        session.changed.connect(self._on_changed)
        session.streamed.connect(lambda *_: self.transcript.schedule_redraw())
        session.streaming_changed.connect(self._on_streaming)
        session.notice.connect(self.show_notice)
        session.client.model_changed.connect(lambda *_: self._update_meter())
        self._loading_conv = False
        first = self.list_model.rows[0].id if self.list_model.rows else None
        self.open_conversation(first)

    # ------------------------------------------------------------------ conversations
    def new_chat(self) -> None:
        if self.session.streaming:
            return
        self.session.new_conversation()
        self.list_model.refresh()
        self._select_in_list(self.session.conv_id)
        self.composer.setFocus()

    def open_conversation(self, conv_id: int | None) -> None:
        if self.session.streaming and conv_id != self.session.conv_id:
            self.show_notice("Stop the answer that is streaming before switching chats.")
            self._select_in_list(self.session.conv_id)
            return
        self.cancel_edit()
        self.session.open(conv_id)
        self._select_in_list(conv_id)

    def _select_in_list(self, conv_id) -> None:
        row = self.list_model.row_of(conv_id) if conv_id else -1
        if row >= 0:
            self.conv_list.setCurrentIndex(self.list_model.index(row))

    def _conv_menu(self, pos) -> None:
        ix = self.conv_list.indexAt(pos)
        if not ix.isValid():
            return
        conv_id = ix.data(ConversationIdRole)
        conv = self.store.conversation(conv_id)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename(conv_id))
        menu.addAction("Unpin" if conv.pinned else "Pin", lambda: self.set_pinned(conv_id, not conv.pinned))
        menu.addAction("Export Markdown…", lambda: self.export("md", conv_id))
        menu.addAction("Export JSON…", lambda: self.export("json", conv_id))
        menu.addSeparator()
        menu.addAction("Delete…", lambda: self.delete(conv_id))
        menu.exec(self.conv_list.viewport().mapToGlobal(pos))

    def rename(self, conv_id: int, title: str | None = None) -> None:
        if title is None:
            conv = self.store.conversation(conv_id)
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=conv.title)
            if not ok:
                return
        self.store.rename(conv_id, title)
        self.list_model.refresh()
        self._select_in_list(self.session.conv_id)
        self._update_header()

    def set_pinned(self, conv_id: int, pinned: bool) -> None:
        self.store.set_pinned(conv_id, pinned)
        self.list_model.refresh()
        self._select_in_list(self.session.conv_id)

    def delete(self, conv_id: int, confirm: bool = True) -> None:
        if self.session.streaming and conv_id == self.session.conv_id:
            self.show_notice("Stop the answer first.")
            return
        if confirm:
            conv = self.store.conversation(conv_id)
            if QMessageBox.question(self, "Delete chat", f"Delete “{conv.title}” and all its branches?") != QMessageBox.Yes:
                return
        self.store.delete_conversation(conv_id)
        self.list_model.refresh()
        if conv_id == self.session.conv_id:
            self.open_conversation(self.list_model.rows[0].id if self.list_model.rows else None)

    def export(self, fmt: str, conv_id: int | None = None, path: str | None = None) -> str | None:
        conv_id = conv_id or self.session.conv_id
        if not conv_id:
            return None
        conv = self.store.conversation(conv_id)
        if path is None:
            safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title).strip() or "chat"
            filt = "Markdown (*.md)" if fmt == "md" else "JSON (*.json)"
            path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / f"{safe}.{fmt}"), filt)
            if not path:
                return None
        text = self.store.export_markdown(conv_id) if fmt == "md" else json.dumps(self.store.export_json(conv_id), indent=2)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            self.show_notice(f"Could not write {path}: {e.strerror or e}")
            return None
        self.show_notice(f"Exported to {path}")
        return path

    # ------------------------------------------------------------------ composing
    def submit(self) -> None:
        if self.session.streaming:
            return
        text = self.composer.toPlainText()
        if self.editing is not None:
            msg_id, self.editing = self.editing, None
            self.edit_banner.setVisible(False)
            self.composer.clear()
            self.session.edit(msg_id, text)
            return
        if not text.strip() and not self.attached:
            return
        images, self.attached = self.attached, []
        self._refresh_thumbs()
        self.composer.clear()
        self.hide_notice()
        self.session.send(text, images)
        self.list_model.refresh()
        self._select_in_list(self.session.conv_id)

    def _send_or_stop(self) -> None:
        if self.session.streaming:
            self.session.stop()
        else:
            self.submit()

    def escape(self) -> None:
        if self.session.streaming:
            self.session.stop()
        elif self.editing is not None:
            self.cancel_edit()

    def cancel_edit(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.composer.clear()
        self.edit_banner.setVisible(False)

    def _on_action(self, kind: str, msg_id: int, arg: int) -> None:
        if kind == "nav":
            self.session.switch_alternative(msg_id, arg)
        elif kind == "regen":
            self.session.regenerate(msg_id)
        elif kind == "edit":
            m = self.store.message(msg_id)
            if m is None or self.session.streaming:
                return
            self.editing = msg_id
            self.composer.setPlainText(m.content)
            self.composer.setFocus()
            who = "your message" if m.role == "user" else "the answer"
            self.edit_banner.setText(f"Editing {who}: Send makes a new branch (the original stays). Esc cancels.")
            self.edit_banner.setVisible(True)

    # ------------------------------------------------------------------ attachments
    def _pick_images(self) -> None:
        files, _ = QFileDialog.getOpenFileNames(self, "Attach images", str(Path.home()),
                                                "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp);;All files (*)")
        if files:
            self.attach_files(files)

    def attach_files(self, paths: list[str]) -> None:
        errors = []
        for p in paths:
            try:
                self.attached.append(attachments.import_image(p))
            except attachments.AttachmentError as e:
                errors.append(str(e))
        self._refresh_thumbs()
        if errors:
            self.show_notice("; ".join(errors))
        elif self.attached and self.session.client.model is not None and not self.session.model_has_vision():
            self.show_notice(f"{self.session.client.model.get('name', 'The loaded model')} has no vision: "
                             "images will be kept in the chat but not sent to it.")

    def _attach_qimage(self, image) -> None:
        try:
            self.attached.append(attachments.import_qimage(image))
        except attachments.AttachmentError as e:
            self.show_notice(str(e))
        self._refresh_thumbs()

    def _refresh_thumbs(self) -> None:
        while self.thumbs.count() > 1:
            w = self.thumbs.takeAt(0).widget()
            if w:
                w.deleteLater()
        for i, p in enumerate(self.attached):
            b = QToolButton()
            b.setIcon(QPixmap(p).scaled(56, 56, Qt.KeepAspectRatio, Qt.SmoothTransformation))
            b.setIconSize(QSize(56, 56))
            b.setToolTip(f"{Path(p).name} — click to remove")
            b.clicked.connect(lambda _=False, p=p: self._remove_attachment(p))
            self.thumbs.insertWidget(i, b)
        self.thumbs_box.setVisible(bool(self.attached))

    def _remove_attachment(self, path: str) -> None:
        self.attached = [p for p in self.attached if p != path]
        self._refresh_thumbs()

    # ------------------------------------------------------------------ updates
    def show_notice(self, text: str) -> None:
        self.notice.setText(text)
        self.notice.setVisible(True)

    def hide_notice(self) -> None:
        self.notice.setVisible(False)

    def _preset_changed(self, name: str) -> None:
        if not self.session.conv_id and not self._loading_conv:
            self.session.new_conversation()
            self.list_model.refresh()
            self._select_in_list(self.session.conv_id)
        if self.session.conv_id and not self._loading_conv:
            self.store.set_preset(self.session.conv_id, name)

    def _system_changed(self) -> None:
        if not self.session.conv_id and not self._loading_conv and self.system_edit.toPlainText().strip():
            self.session.new_conversation(system_prompt=self.system_edit.toPlainText())   # typed before a chat
            self.list_model.refresh()
            self._select_in_list(self.session.conv_id)
            return
        if self.session.conv_id and not self._loading_conv:
            self.store.set_system_prompt(self.session.conv_id, self.system_edit.toPlainText())
            self._update_meter()

    def _update_header(self) -> None:
        conv = self.store.conversation(self.session.conv_id) if self.session.conv_id else None
        self._loading_conv = True
        self.title.setText(conv.title if conv else "New chat")
        self.preset.setCurrentText(conv.preset if conv else "Balanced")
        if conv is not None and self.system_edit.toPlainText() != conv.system_prompt:
            self.system_edit.setPlainText(conv.system_prompt)
        elif conv is None:
            self.system_edit.clear()
        self._loading_conv = False

    def _on_changed(self, conv_id: int) -> None:
        if conv_id and conv_id != self.session.conv_id:
            return
        self._update_header()
        self.transcript.show_conversation(self.session.conv_id, self.session.streaming_message_id)
        self._update_meter()

    def _on_streaming(self, on: bool) -> None:
        self.send_button.setText("Stop" if on else "Send")
        self.send_button.setIcon(icon("stop", "#ffffff") if on else icon("send", on_accent=True))
        self.send_button.setProperty("streaming", on)
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        if not on:
            self.list_model.refresh()
            self._select_in_list(self.session.conv_id)

    def _update_meter(self) -> None:
        limit = self.session.model_max_context()
        used = self.session.context_used()
        if not limit:
            self.meter.setVisible(False)
            self.meter_label.setText(f"≈ {used:,} tokens in this chat · no model loaded" if used else "No model loaded")
            return
        self.meter.setVisible(True)
        # QProgressBar repaints synchronously inside setValue (~7 ms of the UI thread with our
        # style sheet); with updates off the paint is deferred to the event loop's next pass.
        self.meter.setUpdatesEnabled(False)
        self.meter.setRange(0, limit)
        self.meter.setValue(min(used, limit))
        self.meter.setUpdatesEnabled(True)
        frac = used / limit
        level = "full" if frac >= 1 else ("warn" if frac >= 0.8 else "ok")
        if self.meter.property("level") != level:     # a re-polish costs milliseconds: only on change
            self.meter.setProperty("level", level)
            self.meter.style().unpolish(self.meter)
            self.meter.style().polish(self.meter)
        text = f"≈ {used:,} / {limit:,} tokens of context"
        if level != "ok":
            text += (" — nearly full: when it overflows, the oldest messages are left out of what the model "
                     "sees (the chat keeps them)" if level == "warn" else
                     " — full: the oldest messages are being left out of what the model sees")
        self.meter_label.setText(text)
