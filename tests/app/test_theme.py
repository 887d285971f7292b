"""Theme switches at run time (the system going dark): nothing crashes, icons follow the palette."""
from __future__ import annotations

from collections import Counter

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QLabel, QVBoxLayout, QWizard, QWizardPage

from app import icons, theme


def _main_colour(ic: QIcon, mode=QIcon.Normal) -> str:
    img = ic.pixmap(24, 24, mode).toImage()
    seen = Counter(img.pixelColor(x, y).name() for x in range(img.width()) for y in range(img.height())
                   if img.pixelColor(x, y).alpha() > 200)
    return seen.most_common(1)[0][0]


def test_switching_theme_with_a_wizard_open_does_not_crash(qtbot):
    app = QApplication.instance()
    wizard = QWizard()
    wizard.setWizardStyle(QWizard.ModernStyle)
    page = QWizardPage()
    page.setTitle("Model to convert")
    QVBoxLayout(page).addWidget(QLabel("x"))
    wizard.addPage(page)
    qtbot.addWidget(wizard)
    try:
        theme.apply(app, dark=False)
        wizard.show()
        qtbot.waitExposed(wizard)
        for dark in (True, False, True):       # re-setting the style here used to segfault
            assert theme.apply(app, dark=dark) is dark
            app.processEvents()
        assert wizard.isVisible()
    finally:
        theme.apply(app, dark=False)


def test_icons_made_before_a_theme_switch_follow_it(qtbot):
    app = QApplication.instance()
    try:
        theme.apply(app, dark=False)
        ic = icons.icon("chat")                           # made once, kept by a widget
        assert _main_colour(ic) == theme.COLORS[False]["text"]
        theme.apply(app, dark=True)
        assert _main_colour(ic) == theme.COLORS[True]["text"]
        assert _main_colour(ic, QIcon.Disabled) == theme.COLORS[True]["disabled_text"]
        assert _main_colour(icons.icon("warning", "#ffffff")) == "#ffffff"   # a fixed colour stays
    finally:
        theme.apply(app, dark=False)


def test_icons_on_accent_buttons_use_the_button_text_colour(qtbot):
    app = QApplication.instance()
    try:
        for dark in (False, True):
            theme.apply(app, dark=dark)
            assert _main_colour(icons.icon("send", on_accent=True)) == theme.COLORS[dark]["accent_text"]
    finally:
        theme.apply(app, dark=False)
