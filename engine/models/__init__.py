"""Model families and `load_model`: a model folder in, a ready `CausalLM` out.

The registry maps HF `architectures[0]` to the class that runs it and to where its text-model
tensors live. Multimodal checkpoints keep the language model under a prefix, and different
writers (exllamav3, transformers 4.x, transformers 5.x) chose different ones, so each
architecture lists candidates and the first whose embedding exists wins.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import ConfigError, ModelLoadError
from engine.io.hf_config import ModelConfig, load_model_config
from engine.io.safetensors_io import TensorStore
from engine.models.base import CausalLM
from engine.models.decoder import DecoderLM
from engine.models.gemma import GemmaLM
from engine.models.layers import fuse_projections
from engine.models.loading import WeightLoader

__all__ = ["CausalLM", "ModelConfig", "load_model", "MODEL_CLASSES", "TENSOR_LAYOUTS", "SUPPORTED_ARCHITECTURES"]


@dataclass(frozen=True)
class TensorLayout:
    """Where a text model's tensors are: `<prefix>embed_tokens`, `<prefix>layers.N...`, `<head>`."""

    prefix: str
    head_key: str


MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
    "Qwen2_5_VLForConditionalGeneration": DecoderLM,
    "Gemma2ForCausalLM": GemmaLM,
    "Gemma3ForCausalLM": GemmaLM,
    "Gemma3ForConditionalGeneration": GemmaLM,
}

_PLAIN = (TensorLayout("model.", "lm_head"),)
TENSOR_LAYOUTS: dict[str, tuple[TensorLayout, ...]] = {
    # exllamav3 writes `language_model.model.*` + `language_model.lm_head`; transformers 5 saves
    # `model.language_model.*` + `lm_head`.
    "Gemma3ForConditionalGeneration": (TensorLayout("language_model.model.", "language_model.lm_head"),
                                       TensorLayout("model.language_model.", "lm_head")),
    # exllamav3 (spec pitfall 11b) and older saves use the plain layout; newer transformers nests.
    "Qwen2_5_VLForConditionalGeneration": (TensorLayout("model.", "lm_head"),
                                           TensorLayout("model.language_model.", "lm_head")),
    # Spec pitfall 11a: upstream may build text-only Gemma 3 keys with a leading dot.
    "Gemma3ForCausalLM": (TensorLayout("model.", "lm_head"), TensorLayout(".model.", ".lm_head")),
}

SUPPORTED_ARCHITECTURES = tuple(sorted(MODEL_CLASSES))

# q/k/v and gate/up of compressed EXL3 layers computed as one grouped product each (on by default;
# TRELLIS_GROUP=0 keeps one product per linear).
GROUPED_PRODUCTS = os.environ.get("TRELLIS_GROUP", "1") != "0"


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def find_layout(store: TensorStore, architecture: str) -> TensorLayout:
    candidates = TENSOR_LAYOUTS.get(architecture, _PLAIN)
    for layout in candidates:
        if f"{layout.prefix}embed_tokens.weight" in store:
            return layout
    raise ModelLoadError(f"tensor {candidates[0].prefix}embed_tokens.weight is missing from {store.dir}")


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               progress: Callable[[int, int], None] | None = None) -> CausalLM:
    """Load a model folder (HF dense or EXL3, detected per tensor) for inference.

    dtype None → fp32 on CPU, fp16 on CUDA. `progress(done, total)` is called as parts load
    (total = layers + 2: embedding, each layer, head). EXL3 linears are reconstructed to dense
    weights here on the torch path, which is where most of the load time goes.
    """
    config = load_model_config(model_dir)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"invalid device {device!r}") from e
    dtype = dtype or default_dtype(device)
    store = TensorStore(model_dir)
    try:
        layout = find_layout(store, config.architecture)
        loader = WeightLoader(store, device, dtype)
        model = MODEL_CLASSES[config.architecture](config, loader, layout.prefix, layout.head_key, progress)
    finally:
        store.close()
    if GROUPED_PRODUCTS:
        fuse_projections(model)  # q/k/v and gate/up as one product each where the GPU kernels run
    return model.eval()
