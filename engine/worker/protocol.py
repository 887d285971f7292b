"""The app <-> engine protocol: message types and their framing. Torch-free on purpose.

Why a separate, dependency-free module: the desktop app imports it to talk to the engine
process without importing torch, and both sides share one definition of every message, so a
field renamed on one side is renamed on the other.

Framing
-------
One message per line: a JSON object encoded as UTF-8 and terminated by ``\\n`` (JSON escapes
any newline inside strings, so a line is always a whole message). The app writes *commands* to
the worker's stdin; the worker writes *events* to its stdout. The worker's stdout carries
nothing else (stray prints go to stderr), so a client can treat every stdout line as a message.
Unknown fields are ignored (new fields can be added without breaking old clients); an unknown
``type`` is a protocol error.

Every message has a ``type`` (the command or event name below) and an optional ``id``: the
client picks ids for its commands, and every event that answers a command carries that
command's ``id``, so the client can route answers. Events not caused by a command (``hello``)
have ``id`` null.

Commands (client -> worker)
---------------------------
``load``      load a model; answered by ``progress`` events (task "load") then ``result`` (with
              the model's info) or ``error``. Loading replaces any loaded model.
``unload``    drop the model and free its memory; answered by ``result``.
``generate``  queue a generation; answered by ``token`` events then one ``done`` (or ``error``).
              Generations run one at a time in arrival order; commands are still read and answered
              while one runs.
``cancel``    stop a queued or running generation, convert or download, by the id it was started
              with; the target ends with ``done`` (finish_reason "cancelled") or its own
              ``error`` with code "cancelled"; the cancel itself is answered with ``result``.
``status``    answered by one ``status`` event (model, memory per device, queue, tasks).
``plan``      VRAM plan for a model and context; answered by ``result`` (the plan as a dict).
``convert``   start a conversion job (its own process); ``progress`` events (task "convert"),
              then ``result`` or ``error``.
``download``  download files of a hub repo; ``progress`` events (task "download"), then
              ``result`` (local folder) or ``error``.
``shutdown``  answered by ``result``; then the worker exits. Closing stdin does the same.

Events (worker -> client)
-------------------------
``hello``     sent once at start: protocol version, engine version, pid, devices. The worker is
              ready for commands once this arrives.
``progress``  long work: task kind, fraction 0..1 (None if unknown), ETA in seconds, message.
``token``     a text delta of a generation, with the running token count and stats.
``done``      a generation finished: finish reason ("stop", "length", "cancelled") and stats.
``error``     something failed: a machine-readable ``code`` (see ``ErrorCode``), a ``message``
              a user understands, and the ``request_id`` when it concerns a generation.
``status``    the worker's state (answer to ``status``).
``result``    a command other than generate finished: ``command`` names it, ``data`` holds its
              answer (load: model info; plan: the plan; download: the local folder; ...).

If the process dies, the client synthesizes an ``error`` with code "worker_died" (see the
reference client without Qt, engine/worker/client.py, which the tests drive).

Example exchange::

    <- {"type": "hello", "id": null, "protocol": 1, "engine_version": "0.1.0", ...}
    -> {"type": "load", "id": "1", "model_dir": "/models/llama-4.0bpw", "max_context": 4096}
    <- {"type": "progress", "id": "1", "task": "load", "fraction": 0.5, "eta_s": 1.2, ...}
    <- {"type": "result", "id": "1", "command": "load", "data": {"name": "llama-4.0bpw", ...}}
    -> {"type": "generate", "id": "2", "request_id": "chat-7", "prompt": "Hello", "max_tokens": 8}
    <- {"type": "token", "id": "2", "request_id": "chat-7", "text": " there", "tokens": 1, ...}
    <- {"type": "done", "id": "2", "request_id": "chat-7", "finish_reason": "length", ...}
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A line that is not a valid message (bad JSON, unknown type, wrong field types)."""


class ErrorCode:
    """Machine-readable codes carried by ``Error.code``. The app branches on these; the
    ``message`` beside them is for people."""

    BAD_COMMAND = "bad_command"          # malformed line, unknown type, invalid field values
    NO_MODEL = "no_model"                # generate/... without a loaded model
    MODEL_LOAD_FAILED = "model_load_failed"  # missing/corrupt files, unsupported architecture
    OUT_OF_MEMORY = "out_of_memory"      # CUDA or host OOM; message says device, what, what to change
    NOT_FOUND = "not_found"              # cancel of an unknown id, missing file or folder
    CANCELLED = "cancelled"              # a task (convert/download) ended because it was cancelled
    GENERATION_FAILED = "generation_failed"
    CONVERT_FAILED = "convert_failed"
    DOWNLOAD_FAILED = "download_failed"
    OFFLINE = "offline"                  # the hub cannot be reached
    PLAN_FAILED = "plan_failed"
    UNSUPPORTED = "unsupported"          # e.g. images for a model without a vision tower
    INTERNAL = "internal"                # a bug; message says so
    WORKER_DIED = "worker_died"          # produced client-side when the process ends unexpectedly


