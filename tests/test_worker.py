"""The engine process, driven over its real pipe: `python -m engine.worker` on a fixture model."""
from __future__ import annotations

import io
import json
import threading
import time

import pytest

from engine.worker import protocol as p
from engine.worker.client import WorkerProcess, wait_for

MODEL_TAG = "llama-4.0bpw-mul1-h6"


@pytest.fixture(scope="module")
def model_dir(ref_fixtures):
    return str(ref_fixtures / "exl3" / MODEL_TAG)


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    w.wait_ready(timeout=120)
    yield w
    w.close()


def is_answer(cid, *types):
    return lambda e: e.id == cid and e.type in types


def load(worker, model_dir, **kw):
    cid = worker.send(p.Load(model_dir=model_dir, **kw))
    events = wait_for(worker, is_answer(cid, "result", "error"), timeout=120)
    return events


def test_hello_reports_protocol_and_devices(worker):
    assert worker.hello.protocol == p.PROTOCOL_VERSION
    assert worker.hello.pid == worker.process.pid
    assert any(d.device == "cpu" and d.total_bytes > 0 for d in worker.hello.devices)


def test_bad_lines_get_errors_and_worker_lives_on(worker):
    worker.process.stdin.write(b"this is not json\n")
    worker.process.stdin.write(b'{"type": "fly", "id": "x1"}\n')
    worker.process.stdin.write(b'{"type": "load", "id": "x2", "max_context": "lots"}\n')
    worker.process.stdin.flush()
    errors = [worker.next_event() for _ in range(3)]
    assert all(e.type == "error" and e.code == p.ErrorCode.BAD_COMMAND for e in errors)
    assert [e.id for e in errors] == [None, "x1", "x2"]
    sid = worker.send(p.Status())
    assert wait_for(worker, is_answer(sid, "status"))[-1].state == "idle"


def test_generate_without_model_is_a_clear_error(worker):
    worker.send(p.Unload())
    wait_for(worker, lambda e: e.type == "result" and e.command == "unload")
    gid = worker.send(p.Generate(prompt="hi", max_tokens=4))
    err = wait_for(worker, is_answer(gid, "error", "done"))[-1]
    assert err.type == "error" and err.code == p.ErrorCode.NO_MODEL and err.request_id == gid


def test_load_missing_folder(worker, tmp_path):
    err = load(worker, str(tmp_path / "nope"))[-1]
    assert err.type == "error" and err.code == p.ErrorCode.NOT_FOUND and "nope" in err.message


