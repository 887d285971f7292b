"""The app driving the real engine process (`python -m engine.worker`) on a reference fixture:
load from the library, chat with streamed tokens, stop, regenerate, and clear errors for a
folder that is not a model and for a corrupt model."""
from __future__ import annotations

import shutil

import pytest
from PySide6.QtCore import Qt

from app import settings
from app import store as S
from app.main_window import MainWindow

pytestmark = pytest.mark.slow     # one engine start (torch import) and a model load: ~15 s on 2 cores


def test_chat_with_the_real_engine(qtbot, make_client, ref_fixtures, tmp_path):
    model = ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6"
    corrupt = tmp_path / "models" / "corrupt-exl3"
    shutil.copytree(model, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").chmod(0o644)
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "models" / "not-a-model").mkdir()
    settings.set_model_folders([str(ref_fixtures / "exl3"), str(tmp_path / "models")])

    client = make_client(real=True)
    w = MainWindow(client=client, start_engine=False)
    qtbot.addWidget(w)
    w.show()
    lib = w.library
    qtbot.waitUntil(lambda: bool(lib.model.entries), timeout=20000)

    # bad input first: the engine refuses, the pane says why, nothing crashes
    lib.load(str(tmp_path / "models" / "not-a-model"))       # checked before the engine is asked
    assert lib.status.text() == "Could not load: not-a-model is not a model folder (it has no config.json)."
    with qtbot.waitSignal(client.error, timeout=60000):
        lib.load(str(corrupt))
    assert lib.status.text().startswith("Could not load:") and "Traceback" not in lib.status.text()
    assert client.running and client.model is None

    assert lib.select_path(str(model))
    with qtbot.waitSignal(client.model_changed, timeout=90000):
        lib.primary_action()
    assert client.model["name"] == "llama-4.0bpw-mul1-h6"

    w.show_pane("Chat")
    w.session.max_tokens = 16
    # greedy, so the answer (and how many text pieces it streams in) is the same every run: with
    # sampling, two byte-fallback tokens sometimes made one character, hence one piece
    w.session.store.set_preset(w.session.new_conversation(), "Precise")
    pieces = []
    w.session.streamed.connect(lambda mid, delta: pieces.append(delta))
    with qtbot.waitSignal(w.session.streaming_changed, timeout=60000, check_params_cb=lambda on: not on):
        w.chat.composer.setPlainText("Hello")
        qtbot.keyClick(w.chat.composer, Qt.Key_Return)
    answer = w.store.path(w.session.conv_id)[-1]
    assert answer.state == S.DONE, answer.stats
    assert 1 <= answer.stats["generated_tokens"] <= 16 and answer.stats["finish_reason"] in ("stop", "length")
    assert "".join(pieces) == answer.content and len(pieces) >= min(2, answer.stats["generated_tokens"])
    assert answer.stats["prompt_tokens"] > 0
    # a decode rate exists only past the first token (that one belongs to the prompt's time); the
    # fixture's random weights sometimes stop right there
    if answer.stats["generated_tokens"] > 1:
        assert answer.stats["tokens_per_s"] > 0
    else:
        assert answer.stats["tokens_per_s"] == 0

    # regenerate: a second alternative beside the first
    with qtbot.waitSignal(w.session.streaming_changed, timeout=60000, check_params_cb=lambda on: not on):
        w.chat.transcript.action.emit("regen", answer.id, 0)
    second = w.store.path(w.session.conv_id)[-1]
    assert second.id != answer.id and len(w.store.siblings(second.id)) == 2

    # stop: a long answer cut short by Esc
    w.session.max_tokens = 2000
    w.chat.composer.setPlainText("Tell me more")
    qtbot.keyClick(w.chat.composer, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(w.store.path(w.session.conv_id)[-1].content) > 0, timeout=60000)
    with qtbot.waitSignal(w.session.streaming_changed, timeout=60000):
        qtbot.keyClick(w.chat.composer, Qt.Key_Escape)
    stopped = w.store.path(w.session.conv_id)[-1]
    assert stopped.state == S.CANCELLED and stopped.stats.get("generated_tokens", 0) < 2000
