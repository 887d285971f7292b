"""Which decode steps may chain their product links (engine/ops/chain.py), decided on the host: one
row always, 2..4 rows only where TRELLIS_CHAIN_ROWS asks and the finish kernel writes the links
(split finish 5), never more than the integer path's rows; and the int8 input a chain writes for
several rows has one set of steps and sums per row. The kernels themselves are tested on the GPU
(tests/test_chain_gpu.py)."""
import torch

from engine import ops
from engine.ops import chain


class _Ext:
    """The extension's split-finish setting, as the host code asks it."""

    def __init__(self, split: int):
        self.split = split
        self.asked = 0

    def split_finish_setting(self) -> int:
        self.asked += 1
        return self.split


def test_one_row_always_chains_without_asking_the_kernels(monkeypatch):
    ext = _Ext(4)
    monkeypatch.setattr(ops, "extension", lambda: ext)
    monkeypatch.setattr(ops, "CHAIN_ROWS", 1)
    assert chain._chain_rows(1)
    assert ext.asked == 0


def test_several_rows_chain_only_where_asked_and_through_the_finish_kernel(monkeypatch):
    ext = _Ext(5)
    monkeypatch.setattr(ops, "extension", lambda: ext)
    monkeypatch.setattr(ops, "INT8_MAX_ROWS", 4)
    monkeypatch.setattr(ops, "CHAIN_ROWS", 1)
    assert not any(chain._chain_rows(r) for r in (0, 2, 3, 4, 5))
    monkeypatch.setattr(ops, "CHAIN_ROWS", 3)
    assert [chain._chain_rows(r) for r in (2, 3, 4)] == [True, True, False]
    monkeypatch.setattr(ops, "CHAIN_ROWS", 4)
    assert [chain._chain_rows(r) for r in (2, 4, 5, 32)] == [True, True, False, False]
    ext.split = 4  # the in-warp chain writes one row
    assert not chain._chain_rows(2)
    monkeypatch.setattr(ops, "INT8_MAX_ROWS", 2)  # TRELLIS_INT8 narrower than the chain rows
    ext.split = 5
    assert [chain._chain_rows(r) for r in (2, 3)] == [True, False]


def test_a_prepared_input_of_several_rows_has_their_steps_and_sums():
    p = chain.PreparedInput.empty(3, 1024, torch.device("cpu"), normed=True, eps=1e-5, rows=4)
    assert p.rows == 4
    assert p.xb.shape == (3, 64, 1, 32, 4)  # one fragment group holds up to four rows
    assert p.scales.shape == (3, 4, 8, 2) and p.csum.shape == (3, 4, 8) and p.part.shape == (4, 8)
    one = chain.PreparedInput.empty(1, 1024, torch.device("cpu"))
    assert one.rows == 1 and one.part is None and one.scales.shape == (1, 1, 8, 2)