def test_load_generate_cancel_status_unload(worker, model_dir):
    events = load(worker, model_dir, max_context=2048)
    result = events[-1]
    assert result.type == "result", result
    assert result.data["name"] == MODEL_TAG and result.data["max_context"] == 2048
    assert result.data["bits_per_weight"] == 4.0 and result.data["cache_bytes"] > 0
    assert result.data["kernels"] == "torch" and result.data["kernels_note"] == ""  # the CPU: nothing to explain
    fractions = [e.fraction for e in events if e.type == "progress"]
    assert fractions and fractions[-1] == 1.0 and fractions == sorted(fractions)

    # Three generations sent back to back: a long one (cancelled while running), a short
    # one that must complete, and a third cancelled while still queued.
    greedy = p.SamplerParams(temperature=0.0)
    long_id = worker.send(p.Generate(request_id="long", prompt="Hello", max_tokens=2000, sampler=greedy))
    short_id = worker.send(p.Generate(request_id="short", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=12, sampler=p.SamplerParams(temperature=0.8, seed=3)))
    worker.send(p.Generate(request_id="third", prompt="Bye", max_tokens=12, sampler=greedy))
    cancel_third = worker.send(p.Cancel(target="third"))

    seen = wait_for(worker, lambda e: e.type == "token" and e.request_id == "long")
    status_id = worker.send(p.Status())
    seen += wait_for(worker, is_answer(status_id, "status"))
    status = seen[-1]
    assert status.state == "generating" and status.running == "long"
    assert status.queue == ["short"]  # "third" was cancelled while queued
    assert status.model is not None and status.model.name == MODEL_TAG

    cancel_long = worker.send(p.Cancel(target="long"))
    seen += wait_for(worker, lambda e: e.type in ("done", "error") and e.request_id == "short")

    third_done = [e for e in seen if e.type == "done" and e.request_id == "third"]
    assert len(third_done) == 1 and third_done[0].finish_reason == "cancelled"
    assert [e for e in seen if e.id == cancel_third][0].data["was"] == "queued"
    assert [e for e in seen if e.id == cancel_long][0].data["was"] == "running"

    long_done = [e for e in seen if e.type == "done" and e.request_id == "long"]
    assert len(long_done) == 1 and long_done[0].finish_reason == "cancelled"
    assert long_done[0].stats.generated_tokens < 2000
    assert long_done[0].id == long_id

    short_tokens = [e for e in seen if e.type == "token" and e.request_id == "short"]
    short_done = seen[-1]
    assert short_done.type == "done" and short_done.id == short_id
    assert short_done.finish_reason in ("length", "stop")
    assert "".join(t.text for t in short_tokens) == short_done.text
    assert 0 < short_done.stats.generated_tokens <= 12
    assert short_done.stats.queue_s > 0 and short_done.stats.prompt_tokens > 0
    counts = [t.tokens for t in short_tokens]
    assert counts == sorted(counts) and counts[-1] <= short_done.stats.generated_tokens
    # no token of a request arrives after its done
    long_positions = [i for i, e in enumerate(seen) if getattr(e, "request_id", None) == "long"]
    assert seen[long_positions[-1]].type == "done"

    assert [e for e in seen if e.type == "error"] == []

    worker.send(p.Cancel(id="nothing-here", target="no-such-request"))
    err = wait_for(worker, is_answer("nothing-here", "error", "result"))[-1]
    assert err.type == "error" and err.code == p.ErrorCode.NOT_FOUND

    img_id = worker.send(p.Generate(prompt="what is this?", images=["/tmp/cat.png"], max_tokens=4))
    err = wait_for(worker, is_answer(img_id, "error", "done"))[-1]
    assert err.type == "error" and err.code == p.ErrorCode.UNSUPPORTED and "vision" in err.message

    unload_id = worker.send(p.Unload())
    wait_for(worker, is_answer(unload_id, "result"))
    status_id = worker.send(p.Status())
    status = wait_for(worker, is_answer(status_id, "status"))[-1]
    assert status.model is None and status.running is None and status.queue == []


def test_stdin_close_exits_cleanly():
    w = WorkerProcess()
    w.wait_ready(timeout=120)
    assert w.close(timeout=30) == 0


# ---------------------------------------------------------------- in-process: out of memory

class _Sink(io.StringIO):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def events(self):
        with self.lock:
            return [p.decode(line) for line in self.getvalue().splitlines()]


def _wait_in_process(sink, predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in sink.events() if predicate(e)]
        if found:
            return found[-1]
        time.sleep(0.02)
    raise TimeoutError([e.type for e in sink.events()])


def _load_answer(worker, sink, model_dir, load_id: str):
    """The error or result an in-process worker answers a load of model_dir with."""
    worker.handle_line(p.Load(id=load_id, model_dir=model_dir, max_context=256).to_line())
    return _wait_in_process(sink, lambda e: e.id == load_id and e.type in ("error", "result"))


