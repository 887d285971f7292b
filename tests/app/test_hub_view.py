"""Hub browser pane (app/views/hub_view.py) against the fake hub (tests/fakehub.py) and the real
engine process: search with EXL3 first, card summary, revisions with size and fit badge, a
download cut mid-file and resumed by a new pane (as after a restart) to checksum-verified files
in the library, pause, cancel, a repo that does not exist, and a full disk before and during a
download (the latter simulated inside the engine process)."""
from __future__ import annotations

import json
import sys
import time

import pytest

from app import settings
from app.engine_client import EngineClient
from app.hub_info import card_summary, revision_plan
from app.views.hub_view import HubPane
from tests.fakehub import FakeHub

README = b"""---
license: apache-2.0
base_model: meta/tiny
tags:
- exl3
---
# Tiny EXL3

![logo](logo.png)

A **tiny** Llama quantized to [EXL3](https://example.com), for tests.

More text that is not the summary.
"""

# The engine process with writes of partial downloads failing like a full disk, for one repo only.
DISK_FULL_WORKER = r"""
import builtins, errno, runpy, sys
import engine.hub as h
real_open = builtins.open
class FullDisk:
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *a): self.f.close()
    def write(self, b): raise OSError(errno.ENOSPC, "No space left on device")
def fake_open(path, mode="r", *a, **k):
    f = real_open(path, mode, *a, **k)
    if "diskfull" in str(path) and str(path).endswith(".part") and ("a" in mode or "w" in mode):
        return FullDisk(f)
    return f
h.open = fake_open
sys.argv = ["engine.worker"]
runpy.run_module("engine.worker", run_name="__main__")
"""


@pytest.fixture
def hub_env(monkeypatch, ref_fixtures, tmp_path):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        exl3 = ref_fixtures / "exl3"
        cfg = json.loads((exl3 / "llama-4.0bpw-mul1-h6" / "config.json").read_text())
        h.add_repo("turbo/tiny-exl3", {"main": {"README.md": README},
                                       "4.0bpw": FakeHub.read_folder(exl3 / "llama-4.0bpw-mul1-h6"),
                                       "2.5bpw": FakeHub.read_folder(exl3 / "llama-2.5bpw-mcg-h4")},
                   hub_tags=["exl3"], downloads=10, likes=3, config=cfg)
        h.add_repo("meta/tiny", {"main": FakeHub.read_folder(ref_fixtures / "hf" / "llama")}, downloads=999,
                   config={"architectures": ["LlamaForCausalLM"]})
        h.add_repo("turbo/tiny-diskfull-exl3", {"4.0bpw": FakeHub.read_folder(exl3 / "llama-4.0bpw-mul1-h6")},
                   hub_tags=["exl3"], config=cfg)
        settings.set_model_folders([str(tmp_path / "models")])
        yield h


@pytest.fixture
def engine(qtbot, hub_env):
    """The real engine process (download runs there), with the full-disk simulation for one repo."""
    c = EngineClient([sys.executable, "-c", DISK_FULL_WORKER], env={"HF_ENDPOINT": hub_env.url})
    with qtbot.waitSignal(c.ready, timeout=60000):
        c.start()
    yield c
    c.close()


def rows_by_name(pane):
    m = pane.revisions
    return {r.name: [m.data(m.index(i, c)) for c in range(m.columnCount())] for i, r in enumerate(m.items)}


def wait_state(qtbot, item, *states, timeout=60000):
    qtbot.waitUntil(lambda: item.state in states, timeout=timeout)


def test_card_summary_reads_front_matter_and_first_paragraph():
    meta, text = card_summary(README.decode())
    assert meta["license"] == "apache-2.0" and meta["tags"] == ["exl3"]
    assert text == "A tiny Llama quantized to EXL3, for tests."


def test_revision_fit_counts_dense_copies_without_the_kernels():
    """A hub revision's fit on a GPU that cannot have the CUDA kernels counts the dense fp16 copies
    its weights will load as: a 4.0 bpw Llama-3.1-8B fits 16 GiB with them, not without."""
    from tests.app.test_library_planner import LLAMA_8B

    fits, _ = revision_plan(LLAMA_8B, "llama", 4.0, 0, 4096, [16 << 30])
    dense, needs = revision_plan(LLAMA_8B, "llama", 4.0, 0, 4096, [16 << 30], without_kernels="nvcc not found")
    assert fits.fits and not dense.fits and needs == dense.total > fits.total
    assert "nvcc not found" in dense.advice


