"""Library and planner panes on the reference fixture models (read in place), plus broken folders."""
from __future__ import annotations

import json
import shutil

import pytest

from app import library_scan, settings
from app.main_window import MainWindow
from engine import plan as planner


LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                max_position_embeddings=131072, quantization_config=dict(quant_method="exl3", bits=4.0, head_bits=6))


@pytest.fixture
def library_dirs(ref_fixtures, tmp_path):
    broken = tmp_path / "mine" / "broken-model"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (tmp_path / "mine" / "just-notes").mkdir()
    (tmp_path / "mine" / "just-notes" / "readme.txt").write_text("not a model")
    settings.set_model_folders([str(ref_fixtures), str(tmp_path / "mine")])
    return ref_fixtures, broken


@pytest.fixture
def window(qtbot, make_client, library_dirs):
    w = MainWindow(client=make_client(), start_engine=False)
    qtbot.addWidget(w)
    w.show()
    if not w.library.model.entries:
        with qtbot.waitSignal(w.library.scanned, timeout=20000):
            pass
    return w


def test_library_lists_models_with_details_and_fit(qtbot, window, library_dirs):
    ref, broken = library_dirs
    lib = window.library
    rows = {e.name: e for e in lib.model.entries}
    assert {"llama-4.0bpw-mul1-h6", "llama-2.5bpw-mcg-h4", "qwen2-3.0bpw-mul1-h6", "llama", "qwen2",
            "broken-model"} <= set(rows)
    assert "just-notes" not in rows
    m = lib.model
    r = m.entries.index(rows["llama-4.0bpw-mul1-h6"])
    cells = [m.data(m.index(r, c)) for c in range(8)]
    assert cells[1] == "LlamaForCausalLM" and cells[3] == "4.00" and cells[4] == "6" and cells[6] == "no"
    assert cells[2].endswith("M") and cells[5].endswith("MB")
    assert cells[7].startswith("fits")                       # 6 GiB free reported by the (fake) engine
    hf = m.entries.index(rows["qwen2"])
    assert m.data(m.index(hf, 7)) == "convert"
    bad = m.entries.index(rows["broken-model"])
    assert m.data(m.index(bad, 7)) == "broken"
    assert "not valid JSON" in m.data(m.index(bad, 1)) or "header" in m.data(m.index(bad, 1))
    # the badge follows the memory the engine reports: with 64 KiB free nothing fits
    window.client.devices[0].free_bytes = 64 * 1024
    lib._refresh_fits()
    assert m.data(m.index(r, 7)).startswith("too big")


def test_a_gpu_without_its_kernels_is_said_at_load(qtbot, window, tmp_path):
    """A model the engine loaded on a GPU without the CUDA kernels: the library's load line and
    the status bar say so, with the engine's reason."""
    d = tmp_path / "mine" / "llama-nokernels"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with qtbot.waitSignal(window.client.model_changed, timeout=10000):
        window.library.load(str(d))
    assert "without CUDA kernels (slow): cannot build the CUDA kernels: nvcc not found" in window.library.status.text()
    assert "without CUDA kernels" in window.model_label.text() and "nvcc not found" in window.model_label.toolTip()


def test_broken_model_says_why_and_load_errors_are_shown(qtbot, window, library_dirs):
    ref, broken = library_dirs
    lib = window.library
    assert lib.select_path(str(broken))
    lib.primary_action()
    assert "broken-model" in lib.status.text() and lib.model.entries
    # a folder that is not a model: said at once, the engine is not bothered
    lib.load(str(broken.parent / "just-notes"))
    assert lib.status.text().startswith("Could not load") and "not a model folder" in lib.status.text()
    # a load the engine refuses: its reason is shown in the pane (the real engine: test_real_engine)
    with qtbot.waitSignal(window.client.error, timeout=10000):
        window.client.load(str(broken.parent / "just-notes"))
    assert lib.status.text().startswith("Could not load") and window.client.running


def test_load_from_library_then_unload(qtbot, window, library_dirs):
    ref, _ = library_dirs
    lib = window.library
    path = str(ref / "exl3" / "llama-4.0bpw-mul1-h6")
    assert lib.select_path(path)
    with qtbot.waitSignal(window.client.model_changed, timeout=10000):
        lib.primary_action()
    assert window.client.model["model_dir"] == path
    assert "(loaded)" in lib.model.data(lib.model.index(lib.model.entries.index(lib.selected()), 0))
    assert window.stack.currentWidget() is window.chat          # loading takes you to the chat
    with qtbot.waitSignal(window.client.model_changed, timeout=10000):
        lib.unload_button.click()
    assert window.client.model is None


def test_delete_removes_a_model_folder(qtbot, window, library_dirs, tmp_path):
    _, broken = library_dirs
    lib = window.library
    assert lib.select_path(str(broken))
    with qtbot.waitSignal(lib.scanned, timeout=20000):
        lib.delete_selected(confirm=False)
    assert not broken.exists() and "broken-model" not in {e.name for e in lib.model.entries}


