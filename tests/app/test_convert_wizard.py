"""Conversion wizard: source → bpw with a live size estimate and fit badge → folders → run with
progress, stop, and resume from the work folder. The engine side is the fake worker (a real
conversion of even the tiny fixture takes minutes on this CPU; the converter has its own tests)."""
from __future__ import annotations

import shutil

import pytest
from PySide6.QtWidgets import QWizard

from app import settings
from app.views.library_view import LibraryPane


@pytest.fixture
def pane(qtbot, make_client, ref_fixtures, tmp_path):
    src = tmp_path / "models" / "llama"
    shutil.copytree(ref_fixtures / "hf" / "llama", src)
    settings.set_model_folders([str(tmp_path / "models")])
    p = LibraryPane(make_client(FAKE_CONVERT_DELAY=0.2))
    qtbot.addWidget(p)
    qtbot.waitUntil(lambda: bool(p.model.entries), timeout=20000)
    assert p.select_path(str(src))
    return p, src


def test_wizard_estimates_then_converts_with_stop_and_resume(qtbot, pane, tmp_path):
    lib, src = pane
    wiz = lib.open_wizard(show=False)
    qtbot.addWidget(wiz)
    wiz.show()
    assert wiz.source.path() == str(src) and wiz.source.isComplete()
    wiz.next()
    wiz.target.bits.setValue(2.5)
    small = wiz.target.estimate.text()
    wiz.target.bits.setValue(6.0)
    big = wiz.target.estimate.text()
    assert "Output ≈" in small and small != big and "fits" in big        # the estimate follows the bpw
    wiz.target.bits.setValue(3.0)
    wiz.next()
    out = tmp_path / "models" / "llama-exl3-3bpw-h6"
    assert wiz.output.output.text() == str(out)
    wiz.next()                                                             # starts the job
    run = wiz.run
    qtbot.waitUntil(lambda: run.bar.value() >= 200, timeout=10000)
    assert "left" in run.eta.text() and run.message.text().startswith("model.layers.")
    with qtbot.waitSignal(lib.client.error, timeout=10000):
        run.stop()
    assert "cancelled" in run.message.text() and not run.isComplete()
    # run it again with the same folders: it resumes and finishes
    wiz.back()
    fractions = []
    lib.client.progress.connect(lambda cid, prog: fractions.append(prog.fraction))
    with qtbot.waitSignal(wiz.converted, timeout=20000) as sig:
        wiz.next()
    assert sig.args == [str(out)] and run.isComplete() and (out / "config.json").exists()
    assert fractions and min(fractions) > 0.2       # resumed after the modules already done
    with qtbot.waitSignal(lib.scanned, timeout=20000):
        pass
    names = {e.name: e for e in lib.model.entries}
    assert names["llama-exl3-3bpw-h6"].kind == "exl3"


def test_wizard_refuses_an_exl3_source_and_bad_folder(qtbot, pane, ref_fixtures, tmp_path):
    lib, _ = pane
    wiz = lib.open_wizard(show=False)
    qtbot.addWidget(wiz)
    wiz.source.combo.setEditText(str(ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6"))
    assert not wiz.source.isComplete() and "already EXL3" in wiz.source.info.text()
    wiz.source.combo.setEditText(str(tmp_path))
    assert not wiz.source.isComplete() and "config.json" in wiz.source.info.text()
    assert wiz.button(QWizard.NextButton).isEnabled() is False


@pytest.fixture
def restore_theme(qapp):
    """theme.apply changes the whole application; put it back for the tests that follow. Ask for
    it before qtbot, so that it is torn down after qtbot has closed the test's widgets."""
    style, palette, sheet = qapp.style().name(), qapp.palette(), qapp.styleSheet()
    yield qapp
    qapp.setStyleSheet(sheet)
    qapp.setPalette(palette)
    if qapp.style().name() != style:
        qapp.setStyle(style)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_disabled_wizard_buttons_look_disabled(restore_theme, qtbot, make_client, tmp_path, dark):
    from PySide6.QtGui import QPalette
    from app import theme
    from app.views.convert_wizard import ConvertWizard
    theme.apply(restore_theme, dark=dark)
    wiz = ConvertWizard(make_client(start=False), [], str(tmp_path), capacity=[])
    wiz.confirm_close = False
    qtbot.addWidget(wiz)
    wiz.show()
    back, nxt = wiz.button(QWizard.BackButton), wiz.button(QWizard.NextButton)
    assert not back.isEnabled() and not nxt.isEnabled()     # first page, no source chosen
    for button in (back, nxt, wiz.button(QWizard.FinishButton)):
        pal = button.palette()
        for role in (QPalette.ButtonText, QPalette.Button):
            assert pal.color(QPalette.Disabled, role) != pal.color(QPalette.Active, role), (button.text(), role)
        # faded: the disabled text sits closer to the button's fill than the enabled text does
        fill = pal.color(QPalette.Active, QPalette.Button).lightness()
        assert abs(pal.color(QPalette.Disabled, QPalette.ButtonText).lightness() - fill) < \
            abs(pal.color(QPalette.Active, QPalette.ButtonText).lightness() - fill)
    # and the pixels differ: the same button drawn disabled and enabled
    off = nxt.grab().toImage()
    nxt.setEnabled(True)
    on = nxt.grab().toImage()
    assert off.size() == on.size() and off != on