def private_hub_names_used(source: str) -> list[str]:
    """`engine.hub` names starting with an underscore that `source` reaches for."""
    import ast
    tree = ast.parse(source)
    aliases, used = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "engine":
            aliases |= {a.asname or a.name for a in node.names if a.name == "hub"}
        elif isinstance(node, ast.ImportFrom) and node.module == "engine.hub":
            used += [a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "engine.hub" and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.append(node.attr)
            elif ast.unparse(node.value) == "engine.hub":
                used.append(node.attr)
    return used


def test_app_uses_only_public_engine_hub_names():
    from pathlib import Path
    assert private_hub_names_used("from engine import hub\nhub._api()\nfrom engine.hub import _translate") == \
        ["_translate", "_api"]                               # the check itself finds them
    app_dir = Path(__file__).resolve().parents[2] / "app"
    found = {str(p.relative_to(app_dir)): names for p in sorted(app_dir.rglob("*.py"))
             if (names := private_hub_names_used(p.read_text()))}
    assert found == {}


def test_repo_card_through_public_hub_calls(monkeypatch):
    from app import hub_info
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        fake.add_repo("turbo/tiny-exl3", {"main": {"README.md": README, "config.json": b"{}"}},
                      config={"architectures": ["LlamaForCausalLM"]}, hub_tags=["exl3"], downloads=12, likes=3,
                      parameters=5000)
        fake.add_repo("meta/no-card", {"main": {"config.json": b"{}"}}, config={"architectures": ["X"]})
        card = hub_info.repo_card("turbo/tiny-exl3")
        assert (card.architecture, card.downloads, card.likes, card.parameters, card.is_exl3) == \
            ("LlamaForCausalLM", 12, 3, 5000, True)
        assert card.license == "apache-2.0" and card.base_model == "meta/tiny"
        assert card.summary == "A tiny Llama quantized to EXL3, for tests."
        bare = hub_info.repo_card("meta/no-card")
        assert bare.summary == "" and not bare.is_exl3 and bare.architecture == "X"
        from engine import hub
        with pytest.raises(hub.RepoNotFound):
            hub_info.repo_card("meta/missing")


@pytest.mark.slow   # one engine process (torch import) and several downloads: ~15 s on 2 busy cores
def test_search_revisions_download_pause_resume_cancel(qtbot, hub_env, engine, tmp_path):
    pane = HubPane(engine)
    qtbot.addWidget(pane)
    pane.show()

    # search: EXL3 first although the other model has far more downloads
    pane.query.setText("tiny")
    with qtbot.waitSignal(pane.searched, timeout=20000):
        pane.search()
    assert [r.id for r in pane.results.items] == ["turbo/tiny-exl3", "turbo/tiny-diskfull-exl3", "meta/tiny"]
    assert pane.results.data(pane.results.index(0, 1)) == "EXL3" and pane.results.data(pane.results.index(2, 1)) == "HF"
    pane.exl3_only.setChecked(True)
    assert [r.id for r in pane.results.items] == ["turbo/tiny-exl3", "turbo/tiny-diskfull-exl3"]
    pane.architecture.setEditText("qwen2")
    with qtbot.waitSignal(pane.searched, timeout=20000):
        pane.search()
    assert pane.results.rowCount() == 0 and pane.search_status.text() == "No models found."
    pane.architecture.setCurrentIndex(0)
    with qtbot.waitSignal(pane.searched, timeout=20000):
        pane.search()
    assert pane.results.rowCount() == 2

    # a repo: card summary, one row per revision with size and fit badge
    with qtbot.waitSignal(pane.repo_shown, timeout=30000):
        pane.results_view.selectRow(0)
    card = pane.card.text()
    assert "turbo/tiny-exl3" in card and "A tiny Llama quantized to EXL3, for tests." in card
    assert "apache-2.0" in card and "EXL3" in card and "LlamaForCausalLM" in card
    rows = rows_by_name(pane)
    assert set(rows) == {"main", "2.5bpw", "4.0bpw"}
    src = hub_env.repos["turbo/tiny-exl3"].branches
    assert rows["4.0bpw"][1] == "4.00" and rows["2.5bpw"][1] == "2.50" and rows["4.0bpw"][2] == "6"
    size = lambda b: sum(len(v) for v in src[b].values())
    four = next(r for r in pane.revisions.items if r.name == "4.0bpw")
    assert four.total_bytes == size("4.0bpw") and four.total_bytes > size("2.5bpw")
    assert rows["4.0bpw"][5].startswith("fits · ") and rows["main"][5] == "no weights"
    assert four.plan.weights_exact and four.plan.weights == len(src["4.0bpw"]["model.safetensors"])
    assert pane.selected_revision().name == "4.0bpw"          # the highest bitrate that fits is preselected
    assert "context" in pane.fit_note.text()

    # download 4.0bpw; the first transfer of the weights drops mid-body
    cut = {"done": False}

    def cut_after(path, start):
        if path == "model.safetensors" and not cut["done"]:
            cut["done"] = True
            return 100_000
        return None
    hub_env.cut_after = cut_after
    pane.revisions_view.selectRow([r.name for r in pane.revisions.items].index("4.0bpw"))
    pane.download_selected()
    item = pane.downloads.find("turbo/tiny-exl3", "4.0bpw")
    wait_state(qtbot, item, "failed", "done")
    assert item.state == "failed" and "resume" in item.message.lower()
    local = tmp_path / "models" / "turbo--tiny-exl3--4.0bpw"
    assert not (local / "model.safetensors").exists()

    # a new pane, as after restarting the app: the download is listed and resumes where it stopped
    pane2 = HubPane(engine)
    qtbot.addWidget(pane2)
    item2 = pane2.downloads.find("turbo/tiny-exl3", "4.0bpw")
    assert item2 is not None and item2.state == "failed" and pane2.downloads_model.rowCount() == 1
    pane2.downloads_view.selectRow(0)
    assert pane2.pause_button.text() == "Resume" and pane2.pause_button.isEnabled()
    pane2.pause_button.click()
    wait_state(qtbot, item2, "done", "failed")
    assert item2.state == "done" and item2.verified, item2.message
    for name, data in src["4.0bpw"].items():
        assert (local / name).read_bytes() == data
    ranges = [r for m, p, r in hub_env.requests if p.endswith("4.0bpw/model.safetensors") or
              (p.endswith("/model.safetensors") and m == "GET" and r)]
    assert "bytes=100000-" in ranges, "the resume continues where the cut left off"
    assert "checksums" in pane2.downloads_model.data(pane2.downloads_model.index(0, 4))
    assert "match the hub's checksums" in item2.message

    # verify again: markers dropped, every file hashed again in the engine, still done
    pane2.verify_button.click()
    assert item2.state == "verifying"
    wait_state(qtbot, item2, "done", "failed")
    assert item2.state == "done" and item2.verified

    # pause mid-transfer (a slow server), then cancel: the partial folder is deleted
    def slow(path, start):
        time.sleep(0.8)
        return None
    hub_env.cut_after = slow
    item3 = pane2.downloads.start("turbo/tiny-exl3", "2.5bpw", total_bytes=size("2.5bpw"))
    assert item3.state == "downloading"
    pane2.downloads_view.selectRow(pane2.downloads.items.index(item3))
    assert pane2.pause_button.text() == "Pause"
    qtbot.waitUntil(lambda: item3.message.startswith("downloading"), timeout=30000)   # bytes are flowing
    pane2.pause_button.click()
    wait_state(qtbot, item3, "paused", timeout=30000)
    qtbot.waitUntil(lambda: item3.command_id is None and "Paused at" in item3.message, timeout=30000)
    partial = tmp_path / "models" / "turbo--tiny-exl3--2.5bpw"
    assert partial.is_dir() and not (partial / "model.safetensors").exists()
    pane2.cancel_button.click()
    assert pane2.downloads.find("turbo/tiny-exl3", "2.5bpw") is None
    assert not partial.exists(), list(partial.rglob("*"))
    hub_env.cut_after = None

    # the disk fills up during the transfer: a clear sentence, bytes kept, resumable
    item4 = pane2.downloads.start("turbo/tiny-diskfull-exl3", "4.0bpw")
    wait_state(qtbot, item4, "failed", "done")
    assert item4.message.startswith("The disk is full:") and "press Resume" in item4.message
    assert "Traceback" not in item4.message


def test_missing_repo_full_disk_and_offline_are_clear_messages(qtbot, hub_env, make_client, monkeypatch, tmp_path):
    from app.views.library_view import LibraryPane
    client = make_client()                     # the fake engine: nothing here needs the real one
    lib = LibraryPane(client)
    pane = HubPane(client, lib)
    qtbot.addWidget(lib)
    qtbot.addWidget(pane)

    # an unquantized repo offers "Convert…": the wizard opens on it, looked up on the hub
    with qtbot.waitSignal(pane.repo_shown, timeout=20000):
        pane.open_repo("meta/tiny")
    assert [r.name for r in pane.revisions.items] == ["main"] and not pane.convert_button.isHidden()
    with qtbot.waitSignal(pane.convert_requested, timeout=5000) as sig:
        pane.convert_button.click()
    assert sig.args == ["meta/tiny", "main"]
    wiz = pane.wizard
    qtbot.addWidget(wiz)
    qtbot.waitUntil(lambda: wiz.source.hub_config is not None, timeout=20000)
    assert wiz.source.is_hub() and wiz.source.isComplete() and "to download first" in wiz.source.info.text()
    wiz.close()

    # a repo id that does not exist (typed into the search box)
    pane.query.setText("nobody/missing-exl3")
    with qtbot.waitSignal(pane.repo_shown, timeout=20000):
        pane.search()
    assert "nobody/missing-exl3" in pane.card.text() and "does not exist" in pane.card.text()
    assert pane.revisions.rowCount() == 0 and not pane.download_button.isEnabled()

    # not enough free space: refused before the engine is asked
    import app.downloads as downloads
    monkeypatch.setattr(downloads, "free_bytes", lambda path: 1000)
    sent = []
    monkeypatch.setattr(client, "send", lambda msg: sent.append(msg) or "x")
    item = pane.downloads.start("turbo/tiny-exl3", "4.0bpw", total_bytes=5 << 20)
    assert item.state == "failed" and not sent
    assert item.message.startswith("Not enough disk space: turbo/tiny-exl3@4.0bpw needs 5.0 MB more")
    assert "1000 B free" in item.message

    # the hub cannot be reached
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    pane.query.setText("anything")
    with qtbot.waitSignal(pane.searched, timeout=30000):
        pane.search()
    assert pane.search_status.text().startswith("Search failed: cannot search the hub: the hub at http://127.0.0.1:9 "
                                                "cannot be reached")
