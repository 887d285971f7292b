"""Table models of the hub browser: search results, a repo's revisions, and the downloads."""
from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QColor, QFont

from app.hub_info import RevisionRow
from app.models.library import human_bytes, human_count

ItemRole = Qt.UserRole + 1
FractionRole = Qt.UserRole + 2
_INFO = {False: "#1565c0", True: "#7db7f0"}


def badge_color(level: str) -> str:
    """The colour of a badge level ("ok", "bad", "info") in the current theme (light or dark)."""
    from PySide6.QtWidgets import QApplication
    from app.theme import COLORS
    app = QApplication.instance()
    dark = bool(app.property("trellisDark")) if app is not None else False
    return {"ok": COLORS[dark]["ok"], "bad": COLORS[dark]["danger"]}.get(level, _INFO[dark])


class _ListTable(QAbstractTableModel):
    """A table over a Python list; subclasses say what each cell shows."""

    COLUMNS: tuple[str, ...] = ()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list = []

    def set_items(self, items: list) -> None:
        self.beginResetModel()
        self.items = list(items)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.items)

    def columnCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if orientation == Qt.Horizontal and role == Qt.DisplayRole:
            return self.COLUMNS[section]
        return None

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid() or index.row() >= len(self.items):
            return None
        item = self.items[index.row()]
        if role == ItemRole:
            return item
        return self.cell(item, index.column(), role)

    def cell(self, item, col: int, role):
        raise NotImplementedError


class SearchResultsModel(_ListTable):
    COLUMNS = ("Model", "Format", "Architecture", "Parameters", "Downloads")

    def cell(self, r, col, role):
        if role == Qt.ForegroundRole and col == 1:
            return QColor(badge_color("ok" if r.is_exl3 else "info"))
        if role == Qt.FontRole and col == 1 and r.is_exl3:
            f = QFont()
            f.setBold(True)
            return f
        if role == Qt.ToolTipRole:
            return ", ".join(r.tags) or r.id
        if role != Qt.DisplayRole:
            return None
        return (r.id, "EXL3" if r.is_exl3 else "HF", r.architecture, human_count(r.parameters or 0),
                f"{r.downloads:,}")[col]


def fit_badge(row: RevisionRow) -> tuple[str, str]:
    """(badge text, level) of a revision: fits / too big with the total, or what is known."""
    if row.error:
        return "error", "bad"
    if row.plan is not None:
        gib = row.plan.total / 2 ** 30
        return (f"fits · {gib:.1f} GiB", "ok") if row.plan.fits else (f"too big · {gib:.1f} GiB", "bad")
    if row.needs_bytes:
        return f"needs {row.needs_bytes / 2 ** 30:.1f} GiB", "info"
    return "no weights" if row.total_bytes else "?", "info"


class RevisionsModel(_ListTable):
    COLUMNS = ("Revision", "bpw", "Head", "Files", "Size", "Fit")

    def cell(self, row: RevisionRow, col, role):
        if role == Qt.ForegroundRole and col == 5:
            return QColor(badge_color(fit_badge(row)[1]))
        if role == Qt.ToolTipRole:
            if row.error:
                return row.error
            if row.plan is not None:
                return row.plan.advice
            return f"{row.kind} {row.name} at {row.commit[:10]}"
        if role != Qt.DisplayRole:
            return None
        if col == 0:
            return row.name + ("  (tag)" if row.kind == "tag" else "")
        if col == 1:
            return f"{row.bits:.2f}" if row.bits else ""
        if col == 2:
            return str(row.head_bits) if row.head_bits else ""
        if col == 3:
            return str(row.file_count) if row.file_count else ""
        if col == 4:
            return human_bytes(row.total_bytes) if row.total_bytes else ""
        return fit_badge(row)[0]


STATE_TEXT = {"downloading": "downloading", "paused": "paused", "done": "done", "failed": "failed",
              "verifying": "verifying checksums"}


class DownloadsModel(_ListTable):
    """Rows are app.downloads.DownloadItem objects owned by the DownloadManager."""

    COLUMNS = ("Model", "Revision", "Size", "Progress", "State")

    def refresh(self, item) -> None:
        if item in self.items:
            r = self.items.index(item)
            self.dataChanged.emit(self.index(r, 0), self.index(r, len(self.COLUMNS) - 1))

    def cell(self, d, col, role):
        if role == FractionRole and col == 3:
            return d.fraction
        if role == Qt.ToolTipRole:
            return "\n".join(filter(None, (d.message, d.detail, d.local_dir)))
        if role == Qt.ForegroundRole and col == 4:
            level = {"done": "ok", "failed": "bad"}.get(d.state, "info")
            return QColor(badge_color(level))
        if role != Qt.DisplayRole:
            return None
        if col == 0:
            return d.repo
        if col == 1:
            return d.revision
        if col == 2:
            return human_bytes(d.total_bytes) if d.total_bytes else ""
        if col == 3:
            eta = f" · {d.eta_s:.0f} s left" if d.state == "downloading" and d.eta_s else ""
            return f"{d.fraction * 100:.0f}%{eta}"
        state = STATE_TEXT.get(d.state, d.state)
        if d.state == "done" and d.verified:
            state = "done · checksums verified"
        return state
