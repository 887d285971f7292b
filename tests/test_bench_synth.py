"""The synthetic-model writer used by the speed benchmarks produces loadable, valid EXL3 files."""
import json

from bench.synth import SHAPES, write_synth_model
from engine.formats.exl3 import find_exl3
from engine.io.safetensors_io import TensorStore


def test_tiny_synthetic_model_is_valid_exl3(tmp_path):
    out = write_synth_model(tmp_path / "m", SHAPES["tiny"], bits=3.5, head_bits=6, shard_bytes=300_000)
    store = TensorStore(out)
    assert len(store.files) > 1  # sharded with an index
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    q = find_exl3(store, "model.layers.0.self_attn.q_proj")
    assert (q.K, q.codebook) == (4, "mul1")  # attention raised one bit above floor(3.5)
    assert find_exl3(store, "model.layers.1.mlp.down_proj").K == 3
    head = find_exl3(store, "lm_head")
    assert head.K == 6 and head.out_features == 512
    w = q.dense_weight()
    rms = w.pow(2).mean().sqrt().item()
    assert 0.5 * 256**-0.5 < rms < 2 * 256**-0.5
