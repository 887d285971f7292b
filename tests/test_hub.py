"""engine.hub against a fake hub on 127.0.0.1 (tests/fakehub.py): search, revisions, files,
downloads interrupted at random points and resumed by new processes, traversal, offline."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import hub
from tests.fakehub import FakeHub

ROOT = Path(__file__).resolve().parents[1]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def fake_hub(monkeypatch):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield h


def model_files(seed: int = 0, big: int = 600_000) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config":
                                        {"quant_method": "exl3", "bits": 4.0}}).encode(),
            "tokenizer.json": b'{"model": {"vocab": {}}}' * 60,
            "model.safetensors": rng.randbytes(big),
            "extra/notes.txt": b"small text file\n"}


def test_search_puts_exl3_first_and_filters(fake_hub):
    fake_hub.add_repo("meta/Llama-8B", {"main": {"config.json": b"{}"}}, downloads=5000, parameters=8_000_000_000,
                      config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    fake_hub.add_repo("someone/Llama-8B-exl3", {"main": {"config.json": b"{}"}}, downloads=20, hub_tags=["exl3"],
                      parameters=8_000_000_000, config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    fake_hub.add_repo("other/Qwen2-1.5B-exl3", {"main": {"config.json": b"{}"}}, downloads=10,
                      parameters=1_500_000_000,
                      config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                              "quantization_config": {"quant_method": "exl3"}})
    found = hub.search_models("")
    assert [r.id for r in found] == ["someone/Llama-8B-exl3", "other/Qwen2-1.5B-exl3", "meta/Llama-8B"]
    assert [r.is_exl3 for r in found] == [True, True, False]
    assert found[0].architecture == "LlamaForCausalLM" and found[0].parameters == 8_000_000_000
    assert [r.id for r in hub.search_models("llama")] == ["someone/Llama-8B-exl3", "meta/Llama-8B"]
    assert [r.id for r in hub.search_models(architecture="qwen2")] == ["other/Qwen2-1.5B-exl3"]
    assert [r.id for r in hub.search_models(max_params=2_000_000_000)] == ["other/Qwen2-1.5B-exl3"]
    assert [r.id for r in hub.search_models(min_params=2_000_000_000, limit=1)] == ["someone/Llama-8B-exl3"]


def test_revisions_one_branch_per_bpw(fake_hub):
    branches = {"main": {"README.md": b"# card\n"}, "6_0bpw": model_files(6), "2.5bpw": model_files(2),
                "4.0bpw": model_files(4)}
    repo = fake_hub.add_repo("turbo/Model-exl3", branches, tags={"v1": "4.0bpw"})
    revs = hub.list_revisions("turbo/Model-exl3")
    assert [(r.name, r.kind, r.bits) for r in revs] == [
        ("main", "branch", None), ("2.5bpw", "branch", 2.5), ("4.0bpw", "branch", 4.0),
        ("6_0bpw", "branch", 6.0), ("v1", "tag", None)]
    assert all(r.commit == repo.commit(r.name if r.kind == "branch" else "4.0bpw") for r in revs)
    assert len({r.commit for r in revs if r.kind == "branch"}) == 4


def test_files_with_sizes_and_checksums(fake_hub, ref_fixtures):
    folder = ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6"
    fake_hub.add_repo("turbo/tiny-exl3", {"main": {"README.md": b"hi"}, "4.0bpw": FakeHub.read_folder(folder)})
    commit, files = hub.repo_files("turbo/tiny-exl3", "4.0bpw")
    assert commit == fake_hub.repos["turbo/tiny-exl3"].commit("4.0bpw")
    by_path = {f.path: f for f in files}
    assert set(by_path) == {p.name for p in folder.iterdir()}
    st = by_path["model.safetensors"]
    data = (folder / "model.safetensors").read_bytes()
    assert st.size == len(data) and st.sha256 == sha256(data)
    small = by_path["generation_config.json"]  # under the fake hub's LFS threshold: a git blob
    data = (folder / "generation_config.json").read_bytes()
    assert small.size == len(data) and small.sha256 is None
    assert small.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_unknown_repo_and_revision(fake_hub):
    fake_hub.add_repo("a/b", {"main": {"x": b"1"}})
    with pytest.raises(hub.RepoNotFound, match="does not exist"):
        hub.download("a/missing", local_dir="/nonexistent-should-not-be-created")
    with pytest.raises(hub.RepoNotFound, match="revision"):
        hub.list_files("a/b", "9.9bpw")


def test_repo_details_and_read_text_for_the_app(fake_hub):
    """The public calls the app's hub browser and wizard use (app/hub_info.py)."""
    readme = "---\nlicense: mit\n---\nA small model.\n" + "x" * 5000
    repo = fake_hub.add_repo("turbo/Tiny-exl3", {"main": {"README.md": readme.encode(), "config.json": b"{}"},
                                                 "4.0bpw": {"config.json": b'{"a": 1}'}},
                             config={"architectures": ["LlamaForCausalLM"]}, hub_tags=["exl3", "llama"],
                             downloads=42, likes=7, parameters=1234)
    d = hub.repo_details("turbo/Tiny-exl3")
    assert (d.id, d.commit, d.tags, d.downloads, d.likes) == ("turbo/Tiny-exl3", repo.commit("main"),
                                                              ["exl3", "llama"], 42, 7)
    assert d.architecture == "LlamaForCausalLM" and d.parameters == 1234 and d.is_exl3
    assert hub.repo_details("turbo/Tiny-exl3", "4.0bpw").commit == repo.commit("4.0bpw")
    assert hub.read_text("turbo/Tiny-exl3", d.commit, "README.md", 100) == readme[:100]
    assert hub.read_text("turbo/Tiny-exl3", repo.commit("4.0bpw"), "config.json") == '{"a": 1}'
    assert hub.read_text("turbo/Tiny-exl3", d.commit, "missing.md") is None
    with pytest.raises(hub.RepoNotFound, match="does not exist"):
        hub.repo_details("turbo/missing")


