"""Light and dark themes that follow the system colour scheme (Qt 6.5+ reports it), applied as a
Fusion palette plus resources/style.qss with the colours (and @resources, the folder of its images)
filled in."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from app import icons

STYLE = Path(__file__).resolve().parents[1] / "resources" / "style.qss"

COLORS = {
    False: dict(window="#f6f7f9", base="#ffffff", alt="#eef1f5", text="#1f2328", muted="#6a737d", accent="#2f6f4f",
                accent_text="#ffffff", border="#d0d7de", sidebar="#e9edf1", banner="#b3261e", notice="#fff4ce",
                notice_text="#5c4400", danger="#c62828", ok="#2e7d32", disabled_text="#a3aab2",
                disabled_button="#f1f3f6"),
    True: dict(window="#1b1d21", base="#23262b", alt="#2a2e35", text="#e6e6e6", muted="#9aa0a6", accent="#5fae83",
               accent_text="#0d1f16", border="#3a3f47", sidebar="#15171a", banner="#8c1d18", notice="#3d3415",
               notice_text="#f3e3a0", danger="#ef5350", ok="#66bb6a", disabled_text="#62676f",
               disabled_button="#202327"),
}


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    scheme = getattr(hints, "colorScheme", None)
    if scheme is not None:
        return scheme() == Qt.ColorScheme.Dark
    return QGuiApplication.palette().color(QPalette.Window).lightness() < 128


def _set_disabled_colors(pal: QPalette, c: dict) -> None:
    """setColor without a group paints every group alike, so a disabled button (the wizard's Back
    and Next while a job runs) would look clickable. Disabled widgets get faded text and a
    flatter fill in both themes."""
    off = QPalette.Disabled
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText, QPalette.PlaceholderText,
                 QPalette.HighlightedText, QPalette.ToolTipText, QPalette.BrightText):
        pal.setColor(off, role, QColor(c["disabled_text"]))
    pal.setColor(off, QPalette.Button, QColor(c["disabled_button"]))
    pal.setColor(off, QPalette.Base, QColor(c["window"]))
    pal.setColor(off, QPalette.AlternateBase, QColor(c["window"]))
    pal.setColor(off, QPalette.Highlight, QColor(c["border"]))
    pal.setColor(off, QPalette.Link, QColor(c["muted"]))


def apply(app: QApplication, dark: bool | None = None) -> bool:
    dark = system_is_dark() if dark is None else dark
    c = COLORS[dark]
    # Once only: setStyle replaces (and deletes) the style object even when it is already Fusion,
    # and an open QWizard then crashes the app on the next stylesheet change (seen when the system
    # switched theme with the convert wizard open). app.style() cannot tell us, since with a
    # stylesheet it is Qt's stylesheet proxy, whose name is empty.
    if not app.property("trellisFusion"):
        app.setStyle("Fusion")
        app.setProperty("trellisFusion", True)
    pal = QPalette()
    pal.setColor(QPalette.Window, QColor(c["window"]))
    pal.setColor(QPalette.WindowText, QColor(c["text"]))
    pal.setColor(QPalette.Base, QColor(c["base"]))
    pal.setColor(QPalette.AlternateBase, QColor(c["alt"]))
    pal.setColor(QPalette.Text, QColor(c["text"]))
    pal.setColor(QPalette.Button, QColor(c["alt"]))
    pal.setColor(QPalette.ButtonText, QColor(c["text"]))
    pal.setColor(QPalette.Highlight, QColor(c["accent"]))
    pal.setColor(QPalette.HighlightedText, QColor(c["accent_text"]))
    pal.setColor(QPalette.ToolTipBase, QColor(c["base"]))
    pal.setColor(QPalette.ToolTipText, QColor(c["text"]))
    pal.setColor(QPalette.PlaceholderText, QColor(c["muted"]))
    pal.setColor(QPalette.Link, QColor(c["accent"]))
    _set_disabled_colors(pal, c)
    app.setPalette(pal)
    qss = STYLE.read_text() if STYLE.exists() else ""
    qss = qss.replace("@resources", STYLE.parent.as_posix())
    for k, v in sorted(c.items(), key=lambda kv: -len(kv[0])):
        qss = qss.replace("@" + k, v)
    app.setStyleSheet(qss)
    app.setProperty("trellisDark", dark)
    icons.clear_cache()
    return dark
