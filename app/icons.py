"""Icons: our own line-art SVGs in resources/icons, tinted to the palette's text colour so the
same file works in light and dark themes (Qt's SVG renderer has no `currentColor`)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QGuiApplication, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"


def _text_color() -> str:
    app = QGuiApplication.instance()
    return app.palette().color(QPalette.WindowText).name() if app else "#333333"


@lru_cache(maxsize=128)
def _icon(name: str, color: str) -> QIcon:
    path = ICONS / f"{name}.svg"
    if not path.exists():
        return QIcon()
    svg = path.read_text().replace("#COLOR", color)
    renderer = QSvgRenderer(QByteArray(svg.encode()))
    ic = QIcon()
    for size in (16, 24, 32, 48, 64):
        pm = QPixmap(size, size)
        pm.fill(Qt.transparent)
        p = QPainter(pm)
        renderer.render(p)
        p.end()
        ic.addPixmap(pm)
    return ic


def icon(name: str, color: str | None = None) -> QIcon:
    return _icon(name, color or _text_color())


def clear_cache() -> None:
    """After a theme change, icons are re-tinted on next use."""
    _icon.cache_clear()
