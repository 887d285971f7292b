"""The app <-> engine protocol: every message survives a round trip, bad lines are rejected
with a ProtocolError, and the module (like the client and hub) imports no torch."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker import protocol as p

ROOT = Path(__file__).resolve().parents[1]

SAMPLES = [
    p.Load(id="1", model_dir="/m/llama", max_context=8192, cache_bits=[4, 6], draft_model_dir="/m/draft",
           device="cuda:1", gpu_memory_limit_bytes=20 << 30),
    p.Unload(id="2"),
    p.Generate(id="3", request_id="chat-9", messages=[{"role": "user", "content": [{"type": "text", "text": "hé\n"}]}],
               images=["data:image/png;base64,AAAA", "/tmp/cat.png"],
               sampler=p.SamplerParams(temperature=0.3, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                       seed=7), max_tokens=77, stop=["\n\n", "</s>"], add_bos=False),
    p.Generate(id="3b", prompt="raw text"),
    p.Cancel(id="4", target="chat-9"),
    p.Status(id="5"),
    p.Plan(id="6", model="org/repo", context=32768, batch=2, cache_bits=[8, 8]),
    p.Convert(id="7", input_dir="/in", output_dir="/out", bits=3.5, head_bits=6, work_dir="/w", resume=False,
              codebook="mcg", calibration="/data/my texts", cal_rows=8, cal_cols=64, device="cpu"),
    p.Download(id="8", repo="org/repo", revision="4.0bpw", files=["config.json"], local_dir="/models/x"),
    p.Shutdown(id="9"),
    p.Hello(protocol=1, engine_version="0.1.0", pid=42, devices=[p.DeviceMemory("cuda:0", "H200", 10, 5, 3, 4)]),
    p.Progress(id="1", task="load", fraction=0.5, eta_s=2.5, message="layer 3 of 6"),
    p.Token(id="3", request_id="chat-9", text=" wörld 🌍", tokens=4,
            stats=p.GenerationStats(prompt_tokens=3, generated_tokens=4, tokens_per_s=12.5)),
    p.Done(id="3", request_id="chat-9", finish_reason="length", text="all of it",
           stats=p.GenerationStats(prompt_tokens=3, generated_tokens=77, queue_s=0.1, prompt_s=0.2, generate_s=3.0,
                                   prompt_tokens_per_s=15.0, tokens_per_s=25.3)),
    p.Error(id="3", code=p.ErrorCode.OUT_OF_MEMORY, message="Out of memory on cuda:0 ...", request_id="chat-9",
            command="generate"),
    p.StatusReport(id="5", state="generating", model=p.ModelInfo(model_dir="/m/llama", name="llama", max_context=8192,
                                                                  bits_per_weight=4.0, device="cuda:0"),
                   devices=[p.DeviceMemory("cpu", total_bytes=1)], running="chat-9", queue=["a", "b"],
                   tasks=[p.TaskInfo(id="7", task="convert", fraction=0.25, message="module 5 of 20")]),
    p.Result(id="1", command="load", data={"name": "llama", "nested": {"x": [1, 2]}}),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.type)
def test_round_trip(message):
    line = p.encode(message)
    assert line.endswith("\n") and line.count("\n") == 1  # newlines inside strings are escaped
    obj = json.loads(line)
    assert obj["type"] == message.type and obj["id"] == message.id
    kinds = p.COMMANDS if type(message) in p.COMMANDS.values() else p.EVENTS
    again = p.decode(line, kinds)
    assert type(again) is type(message) and again == message
    assert p.decode(line.encode("utf-8"), kinds) == message


def test_every_type_is_registered_once():
    assert set(p.COMMANDS) == {"load", "unload", "generate", "cancel", "status", "plan", "convert", "download",
                               "shutdown"}
    assert set(p.EVENTS) == {"hello", "progress", "token", "done", "error", "status", "result"}
    # "status" is both a command and an event: the direction decides which class it is
    assert type(p.decode('{"type": "status"}', p.COMMANDS)) is p.Status
    assert type(p.decode('{"type": "status"}', p.EVENTS)) is p.StatusReport


def test_defaults_and_unknown_fields():
    g = p.decode('{"type": "generate", "id": "7", "prompt": "x", "future_field": 1}', p.COMMANDS)
    assert g.rid == "7" and g.max_tokens == 256 and g.sampler == p.SamplerParams() and g.stop == []
    assert p.decode('{"type": "load", "model_dir": "/m", "max_context": 4096.0}').max_context == 4096
    assert p.decode('{"type": "progress", "fraction": 1}').fraction == 1.0


@pytest.mark.parametrize("line, fragment", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"id": "1"}', "unknown message type"),
    ('{"type": "teleport"}', "unknown message type"),
    ('{"type": "load", "max_context": "big"}', "load.max_context: expected an integer"),
    ('{"type": "load", "max_context": 1.5}', "expected an integer"),
    ('{"type": "load", "max_context": true}', "expected an integer"),
    ('{"type": "convert", "resume": 1}', "expected true or false"),
    ('{"type": "generate", "stop": "x"}', "generate.stop: expected a list"),
    ('{"type": "generate", "sampler": {"temperature": "hot"}}', "generate.sampler.temperature: expected a number"),
    ('{"type": "generate", "sampler": [1]}', "expected an object"),
    ('{"type": "result", "data": []}', "expected an object"),
    ('{"type": "load", "model_dir": 5}', "expected a string"),
])
def test_bad_lines_raise_protocol_error(line, fragment):
    with pytest.raises(p.ProtocolError) as info:
        p.decode(line)
    assert fragment in str(info.value)


def test_direction_is_enforced():
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.Done(request_id="x")), p.COMMANDS)
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.Load(model_dir="/m")), p.EVENTS)


def test_bad_utf8_is_a_protocol_error():
    with pytest.raises(p.ProtocolError, match="UTF-8"):
        p.decode(b'{"type": "status", "id": "\xff"}')


def test_messages_are_plain_dataclasses():
    for cls in list(p.COMMANDS.values()) + list(p.EVENTS.values()):
        assert dataclasses.is_dataclass(cls) and "id" in {f.name for f in dataclasses.fields(cls)}


def test_app_facing_modules_import_no_torch():
    code = ("import sys; import engine.worker.protocol, engine.worker.client, engine.hub; "
            "bad = [m for m in ('torch', 'PySide6') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
