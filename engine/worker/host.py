"""ModelHost: the one loaded model of an engine process, and the memory it uses.

It is the only place that touches the model object, so the worker loop and the HTTP API can
share it: load/unload, prompt building (chat template or raw text), one generation, device
memory figures. Out-of-memory is turned into an `OutOfMemory` error whose message says which
device ran out, while doing what, and what to change; the host cleans up so the process stays
usable. Calls are not thread-safe by themselves: callers serialize them (GenerationQueue).
"""
from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from engine.errors import TrellisError, first_line
from engine.worker.protocol import (DeviceMemory, ErrorCode, FinishReason, Generate, GenerationStats, Load,
                                    ModelInfo)

ProgressFn = Callable[[Optional[float], str], None]

# generate()'s finish reasons -> protocol's (eos and stop strings are both "stop" for clients)
_FINISH_REASONS = {"eos": FinishReason.STOP, "stop": FinishReason.STOP, "length": FinishReason.LENGTH,
                   "cancelled": FinishReason.CANCELLED}


class WorkerError(TrellisError):
    """A failure with a protocol error code attached (the message is the user's sentence)."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class OutOfMemory(WorkerError):
    code = ErrorCode.OUT_OF_MEMORY


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA OOM (torch.OutOfMemoryError), Python's MemoryError, and the CPU allocator's
    RuntimeError ("can't allocate memory"), which torch does not give its own class."""
    if isinstance(error, MemoryError):
        return True
    try:
        import torch
        if isinstance(error, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(error, RuntimeError) and ("can't allocate memory" in str(error)
                                                 or "out of memory" in str(error).lower())


def out_of_memory_message(device: str, what: str, advice: str, error: BaseException) -> str:
    detail = first_line(error)
    if len(detail) > 160:
        detail = detail[:157] + "..."
    return f"Out of memory on {device} while {what} ({detail}). {advice}"


@dataclass
class GenerationOutcome:
    text: str
    finish_reason: str
    stats: GenerationStats


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_model_dir(model_dir: Path) -> ModelInfo:
    """What can be said about a model folder without loading it (torch-free)."""
    config = _read_json(model_dir / "config.json")
    quant = config.get("quantization_config") or _read_json(model_dir / "quantization_config.json")
    archs = config.get("architectures") or [""]
    bits = quant.get("bits") if isinstance(quant, dict) else None
    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return ModelInfo(model_dir=str(model_dir), name=model_dir.name, architecture=str(archs[0]),
                     bits_per_weight=float(bits) if isinstance(bits, (int, float)) else None,
                     vision="vision_config" in config, weight_bytes=weight_bytes)


class ModelHost:
    def __init__(self):
        self.model = None
        self.tokenizer = None
        self.draft_model = None
        self.info: Optional[ModelInfo] = None
        self.device = "cpu"

    # ------------------------------------------------------------------ load / unload

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def load(self, cmd: Load, progress: Optional[ProgressFn] = None) -> ModelInfo:
        progress = progress or (lambda fraction, message: None)
        model_dir = Path(cmd.model_dir).expanduser()
        if not cmd.model_dir or not model_dir.is_dir():
            raise WorkerError(f"model folder not found: {cmd.model_dir}", ErrorCode.NOT_FOUND)
        if cmd.max_context < 0:
            raise WorkerError(f"max_context must be >= 0 (got {cmd.max_context})", ErrorCode.BAD_COMMAND)
        if cmd.cache_bits and any(b < 16 for b in cmd.cache_bits):
            # Refused rather than ignored: a user who picked a 4-bit cache to fit a long context
            # must not find out from an out-of-memory error later.
            raise WorkerError("a quantized KV cache (cache_bits) is not available in this engine version yet; "
                              "load with an fp16 cache (no cache_bits) and a shorter context", ErrorCode.UNSUPPORTED)
        self.unload()
        device = self._pick_device(cmd.device)
        self._apply_memory_limit(device, cmd.gpu_memory_limit_bytes)
        info = describe_model_dir(model_dir)
        failure: Optional[WorkerError] = None
        step = {"what": f"loading the weights of {model_dir.name}"}
        try:
            model, tokenizer, draft, max_context = self._load_parts(cmd, model_dir, device, info, step, progress)
        except WorkerError as e:
            failure = e
        except TrellisError as e:
            failure = WorkerError(str(e), ErrorCode.MODEL_LOAD_FAILED)
        except Exception as e:
            if is_out_of_memory(e):
                advice = ("Try a smaller cache (shorter max_context), 8-bit or 4-bit cache, "
                          "or a lower-bpw version of the model.")
                if info.kernels_note:
                    # Without the kernels the weights also load as a dense fp16 copy, 16 / bpw times
                    # their EXL3 size: that, more than the model, is what did not fit.
                    advice = (f"This GPU runs without the CUDA kernels ({info.kernels_note}), so the weights "
                              "also load as dense fp16, 16 / bpw times their size in the model folder; with "
                              "the kernels (install the CUDA toolkit's nvcc) they stay compressed alone.")
                failure = OutOfMemory(out_of_memory_message(device, step["what"], advice, e))
            else:
                failure = WorkerError(f"cannot load {model_dir.name}: {type(e).__name__}: {e}",
                                      ErrorCode.MODEL_LOAD_FAILED)
        if failure is not None:
            # Raised outside the except block so the failed attempt's frames (and the tensors
            # they hold) are gone before memory is released.
            self._free_memory()
            raise failure
        info.max_context = max_context
        info.device = device
        info.draft_model_dir = cmd.draft_model_dir
        self.model, self.tokenizer, self.draft_model, self.info, self.device = model, tokenizer, draft, info, device
        progress(1.0, f"loaded {model_dir.name}")
        return info

    def _load_parts(self, cmd: Load, model_dir: Path, device: str, info: ModelInfo, step: dict,
                    progress: ProgressFn):
        from engine.generate.graph_decode import graph_decoder
        from engine.models import load_model
        from engine.tokenizer import Tokenizer

        progress(0.0, f"reading {model_dir.name}")
        tokenizer = Tokenizer.from_dir(model_dir)
        step["what"] = "preparing the CUDA kernels"
        status = self._kernel_status(device, progress)
        info.kernels, info.kernels_note = status.kernels, status.note
        step["what"] = f"loading the weights of {model_dir.name}"
        model = load_model(model_dir, device=device, progress=_scaled_progress(progress, 0.9, f"loading {model_dir.name}"))
        context_limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        max_context = cmd.max_context or context_limit or 4096
        if context_limit and max_context > context_limit:
            raise WorkerError(f"max_context {max_context} is longer than the model's context "
                              f"({context_limit} tokens)", ErrorCode.BAD_COMMAND)
        draft = None
        if cmd.draft_model_dir:
            step["what"] = f"loading the draft model {Path(cmd.draft_model_dir).name}"
            progress(0.9, step["what"])
            draft = load_model(Path(cmd.draft_model_dir).expanduser(), device=device)
        # Reserve the cache once now so a context that does not fit fails at load, with
        # advice, instead of in the middle of someone's chat.
        step["what"] = f"allocating the KV cache for {max_context} tokens"
        progress(0.95, step["what"])
        cache = model.new_cache(1, max_context)
        info.cache_bytes = _tensor_bytes(cache)
        graphs = graph_decoder(model)
        if graphs is not None:
            # On CUDA the decode steps are graph replays over the decoder's own static cache:
            # allocate that one now, at the size that just fitted, and every generation reuses
            # it (and the graphs captured over it) instead of allocating its own.
            del cache
            graphs.new_cache(1, max_context)
        return model, tokenizer, draft, max_context

    def unload(self) -> None:
        self.model = self.tokenizer = self.draft_model = self.info = None
        self._free_memory()

    def _free_memory(self) -> None:
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    @staticmethod
    def kernels_note() -> str:
        """Why this machine's GPU would run models without the CUDA kernels ("" when it can have
        them, or has no GPU). Builds nothing: a first load may still compile them."""
        import torch

        from engine import ops
        from engine.ops.build import kernel_obstacle

        if not torch.cuda.is_available():
            return ""
        if not ops.kernels_enabled():
            return ops.kernel_status("cuda").note
        return kernel_obstacle() or ""

    @staticmethod
    def _kernel_status(device: str, progress: ProgressFn):
        """The ops' path on `device`. The first model on a GPU may compile the kernels (minutes,
        once per GPU kind and engine version): the progress line says so first."""
        from engine import ops
        from engine.ops.build import needs_compile

        if device.startswith("cuda") and ops.kernels_enabled() and not ops.kernels_settled():
            progress(0.0, "compiling the CUDA kernels for this GPU (first use only; a few minutes)"
                     if needs_compile() else "loading the CUDA kernels")
        return ops.kernel_status(device)

    @staticmethod
    def _pick_device(requested: str) -> str:
        import torch
        if requested in ("", "auto"):
            return "cuda:0" if torch.cuda.is_available() else "cpu"
        if requested.startswith("cuda"):
            if not torch.cuda.is_available():
                raise WorkerError(f"device {requested} requested but no CUDA device is available",
                                  ErrorCode.BAD_COMMAND)
            index = int(requested.split(":")[1]) if ":" in requested else 0
            if index >= torch.cuda.device_count():
                raise WorkerError(f"device {requested} does not exist ({torch.cuda.device_count()} CUDA devices)",
                                  ErrorCode.BAD_COMMAND)
            return f"cuda:{index}"
        if requested != "cpu":
            raise WorkerError(f"unknown device {requested!r} (use auto, cpu or cuda:N)", ErrorCode.BAD_COMMAND)
        return "cpu"

    @staticmethod
    def _apply_memory_limit(device: str, limit: Optional[int]) -> None:
        if not limit or not device.startswith("cuda"):
            return
        import torch
        index = int(device.split(":")[1])
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)

    # ------------------------------------------------------------------ generation

    def prompt_ids(self, req: Generate) -> list[int]:
        """The token ids a request starts from: chat template for messages, raw text otherwise."""
        if self.model is None:
            raise WorkerError("no model is loaded: load one first", ErrorCode.NO_MODEL)
        if req.images or any(_has_image_part(m) for m in req.messages or ()):
            if not (self.info and self.info.vision):
                raise WorkerError(f"{self.info.name if self.info else 'this model'} has no vision support: "
                                  "images cannot be used with it", ErrorCode.UNSUPPORTED)
            raise WorkerError("images are not supported by this engine version yet", ErrorCode.UNSUPPORTED)
        if req.messages is not None:
            messages = [{**m, "content": _text_content(m.get("content"))} for m in req.messages]
            try:
                return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
            except TrellisError as e:
                raise WorkerError(str(e), ErrorCode.BAD_COMMAND) from None
        if req.prompt is None:
            raise WorkerError("generate needs messages or a prompt", ErrorCode.BAD_COMMAND)
        return self.tokenizer.encode(req.prompt, add_bos=req.add_bos)

    def count_tokens(self, req: Generate) -> int:
        return len(self.prompt_ids(req))

    def generate(self, req: Generate, on_text: Callable[[str], None], should_stop: Callable[[], bool],
                 prompt_ids: Optional[list[int]] = None) -> GenerationOutcome:
        """Run one generation to its end; `prompt_ids` skips re-tokenizing a checked request."""
        from engine.generate import SamplerSettings, generate

        if self.model is None:
            raise WorkerError("no model is loaded: load one first", ErrorCode.NO_MODEL)
        ids = prompt_ids if prompt_ids is not None else self.prompt_ids(req)
        limit = self.info.max_context if self.info else 0
        if req.max_tokens < 0:
            raise WorkerError(f"max_tokens must be >= 0 (got {req.max_tokens})", ErrorCode.BAD_COMMAND)
        if limit and len(ids) >= limit:
            raise WorkerError(f"the prompt has {len(ids)} tokens but the loaded context is {limit}: "
                              "shorten the conversation or load with a longer context", ErrorCode.BAD_COMMAND)
        max_new = min(req.max_tokens, limit - len(ids)) if limit else req.max_tokens
        sampler = _sampler_settings(SamplerSettings, req)
        failure: Optional[WorkerError] = None
        try:
            result = generate(self.model, self.tokenizer, ids, max_new, sampler,
                              stop_strings=tuple(req.stop), on_text=on_text, should_stop=should_stop)
        except TrellisError as e:
            failure = WorkerError(str(e), ErrorCode.BAD_COMMAND)
        except Exception as e:
            if is_out_of_memory(e):
                failure = OutOfMemory(out_of_memory_message(
                    self.device, f"generating (prompt {len(ids)} tokens, up to {max_new} new)",
                    "Try a shorter context or fewer max tokens, a smaller cache, or a lower-bpw model.", e))
            else:
                failure = WorkerError(f"generation failed: {type(e).__name__}: {e}", ErrorCode.GENERATION_FAILED)
        if failure is not None:
            self._free_memory()  # outside the except block: the failed frames are released first
            raise failure
        s = result.stats
        decode_steps = max(0, s.generated_tokens - 1)
        stats = GenerationStats(
            prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
            prompt_s=round(s.time_to_first_token_s, 4), generate_s=round(s.decode_s, 4),
            prompt_tokens_per_s=round(s.prompt_tokens / s.time_to_first_token_s, 2) if s.time_to_first_token_s else 0.0,
            tokens_per_s=round(decode_steps / s.decode_s, 2) if decode_steps and s.decode_s else 0.0)
        return GenerationOutcome(result.text, _FINISH_REASONS.get(result.finish_reason, FinishReason.STOP), stats)

    # ------------------------------------------------------------------ memory

    def devices(self) -> list[DeviceMemory]:
        out = [_cpu_memory()]
        try:
            import torch
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    free, total = torch.cuda.mem_get_info(i)
                    out.append(DeviceMemory(device=f"cuda:{i}", name=torch.cuda.get_device_name(i),
                                            total_bytes=total, free_bytes=free,
                                            used_bytes=torch.cuda.memory_allocated(i),
                                            reserved_bytes=torch.cuda.memory_reserved(i)))
        except ImportError:
            pass
        return out


