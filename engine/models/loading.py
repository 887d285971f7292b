"""Turning stored tensors into modules: dense or EXL3 linears, norms, embeddings.

Each linear is detected on its own (spec §1.8), so a checkpoint may mix EXL3 and plain layers.
Shape checks happen here, against the sizes config.json implies, so a mismatched file fails at
load with the tensor's name instead of deep inside a matmul.
"""
from __future__ import annotations

import torch

from engine.errors import FormatError, ModelLoadError
from engine.formats.exl3 import find_exl3, pad_to_128
from engine.io.safetensors_io import DTYPES, TensorStore
from engine.models.layers import DenseLinear, QuantLinear, RMSNorm


class WeightLoader:
    """Reads named tensors from a TensorStore onto one device in one compute dtype."""

    def __init__(self, store: TensorStore, device: torch.device, dtype: torch.dtype):
        self.store = store
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.store

    def require(self, name: str, why: str = "") -> None:
        if name not in self.store:
            raise ModelLoadError(f"tensor {name} is missing from {self.store.dir}{why}")

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.require(name)
        return self.store.get(name).to(device=self.device, dtype=dtype or self.dtype)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype on disk (the compute dtype may differ)."""
        return DTYPES[self.store.dtype_str(name)][0]

    def _check_shape(self, name: str, want: tuple[int, ...]) -> None:
        got = tuple(self.store.shape(name))
        if got != want:
            raise FormatError(f"tensor {name} has shape {list(got)} but config.json implies {list(want)}")

    def norm(self, key: str, size: int, eps: float, unit_offset: bool = False) -> RMSNorm:
        name = f"{key}.weight"
        self.require(name)
        self._check_shape(name, (size,))
        return RMSNorm(self.tensor(name), eps, unit_offset)

    def embedding(self, key: str, vocab_size: int, hidden: int) -> torch.Tensor:
        """The token embedding table; it may have more rows than vocab_size, never fewer."""
        name = f"{key}.weight"
        self.require(name)
        shape = tuple(self.store.shape(name))
        if len(shape) != 2 or shape[1] != hidden or shape[0] < vocab_size:
            raise FormatError(f"tensor {name} has shape {list(shape)} but config.json implies [{vocab_size}, {hidden}]")
        return self.tensor(name)

    def is_quantized(self, key: str) -> bool:
        return f"{key}.trellis" in self.store

    def linear(self, key: str, in_features: int, out_features: int, bias: bool = False) -> DenseLinear:
        """EXL3 if `<key>.trellis` is there, else a dense `<key>.weight` (HF [out, in] layout).

        `bias=True` makes a missing `<key>.bias` an error; a bias that is present is always used.
        """
        exl3 = find_exl3(self.store, key)
        if exl3 is not None:
            exl3.check_shape(in_features, out_features)
            if bias and exl3.bias is None:
                self.require(f"{key}.bias")
            return QuantLinear(exl3.to(self.device), in_features, out_features, self.dtype)

        name = f"{key}.weight"
        self.require(name)
        shape = tuple(self.store.shape(name))
        padded = (pad_to_128(out_features), pad_to_128(in_features))
        if shape not in ((out_features, in_features), padded):
            raise FormatError(f"tensor {name} has shape {list(shape)} but config.json implies "
                              f"[{out_features}, {in_features}]")
        weight = self.tensor(name)[:out_features, :in_features].contiguous()
        b = None
        if f"{key}.bias" in self.store:
            b = self.tensor(f"{key}.bias")[:out_features].contiguous()
        elif bias:
            self.require(f"{key}.bias")
        return DenseLinear(weight, b)

    def head(self, head_key: str, embedding: torch.Tensor, hidden: int, vocab_size: int,
             tied: bool) -> DenseLinear:
        """The output projection, trimmed to `vocab_size` rows.

        Order (spec §1.6): a quantized head wins even when config.json says tied, because EXL3
        converters quantize a copy of the embedding as `lm_head`; then a tied config uses the
        embedding; otherwise a dense `<head_key>.weight` must exist.
        """
        if self.is_quantized(head_key):
            return self.linear(head_key, hidden, vocab_size)
        if tied:
            return DenseLinear(embedding[:vocab_size])
        name = f"{head_key}.weight"
        self.require(name, " (config.json says the head is not tied to the embedding)")
        shape = tuple(self.store.shape(name))
        if len(shape) != 2 or shape[0] < vocab_size or shape[1] not in (hidden, pad_to_128(hidden)):
            raise FormatError(f"tensor {name} has shape {list(shape)} but config.json implies [{vocab_size}, {hidden}]")
        return DenseLinear(self.tensor(name)[:vocab_size, :hidden].contiguous())