@pytest.mark.parametrize("repo_id, tags, config, expected", [
    ("a/plain", [], {}, False),
    ("a/Model-EXL3", [], {}, True),
    ("a/plain", ["EXL3"], {}, True),
    ("a/plain", [], {"quantization_config": {"quant_method": "exl3"}}, True),
    ("a/plain", [], {"quantization_config": {"quant_method": "gptq"}}, False),
    ("a/plain", [], None, False),
])
def test_looks_exl3(repo_id, tags, config, expected):
    assert hub.looks_exl3(repo_id, tags, config) is expected


def test_repo_details_and_read_text_offline_are_one_line(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for call in (lambda: hub.repo_details("a/b"), lambda: hub.read_text("a/b", "0" * 40, "README.md")):
        with pytest.raises(hub.HubOffline, match="cannot be reached") as e:
            call()
        assert "\n" not in str(e.value)


DOWNLOAD_SCRIPT = ("import sys; from engine import hub; "
                   "hub.download(sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3])")


def test_download_interrupted_at_random_points_resumes_in_new_processes(fake_hub, tmp_path):
    files = model_files(seed=11)
    fake_hub.add_repo("turbo/resume-exl3", {"main": {"README.md": b"x"}, "4.0bpw": files})
    rng = random.Random(1234)
    served_from = []

    def cut(path, start):
        served_from.append((path, start))
        remaining = len(files[path]) - start
        first_try_of_big_file = path == "model.safetensors" and start == 0
        if remaining > 1 and (first_try_of_big_file or rng.random() < 0.4):
            return rng.randrange(1, remaining)  # drop the connection somewhere mid-body
        return None
    fake_hub.cut_after = cut

    target = tmp_path / "model"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=fake_hub.url)
    runs = 0
    while True:
        runs += 1
        assert runs <= 40, "download never completed"
        proc = subprocess.run([sys.executable, "-c", DOWNLOAD_SCRIPT, "turbo/resume-exl3", "4.0bpw", str(target)],
                              env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            break
        assert "Traceback" not in proc.stderr or "HubOffline" in proc.stderr, proc.stderr[-2000:]
    assert runs > 2  # it really was interrupted, more than once
    for path, data in files.items():
        assert sha256((target / path).read_bytes()) == sha256(data), path
    # resumed transfers asked for the rest of the file, not all of it again
    assert any(start > 0 for path, start in served_from if path == "model.safetensors")
    big = [start for path, start in served_from if path == "model.safetensors"]
    assert big == sorted(big)
    assert not list((target / hub.PARTIAL_DIR).glob("**/*.part"))

    # A finished download is not fetched again.
    before = len(fake_hub.requests)
    fake_hub.cut_after = None
    hub.download("turbo/resume-exl3", revision="4.0bpw", local_dir=target)
    assert not [r for r in fake_hub.requests[before:] if "/resolve/" in r[1]]


def _part_size(target: Path) -> int:
    parts = list((target / hub.PARTIAL_DIR).glob("model.safetensors.*.part")) if target.exists() else []
    try:
        return parts[0].stat().st_size if parts else 0
    except FileNotFoundError:  # just renamed into place
        return 0


def test_download_killed_mid_file_resumes_in_new_processes(fake_hub, tmp_path):
    """kill -9 at random moments of a slow transfer; every restart continues the partial file."""
    files = model_files(seed=12, big=400_000)
    fake_hub.add_repo("turbo/killed", {"main": files})
    fake_hub.throttle_s = 0.01  # ~1.6 MB/s
    target = tmp_path / "model"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=fake_hub.url)
    rng = random.Random(99)
    kills = 0
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, "-c", DOWNLOAD_SCRIPT, "turbo/killed", "main", str(target)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        # kill once the big file has grown by a random amount in this run
        goal = _part_size(target) + rng.randrange(20_000, 150_000)
        while proc.poll() is None and time.monotonic() < deadline:
            if _part_size(target) >= goal:
                proc.kill()
                kills += 1
                break
            time.sleep(0.005)
        proc.wait(30)
        if proc.returncode == 0:
            break
    else:
        pytest.fail("download never completed")
    assert kills >= 2
    for path, data in files.items():
        assert sha256((target / path).read_bytes()) == sha256(data), path
    starts = [int(r[2].split("=")[1].rstrip("-")) for r in fake_hub.requests
              if r[0] == "GET" and r[1].endswith("model.safetensors") and r[2]]
    assert len(starts) >= 2 and starts == sorted(starts)  # each restart continued further along