class FinishReason:
    STOP = "stop"            # end-of-sequence token or a stop string
    LENGTH = "length"        # max_tokens (or the context) reached
    CANCELLED = "cancelled"  # a cancel command


class TaskKind:
    LOAD = "load"
    CONVERT = "convert"
    DOWNLOAD = "download"
    GENERATE = "generate"    # prompt processing of a long prompt


# --------------------------------------------------------------------------- shared parts

@dataclass
class SamplerParams:
    """Sampler settings as they travel; the worker maps them onto engine.generate.SamplerSettings.
    Defaults match common chat defaults; temperature 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0          # time waiting behind other generations
    prompt_s: float = 0.0         # prompt processing (prefill)
    generate_s: float = 0.0       # token generation
    prompt_tokens_per_s: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class DeviceMemory:
    """Memory of one device. For CUDA: ``used`` is what this process's allocator holds,
    ``reserved`` what its caching allocator reserved, ``free``/``total`` what the driver reports."""

    device: str                    # "cuda:0", "cpu"
    name: str = ""
    total_bytes: int = 0
    free_bytes: int = 0
    used_bytes: int = 0
    reserved_bytes: int = 0


@dataclass
class ModelInfo:
    model_dir: str
    name: str = ""
    architecture: str = ""
    bits_per_weight: Optional[float] = None
    max_context: int = 0
    device: str = "cpu"
    vision: bool = False
    draft_model_dir: Optional[str] = None
    weight_bytes: int = 0
    cache_bytes: int = 0
    kernels: str = ""              # "cuda" (the CUDA kernels) or "torch" (the PyTorch path)
    kernels_note: str = ""         # on a CUDA device without the kernels: why, in one line


@dataclass
class TaskInfo:
    id: Optional[str]
    task: str                      # TaskKind
    fraction: Optional[float] = None
    message: str = ""


# --------------------------------------------------------------------------- base

@dataclass
class Message:
    """Base of every command and event. ``type`` is a class-level name, written to JSON."""

    type: ClassVar[str] = ""
    id: Optional[str] = None

    def to_dict(self) -> dict:
        out = {"type": self.type}
        out.update(dataclasses.asdict(self))
        return out

    def to_line(self) -> str:
        return encode(self)


# --------------------------------------------------------------------------- commands

@dataclass
class Load(Message):
    """Load a model folder. ``max_context`` sizes the KV cache in tokens (0: the model's own
    limit, capped by the worker); ``cache_bits`` is (key bits, value bits) for a quantized cache,
    None for fp16; ``gpu_memory_limit_bytes`` caps what the worker may use on the device."""

    type: ClassVar[str] = "load"
    model_dir: str = ""
    max_context: int = 0
    cache_bits: Optional[list[int]] = None
    draft_model_dir: Optional[str] = None
    device: str = "auto"           # "auto" (cuda:0 if present, else cpu), "cpu", "cuda:N"
    gpu_memory_limit_bytes: Optional[int] = None


@dataclass
class Unload(Message):
    type: ClassVar[str] = "unload"


@dataclass
class Generate(Message):
    """A generation. Give ``messages`` (OpenAI-style chat: role + content, where content is a
    string or a list of parts) to use the model's chat template, or ``prompt`` for raw text.
    ``images`` are file paths or data URLs; ``request_id`` defaults to the command ``id``."""

    type: ClassVar[str] = "generate"
    request_id: Optional[str] = None
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    images: list[str] = field(default_factory=list)
    sampler: SamplerParams = field(default_factory=SamplerParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    add_bos: bool = True           # only for ``prompt``; chat templates carry their own BOS

    @property
    def rid(self) -> str:
        return self.request_id if self.request_id is not None else (self.id or "")


@dataclass
class Cancel(Message):
    """Cancel the generation, convert or download that was started with ``target`` as its
    request id (generate) or command id (convert, download)."""

    type: ClassVar[str] = "cancel"
    target: str = ""


@dataclass
class Status(Message):
    type: ClassVar[str] = "status"


@dataclass
class Plan(Message):
    """VRAM plan: ``model`` is a local folder or a hub repo id."""

    type: ClassVar[str] = "plan"
    model: str = ""
    context: int = 4096
    batch: int = 1
    cache_bits: Optional[list[int]] = None
    revision: Optional[str] = None  # hub branch, for a repo id


@dataclass
class Convert(Message):
    """Run ``trellis convert`` in its own process; its progress is relayed."""

    type: ClassVar[str] = "convert"
    input_dir: str = ""
    output_dir: str = ""
    bits: float = 4.0
    head_bits: Optional[int] = None
    work_dir: Optional[str] = None
    resume: bool = True
    codebook: Optional[str] = None  # "mul1" | "mcg" | "3inst"
    cal_rows: Optional[int] = None  # calibration size (None: the converter's defaults)
    cal_cols: Optional[int] = None
    calibration: Optional[str] = None  # a user's text file or folder; None: the built-in corpus
    device: Optional[str] = None    # "auto", "cpu", "cuda:N"


@dataclass
class Download(Message):
    """Download ``files`` (None: all) of a hub repo at ``revision`` into ``local_dir`` (None: a
    folder named after the repo and revision under the worker's models folder)."""

    type: ClassVar[str] = "download"
    repo: str = ""
    revision: str = "main"
    files: Optional[list[str]] = None
    local_dir: Optional[str] = None


@dataclass
class Shutdown(Message):
    type: ClassVar[str] = "shutdown"


# --------------------------------------------------------------------------- events

@dataclass
class Hello(Message):
    type: ClassVar[str] = "hello"
    protocol: int = PROTOCOL_VERSION
    engine_version: str = ""
    pid: int = 0
    devices: list[DeviceMemory] = field(default_factory=list)
    # With a CUDA device: why its models would run without the CUDA kernels, in one line ("" when
    # they can have them), so that the app plans their weights as they will load (dense copies).
    kernels_note: str = ""


@dataclass
class Progress(Message):
    type: ClassVar[str] = "progress"
    task: str = ""                 # TaskKind
    fraction: Optional[float] = None
    eta_s: Optional[float] = None
    message: str = ""


@dataclass
class Token(Message):
    type: ClassVar[str] = "token"
    request_id: str = ""
    text: str = ""                 # the new text since the previous token event
    tokens: int = 0                # tokens generated so far
    stats: Optional[GenerationStats] = None


@dataclass
class Done(Message):
    type: ClassVar[str] = "done"
    request_id: str = ""
    finish_reason: str = FinishReason.STOP
    text: str = ""                 # the whole generated text (stop string excluded)
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Error(Message):
    type: ClassVar[str] = "error"
    code: str = ErrorCode.INTERNAL
    message: str = ""
    request_id: Optional[str] = None
    command: Optional[str] = None  # the type of the command that failed, when there is one


@dataclass
class StatusReport(Message):
    type: ClassVar[str] = "status"
    state: str = "idle"            # "idle" | "loading" | "generating"
    model: Optional[ModelInfo] = None
    devices: list[DeviceMemory] = field(default_factory=list)
    running: Optional[str] = None  # request id of the generation in progress
    queue: list[str] = field(default_factory=list)  # queued request ids, in order
    tasks: list[TaskInfo] = field(default_factory=list)


@dataclass
class Result(Message):
    type: ClassVar[str] = "result"
    command: str = ""
    data: dict = field(default_factory=dict)


COMMANDS: dict[str, type[Message]] = {
    c.type: c for c in (Load, Unload, Generate, Cancel, Status, Plan, Convert, Download, Shutdown)
}
EVENTS: dict[str, type[Message]] = {
    e.type: e for e in (Hello, Progress, Token, Done, Error, StatusReport, Result)
}


# --------------------------------------------------------------------------- (de)serialization

def encode(message: Message) -> str:
    """One protocol line, newline included."""
    return json.dumps(message.to_dict(), ensure_ascii=False, separators=(",", ":")) + "\n"


def decode(line: Union[str, bytes], kinds: Optional[dict[str, type[Message]]] = None) -> Message:
    """Parse one line into its message class. ``kinds`` limits the accepted types (COMMANDS on
    the worker side, EVENTS on the client side). Pass it: "status" is both a command and an
    event, and without `kinds` it decodes as the event."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"message is not UTF-8: {e}") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"message is not JSON: {e}") from None
    return from_dict(obj, kinds)


def from_dict(obj: Any, kinds: Optional[dict[str, type[Message]]] = None) -> Message:
    if not isinstance(obj, dict):
        raise ProtocolError("message must be a JSON object")
    kind = obj.get("type")
    table = kinds if kinds is not None else {**COMMANDS, **EVENTS}
    cls = table.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    return _build(cls, obj, kind)


def _build(cls: type, obj: dict, where: str):
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected an object")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _convert(hints[f.name], obj[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ProtocolError(f"{where}: {e}") from None


def _convert(hint: Any, value: Any, where: str) -> Any:
    """Check ``value`` against a field's annotation and build nested dataclasses. Only the
    shapes used in this module are handled: scalars, Optional, list[...], dict, dataclasses."""
    origin = typing.get_origin(hint)
    if origin is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_convert(item, v, where) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ProtocolError(f"{where}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string")
        return value
    return value  # Any
