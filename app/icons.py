"""Icons: our own line-art SVGs in resources/icons, tinted to the palette's text colour so the
same file works in light and dark themes (Qt's SVG renderer has no `currentColor`).

The tint is looked up when the icon is painted, not when it is made: an icon made under the light
theme must not stay dark-on-dark after the system switches to dark (the sidebar and buttons keep
the QIcon they were given at start-up)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from PySide6.QtCore import QByteArray, QRectF, Qt
from PySide6.QtGui import QGuiApplication, QIcon, QIconEngine, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"


def _text_color(disabled: bool = False, role=QPalette.WindowText) -> str:
    app = QGuiApplication.instance()
    group = QPalette.Disabled if disabled else QPalette.Active
    return app.palette().color(group, role).name() if app else "#333333"


@lru_cache(maxsize=256)
def _renderer(name: str, color: str) -> QSvgRenderer | None:
    path = ICONS / f"{name}.svg"
    if not path.exists():
        return None
    return QSvgRenderer(QByteArray(path.read_text().replace("#COLOR", color).encode()))


class _PaletteTinted(QIconEngine):
    """Draws the SVG in the current palette's text colour (faded when disabled), or in the text
    colour of accent-filled buttons (`role` HighlightedText, which the theme sets to accent_text)."""

    def __init__(self, name: str, role=QPalette.WindowText):
        super().__init__()
        self.name = name
        self.role = role

    def paint(self, painter: QPainter, rect, mode, state) -> None:
        r = _renderer(self.name, _text_color(mode == QIcon.Disabled, self.role))
        if r is not None:
            r.render(painter, QRectF(rect))

    def pixmap(self, size, mode, state) -> QPixmap:
        pm = QPixmap(size)
        pm.fill(Qt.transparent)
        p = QPainter(pm)
        self.paint(p, pm.rect(), mode, state)
        p.end()
        return pm

    def clone(self) -> QIconEngine:
        return _PaletteTinted(self.name, self.role)


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


def icon(name: str, color: str | None = None, on_accent: bool = False) -> QIcon:
    """A fixed `color` for icons on backgrounds that do not change with the theme (the banner);
    `on_accent` for accent-filled buttons (Send); otherwise the palette's text colour."""
    if color is not None:
        return _icon(name, color)
    if not (ICONS / f"{name}.svg").exists():
        return QIcon()
    return QIcon(_PaletteTinted(name, QPalette.HighlightedText if on_accent else QPalette.WindowText))


def clear_cache() -> None:
    """After a theme change, icons are re-tinted on next use."""
    _icon.cache_clear()
    _renderer.cache_clear()
