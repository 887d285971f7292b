"""The conversion wizard running a real conversion (`trellis convert` in its own process): user
calibration text, per-module progress, closed mid-job, offered again by a new wizard (as after a
restart) and resumed to a finished EXL3 folder.

The model is a one-layer Llama built here from the fixture's tokenizer and config (hidden 128) with
an unquantized head: the fixture llama itself takes ~3 CPU-minutes at 8 x 64 calibration on this
machine, the one-layer model ~20 s."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from app import convert_job as J
from PySide6.QtWidgets import QWizard

from app.views.convert_wizard import ConvertWizard



def tiny_llama(src, out):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    h, v = 128, cfg["vocab_size"]
    w = lambda o, i: (rng.standard_normal((o, i)) * 0.05).astype(np.float16)
    p = "model.layers.0."
    save_file({"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float16),
               p + "input_layernorm.weight": np.ones(h, np.float16),
               p + "post_attention_layernorm.weight": np.ones(h, np.float16),
               p + "self_attn.q_proj.weight": w(128, h), p + "self_attn.k_proj.weight": w(64, h),
               p + "self_attn.v_proj.weight": w(64, h), p + "self_attn.o_proj.weight": w(h, 128),
               p + "mlp.gate_proj.weight": w(128, h), p + "mlp.up_proj.weight": w(128, h),
               p + "mlp.down_proj.weight": w(h, 128)}, str(out / "model.safetensors"))


def log_lines(wiz):
    return [wiz.run.log.item(i).text() for i in range(wiz.run.log.count())]


@pytest.mark.slow   # two converter processes (torch import) and one quantized layer: ~25 s on 2 cores
def test_convert_close_resume_finish(qtbot, make_client, ref_fixtures, tmp_path):
    models = tmp_path / "models"
    src = models / "tiny-llama"
    tiny_llama(ref_fixtures / "hf" / "llama", src)
    calib = tmp_path / "calibration.txt"
    calib.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog while the "
                                 f"river runs to the sea and the bells ring {i} times." for i in range(40)))
    client = make_client(start=False)   # no engine running: the wizard runs the converter process itself

    wiz = ConvertWizard(client, [("tiny-llama", str(src))], str(models), capacity=[8 << 30], context=4096)
    wiz.confirm_close = False
    qtbot.addWidget(wiz)
    wiz.show()
    assert not wiz.source.unfinished_box.isVisible()
    assert wiz.source.isComplete() and "LlamaForCausalLM, 1 layer" in wiz.source.info.text()
    wiz.next()

    # live estimate and fit badge follow the settings
    t = wiz.target
    t.bits.setValue(2.0)
    small = t.estimate.text()
    t.bits.setValue(6.0)
    big = t.estimate.text()
    assert small.startswith("Output ≈ ") and "fits" in big and small != big
    t.bits.setValue(2.0)
    t.head.setCurrentText("16")
    t.calibration.setCurrentIndex(1)
    assert not t.isComplete() and "Choose the calibration text" in t.advice.text()
    t.cal_path.setText(str(tmp_path / "nope.txt"))
    assert not t.isComplete() and "does not exist" in t.advice.text()
    t.cal_path.setText(str(calib))
    assert t.isComplete()
    t.cal_rows.setValue(8)
    t.cal_cols.setValue(64)
    wiz.next()
    out = models / "tiny-llama-exl3-2bpw-h16"
    assert wiz.output.output.text() == str(out)
    work = wiz.output.work.text()
    wiz.next()                                               # runs `trellis convert` in a QProcess

    # the first module finishes: per-module progress; then the window is closed mid-job
    qtbot.waitUntil(lambda: any(l.startswith("✓ model.embed_tokens") for l in log_lines(wiz)), timeout=120000)
    assert wiz.run.stage.text() == "Module 2 of 4" and wiz.run.bar.value() == 250
    assert isinstance(wiz.run.runner, J.ProcessConvert) and wiz.run.running
    assert wiz.run.message.text() == "model.embed_tokens done · working on the next module…"
    assert not wiz.button(QWizard.BackButton).isEnabled() and not wiz.button(QWizard.FinishButton).isEnabled()
    wiz.reject()
    assert not wiz.run.running and J.modules_done(work) == 1 and not out.exists()
    assert "cancelled" in wiz.run.message.text() and "1 finished module" in wiz.run.message.text()

    # a new wizard (as after restarting the app) offers the unfinished job and resumes it
    wiz2 = ConvertWizard(client, [], str(models), capacity=[8 << 30])
    qtbot.addWidget(wiz2)
    wiz2.show()
    assert wiz2.source.unfinished.count() == 1
    assert "tiny-llama → tiny-llama-exl3-2bpw-h16" in wiz2.source.unfinished.item(0).text()
    assert "1 module done" in wiz2.source.unfinished.item(0).text()
    with qtbot.waitSignal(wiz2.converted, timeout=240000) as sig:
        wiz2.source.resume_button.click()
        assert wiz2.currentPage() is wiz2.run
    assert sig.args == [str(out)] and wiz2.run.isComplete()
    lines = log_lines(wiz2)
    assert "Resumed: 1 of 4 modules were already done" in lines
    assert not any(l.startswith("✓ model.embed_tokens") for l in lines)     # not done twice
    assert any(l.startswith("✓ model.layers.0 in ") and "SQNR" in l for l in lines)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "exl3" and quant["head_bits"] == 16 and 1.5 < quant["bits"] <= 2.5
    assert (out / "model.safetensors").stat().st_size > 0
    assert J.unfinished() == []


@pytest.mark.slow   # the real engine (torch import) and a converter process: ~7 s
def test_hub_source_downloads_then_converts_through_the_engine(qtbot, make_client, ref_fixtures, tmp_path,
                                                               monkeypatch):
    from tests.fakehub import FakeHub
    built = tmp_path / "built" / "tiny-llama"
    tiny_llama(ref_fixtures / "hf" / "llama", built)
    models = tmp_path / "models"
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        hub.add_repo("meta/tiny-llama", {"main": FakeHub.read_folder(built)})
        hub.add_repo("turbo/tiny-exl3", {"main": FakeHub.read_folder(ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6")})
        client = make_client(real=True, HF_ENDPOINT=hub.url)
        wiz = ConvertWizard(client, [], str(models), capacity=[8 << 30])
        wiz.confirm_close = False
        qtbot.addWidget(wiz)
        wiz.show()
        src = wiz.source

        # bad input first: a repo that does not exist, an EXL3 repo
        wiz.set_hub_source("nobody/missing")
        qtbot.waitUntil(lambda: bool(src.hub_error), timeout=20000)
        assert not src.isComplete() and "does not exist" in src.info.text()
        wiz.set_hub_source("turbo/tiny-exl3")
        qtbot.waitUntil(lambda: src.hub_config is not None, timeout=20000)
        assert not src.isComplete() and "already EXL3" in src.info.text()

        wiz.set_hub_source("meta/tiny-llama")
        qtbot.waitUntil(lambda: src.hub_config is not None, timeout=20000)
        assert src.isComplete() and "to download first" in src.info.text()
        wiz.next()
        assert "fits" in wiz.target.estimate.text()
        wiz.target.bits.setValue(3.0)
        wiz.target.cal_rows.setValue(8)
        wiz.target.cal_cols.setValue(64)
        wiz.next()
        assert wiz.output.output.text() == str(models / "tiny-llama-exl3-3bpw-h6")
        wiz.next()                    # downloads into the library, then the engine's convert command
        qtbot.waitUntil(lambda: isinstance(wiz.run.runner, J.EngineConvert), timeout=60000)
        assert (models / "tiny-llama" / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
        assert "checksums verified" in wiz.run.log.item(0).text()
        work = wiz.output.work.text()
        relayed = []
        client.progress.connect(lambda cid, prog: relayed.append(prog))
        qtbot.waitUntil(lambda: (J.modules_done(work) or 0) >= 1 and bool(relayed), timeout=120000)
        assert wiz.run.running and relayed[-1].task == "convert"
        last = relayed[-1].message
        shown = wiz.run.message.text()
        # The last relayed event may still be a stage (the work folder can show a finished module
        # before its progress message arrives); each stage has its own text.
        if last.startswith("model."):
            assert shown.startswith(last + " done")
        elif last == "measure":
            assert shown == "Deciding how many bits each group of layers gets…"
        else:
            assert shown == "Loading the model and the calibration data…"
        wiz.run.stop()
        qtbot.waitUntil(lambda: not wiz.run.running, timeout=30000)
        assert "cancelled" in wiz.run.message.text()
        assert J.modules_done(work) >= 1


def test_user_calibration_goes_through_the_running_engine(qtbot, make_client, ref_fixtures, tmp_path):
    """With the engine running, a conversion on the user's own text is the engine's convert command
    (carrying the calibration path), not a converter process of the wizard's own."""
    models = tmp_path / "models"
    src = models / "llama"
    shutil.copytree(ref_fixtures / "hf" / "llama", src)
    calib = tmp_path / "calibration"
    calib.mkdir()
    (calib / "notes.txt").write_text("Some of my own text to calibrate on. " * 50)
    client = make_client()                                   # the fake engine
    sent = []
    send = client.send
    client.send = lambda msg: (sent.append(msg), send(msg))[1]
    wiz = ConvertWizard(client, [("llama", str(src))], str(models), capacity=[8 << 30])
    wiz.confirm_close = False
    qtbot.addWidget(wiz)
    wiz.show()
    wiz.next()
    wiz.target.calibration.setCurrentIndex(1)
    wiz.target.cal_path.setText(str(calib))
    assert wiz.target.isComplete()
    wiz.next()
    out = wiz.output.output.text()
    with qtbot.waitSignal(wiz.converted, timeout=20000) as sig:
        wiz.next()
        assert isinstance(wiz.run.runner, J.EngineConvert)
    assert sig.args == [out] and wiz.run.isComplete()
    converts = [m for m in sent if m.type == "convert"]
    assert len(converts) == 1 and converts[0].calibration == str(calib) and converts[0].output_dir == out