def _scaled_progress(progress: ProgressFn, scale: float, message: str):
    """Adapt load_model's progress callback (a fraction, or done and total counts) to ours."""
    def report(done, total=None, *rest):
        try:
            fraction = float(done) / float(total) if isinstance(total, (int, float)) and total else float(done)
        except (TypeError, ValueError):
            return
        progress(max(0.0, min(1.0, fraction)) * scale, message)
    return report


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors an object holds (attributes, lists): used for the cache size."""
    import torch
    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return total


def _sampler_settings(cls, req: Generate):
    wanted = {k: v for k, v in vars(req.sampler).items() if v is not None or k == "seed"}
    fields = getattr(cls, "__dataclass_fields__", {})
    return cls(**{k: v for k, v in wanted.items() if k in fields})


def _has_image_part(message: dict) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_image") for p in content)


def _text_content(content) -> str:
    """Chat templates expect a string; OpenAI-style part lists are joined (text parts only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise WorkerError("message content must be a string or a list of parts", ErrorCode.BAD_COMMAND)


def _cpu_memory() -> DeviceMemory:
    total = free = used = 0
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        free = int(fields.get("MemAvailable", fields["MemFree"]).split()[0]) * 1024
        used = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return DeviceMemory(device="cpu", name="system memory", total_bytes=total, free_bytes=free, used_bytes=used)
