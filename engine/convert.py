"""HF model folder → EXL3 model folder, as a resumable job (spec sections 1 and 5).

The job's only state is its working directory:

    <work>/job.json                  fixed arguments, input fingerprint, modules done, reports
    <work>/calibration.safetensors   the calibration token ids (so a resume uses the same rows)
    <work>/allocation.json           K per linear (and the measured sensitivities behind it)
    <work>/qtensors/NNNN.safetensors finished modules' output tensors (+ storage metadata)

Each file is written to a temporary name, fsynced and renamed, so kill -9 at any moment leaves
either the old or the new version. Hidden states are *not* checkpointed: on resume they are
recomputed by running the calibration rows through the finished (quantized) modules, which is
cheap next to quantizing and reproduces them bit for bit, so a resumed job writes the same bytes
as an uninterrupted one. The output folder is assembled under a temporary name and renamed into
place last.

Before the first module, the bits are allocated: an integer K for every linear, either from
sensitivities measured on the unquantized model, one per linear (engine.quantize.sensitivity,
the default), or by the reference's fixed heuristic, one K per group (q/k/v, o, gate/up, down).
The result is stored once, so a resumed job never re-measures once it has started quantizing.

Modules are processed in model order: embedding, every decoder layer (capture input Hessians
with the unquantized layer on the already-quantized stream, quantize its linears, swap the
quantized weights in, advance the stream), final norm, head.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.errors import TrellisError
from engine.formats.exl3 import EXL3Tensors, pad_to_128
from engine.io.hf_config import load_model_config
from engine.io.safetensors_io import TensorStore, write_safetensors
from engine.quantize.allocation import QGroup, allocate_bits, allocate_measured, average_bits, measured_k_range
from engine.quantize.block_runner import DECODER_SLOTS, LAYER_NORMS, ModelRunner
from engine.quantize.calibration import build_calibration, text_rows
from engine.quantize.hessian import HessianAccumulator
from engine.quantize.linear import LinearSpec, QuantizedLinear, quantize_linears
from engine.quantize.sensitivity import (SAMPLE, HessianStream, decoder_groups, free_bytes, hessian_rows,
                                         measure_sensitivities, measurement_bytes, probe_mse)

JOB_VERSION = 1
CODEBOOKS = ("mul1", "mcg", "3inst")
ALLOCATIONS = ("measured", "heuristic")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
NUM_REF_ROWS = 5
QUANTIZER_VERSION = "1.4.1"  # format version we write (tools read `version` as exllamav3's)


# Where exllamav3 looks for the text model of multimodal checkpoints, whatever layout the source
# used (spec Appendix B and pitfall 11b); vision tensors are copied verbatim under these names.
OUTPUT_LAYOUTS = {
    "Gemma3ForConditionalGeneration": ("language_model.model.", "language_model.lm_head"),
    "Qwen2_5_VLForConditionalGeneration": ("model.", "lm_head"),
}
VISION_RENAMES = (("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
                  ("model.visual.", "visual."), ("mm_input_projection_weight", "mm_input_projection.weight"))


class ConversionError(TrellisError):
    """The conversion cannot start or continue (bad input, settings, disk, work directory)."""


@dataclass
class ConvertSettings:
    """Everything that defines a conversion. `FIXED` fields may not change on resume."""

    in_dir: str
    out_dir: str
    bits: float
    head_bits: int = 6
    work_dir: str | None = None
    codebook: str = "mul1"
    cal_rows: int = 250
    cal_cols: int = 2048
    device: str = "auto"
    seed: int = 0
    calibration: str | None = None     # user text file/folder instead of the built-in corpus
    scale_effort: str = "auto"         # "full" | "fast" | "auto" (full on CUDA, fast on CPU)
    shard_mb: float = 8192
    keep_work: bool = False
    sequential: str = "module"         # "module": all Hessians from one pass (reference); "linear": true sequential
    allocation: str = "measured"       # "measured": K per linear from measured sensitivities; "heuristic": spec 5.10

    FIXED = ("bits", "head_bits", "codebook", "cal_rows", "cal_cols", "seed", "calibration", "scale_effort",
             "sequential", "allocation")

    def fixed(self) -> dict:
        return {k: getattr(self, k) for k in self.FIXED}


@dataclass
class ProgressEvent:
    """What the wizard shows: stage, module i of n, ETA."""

    stage: str                 # "start" | "measure" | "module" | "compile" | "done"
    index: int                 # modules finished ("measure": linears measured)
    total: int                 # modules ("measure": linears)
    module: str = ""
    elapsed_s: float = 0.0
    eta_s: float | None = None
    report: dict | None = field(default=None)

    def to_json(self) -> str:
        return json.dumps({"event": "progress", **asdict(self)})


# ------------------------------------------------------------------------------------------------
# small file helpers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_safetensors(tmp, tensors, metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    out = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out, meta


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def _filesystem(path: Path) -> tuple[int, Path]:
    p = _existing_parent(path)
    return os.stat(p).st_dev, p


def _free_bytes(path: Path) -> int:
    """Free space on the filesystem holding `path` (its nearest existing parent)."""
    return shutil.disk_usage(_existing_parent(path)).free


# ------------------------------------------------------------------------------------------------
# the job


@dataclass
class _Module:
    kind: str        # "embed" | "layer" | "norm" | "head"
    key: str         # e.g. "model.layers.3"
    layer: int = -1
    numel: int = 0   # quantized weights (for the ETA)


class ConversionJob:
    def __init__(self, settings: ConvertSettings, resume: bool = False,
                 progress: Callable[[ProgressEvent], None] | None = None, log: Callable[[str], None] | None = None):
        self.s = settings
        self.resume = resume
        self.progress = progress or (lambda e: None)
        self.log = log or (lambda m: None)
        self.in_dir = Path(settings.in_dir)
        self.out_dir = Path(settings.out_dir)
        self.work = Path(settings.work_dir) if settings.work_dir else self.out_dir.with_name(self.out_dir.name + ".work")

    # -- validation ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Every check that can fail before anything is written (one-line ConversionError)."""
        s = self.s
        if not (isinstance(s.bits, (int, float)) and 1.0 <= float(s.bits) <= 8.0):
            raise ConversionError(f"bits per weight must be between 1.0 and 8.0 (got {s.bits})")
        if s.head_bits not in (*range(1, 9), 16):
            raise ConversionError(f"head bits must be 1..8 or 16 for an unquantized head (got {s.head_bits})")
        if s.codebook not in CODEBOOKS:
            raise ConversionError(f"codebook must be one of {', '.join(CODEBOOKS)} (got {s.codebook})")
        if s.cal_rows < 1 or s.cal_cols < 16:
            raise ConversionError(f"calibration must be at least 1 row of 16 tokens (got {s.cal_rows} x {s.cal_cols})")
        if s.allocation not in ALLOCATIONS:
            raise ConversionError(f"allocation must be measured or heuristic (got {s.allocation})")
        if s.sequential not in ("module", "linear"):
            raise ConversionError(f"sequential must be module or linear (got {s.sequential})")
        if s.scale_effort not in ("auto", "full", "fast"):
            raise ConversionError(f"scale search effort must be auto, full or fast (got {s.scale_effort})")
        if not self.in_dir.is_dir():
            raise ConversionError(f"input folder {self.in_dir} does not exist")
        if not (self.in_dir / "config.json").is_file():
            raise ConversionError(f"no config.json in {self.in_dir} (is this a Hugging Face model folder?)")
        try:
            self.config = load_model_config(self.in_dir)
        except TrellisError as e:
            raise ConversionError(str(e)) from None
        from engine.models import MODEL_CLASSES
        if self.config.architecture not in MODEL_CLASSES:
            raise ConversionError(f"architecture {self.config.architecture} is not supported for conversion")
        files = [p for p in self.in_dir.iterdir() if p.is_file()]
        if not any(p.suffix == ".safetensors" for p in files):
            if any(p.suffix in PICKLE_SUFFIXES for p in files):
                raise ConversionError(f"{self.in_dir} has only PyTorch pickle weights (.bin/.pt); Trellis reads "
                                      "safetensors only (pickles can run code): convert them to safetensors first")
            raise ConversionError(f"no .safetensors weights in {self.in_dir}")
        if not any((self.in_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
            raise ConversionError(f"no tokenizer (tokenizer.json or tokenizer.model) in {self.in_dir}")
        if self.work.resolve() == self.out_dir.resolve() or self.work.resolve() == self.in_dir.resolve():
            raise ConversionError("the working folder must differ from the input and output folders")
        self._check_work_dir()
        complete = (self.out_dir / "quantization_config.json").is_file()
        self.finished = complete and bool(
            (self.existing and self.existing.get("compiled_to") == str(self.out_dir.resolve()))
            # killed after the working folder was discarded: the job had already finished
            or (self.resume and self.existing is None and not self.work.exists())
        )
        if self.finished:
            return  # killed after the output was renamed into place: only cleanup is left
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise ConversionError(f"output folder {self.out_dir} already exists and is not empty")
        self._check_disk()

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update((self.in_dir / "config.json").read_bytes())
        for p in sorted(self.in_dir.glob("*.safetensors")):
            h.update(p.name.encode())
            h.update(str(p.stat().st_size).encode())
        return h.hexdigest()[:16]

    def _discard_work(self) -> None:
        """Rename, then delete: a kill during the deletion never leaves a half-removed job folder
        for a later resume to trip over (the folder is either whole or gone)."""
        if not self.work.exists():
            return
        trash = self.work.with_name(f".{self.work.name}.discard-{os.getpid()}")
        os.replace(self.work, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _check_work_dir(self) -> None:
        for stale in self.work.parent.glob(f".{self.work.name}.discard-*"):
            shutil.rmtree(stale, ignore_errors=True)
        job_file = self.work / "job.json"
        self.existing = None
        if not job_file.exists():
            if self.work.exists() and self.work.is_dir() and any(self.work.iterdir()):
                raise ConversionError(f"working folder {self.work} is not empty and holds no conversion job")
            return
        try:
            job = json.loads(job_file.read_text())
        except (OSError, json.JSONDecodeError):
            raise ConversionError(f"working folder {self.work} has an unreadable job.json; remove it to start over") from None
        same = (job.get("version") == JOB_VERSION and job.get("fixed") == self.s.fixed()
                and job.get("fingerprint") == self._fingerprint())
        if not same:
            hint = "" if self.resume else "; use another -w or delete it"
            raise ConversionError(f"working folder {self.work} belongs to a different conversion job{hint}")
        if not self.resume:
            raise ConversionError(f"working folder {self.work} holds an unfinished job: resume it with -r or delete it")
        self.existing = job

    def _estimate_bytes(self) -> int:
        store = TensorStore(self.in_dir)
        try:
            src = store.total_bytes
        finally:
            store.close()
        return int(src * max(self.s.bits, self.s.head_bits if self.s.head_bits != 16 else 8) / 16) + (64 << 20)

    def _check_disk(self) -> None:
        """The work folder and the output each end up holding about one copy of the result."""
        need = self._estimate_bytes()
        out_fs, work_fs = _filesystem(self.out_dir), _filesystem(self.work)
        demands = {out_fs: need}
        demands[work_fs] = demands.get(work_fs, 0) + need
        for (dev, where), total in demands.items():
            free = _free_bytes(where)
            if free < total:
                raise ConversionError(f"not enough disk space at {where}: need about {total / 1e9:.2f} GB, "
                                      f"{free / 1e9:.2f} GB free")

    # -- plan ---------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        d = self.s.device
        if d == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError):
            raise ConversionError(f"invalid device {d!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConversionError(f"device {d} requested but CUDA is not available")
        return dev

    def _plan(self, store: TensorStore) -> tuple[list[_Module], list[QGroup], list[QGroup]]:
        """Modules in order, the heuristic's groups (q/k/v, o, gate/up, down per layer) and the
        measured allocation's units (every linear on its own, named by its tensor key)."""
        c = self.config
        prefix = self.layout.prefix
        mods = [_Module("embed", f"{prefix}embed_tokens")]
        groups: list[QGroup] = []
        units: list[QGroup] = []
        order = 0
        for i in range(c.num_layers):
            key = f"{prefix}layers.{i}"
            numel = 0
            gsize: dict[str, int] = {}
            for slot in DECODER_SLOTS:
                w = f"{key}.{slot.name}.weight"
                if w not in store:
                    raise ConversionError(f"tensor {w} is missing from {self.in_dir}")
                o, n = store.shape(w)
                sz = pad_to_128(n) * pad_to_128(o)
                gsize[slot.group] = gsize.get(slot.group, 0) + sz
                units.append(QGroup(f"{key}.{slot.name}", i, slot.priority, sz, len(units)))
                numel += sz
            for slot_group in ("qkv", "o", "gu", "d"):
                prio = 2 if slot_group in ("qkv", "o") else 1
                groups.append(QGroup(f"{key}.{slot_group}", i, prio, gsize[slot_group], order))
                order += 1
            mods.append(_Module("layer", key, i, numel))
        mods.append(_Module("norm", f"{prefix}norm"))
        head_numel = 0 if self.s.head_bits == 16 else pad_to_128(c.hidden_size) * pad_to_128(c.vocab_size)
        mods.append(_Module("head", self.layout.head_key, numel=head_numel))
        return mods, groups, units

    # -- bit allocation -----------------------------------------------------------------------

    def _allocate(self, groups: list[QGroup], units: list[QGroup], runner: ModelRunner, ids: torch.Tensor,
                  device) -> dict[str, int]:
        """K per linear (keyed by tensor key), computed once per job and stored in allocation.json
        (a resume reuses it; a job killed before it was written measures again, which is
        deterministic)."""
        path = self.work / "allocation.json"
        names = {u.name for u in units}
        if self.existing and path.exists():
            try:
                saved = json.loads(path.read_text())
                if set(saved["bits"]) == names:
                    return {u.name: int(saved["bits"][u.name]) for u in units}
            except (OSError, ValueError, KeyError, TypeError):
                pass  # torn or foreign: allocate again
        record: dict = {"allocation": self.s.allocation, "target_bits": self.s.bits}
        bits = None
        if self.s.allocation == "measured":
            bits = self._measured_bits(units, runner, ids, device, record)
        if bits is None:
            per_group = allocate_bits(groups, float(self.s.bits), self.config.num_layers)
            layers = [f"{self.layout.prefix}layers.{i}" for i in range(self.config.num_layers)]
            bits = {f"{key}.{slot.name}": per_group[f"{key}.{slot.group}"] for key in layers for slot in DECODER_SLOTS}
            record["used"] = "heuristic"
        record["average_bits"] = round(average_bits(units, bits), 4)
        record["bits"] = {u.name: bits[u.name] for u in units}
        _write_json_atomic(path, record)
        return bits

    def _measured_bits(self, units, runner, ids, device, record: dict) -> dict[str, int] | None:
        """Sensitivities of every linear on the unquantized model (engine.quantize.sensitivity),
        then the allocation that minimizes their predicted KLD; None (heuristic) when it cannot
        run. Per linear rather than per group: q, k and v (or gate and up) differ several-fold
        in sensitivity per weight, and the finer choice doubled to tripled the simulated gain
        on SmolLM2 (bench/alloc_sim.py --per-tensor)."""
        c = self.config
        rows, tokens = SAMPLE["cuda" if device.type == "cuda" else "cpu"]
        sample = text_rows(ids, rows, min(tokens, ids.shape[1]))
        hrows = hessian_rows(ids)
        need = measurement_bytes(c.num_layers, c.hidden_size, c.vocab_size, sample.numel())
        need += 0 if self._state_device(device) != device else hrows.numel() * c.hidden_size * 4
        if need > free_bytes(device) // 2:
            self.log(f"bit allocation: measuring sensitivities needs about {need / 1e9:.1f} GB more than the "
                     f"{device.type} has free; using the heuristic allocation instead")
            record["fallback"] = "not enough memory"
            return None
        sgroups = decoder_groups([f"{self.layout.prefix}layers.{i}" for i in range(c.num_layers)], per_tensor=True)
        t0 = time.time()

        def on_progress(done: int, total: int, name: str) -> None:
            el = time.time() - t0
            self.progress(ProgressEvent("measure", done, total, "", round(el, 2), round(el / done * (total - done), 1)))

        self.progress(ProgressEvent("measure", 0, len(sgroups)))
        try:
            stream = HessianStream(runner, hrows, self._chunks(hrows.shape[0], device), self._state_device(device))
            sens = measure_sensitivities(runner, sample, sgroups, probe_mse(float(self.s.bits)), self.s.seed,
                                         hessians=stream, progress=on_progress)
        except torch.OutOfMemoryError:
            self.log("bit allocation: out of memory while measuring sensitivities; using the heuristic allocation")
            record["fallback"] = "out of memory"
            return None
        finally:
            stream = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        seconds = time.time() - t0
        bad = [k for k, v in sens.items() if not (v == v and abs(v) != float("inf"))]
        if bad:
            self.log(f"bit allocation: non-finite sensitivity for {bad[0]}; using the heuristic allocation")
            record["fallback"] = "non-finite sensitivity"
            return None
        k_min, k_max = measured_k_range(float(self.s.bits))
        bits = allocate_measured(units, sens, float(self.s.bits), k_min, k_max)
        hist = {k: sum(1 for v in bits.values() if v == k) for k in sorted(set(bits.values()))}
        self.log(f"bit allocation: sensitivities of {len(sgroups)} linears measured in {seconds:.1f} s on "
                 f"{sample.shape[0]} x {sample.shape[1]} tokens; linears per K: {hist}")
        record.update({"used": "measured", "seconds": round(seconds, 3), "sample": list(sample.shape),
                       "probe_mse": probe_mse(float(self.s.bits)), "k_range": [k_min, k_max], "sensitivity": sens})
        return bits

    # -- run ----------------------------------------------------------------------------------

    def run(self) -> Path:
        self.validate()
        if self.finished:
            if not self.s.keep_work:
                self._discard_work()
            return self.out_dir
        from engine.models import find_layout, load_model
        from engine.tokenizer import Tokenizer
        t_start = time.time()
        device = self._device()
        effort = self.s.scale_effort if self.s.scale_effort != "auto" else ("full" if device.type == "cuda" else "fast")
        torch.manual_seed(self.s.seed)
        store = TensorStore(self.in_dir)
        try:
            try:
                self.layout = find_layout(store, self.config.architecture)
                modules, groups, units = self._plan(store)
                tokenizer = Tokenizer.from_dir(self.in_dir)
                model = load_model(self.in_dir, device=device, dtype=torch.float32)
                ids = self._saved_calibration()
                fresh_ids = ids is None
                if fresh_ids:
                    ids = build_calibration(tokenizer, self.config.vocab_size, self.s.cal_rows, self.s.cal_cols,
                                            self.s.seed, self.s.calibration)
            except TrellisError as e:  # still nothing written: fail before creating the job
                raise ConversionError(str(e)) from None
            (self.work / "qtensors").mkdir(parents=True, exist_ok=True)
            job = self.existing or {"version": JOB_VERSION, "fixed": self.s.fixed(), "fingerprint": self._fingerprint(),
                                    "done": 0, "reports": [], "seconds": 0.0}
            if not self.existing:
                for old in (self.work / "qtensors").glob("*.safetensors"):
                    old.unlink()
                _write_json_atomic(self.work / "job.json", job)
            if fresh_ids:
                _save_tensors_atomic(self.work / "calibration.safetensors", {"ids": ids})
            runner = ModelRunner(model)
            prior_seconds = job.get("seconds", 0.0)
            self.progress(ProgressEvent("start", job["done"], len(modules), elapsed_s=prior_seconds))
            bits = self._allocate(groups, units, runner, ids, device)
            avg_bits = average_bits(units, bits)
            states = None
            run_start = time.time()
            for idx, mod in enumerate(modules):
                path = self.work / "qtensors" / f"{idx:04d}.safetensors"
                if idx < job["done"]:
                    states = self._replay(runner, mod, states, ids, path, device)
                    continue
                t0 = time.time()
                tensors, storage, report, states = self._process(runner, store, mod, states, ids, bits, device, effort)
                _save_tensors_atomic(path, tensors, {"storage": json.dumps(storage)})
                report["seconds"] = round(time.time() - t0, 3)
                job["done"] = idx + 1
                job["reports"].append(report)
                job["seconds"] = prior_seconds + (time.time() - run_start)
                _write_json_atomic(self.work / "job.json", job)
                elapsed = time.time() - run_start
                eta = self._eta(modules, idx, elapsed, job)
                self.progress(ProgressEvent("module", idx + 1, len(modules), mod.key, round(prior_seconds + elapsed, 2), eta, report))
            self.progress(ProgressEvent("compile", len(modules), len(modules), elapsed_s=round(time.time() - t_start, 2)))
            # record the destination first: a crash right after the rename then resumes as "finished"
            job["compiled_to"] = str(self.out_dir.resolve())
            _write_json_atomic(self.work / "job.json", job)
            self._compile(modules, avg_bits, store)
        finally:
            store.close()
        if not self.s.keep_work:
            self._discard_work()
        self.progress(ProgressEvent("done", len(modules), len(modules), elapsed_s=round(time.time() - t_start, 2)))
        return self.out_dir

    def _eta(self, modules: list[_Module], idx: int, elapsed: float, job: dict) -> float | None:
        """Seconds left, assuming time is proportional to the number of quantized weights."""
        done_w = sum(m.numel for m in modules[: idx + 1])
        left_w = sum(m.numel for m in modules[idx + 1:])
        if not done_w:
            return None
        return round(job.get("seconds", elapsed) / done_w * left_w, 1)

    # -- calibration --------------------------------------------------------------------------

    def _saved_calibration(self) -> torch.Tensor | None:
        """The rows a resumed job started with (None for a new job or a torn file)."""
        path = self.work / "calibration.safetensors"
        if not (self.existing and path.exists()):
            return None
        try:
            return _load_tensors(path)[0]["ids"]
        except Exception:  # noqa: BLE001 - torn by a crash: rebuilding gives the same rows
            return None

    # -- per module ---------------------------------------------------------------------------

    def _chunks(self, n: int, device: torch.device) -> list[slice]:
        tokens_per_chunk = 16384 if device.type == "cuda" else 2048
        rows = max(1, tokens_per_chunk // self.s.cal_cols)
        return [slice(a, min(n, a + rows)) for a in range(0, n, rows)]

    def _state_device(self, device: torch.device) -> torch.device:
        """Keep the calibration stream on the GPU when it takes under a quarter of its memory."""
        if device.type != "cuda":
            return torch.device("cpu")
        need = self.s.cal_rows * self.s.cal_cols * self.config.hidden_size * 4
        total = torch.cuda.get_device_properties(device).total_memory
        return device if need < total // 4 else torch.device("cpu")

    def _src(self, store: TensorStore, name: str) -> torch.Tensor:
        return store.get(name)

    @staticmethod
    def _out_dtype(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype in (torch.bfloat16, torch.float16) else t.to(torch.float16)

    def _process(self, runner: ModelRunner, store: TensorStore, mod: _Module, states, ids, bits, device, effort):
        """Quantize/copy one module; returns (tensors, storage, report, new states)."""
        if mod.kind == "embed":
            name = f"{mod.key}.weight"
            t = self._out_dtype(self._src(store, name))
            states = torch.cat([runner.embed(ids[sl]).to(self._state_device(device)) for sl in self._chunks(ids.shape[0], device)])
            return {name: t}, [(mod.key, [name], {})], {"module": mod.key}, states
        if mod.kind == "norm":
            name = f"{mod.key}.weight"
            t = self._out_dtype(self._src(store, name))
            return {name: t}, [(mod.key, [name], {})], {"module": mod.key}, states
        if mod.kind == "layer":
            return self._process_layer(runner, store, mod, states, bits, device, effort)
        return self._process_head(runner, store, mod, states, device, effort)

    def _layer_norm_tensors(self, store: TensorStore, key: str):
        out = {}
        for n in LAYER_NORMS:
            name = f"{key}.{n}.weight"
            if name in store:
                out[f"{key}.{n}"] = (name, self._out_dtype(self._src(store, name)))
        return out

    def _capture(self, runner, i, states, device, qmaps, n_ref: int = 0):
        """Run layer i over all rows, accumulating the input Hessians of `qmaps`; returns them
        and the outputs of the first n_ref rows."""
        first: dict[str, str] = {}
        for slot in DECODER_SLOTS:
            if slot.qmap in qmaps:
                first.setdefault(slot.qmap, slot.name)
        hess: dict[str, HessianAccumulator] = {}
        hooks = []
        for qmap, name in first.items():
            lin = runner.linear(i, name)
            hess[qmap] = HessianAccumulator(pad_to_128(lin.in_features), device)
            hooks.append(lin.register_forward_pre_hook(lambda m, args, acc=hess[qmap]: acc.add(args[0])))
        refs = []
        try:
            for sl in self._chunks(states.shape[0], device):
                y = runner.run_layer(i, states[sl].to(device))
                if sl.start < n_ref:
                    refs.append(y[: n_ref - sl.start].cpu())
        finally:
            for h in hooks:
                h.remove()
        return {q: acc.finalize() for q, acc in hess.items()}, (torch.cat(refs)[:n_ref] if refs else None)

    def _process_layer(self, runner, store, mod, states, bits, device, effort):
        """Capture Hessians with the unquantized layer on the quantized stream, quantize, swap
        in, advance. With sequential="linear", each qmap's Hessian is captured after the
        linears before it in the layer are already quantized (GPTQ's "true sequential")."""
        i = mod.layer
        n_ref = min(NUM_REF_ROWS, states.shape[0])
        specs = []
        for slot in DECODER_SLOTS:
            key = f"{mod.key}.{slot.name}"
            w = self._src(store, f"{key}.weight")
            b = self._src(store, f"{key}.bias") if f"{key}.bias" in store else None
            specs.append(LinearSpec(key, w, bits[key], slot.qmap, b))
        qmaps = list(dict.fromkeys(slot.qmap for slot in DECODER_SLOTS))
        stages = [qmaps] if self.s.sequential == "module" else [[q] for q in qmaps]
        by_key = {}
        ref = None
        for stage in stages:
            H, r = self._capture(runner, i, states, device, stage, n_ref if ref is None else 0)
            ref = r if ref is None else ref
            part = [sp for sp in specs if sp.qmap in stage]
            for q in quantize_linears(part, H, self.s.codebook, self.s.seed, effort, device):
                by_key[q.key] = q
                self._swap_one(runner, i, q, device)
        qlins = [by_key[sp.key] for sp in specs]
        tensors, storage = self._layer_storage(store, mod.key, qlins)
        states = self._advance_layer(runner, i, states, device)
        got = states[:n_ref].cpu()
        report = {"module": mod.key, **_error_metrics(got, ref),
                  "linears": {q.key.rsplit(".", 1)[-1]: {"K": q.K, "proxy_err": round(q.proxy_err, 6), "scale": round(q.scale, 4)}
                              for q in qlins}}
        self.log(_format_report(report))
        return tensors, storage, report, states

    def _layer_storage(self, store, key, qlins: list[QuantizedLinear]):
        norms = self._layer_norm_tensors(store, key)
        by_name = {q.key: q for q in qlins}
        order = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj", "post_feedforward_layernorm"]
        tensors, storage = {}, []
        for part in order:
            leaf = f"{key}.{part}"
            if leaf in norms:
                name, t = norms[leaf]
                tensors[name] = t
                storage.append((leaf, [name], {}))
            elif leaf in by_name:
                q = by_name[leaf]
                ts = q.tensors()
                tensors.update(ts)
                storage.append((leaf, list(ts), _exl3_extra(q)))
        return tensors, storage

    def _swap_one(self, runner, i, q: QuantizedLinear, device):
        lin = runner.linear(i, q.key[len(f"{self.layout.prefix}layers.{i}."):])
        lin.weight = q.dense_weight(device).to(dtype=lin.weight.dtype)
        if q.bias is not None:
            lin.bias = q.bias[: q.out_features].to(device=device, dtype=lin.weight.dtype)

    def _swap_in(self, runner, i, qlins, device):
        for q in qlins:
            self._swap_one(runner, i, q, device)

    def _advance_layer(self, runner, i, states, device):
        out = torch.empty_like(states)
        for sl in self._chunks(states.shape[0], device):
            out[sl] = runner.run_layer(i, states[sl].to(device)).to(out.device)
        return out

    def _head_input(self, runner, states, device):
        return torch.cat([runner.final_norm(states[sl].to(device)).to(states.device) for sl in self._chunks(states.shape[0], device)])

    def _head_weight(self, store: TensorStore) -> torch.Tensor:
        name = f"{self.layout.head_key}.weight"
        if name in store:
            return self._src(store, name)
        if self.config.tie_word_embeddings:
            return self._src(store, f"{self.layout.prefix}embed_tokens.weight")[: self.config.vocab_size]
        raise ConversionError(f"tensor {name} is missing from {self.in_dir}")

    def _process_head(self, runner, store, mod, states, device, effort):
        x = self._head_input(runner, states, device)
        n_ref = min(NUM_REF_ROWS, x.shape[0])
        ref = torch.cat([runner.head_logits(x[r:r + 1].to(device)).cpu() for r in range(n_ref)])
        w = self._head_weight(store)
        hb = self.s.head_bits
        lin = runner.model.lm_head
        if hb == 16:
            p_out, p_in = pad_to_128(w.shape[0]), pad_to_128(w.shape[1])
            wt = torch.zeros(p_out, p_in, dtype=torch.float16)
            wt[: w.shape[0], : w.shape[1]] = w.to(torch.float16)
            name = f"{mod.key}.weight"
            tensors, storage = {name: wt}, [(mod.key, [name], {})]
            lin.weight = wt[: self.config.vocab_size, : self.config.hidden_size].to(device=device, dtype=lin.weight.dtype)
            report = {"module": mod.key, "K": 16}
        else:
            acc = HessianAccumulator(pad_to_128(w.shape[1]), device)
            for sl in self._chunks(x.shape[0], device):
                acc.add(x[sl].to(device))
            spec = LinearSpec(mod.key, w, hb, "head", None)
            (q,) = quantize_linears([spec], {"head": acc.finalize()}, self.s.codebook, self.s.seed, effort, device)
            tensors = q.tensors()
            storage = [(mod.key, list(tensors), _exl3_extra(q))]
            lin.weight = q.dense_weight(device)[: self.config.vocab_size].to(dtype=lin.weight.dtype)
            report = {"module": mod.key, "K": hb, "proxy_err": round(q.proxy_err, 6), "scale": round(q.scale, 4)}
        got = torch.cat([runner.head_logits(x[r:r + 1].to(device)).cpu() for r in range(n_ref)])
        report.update(_error_metrics(got, ref))
        self.log(_format_report(report))
        return tensors, storage, report, states

    def _replay(self, runner, mod: _Module, states, ids, path: Path, device):
        """Recompute the stream through a finished module from its saved tensors (resume)."""
        if mod.kind == "embed":
            return torch.cat([runner.embed(ids[sl]).to(self._state_device(device)) for sl in self._chunks(ids.shape[0], device)])
        if mod.kind != "layer":
            return states
        tensors, _ = _load_tensors(path)
        qlins = []
        for slot in DECODER_SLOTS:
            key = f"{mod.key}.{slot.name}"
            t = _exl3_from(tensors, key)
            lin = runner.linear(mod.layer, slot.name)
            qlins.append(QuantizedLinear(key, t.K, t.codebook, t.trellis, t.suh, t.svh, t.bias,
                                         lin.in_features, lin.out_features, 0.0, 1.0))
        self._swap_in(runner, mod.layer, qlins, device)
        return self._advance_layer(runner, mod.layer, states, device)

    # -- output -------------------------------------------------------------------------------

    def _out_name(self, name: str) -> str:
        """Source tensor/module name -> the name exllamav3 expects in the output."""
        if self.config.architecture not in OUTPUT_LAYOUTS:
            return name
        prefix, head = OUTPUT_LAYOUTS[self.config.architecture]
        if name == self.layout.head_key or name.startswith(self.layout.head_key + "."):
            return head + name[len(self.layout.head_key):]
        if name.startswith(self.layout.prefix):
            return prefix + name[len(self.layout.prefix):]
        return name

    def _vision_tensors(self, store: TensorStore) -> dict[str, torch.Tensor]:
        """Non-text tensors of a multimodal checkpoint, copied with data and dtype unchanged."""
        if self.config.architecture not in OUTPUT_LAYOUTS:
            return {}
        out = {}
        for name in store.keys():
            if name.startswith(self.layout.prefix) or name.startswith(self.layout.head_key + "."):
                continue
            new = name
            for a, b in VISION_RENAMES:
                new = new.replace(a, b) if a.startswith("mm_") else (b + new[len(a):] if new.startswith(a) else new)
            out[new] = store.get(name)
        return out

    def _compile(self, modules: list[_Module], avg_bits: float, store: TensorStore) -> None:
        parts: list[tuple[dict, list]] = []
        for idx in range(len(modules)):
            tensors, meta = _load_tensors(self.work / "qtensors" / f"{idx:04d}.safetensors")
            tensors = {self._out_name(k): v for k, v in tensors.items()}
            storage = [(self._out_name(leaf), [self._out_name(n) for n in names], extra)
                       for leaf, names, extra in json.loads(meta["storage"])]
            parts.append((tensors, storage))
        vision = self._vision_tensors(store)
        if vision:
            parts.append((vision, []))
        for stale in self.out_dir.parent.glob(f".{self.out_dir.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a job killed while compiling
        tmp = self.out_dir.with_name(f".{self.out_dir.name}.partial-{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            limit = max(1, int(self.s.shard_mb * (1 << 20)))
            shards: list[dict] = [{}]
            size = 0
            for tensors, _ in parts:
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                if shards[-1] and size + nbytes > limit:
                    shards.append({})
                    size = 0
                shards[-1].update(tensors)
                size += nbytes
            weight_map = {}
            names = ["model.safetensors"] if len(shards) == 1 else \
                [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            for name, shard in zip(names, shards):
                write_safetensors(tmp / name, shard)
                weight_map.update({k: name for k in shard})
            if len(shards) > 1:
                total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
                (tmp / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            qc = {"quant_method": "exl3", "version": QUANTIZER_VERSION, "bits": round(avg_bits, 2),
                  "head_bits": self.s.head_bits, "calibration": {"rows": self.s.cal_rows, "cols": self.s.cal_cols},
                  "out_scales": "always", "codebook": self.s.codebook, "quantizer": "trellis"}
            raw = json.loads((self.in_dir / "config.json").read_text())
            if isinstance(raw.get("quantization_config"), dict) and raw["quantization_config"].get("quant_method") != "exl3":
                qc["original_quantization_config"] = raw["quantization_config"]
            if "tied_word_embeddings" in raw:
                raw["tied_word_embeddings"] = True
            raw["quantization_config"] = qc
            (tmp / "config.json").write_text(json.dumps(raw, indent=4))
            storage = {}
            for tensors, entries in parts:
                for leaf, names_, extra in entries:
                    st = {n: {"shape": list(tensors[n].shape), "n_bytes": tensors[n].numel() * tensors[n].element_size(),
                              "dtype": str(tensors[n].dtype)} for n in names_}
                    storage[leaf] = {"stored_tensors": st, **extra}
            (tmp / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}, indent=4))
            for p in sorted(self.in_dir.iterdir()):
                if not p.is_file() or p.name == "config.json" or p.suffix == ".safetensors" \
                        or p.name.endswith(".safetensors.index.json") or p.suffix in PICKLE_SUFFIXES:
                    continue
                shutil.copy2(p, tmp / p.name)
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            if self.out_dir.exists():
                self.out_dir.rmdir()  # validated empty
            os.replace(tmp, self.out_dir)
            _fsync_dir(self.out_dir.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _exl3_extra(q: QuantizedLinear) -> dict:
    extra = {"quant_format": "exl3", "bits_per_weight": q.K}
    if q.codebook == "mul1":
        extra["mul1_multiplier"] = 0x83DCD12D
    elif q.codebook == "mcg":
        extra["mcg_multiplier"] = 0xCBAC1FED
    return extra


def _exl3_from(tensors: dict, key: str) -> EXL3Tensors:
    cb = "mcg" if f"{key}.mcg" in tensors else "mul1" if f"{key}.mul1" in tensors else "3inst"
    return EXL3Tensors(tensors[f"{key}.trellis"], tensors[f"{key}.suh"], tensors[f"{key}.svh"], cb,
                       tensors.get(f"{key}.bias"), key)


def _error_metrics(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.double().flatten(1), ref.double().flatten(1)
    err = (got - ref).norm(dim=1)
    rn = ref.norm(dim=1).clamp_min(1e-30)
    rfn = float((err / rn).mean())
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    sqnr = float((20 * torch.log10(rn / err.clamp_min(1e-30))).mean())
    return {"rfn": round(rfn, 6), "cos_err": round(float((1 - cos).mean()), 8), "sqnr_db": round(sqnr, 2)}


def _format_report(r: dict) -> str:
    lin = r.get("linears")
    parts = [f"{r['module']}: rfn {r.get('rfn', 0):.4f}  sqnr {r.get('sqnr_db', 0):.2f} dB"]
    if lin:
        parts.append("  ".join(f"{k}:K{v['K']} e{v['proxy_err']:.4f}" for k, v in lin.items()))
    return "  ".join(parts)