def test_download_rejects_a_corrupt_partial_file_then_recovers(fake_hub, tmp_path):
    files = model_files(seed=5, big=200_000)
    fake_hub.add_repo("turbo/corrupt", {"main": files})
    digest = sha256(files["model.safetensors"])
    part = tmp_path / hub.PARTIAL_DIR / f"model.safetensors.{digest[:16]}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 100_000)  # wrong bytes where a previous run stopped
    with pytest.raises(hub.ChecksumMismatch, match="model.safetensors"):
        hub.download("turbo/corrupt", files=["model.safetensors"], local_dir=tmp_path)
    assert not (tmp_path / "model.safetensors").exists() and not part.exists()
    hub.download("turbo/corrupt", files=["model.safetensors"], local_dir=tmp_path)
    assert sha256((tmp_path / "model.safetensors").read_bytes()) == digest


def test_download_refuses_path_traversal(fake_hub, tmp_path):
    for evil in ["../evil.txt", "sub/../../evil.txt", "/etc/evil.txt", "..\\evil.txt", hub.PARTIAL_DIR + "/x.part"]:
        fake_hub.add_repo("bad/repo", {"main": {"config.json": b"{}", evil: b"pwned"}})
        target = tmp_path / "inner" / "model"
        with pytest.raises(hub.UnsafePath, match="refusing"):
            hub.download("bad/repo", local_dir=target)
        assert not (tmp_path / "inner" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
        assert not (target / "config.json").exists()  # nothing is written before every name is checked
    with pytest.raises(hub.UnsafePath):
        hub.safe_relative_path("a//b")
    assert str(hub.safe_relative_path("a/b/c.json")) == "a/b/c.json"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    for call in (lambda: hub.search_models("llama"), lambda: hub.list_revisions("a/b"),
                 lambda: hub.download("a/b", local_dir=tmp_path / "m")):
        with pytest.raises(hub.HubOffline) as info:
            call()
        message = str(info.value)
        assert "cannot be reached" in message and "\n" not in message
    assert time.monotonic() - start < 10  # no long back-off before telling the user


def test_worker_download_command_relays_progress(fake_hub, tmp_path):
    from engine.worker import protocol as p
    from engine.worker.loop import Worker

    files = model_files(seed=3, big=300_000)
    fake_hub.add_repo("turbo/via-worker", {"main": files})
    out = io.StringIO()
    worker = Worker(out)
    try:
        worker.handle_line(p.Download(id="d1", repo="turbo/via-worker", local_dir=str(tmp_path)).to_line())
        deadline = time.monotonic() + 30
        while '"result"' not in out.getvalue() and '"error"' not in out.getvalue():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        worker.close()
    events = [p.decode(line) for line in out.getvalue().splitlines()]
    assert events[-1].type == "result" and events[-1].data["local_dir"] == str(tmp_path)
    progress = [e for e in events if e.type == "progress"]
    assert progress and all(e.task == "download" and e.id == "d1" for e in progress)
    assert progress[-1].fraction == 1.0
    assert sha256((tmp_path / "model.safetensors").read_bytes()) == sha256(files["model.safetensors"])


def test_fake_hub_speaks_huggingface_hub(fake_hub, tmp_path):
    """The fake's tree listing and file endpoints satisfy huggingface_hub's own client too
    (HEAD metadata: ETag, X-Repo-Commit, sizes), so tests above exercise realistic answers."""
    from huggingface_hub import HfApi, hf_hub_download
    files = model_files(seed=8, big=50_000)
    repo = fake_hub.add_repo("turbo/compat", {"main": files})
    api = HfApi(endpoint=fake_hub.url, token=False)
    tree = {e.path: e for e in api.list_repo_tree("turbo/compat", recursive=True)}
    assert set(tree) == set(files) | {"extra"}
    assert tree["model.safetensors"].lfs.sha256 == sha256(files["model.safetensors"])
    assert [e.path for e in api.list_repo_tree("turbo/compat")] == ["extra", "config.json", "model.safetensors",
                                                                    "tokenizer.json"]
    path = hf_hub_download("turbo/compat", "model.safetensors", endpoint=fake_hub.url, local_dir=tmp_path, token=False)
    assert sha256(Path(path).read_bytes()) == sha256(files["model.safetensors"])
    assert api.model_info("turbo/compat").sha == repo.commit("main")
