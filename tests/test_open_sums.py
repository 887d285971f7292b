"""The bookkeeping of open sums (engine/ops/open_sums.py) on the CPU: which workspace a product
gets while another product's sums are unread, and what happens to sums nobody reads. (The kernels
that write and read them: tests/test_open_sums_gpu.py.)"""
from __future__ import annotations

import gc

import pytest
import torch

from engine.ops import open_sums
from engine.ops.open_sums import Region, WorkspacePool

CPU = torch.device("cpu")


def test_pool_never_hands_out_a_buffer_with_unread_sums():
    pool = WorkspacePool(least=64)
    a = pool.get(CPU, 16)
    assert a.numel() == 64 and not a.any()
    assert pool.get(CPU, 16).data_ptr() == a.data_ptr()  # free again: the same buffer
    pool.hold(a)
    b = pool.get(CPU, 16)
    assert b.data_ptr() != a.data_ptr()
    assert pool.get(CPU, 16, avoid=b).data_ptr() not in (a.data_ptr(), b.data_ptr())  # a third
    pool.release(a.data_ptr())
    assert pool.get(CPU, 16, avoid=b).data_ptr() == a.data_ptr()


def test_pool_zeroes_a_dirty_buffer_before_reuse_and_grows_small_ones():
    pool = WorkspacePool(least=8)
    a = pool.get(CPU, 8)
    pool.hold(a)
    a.fill_(3.0)  # sums written, then dropped unread
    pool.release(a.data_ptr(), dirty=True)
    again = pool.get(CPU, 8)
    assert again.data_ptr() == a.data_ptr() and not again.any()
    big = pool.get(CPU, 100)
    assert big.numel() == 100 and not big.any()


def test_region_is_read_once_and_releases_its_buffer(monkeypatch):
    pool = WorkspacePool(least=32)
    monkeypatch.setattr(open_sums, "POOL", pool)
    buf = pool.get(CPU, 32)
    z = buf[:32].view(2, 16)
    r = Region(z, torch.ones(16).half(), None, buf)
    assert buf.data_ptr() in pool.held
    r.mark_read()
    assert buf.data_ptr() not in pool.held and buf.data_ptr() not in pool.dirty
    with pytest.raises(RuntimeError, match="read once"):
        r.mark_read()


def test_unread_region_leaves_its_buffer_dirty(monkeypatch):
    pool = WorkspacePool(least=32)
    monkeypatch.setattr(open_sums, "POOL", pool)
    buf = pool.get(CPU, 32)
    r = Region(buf[:32].view(2, 16), torch.ones(16).half(), None, buf)
    buf.fill_(1.0)
    del r
    gc.collect()
    assert buf.data_ptr() not in pool.held and buf.data_ptr() in pool.dirty
    assert not pool.get(CPU, 32).any()


def test_open_sums_views_of_one_region():
    pool_buf = torch.zeros(64)
    z = pool_buf[:48].view(2, 24)
    z.copy_(torch.arange(48.0).view(2, 24))
    svh = torch.arange(24).half()
    bias = -torch.arange(24).half()
    gate, up = open_sums.wrap(z, svh, bias, pool_buf, [(0, 12), (12, 24)], (2,), torch.float16)
    assert gate.region is up.region and gate.shape == (2, 12) and up.shape == (2, 12)
    assert torch.equal(up.sums(), z[:, 12:])
    s, b = up.post()
    assert torch.equal(s, svh[12:]) and torch.equal(b, bias[12:])
    assert open_sums.readable(gate, up, 12) and not open_sums.readable(gate, up, 24)
    xs, us, post, zero = open_sums.take(gate, up)
    assert torch.equal(xs, z[:, :12]) and torch.equal(us, z[:, 12:]) and len(post) == 4
    assert zero.numel() == 48 and zero.data_ptr() == pool_buf.data_ptr()
    assert not open_sums.readable(gate, None, 12)  # read
