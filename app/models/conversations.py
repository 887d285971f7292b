"""The conversation list as a Qt item model, read from the Store (filtered by a search text)."""
from __future__ import annotations

from PySide6.QtCore import QAbstractListModel, QModelIndex, Qt

from app.icons import icon
from app.store import Conversation, Store

ConversationIdRole = Qt.UserRole + 1
PinnedRole = Qt.UserRole + 2


class ConversationListModel(QAbstractListModel):
    def __init__(self, store: Store, parent=None):
        super().__init__(parent)
        self.store = store
        self.search = ""
        self.rows: list[Conversation] = []
        self.refresh()

    def set_search(self, text: str) -> None:
        self.search = text
        self.refresh()

    def refresh(self) -> None:
        self.beginResetModel()
        self.rows = self.store.list_conversations(self.search)
        self.endResetModel()

    def row_of(self, conv_id: int) -> int:
        return next((i for i, c in enumerate(self.rows) if c.id == conv_id), -1)

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid() or not 0 <= index.row() < len(self.rows):
            return None
        c = self.rows[index.row()]
        if role == Qt.DisplayRole:
            return c.title
        if role == Qt.DecorationRole:
            return icon("pin") if c.pinned else None
        if role == Qt.ToolTipRole:
            return c.title
        if role == ConversationIdRole:
            return c.id
        if role == PinnedRole:
            return c.pinned
        return None