def test_out_of_memory_without_the_kernels_names_them(model_dir, monkeypatch):
    """On a GPU without its CUDA kernels the weights load dense: a load that runs out of memory
    says that this is why, with the kernels' one-line reason, not only 'try a smaller cache'."""
    torch = pytest.importorskip("torch")
    import engine.models as models_module
    from engine import ops
    from engine.worker.host import ModelHost
    from engine.worker.loop import Worker

    def oom_load(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB")

    missing = ops.KernelStatus("torch", "cannot build the CUDA kernels: nvcc not found (install the CUDA toolkit)")
    monkeypatch.setattr(ModelHost, "_kernel_status", staticmethod(lambda device, progress: missing))
    monkeypatch.setattr(models_module, "load_model", oom_load)
    sink = _Sink()
    worker = Worker(sink)
    try:
        err = _load_answer(worker, sink, model_dir, "L1")
        assert err.type == "error" and err.code == p.ErrorCode.OUT_OF_MEMORY and "\n" not in err.message
        assert "without the CUDA kernels" in err.message and "nvcc not found" in err.message
        assert "dense fp16" in err.message and worker.host.model is None
    finally:
        worker.close()


def test_out_of_memory_becomes_an_error_and_worker_stays_usable(model_dir, monkeypatch):
    torch = pytest.importorskip("torch")
    import engine.generate as gen_module
    import engine.models as models_module
    from engine.worker.loop import Worker

    real_load, real_generate = models_module.load_model, gen_module.generate
    fail = {"load": True, "generate": True}

    def flaky_load(*a, **kw):
        model = real_load(*a, **kw)
        if fail.pop("load", False):
            real_new_cache = model.new_cache

            def oom_cache(batch, max_len):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            model.new_cache = oom_cache
        return model

    def flaky_generate(*a, **kw):
        if fail.pop("generate", False):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return real_generate(*a, **kw)

    monkeypatch.setattr(models_module, "load_model", flaky_load)
    monkeypatch.setattr(gen_module, "generate", flaky_generate)

    sink = _Sink()
    worker = Worker(sink)
    try:
        err = _load_answer(worker, sink, model_dir, "L1")
        assert err.type == "error" and err.code == p.ErrorCode.OUT_OF_MEMORY
        assert "cpu" in err.message and "KV cache for 256 tokens" in err.message
        assert "smaller cache" in err.message and "\n" not in err.message
        assert worker.host.model is None

        assert _load_answer(worker, sink, model_dir, "L2").type == "result"

        worker.handle_line(p.Generate(id="G1", prompt="Hello", max_tokens=4).to_line())
        err = _wait_in_process(sink, lambda e: e.id == "G1" and e.type in ("error", "done"))
        assert err.type == "error" and err.code == p.ErrorCode.OUT_OF_MEMORY and err.request_id == "G1"
        assert "generating" in err.message and "shorter context" in err.message

        worker.handle_line(p.Generate(id="G2", prompt="Hello", max_tokens=4).to_line())
        done = _wait_in_process(sink, lambda e: e.id == "G2" and e.type in ("error", "done"))
        assert done.type == "done" and done.stats.generated_tokens > 0
    finally:
        worker.close()
    for line in sink.getvalue().splitlines():
        json.loads(line)  # every output line is a protocol message


# ---------------------------------------------------------------- tasks: plan, convert (in-process)

def _run_task(command: p.Message, timeout=60):
    from engine.worker.loop import Worker
    sink = _Sink()
    worker = Worker(sink)
    try:
        worker.handle_line(command.to_line())
        return _wait_in_process(sink, lambda e: e.id == command.id and e.type in ("error", "result"), timeout), sink
    finally:
        worker.close()


def test_plan_command(model_dir):
    answer, _ = _run_task(p.Plan(id="P1", model=model_dir, context=1024))
    assert answer.type == "result" and answer.command == "plan"
    assert answer.data["context"] == 1024 and answer.data["kv_cache"] > 0 and answer.data["total"] > 0


def test_plan_failure_is_one_line(tmp_path):
    answer, _ = _run_task(p.Plan(id="P2", model=str(tmp_path / "missing"), context=1024))
    assert answer.type == "error" and answer.code == p.ErrorCode.PLAN_FAILED
    assert answer.message and "\n" not in answer.message and "Traceback" not in answer.message


def test_convert_failure_is_relayed(tmp_path):
    answer, sink = _run_task(p.Convert(id="C1", input_dir=str(tmp_path / "no-model"), output_dir=str(tmp_path / "o"),
                                       bits=4.0))
    assert answer.type == "error" and answer.code == p.ErrorCode.CONVERT_FAILED
    assert answer.message and "\n" not in answer.message and "Traceback" not in answer.message
    assert not (tmp_path / "o").exists()


def test_convert_relays_progress_and_cancels(ref_fixtures, tmp_path):
    """A real `trellis convert` child: its first progress event is relayed, then cancel stops it."""
    from engine.worker.loop import Worker
    sink = _Sink()
    worker = Worker(sink)
    try:
        worker.handle_line(p.Convert(id="C2", input_dir=str(ref_fixtures / "hf" / "llama"), output_dir=str(tmp_path / "o"),
                                     bits=2.0, cal_rows=4, cal_cols=64, device="cpu").to_line())
        first = _wait_in_process(sink, lambda e: e.id == "C2" and e.type in ("progress", "error", "result"), 120)
        assert first.type == "progress" and first.task == "convert" and first.fraction == 0.0
        status = None
        worker.handle_line(p.Status(id="S").to_line())
        status = _wait_in_process(sink, lambda e: e.id == "S")
        assert [t.task for t in status.tasks] == ["convert"] and status.tasks[0].id == "C2"
        process = worker.tasks["C2"].process
        worker.handle_line(p.Cancel(id="X", target="C2").to_line())
        end = _wait_in_process(sink, lambda e: e.id == "C2" and e.type in ("error", "result"), 60)
        assert end.type == "error" and end.code == p.ErrorCode.CANCELLED
        assert process.poll() is not None  # the child process is gone
    finally:
        worker.close()
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_convert_passes_user_calibration_to_the_converter(tmp_path):
    """The worker's arguments parse with the converter's own parser, calibration included."""
    import argparse
    from pathlib import Path
    from engine import convert_cli
    from engine.worker.loop import convert_args
    parser = argparse.ArgumentParser()
    convert_cli.register(parser.add_subparsers(dest="command"))
    cal = tmp_path / "my texts"
    ns = parser.parse_args(convert_args(p.Convert(input_dir="/in", output_dir="/out", bits=3.0, calibration=str(cal),
                                                  cal_rows=8, device="cpu")))
    assert ns.calibration == cal and ns.cal_rows == 8 and ns.device == "cpu" and ns.resume and ns.progress_json
    assert ns.in_dir == Path("/in") and ns.out_dir == Path("/out") and ns.bits == 3.0
    for built_in in (None, ""):
        ns = parser.parse_args(convert_args(p.Convert(input_dir="/in", output_dir="/out", calibration=built_in)))
        assert ns.calibration is None


# A stand-in for `trellis convert --progress-json`: it records its arguments, then prints "start" and
# the first module back to back (so the second falls inside the progress rate limit). An output
# folder named "fail" makes it exit 1 right there; otherwise the last modules follow later.
FAKE_CONVERTER = r"""
import json, sys, time
args = sys.argv[1:]
out = args[args.index("-o") + 1]
open(out + ".args.json", "w").write(json.dumps(args))
def event(stage, index, module=""):
    print(json.dumps({"event": "progress", "stage": stage, "index": index, "total": 3, "module": module}), flush=True)
event("start", 0)
event("module", 1, "model.embed_tokens")
if out.endswith("fail"):
    print("calibration data nowhere.txt does not exist", file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(0.5)
event("module", 2, "model.layers.0")
event("module", 3, "lm_head")
event("compile", 3)
event("done", 3)
"""


def _convert_with_fake_converter(monkeypatch, out, **kw):
    import sys
    from engine.worker import loop
    monkeypatch.setattr(loop, "trellis_command", lambda args: [sys.executable, "-c", FAKE_CONVERTER, *args])
    answer, sink = _run_task(p.Convert(id="F", input_dir="/in", output_dir=str(out), **kw), timeout=30)
    progress = [e for e in sink.events() if e.type == "progress"]
    return answer, progress, sink.events()


def test_fast_follow_up_progress_arrives_and_final_is_last(monkeypatch, tmp_path):
    cal = tmp_path / "cal.txt"
    answer, progress, events = _convert_with_fake_converter(monkeypatch, tmp_path / "o", calibration=str(cal))
    assert answer.type == "result" and events[-1] == answer
    messages = [e.message for e in progress]
    assert messages[:2] == ["start", "model.embed_tokens"]       # held by the rate limit, then delivered
    assert "model.layers.0" in messages
    assert progress[-1].fraction == 1.0 and progress[-1].eta_s == 0.0
    assert all(e.fraction is not None for e in progress)
    fractions = [e.fraction for e in progress]
    assert fractions == sorted(fractions)                      # nothing stale after a newer event
    args = json.loads((tmp_path / "o.args.json").read_text())
    assert args[args.index("--calibration") + 1] == str(cal)


def test_held_progress_is_delivered_before_the_error(monkeypatch, tmp_path):
    answer, progress, events = _convert_with_fake_converter(monkeypatch, tmp_path / "fail")
    assert answer.type == "error" and answer.code == p.ErrorCode.CONVERT_FAILED and "does not exist" in answer.message
    assert [e.message for e in progress] == ["start", "model.embed_tokens"]
    assert events.index(progress[-1]) < events.index(answer)
    assert "--calibration" not in json.loads((tmp_path / "fail.args.json").read_text())


def _clock(min_interval_s):
    from engine.worker.loop import ProgressClock
    sent = []
    return ProgressClock(sent.append, "T", p.TaskKind.CONVERT, min_interval_s=min_interval_s), sent


def test_progress_clock_sends_the_latest_held_event_on_the_next_tick():
    clock, sent = _clock(0.05)
    clock(0.0, "start")
    clock(0.1, "model.embed_tokens")
    clock(0.2, "model.layers.0")
    assert [e.message for e in sent] == ["start"]
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert [e.message for e in sent] == ["start", "model.layers.0"]   # the newest held one, once
    assert clock.fraction == 0.2 and clock.message == "model.layers.0"


def test_progress_clock_flush_and_final_event():
    clock, sent = _clock(60.0)                  # no tick within the test: only flush or final send
    clock(0.0, "start")
    clock(0.1, "model.embed_tokens")
    assert [e.message for e in sent] == ["start"]
    clock.flush()
    assert [e.message for e in sent] == ["start", "model.embed_tokens"]
    clock.flush()                               # nothing held: nothing sent twice
    clock(0.5, "model.layers.0")                # held
    clock(1.0, "done")                          # final: at once, and the held one is dropped (older)
    clock.flush()
    assert [(e.message, e.fraction, e.eta_s) for e in sent[2:]] == [("done", 1.0, 0.0)]


def test_quantized_cache_is_refused_not_ignored(worker, model_dir):
    err = load(worker, model_dir, cache_bits=[4, 4])[-1]
    assert err.type == "error" and err.code == p.ErrorCode.UNSUPPORTED and "cache_bits" in err.message


@pytest.mark.parametrize("line, fraction, message", [
    ('{"fraction": 0.25, "message": "layer 3"}', 0.25, "layer 3"),
    ('{"done": 3, "total": 12, "module": "model.layers.2"}', 0.25, "model.layers.2"),
    ("quantizing module 5 of 20", 0.25, "quantizing module 5 of 20"),
    ("[10/40] model.layers.9.mlp", 0.25, "[10/40] model.layers.9.mlp"),
    ("progress 25%", 0.25, "progress 25%"),
    ("loading calibration data", None, "loading calibration data"),
])
def test_progress_lines_from_child_processes(line, fraction, message):
    from engine.worker.loop import parse_progress_line
    assert parse_progress_line(line) == (fraction, message)


# ---------------------------------------------------------------- last: it kills the module's worker

def test_kill_9_mid_stream_then_restart(worker, model_dir):
    """Runs last in this module: it kills the module's worker (whose model loads fast now)."""
    assert load(worker, model_dir)[-1].type == "result"
    worker.send(p.Generate(request_id="doomed", prompt="Hello", max_tokens=2000,
                           sampler=p.SamplerParams(temperature=0.0)))
    wait_for(worker, lambda e: e.type == "token")
    worker.kill()
    died = wait_for(worker, lambda e: e.type == "error", timeout=30)[-1]
    assert died.code == p.ErrorCode.WORKER_DIED
    assert "SIGKILL" in died.message and "\n" not in died.message
    with pytest.raises(Exception):
        for _ in range(3):  # the pipe may take a moment to report closed
            worker.send(p.Status())
            time.sleep(0.2)
    with WorkerProcess() as again:
        again.wait_ready(timeout=120)
        sid = again.send(p.Status())
        assert wait_for(again, is_answer(sid, "status"))[-1].state == "idle"
        assert again.process.pid != worker.process.pid
