"""The library as a table model: one row per model folder (or GGUF file)."""
from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QColor, QGuiApplication

from app.library_scan import LibraryEntry

EntryRole = Qt.UserRole + 1
COLUMNS = ("Name", "Architecture", "Parameters", "bpw", "Head", "Size", "Vision", "Fit")


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    if n >= 1e3:
        return f"{n / 1e3:.0f} K"
    return str(n) if n else ""


class LibraryModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.entries: list[LibraryEntry] = []
        self.fits: dict[str, object] = {}     # path -> Plan | None
        self.loaded_path: str | None = None

    def set_entries(self, entries: list[LibraryEntry], fits: dict) -> None:
        self.beginResetModel()
        self.entries, self.fits = entries, fits
        self.endResetModel()

    def set_loaded(self, path: str | None) -> None:
        self.loaded_path = path
        if self.entries:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self.entries) - 1, len(COLUMNS) - 1))

    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.entries)

    def columnCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if orientation == Qt.Horizontal and role == Qt.DisplayRole:
            return COLUMNS[section]
        return None

    def fit_text(self, e: LibraryEntry) -> tuple[str, str]:
        """(badge text, level) for the fit column."""
        if e.kind == "broken":
            return "broken", "bad"
        if e.kind == "gguf":
            return "import", "info"
        if e.kind == "hf":
            return "convert", "info"
        plan = self.fits.get(e.path)
        if plan is None:
            return "?", "info"
        if plan.fits:
            return f"fits · {plan.total / 2**30:.1f} GiB", "ok"
        return f"too big · {plan.total / 2**30:.1f} GiB", "bad"

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        e = self.entries[index.row()]
        col = index.column()
        if role == EntryRole:
            return e
        if role == Qt.ToolTipRole:
            if e.error:
                return e.error
            plan = self.fits.get(e.path)
            if plan is not None:
                return plan.advice
            return "waiting for the engine to report free memory" if col == 7 and e.kind == "exl3" else e.path
        if role == Qt.ForegroundRole and col == 7:
            level = self.fit_text(e)[1]
            app = QGuiApplication.instance()
            dark = bool(app.property("trellisDark")) if app else False
            colors = ({"ok": "#81c784", "bad": "#ef9a9a", "info": "#90caf9"} if dark else
                      {"ok": "#2e7d32", "bad": "#c62828", "info": "#1565c0"})
            return QColor(colors[level])
        if role == Qt.FontRole and e.path == self.loaded_path:
            from PySide6.QtGui import QFont
            f = QFont()
            f.setBold(True)
            return f
        if role != Qt.DisplayRole:
            return None
        if col == 0:
            return e.name + ("  (loaded)" if e.path == self.loaded_path else "")
        if col == 1:
            return e.error if e.kind == "broken" else e.architecture
        if col == 2:
            return human_count(e.parameters)
        if col == 3:
            return f"{e.bpw:.2f}" if e.bpw else ""
        if col == 4:
            return f"{e.head_bits:g}" if e.head_bits else ""
        if col == 5:
            return human_bytes(e.size_bytes) if e.size_bytes else ""
        if col == 6:
            return "yes" if e.vision else ("no" if e.kind in ("exl3", "hf") else "")
        if col == 7:
            return self.fit_text(e)[0]
        return None
