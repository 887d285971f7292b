"""The OpenAI-compatible API, exercised with the official `openai` client on a fixture model."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from engine.worker import protocol as p  # noqa: E402

MODEL_TAG = "llama-4.0bpw-mul1-h6"
API_KEY = "test-key"
BODY_LIMIT = 64 * 1024
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(ref_fixtures):
    from engine.worker.api import ServerSettings, create_app
    from engine.worker.host import ModelHost
    from engine.worker.jobs import EngineQueue
    from engine.worker.serve_cli import bind_socket

    host = ModelHost()
    host.load(p.Load(model_dir=str(ref_fixtures / "exl3" / MODEL_TAG), max_context=2048))
    engine = EngineQueue()
    app = create_app(host, engine, ServerSettings(model_id=MODEL_TAG, api_key=API_KEY, max_body_bytes=BODY_LIMIT))
    sock = bind_socket("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    port = sock.getsockname()[1]
    yield {"url": f"http://127.0.0.1:{port}", "host": host, "engine": engine}
    srv.should_exit = True
    thread.join(10)
    engine.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post_raw(server, path, data: bytes, headers=None):
    req = urllib.request.Request(server["url"] + path, data=data, method="POST",
                                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_TAG]
    assert client.models.retrieve(MODEL_TAG).id == MODEL_TAG


def test_chat_non_stream_and_stream_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=MODEL_TAG, messages=messages, max_tokens=10, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert 0 < full.usage.completion_tokens <= 10 and full.usage.prompt_tokens > 3
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(model=MODEL_TAG, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content  # greedy: same text either way
    assert finishes == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_non_stream_and_stream(client, server):
    full = client.completions.create(model=MODEL_TAG, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert 0 < full.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_TAG, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    # stop strings end the text before the stop string
    if len(full.choices[0].text) > 3:
        stop = full.choices[0].text[2:4]
        cut = client.completions.create(model=MODEL_TAG, prompt="Once upon a time", max_tokens=8, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]


def test_sixteen_concurrent_streams(client):
    def one(i):
        stream = client.chat.completions.create(
            model=MODEL_TAG, messages=[{"role": "user", "content": f"Request number {i}"}], max_tokens=4,
            temperature=0.7, seed=i, stream=True)
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
            [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert len(results) == 16
    assert all(finish in (["length"], ["stop"]) for _, finish in results)
    assert sum(1 for text, _ in results if text) >= 8  # random weights may hit EOS early, but not everywhere


def test_token_counting(server, ref_fixtures):
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(ref_fixtures / "exl3" / MODEL_TAG)
    status, body = post_raw(server, "/v1/tokenize", json.dumps({"model": MODEL_TAG, "prompt": "count these"}).encode())
    assert status == 200 and body["tokens"] == tok.encode("count these") and body["count"] == len(body["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    status, body = post_raw(server, "/v1/tokenize", json.dumps({"model": MODEL_TAG, "messages": messages}).encode())
    assert status == 200 and body["count"] == len(tok.encode_chat(messages))


def test_bad_model_name_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404 and info.value.code == "model_not_found"


def test_malformed_and_invalid_bodies_are_400(server):
    status, body = post_raw(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = post_raw(server, "/v1/chat/completions", b'[1, 2]')
    assert status == 400
    status, body = post_raw(server, "/v1/chat/completions", json.dumps({"model": MODEL_TAG}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post_raw(server, "/v1/completions", json.dumps(
        {"model": MODEL_TAG, "prompt": "x", "max_tokens": -3}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_oversized_body_is_413(client, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL_TAG, messages=[{"role": "user", "content": "x" * (BODY_LIMIT + 10)}])
    assert info.value.status_code == 413
    # also when the size is not announced up front (chunked upload)
    chunks = iter([b'{"model": "' + MODEL_TAG.encode() + b'", "prompt": "', b"y" * BODY_LIMIT, b'"}'])
    req = urllib.request.Request(server["url"] + "/v1/completions", data=chunks, method="POST",
                                 headers={"Authorization": f"Bearer {API_KEY}", "Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 413


def test_api_key_is_required(server):
    wrong = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_images_refused_for_a_text_model(client, tmp_path):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    for url in (f"data:image/png;base64,{png}", str(picture)):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_TAG, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        assert info.value.code == "model_not_vision" and "does not accept images" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_TAG, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(tmp_path / "missing.png")}}]}])
    assert "not found" in str(info.value)


def test_client_disconnect_cancels_its_generation(client, server):
    stream = client.chat.completions.create(model=MODEL_TAG, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=1900, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while server["engine"].busy:
        assert time.monotonic() < deadline, "the abandoned generation kept running"
        time.sleep(0.05)


def test_trellis_serve_command(ref_fixtures):
    """`trellis serve` as users start it: binds 127.0.0.1, announces the address, answers."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())",
                             "serve", "-m", str(ref_fixtures / "exl3" / MODEL_TAG), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else line
            line = proc.stderr.readline()
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        reply = c.completions.create(model=MODEL_TAG, prompt="Hi", max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(20)


def test_trellis_serve_bad_folder_is_one_line():
    proc = subprocess.run([sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())",
                           "serve", "-m", "/no/such/model"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_trellis_serve_busy_port_is_one_line(ref_fixtures):
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())",
                               "serve", "-m", str(ref_fixtures / "exl3" / MODEL_TAG), "--port",
                               str(busy.getsockname()[1])], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    finally:
        busy.close()
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "cannot listen" in proc.stderr