def test_unfinished_job_listed_and_discarded(qtbot, make_client, ref_fixtures, tmp_path):
    models = tmp_path / "models"
    src = models / "llama"
    shutil.copytree(ref_fixtures / "hf" / "llama", src)
    stale = J.ConversionRequest(str(src), str(models / "llama-exl3-4bpw-h6"), str(models / ".llama-exl3-4bpw-h6.work"))
    Path(stale.work_dir).mkdir()
    (Path(stale.work_dir) / "job.json").write_text(json.dumps({"version": 1, "done": 3}))
    J.remember(stale)
    gone = J.ConversionRequest(str(src), str(models / "other"), str(models / ".other.work"))   # no work folder
    J.remember(gone)
    wiz = ConvertWizard(make_client(), [("llama", str(src))], str(models), capacity=[])
    wiz.confirm_close = False
    qtbot.addWidget(wiz)
    wiz.show()
    assert wiz.source.unfinished.count() == 1 and "3 modules done" in wiz.source.unfinished.item(0).text()
    wiz.source.combo.setEditText(str(tmp_path))              # not a model: Next refuses
    wiz.next()
    assert wiz.currentPage() is wiz.source and "config.json" in wiz.source.info.text()
    wiz.source.combo.setCurrentIndex(0)
    # the output page says that this work folder will be resumed
    wiz.next()
    assert "no free memory known" in wiz.target.estimate.text()
    wiz.next()
    wiz.output.work.setText(stale.work_dir)
    assert "unfinished conversion (3 modules done)" in wiz.output.notice.text() and wiz.output.notice.isVisible()
    wiz.back()
    wiz.back()
    wiz.source.discard_button.click()
    assert not Path(stale.work_dir).exists() and wiz.source.unfinished.count() == 0
    assert not wiz.source.unfinished_box.isVisible() and J.unfinished() == []


