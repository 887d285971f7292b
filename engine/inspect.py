"""What a model folder is: architecture, parameter count, real bits per weight, head bits,
codebooks, file sizes, vision or not.

Torch-free on purpose: the desktop app imports this to describe models in its library, and the
app never imports torch. Safetensors headers are read directly (8-byte length + JSON), so
inspecting a 70B model reads a few hundred kilobytes, never the weights.

Bits per weight are computed from the tensors, not taken from `quantization_config.bits`
(which excludes the head and can be stale after re-compiles): for each EXL3 linear K comes from
the trellis shape ([in/16, out/16, 16·K]).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import ConfigError, FormatError, ModelLoadError
from engine.io.json_files import read_json_object
from engine.io.safetensors_header import read_header, weight_files

DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "U16": 16,
              "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8}
EXL3_AUX_SUFFIXES = (".suh", ".svh", ".su", ".sv", ".mcg", ".mul1")
VISION_PREFIXES = ("vision_tower.", "visual.", "vision_model.", "multi_modal_projector.",
                   "model.vision_tower.", "model.visual.", "model.multi_modal_projector.")


@dataclass
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class FileInfo:
    name: str
    bytes: int


@dataclass
class ModelInfo:
    path: str
    architecture: str | None
    model_type: str | None
    parameters: int                     # logical weights (EXL3 linears count in·out, padded dims)
    quantized: bool
    quant_method: str | None
    bpw: float | None                   # trellis bits / weights over the decoder linears (no head)
    bpw_with_scales: float | None       # the same including suh/svh/bias/marker bytes
    head_bits: float | None             # K of a quantized head, dtype bits of a dense one
    head: str                           # "exl3" | "dense" | "tied" (uses the embedding) | "none"
    codebooks: list[str]
    bits_histogram: dict[str, int]      # K → number of EXL3 linears (head excluded)
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    context_length: int | None
    vision: bool
    weights_bytes: int
    total_bytes: int
    files: list[FileInfo] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def read_safetensors_header(path: Path) -> list[TensorHeader]:
    """Tensor names, dtypes and shapes of one file, checked against the file size."""
    entries, _ = read_header(path)
    return [TensorHeader(name, e.dtype, e.shape, path.name, e.nbytes) for name, e in entries.items()]


def _weight_files(model_dir: Path) -> list[Path]:
    files = weight_files(model_dir)
    if not files:
        raise ModelLoadError(f"no .safetensors files in {model_dir}")
    return files


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json")
    return read_json_object(path)


def _is_head(key: str) -> bool:
    return key == "lm_head" or key.endswith(".lm_head")


def _is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def has_vision(config: dict, tensor_names=()) -> bool:
    """A vision tower in the config or in the weights (checkpoints differ in which they show)."""
    return isinstance(config.get("vision_config"), dict) or any(_is_vision(n) for n in tensor_names)


def inspect_model(model_dir: str | Path) -> ModelInfo:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder not found: {model_dir}")
    config = _read_config(model_dir)
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def cfg(key):
        return config.get(key, text_cfg.get(key))

    tensors: dict[str, TensorHeader] = {}
    for path in _weight_files(model_dir):
        for t in read_safetensors_header(path):
            tensors[t.name] = t

    # EXL3 linears, detected per tensor (format spec 1.8) and validated like a loader would.
    exl3: dict[str, tuple[int, int, int, str]] = {}   # key → (in, out, K, codebook)
    for name, t in tensors.items():
        if not name.endswith(".trellis"):
            continue
        key = name[: -len(".trellis")]
        if not ((key + ".suh" in tensors or key + ".su" in tensors) and (key + ".svh" in tensors or key + ".sv" in tensors)):
            continue
        if len(t.shape) != 3 or t.shape[2] % 16 or not 1 <= t.shape[2] // 16 <= 8:
            raise FormatError(f"{key}.trellis has shape {list(t.shape)}; expected [in/16, out/16, 16*K] with K in 1..8")
        has_mcg, has_mul1 = key + ".mcg" in tensors, key + ".mul1" in tensors
        if has_mcg and has_mul1:
            raise FormatError(f"{key} has both .mcg and .mul1 codebook markers; a tensor uses exactly one codebook")
        codebook = "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"
        in_f, out_f = t.shape[0] * 16, t.shape[1] * 16
        if key + ".suh" in tensors and tensors[key + ".suh"].shape != (in_f,):
            raise FormatError(f"{key}.suh has shape {list(tensors[key + '.suh'].shape)}; the trellis says [{in_f}]")
        if key + ".svh" in tensors and tensors[key + ".svh"].shape != (out_f,):
            raise FormatError(f"{key}.svh has shape {list(tensors[key + '.svh'].shape)}; the trellis says [{out_f}]")
        exl3[key] = (in_f, out_f, t.shape[2] // 16, codebook)

    tied = bool(cfg("tie_word_embeddings") if cfg("tie_word_embeddings") is not None else config.get("tied_word_embeddings", False))
    parameters = 0
    for name, t in tensors.items():
        key, _, suffix = name.rpartition(".")
        if key in exl3 and "." + suffix in EXL3_AUX_SUFFIXES:
            continue
        if key in exl3 and suffix == "trellis":
            if _is_head(key) and tied:
                continue  # the quantized copy of a tied embedding is not a parameter of its own
            parameters += exl3[key][0] * exl3[key][1]
        else:
            parameters += t.numel

    # Decoder linears: EXL3 keys plus dense 2-D `.weight`s of the text model that are not
    # embeddings or the head (norms are 1-D and drop out by themselves).
    bits = weights = overhead_bits = 0
    histogram: dict[str, int] = {}
    for key, (in_f, out_f, k, _) in exl3.items():
        if _is_head(key):
            continue
        bits += in_f * out_f * k
        weights += in_f * out_f
        overhead_bits += sum(tensors[key + s].nbytes * 8 for s in (".suh", ".svh", ".su", ".sv", ".mcg", ".mul1", ".bias")
                             if key + s in tensors)
        histogram[str(k)] = histogram.get(str(k), 0) + 1
    for name, t in tensors.items():
        key = name[: -len(".weight")] if name.endswith(".weight") else None
        if key is None or len(t.shape) != 2 or key in exl3 or _is_head(key) or "embed" in key or _is_vision(name):
            continue
        bits += t.numel * DTYPE_BITS.get(t.dtype, 16)
        weights += t.numel
    bpw = round(bits / weights, 4) if weights else None
    bpw_with_scales = round((bits + overhead_bits) / weights, 4) if weights else None

    head_key = next((k for k in exl3 if _is_head(k)), None)
    dense_head = next((n for n in tensors if n.endswith("lm_head.weight")), None)
    if head_key is not None:
        head, head_bits = "exl3", float(exl3[head_key][2])
    elif dense_head is not None:
        head, head_bits = "dense", float(DTYPE_BITS.get(tensors[dense_head].dtype, 16))
    else:
        embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        head = "tied" if embed is not None else "none"
        head_bits = float(DTYPE_BITS.get(tensors[embed].dtype, 16)) if embed else None

    qcfg = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    files = sorted((FileInfo(p.name, p.stat().st_size) for p in model_dir.iterdir() if p.is_file()),
                   key=lambda f: f.name)
    weight_names = {t.file for t in tensors.values()}
    archs = config.get("architectures")
    return ModelInfo(
        path=str(model_dir),
        architecture=archs[0] if isinstance(archs, list) and archs else None,
        model_type=config.get("model_type"),
        parameters=parameters,
        quantized=bool(exl3) or bool(qcfg),
        quant_method=qcfg.get("quant_method") if qcfg else ("exl3" if exl3 else None),
        bpw=bpw,
        bpw_with_scales=bpw_with_scales,
        head_bits=head_bits,
        head=head,
        codebooks=sorted({cb for (_, _, _, cb) in exl3.values()}),
        bits_histogram=dict(sorted(histogram.items())),
        num_layers=cfg("num_hidden_layers"),
        hidden_size=cfg("hidden_size"),
        vocab_size=cfg("vocab_size"),
        context_length=cfg("max_position_embeddings"),
        vision=has_vision(config, tensors),
        weights_bytes=sum(f.bytes for f in files if f.name in weight_names),
        total_bytes=sum(f.bytes for f in files),
        files=files,
    )


def format_model_info(info: ModelInfo) -> str:
    """Human-readable summary for `trellis inspect` without --json."""
    gib = info.total_bytes / 2**30
    lines = [
        f"model:        {info.path}",
        f"architecture: {info.architecture} ({info.model_type})",
        f"parameters:   {info.parameters:,}",
        f"quantized:    {'yes, ' + str(info.quant_method) if info.quantized else 'no'}",
        f"bpw:          {info.bpw} (with scales {info.bpw_with_scales})",
        f"head:         {info.head}, {info.head_bits} bits",
        f"codebooks:    {', '.join(info.codebooks) or '-'}",
        f"layers:       {info.num_layers}, hidden {info.hidden_size}, vocab {info.vocab_size}, context {info.context_length}",
        f"vision:       {'yes' if info.vision else 'no'}",
        f"size:         {info.total_bytes:,} bytes ({gib:.2f} GiB), weights {info.weights_bytes:,}",
    ]
    return "\n".join(lines)
