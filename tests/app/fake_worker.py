"""A stand-in engine process for app tests: speaks engine/worker/protocol.py over stdin/stdout
with canned, fast behaviour, so UI tests can be exact about timing, crashes and bad input.

Environment: FAKE_TOKENS (tokens per answer, default 12), FAKE_DELAY (seconds between tokens,
default 0.01), FAKE_LOAD_DELAY (seconds a load takes, default 0). A user message containing CRASH
makes the process die the way an OOM would (a line on stderr, then exit code 3)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.worker import protocol as P  # noqa: E402

TOKENS = int(os.environ.get("FAKE_TOKENS", "12"))
DELAY = float(os.environ.get("FAKE_DELAY", "0.01"))
CONVERT_DELAY = float(os.environ.get("FAKE_CONVERT_DELAY", "0.05"))
LOAD_DELAY = float(os.environ.get("FAKE_LOAD_DELAY", "0"))      # seconds a load takes
lock = threading.Lock()
cancelled: set[str] = set()
model: P.ModelInfo | None = None


def send(msg: P.Message) -> None:
    with lock:
        sys.stdout.write(P.encode(msg))
        sys.stdout.flush()


def answer_text(messages) -> str:
    last = ""
    for m in messages or []:
        if m.get("role") == "user":
            c = m.get("content")
            last = c if isinstance(c, str) else " ".join(p.get("text", "") for p in c if isinstance(p, dict))
    return f"echo: {last}"


def generate(cmd: P.Generate) -> None:
    rid = cmd.rid
    if model is None:
        send(P.Error(id=cmd.id, code=P.ErrorCode.NO_MODEL, message="No model is loaded.", request_id=rid))
        return
    text = answer_text(cmd.messages) if cmd.messages is not None else (cmd.prompt or "")
    if "CRASH" in text:
        sys.stderr.write("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        sys.stderr.flush()
        os._exit(3)
    if cmd.images and not model.vision:
        send(P.Error(id=cmd.id, code=P.ErrorCode.UNSUPPORTED, request_id=rid,
                     message="This model has no vision tower; images cannot be used."))
        return
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or ["."]
    n = min(TOKENS, cmd.max_tokens)
    out, t0 = "", time.time()
    for i in range(n):
        if rid in cancelled:
            send(P.Done(id=cmd.id, request_id=rid, finish_reason=P.FinishReason.CANCELLED, text=out,
                        stats=P.GenerationStats(prompt_tokens=5, generated_tokens=i, generate_s=time.time() - t0)))
            return
        piece = pieces[i % len(pieces)] if i < len(pieces) else " more"
        out += piece
        send(P.Token(id=cmd.id, request_id=rid, text=piece, tokens=i + 1))
        time.sleep(DELAY)
    dt = max(time.time() - t0, 1e-6)
    send(P.Done(id=cmd.id, request_id=rid, finish_reason=P.FinishReason.LENGTH, text=out,
                stats=P.GenerationStats(prompt_tokens=5, generated_tokens=n, generate_s=dt, tokens_per_s=n / dt,
                                        prompt_s=0.01)))


def convert(cmd: P.Convert) -> None:
    """Five fake modules; the work folder remembers how many are done, so a rerun resumes."""
    src, out = Path(cmd.input_dir), Path(cmd.output_dir)
    if not (src / "config.json").exists():
        send(P.Error(id=cmd.id, code=P.ErrorCode.CONVERT_FAILED, command="convert",
                     message=f"{src} is not a model folder (no config.json)"))
        return
    work = Path(cmd.work_dir or str(out) + ".work")
    work.mkdir(parents=True, exist_ok=True)
    state = work / "done.json"
    done = json.loads(state.read_text())["done"] if state.exists() else 0
    total = 5
    for i in range(done, total):
        if cmd.id in cancelled:
            send(P.Error(id=cmd.id, code=P.ErrorCode.CANCELLED, command="convert",
                         message="conversion cancelled (resume it later with the same work folder)"))
            return
        time.sleep(CONVERT_DELAY)
        state.write_text(json.dumps({"done": i + 1}))
        send(P.Progress(id=cmd.id, task=P.TaskKind.CONVERT, fraction=(i + 1) / total,
                        eta_s=(total - i - 1) * CONVERT_DELAY, message=f"model.layers.{i}"))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors"):
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": cmd.bits, "head_bits": cmd.head_bits or 6}
    (out / "config.json").write_text(json.dumps(cfg))
    send(P.Result(id=cmd.id, command="convert", data={"output_dir": str(out), "resumed_from": done}))


def main() -> None:
    global model
    devices = [P.DeviceMemory(device="cpu", name="fake CPU", total_bytes=8 << 30, free_bytes=6 << 30)]
    note = os.environ.get("FAKE_GPU_WITHOUT_KERNELS", "")  # a GPU whose kernels cannot be built, and why
    if note:
        devices.insert(0, P.DeviceMemory(device="cuda:0", name="fake GPU", total_bytes=24 << 30, free_bytes=22 << 30))
    send(P.Hello(engine_version="fake", pid=os.getpid(), devices=devices, kernels_note=note))
    threads = []
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = P.decode(line, P.COMMANDS)
        except P.ProtocolError as e:
            send(P.Error(code=P.ErrorCode.BAD_COMMAND, message=str(e)))
            continue
        if isinstance(cmd, P.Load):
            d = Path(cmd.model_dir)
            if not (d / "config.json").exists():
                send(P.Error(id=cmd.id, code=P.ErrorCode.MODEL_LOAD_FAILED, command="load",
                             message=f"{d} is not a model folder (no config.json)"))
                continue
            send(P.Progress(id=cmd.id, task=P.TaskKind.LOAD, fraction=0.5, message="loading"))
            time.sleep(LOAD_DELAY)
            model = P.ModelInfo(model_dir=str(d), name=d.name, architecture="LlamaForCausalLM", max_context=2048,
                                vision="vision" in d.name,
                                weight_bytes=sum(f.stat().st_size for f in d.glob("*.safetensors")),
                                cache_bytes=2048 * 1024, kernels="torch")
            if "nokernels" in d.name:  # a GPU whose CUDA kernels could not be built
                model.device = "cuda:0"
                model.kernels_note = "cannot build the CUDA kernels: nvcc not found (install the CUDA toolkit)"
            send(P.Result(id=cmd.id, command="load", data=model.__dict__))
        elif isinstance(cmd, P.Unload):
            model = None
            send(P.Result(id=cmd.id, command="unload"))
        elif isinstance(cmd, P.Generate):
            t = threading.Thread(target=generate, args=(cmd,), daemon=True)
            t.start()
            threads.append(t)
        elif isinstance(cmd, P.Cancel):
            cancelled.add(cmd.target)
            send(P.Result(id=cmd.id, command="cancel"))
        elif isinstance(cmd, P.Convert):
            t = threading.Thread(target=convert, args=(cmd,), daemon=True)
            t.start()
            threads.append(t)
        elif isinstance(cmd, P.Status):
            send(P.StatusReport(id=cmd.id, model=model))
        elif isinstance(cmd, P.Shutdown):
            send(P.Result(id=cmd.id, command="shutdown"))
            break
    for t in threads:
        t.join(timeout=2)


if __name__ == "__main__":
    main()