def test_hub_config_says_what_is_wrong_with_a_repo(monkeypatch):
    """The wizard's background read of a hub repo: each bad repo gets its own sentence, and the
    line a person sees (failure_line) is that sentence, not an exception's name."""
    from app.background import failure_line
    from app.views.convert_wizard import _hub_config
    from tests.fakehub import FakeHub
    weights = {"model.safetensors": b"\0" * 64}
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        hub.add_repo("a/no-weights", {"main": {"config.json": b"{}"}})
        hub.add_repo("a/no-config", {"main": dict(weights)})
        hub.add_repo("a/bad-json", {"main": {**weights, "config.json": b"{not json"}})
        hub.add_repo("a/list-json", {"main": {**weights, "config.json": b"[1, 2]"}})
        hub.add_repo("a/good", {"main": {**weights, "config.json": b'{"architectures": ["LlamaForCausalLM"]}'}})
        expected = {"a/no-weights": "has no .safetensors weights", "a/no-config": "has no config.json",
                    "a/bad-json": "config.json is not valid JSON", "a/list-json": "config.json is not a JSON object"}
        for repo, words in expected.items():
            with pytest.raises(Exception) as info:
                _hub_config(repo, "main")
            assert words in failure_line(info.value), repo
        cfg = _hub_config("a/good", "main")
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["_size_bytes"] > 64