def test_planner_pane_matches_engine_plan(qtbot, window, library_dirs):
    ref, _ = library_dirs
    p = window.planner
    d = ref / "exl3" / "qwen2-3.0bpw-mul1-h6"
    p.set_model(str(d))
    p.context.setValue(1024)
    p.k_bits.setCurrentText("4")
    p.v_bits.setCurrentText("4")
    p.gpu_mem.setValue(1.0)
    expected = planner.plan(planner.spec_from_dir(d), planner.PlanRequest(
        context=1024, k_bits=4, v_bits=4, gpu_bytes=[planner.GiB]))
    got = p.last_plan
    assert (got.weights, got.kv_cache, got.total, got.largest_context) == \
        (expected.weights, expected.kv_cache, expected.total, expected.largest_context)
    assert p.verdict.text().startswith("Fits") and "2,048" in p.largest.text()
    assert p.advice.text() == expected.advice
    # a hub config (a dict, as the hub browser hands it over): estimated weights, too big for 4 GiB
    p.set_model(LLAMA_8B)
    p.gpu_mem.setValue(4.0)
    assert p.last_plan.weights_exact is False and p.last_plan.fits is False
    assert p.verdict.text().startswith("Does not fit") and "weights alone" in p.advice.text()
    p.gpu_mem.setValue(24.0)
    assert p.last_plan.fits and p.last_plan.largest_context > 4096
    # predicted vs measured once the planned model is loaded
    with qtbot.waitSignal(window.client.model_changed, timeout=10000):
        window.client.load(str(d))
    p.set_model(str(d))
    assert "measured: weights" in p.measured.text() and "predicted" in p.measured.text()
    # not a model: one clear sentence, nothing else
    p.set_model(str(ref))
    assert p.advice.text().startswith("Cannot plan:") and p.last_plan is None


def test_planner_counts_dense_weights_on_a_gpu_without_kernels(qtbot, make_client, library_dirs):
    """An engine whose GPU cannot have the CUDA kernels says so at start; the planner then counts
    the dense fp16 copies the weights will load as, names the reason, and the library's fit badge
    follows the same plan."""
    client = make_client(FAKE_GPU_WITHOUT_KERNELS="cannot build the CUDA kernels: nvcc not found")
    w = MainWindow(client=client, start_engine=False)
    qtbot.addWidget(w)
    p = w.planner
    assert "without CUDA kernels" in p.gpu_source.text() and "nvcc not found" in p.gpu_source.toolTip()
    p.set_model(LLAMA_8B)
    p.context.setValue(4096)
    p.gpu_mem.setValue(16.0)
    spec = planner.spec_from_config(LLAMA_8B, name="x")
    plain = planner.plan(spec, planner.PlanRequest(context=4096, gpu_bytes=[16 * planner.GiB]))
    assert p.last_plan.weights == plain.weights + planner.dense_copy_bytes(spec)
    assert plain.fits and not p.last_plan.fits  # 4.0 bpw Llama-3.1-8B: ~5 GiB compressed, ~14 GiB more dense
    assert "dense fp16 copies" in p.advice.text() and "nvcc not found" in p.advice.text()
    ref, _ = library_dirs
    e = library_scan.LibraryEntry(str(ref), "x", "exl3", spec=spec)
    assert library_scan.fit(e, 4096, [16 * planner.GiB], "nvcc not found").weights == p.last_plan.weights


def test_scan_survives_unreadable_and_gguf(tmp_path, ref_fixtures):
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    shutil.copytree(ref_fixtures / "hf" / "llama", tmp_path / "llama-copy")
    (tmp_path / "llama-copy" / "model.safetensors").write_bytes(b"\x00" * 4)      # truncated
    entries = {e.name: e for e in library_scan.scan([str(tmp_path)])}
    assert entries["a"].kind == "gguf"
    assert entries["llama-copy"].kind == "broken"
    assert "model.safetensors" in entries["llama-copy"].error and "not a safetensors file" in entries["llama-copy"].error


def test_a_scan_that_fails_becomes_a_row_that_says_why(qtbot, make_client, tmp_path, monkeypatch):
    """The scan runs off the UI thread; if it raises, the table shows one broken row with the
    reason, and the app goes on."""
    settings.set_model_folders([str(tmp_path)])
    w = MainWindow(client=make_client(), start_engine=False)
    qtbot.addWidget(w)
    qtbot.waitUntil(lambda: w.library.status.text() != "Reading model folders…", timeout=20000)

    def broken_scan(folders):
        raise PermissionError(f"cannot read {folders[0]}")

    monkeypatch.setattr(library_scan, "scan", broken_scan)
    with qtbot.waitSignal(w.library.scanned, timeout=20000):
        w.library.rescan()
    [row] = w.library.model.entries
    assert row.kind == "broken" and row.error == f"cannot read {tmp_path}"
