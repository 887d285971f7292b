"""Open sums on the GPU (pytest -m gpu; engine/ops/open_sums.py): a product leaves its output as
split-k sums and the next product's prep finishes them as it reads them, against the same
products with their own output stage.

The finish is the same arithmetic in the same order as the output stage, so the two paths differ
only by the order of the fp32 split-k atomics (which differs from run to run anyway). Every case
also checks that the sums were read by a prep (not finished by value()) and that every workspace
is zero again afterwards: the reader's product zeroes what its prep read."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.ops import open_sums  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from tests.gpu_layers import replayed_logits, same_top, workspaces_zero  # noqa: E402
from tests.test_self_prep_gpu import rand_layer, rel_rms  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def open_on(monkeypatch):
    monkeypatch.setattr(ops, "OPEN_SUMS", open_sums.KINDS)
    monkeypatch.setattr(ops, "CHAIN", frozenset())


def _workspaces_zero():
    assert workspaces_zero()
    for c in ops._counters.values():
        assert int(c.abs().max()) == 0


def _read_by_prep(o: ops.OpenSums) -> bool:
    return o.region.read and o.region.finished is None


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n_in,n_out,K,bias", [(4096, 4096, 4, False), (1024, 2816, 2, True), (512, 640, 6, True)])
def test_open_output_finished_by_value_is_the_output_stage(rows, n_in, n_out, K, bias):
    t = rand_layer(n_in, n_out, K, n_in + n_out + K, bias=bias)
    x = torch.randn(rows, n_in, device=DEV).half()
    want = ops.exl3_gemm(x, t)
    o = ops.exl3_gemm(x, t, open_out=True)
    assert isinstance(o, ops.OpenSums) and o.shape == (rows, n_out)
    got = o.value()
    assert got.dtype == torch.float16 and got.shape == want.shape
    assert rel_rms(got, want) < 1e-3
    assert torch.equal(o.value(), got)  # finished once, then cached
    _workspaces_zero()


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("n,outs,K,bias", [(4096, (4096, 1024, 1024), 4, True), (1024, (2816, 2816), 4, False),
                                           (512, (384, 128), 6, True)])
def test_normed_group_reads_open_sums(rows, n, outs, K, bias):
    seed = n + sum(outs) + K + rows
    o = rand_layer(n, n, K, seed, bias=True)
    g = ops.join_linears([rand_layer(n, c, K, seed + 1 + i, bias=bias) for i, c in enumerate(outs)])
    w = (torch.rand(n, device=DEV) + 0.5).half()
    a = torch.randn(rows, 1, n, device=DEV).half()
    res = (torch.randn(rows, 1, n, device=DEV) * 8).half()
    plain = ops.PendingNorm(ops.exl3_gemm(a, o), w, 1e-5, res)
    want = ops.exl3_gemm_group(plain, g)
    a_open = ops.exl3_gemm(a, o, open_out=True)
    assert isinstance(a_open, ops.OpenSums)
    p = ops.PendingNorm(a_open, w, 1e-5, res)
    got = ops.exl3_gemm_group(p, g)
    assert _read_by_prep(a_open)
    assert rel_rms(p.sum.float(), plain.sum.float()) < 1e-3  # the residual stream
    for y, z in zip(got, want):
        assert y.shape == z.shape and rel_rms(y.reshape(rows, -1), z.reshape(rows, -1)) < 2e-3
    ref = fmt.exl3_matmul_reference(ops.rms_norm(plain.sum, w, 1e-5).float(), g.members[0])
    assert rel_rms(got[0].reshape(rows, -1), ref.reshape(rows, -1)) < 3e-3
    _workspaces_zero()


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("hidden,inter,K", [(1024, 2816, 4), (4096, 14336, 4), (640, 384, 6)])
def test_gated_down_reads_open_gate_up(rows, act, hidden, inter, K):
    seed = hidden + inter + K + rows
    g = ops.join_linears([rand_layer(hidden, inter, K, seed), rand_layer(hidden, inter, K, seed + 1, bias=True)])
    down = rand_layer(inter, hidden, K, seed + 2, bias=True)
    x = torch.randn(rows, hidden, device=DEV).half()
    gy, uy = ops.exl3_gemm_group(x, g)
    want = ops.exl3_gemm(gy, down, up=uy, act=act)
    go, uo = ops.exl3_gemm_group(x, g, open_out=True)
    assert isinstance(go, ops.OpenSums) and go.region is uo.region
    got = ops.exl3_gemm(go, down, up=uo, act=act)
    assert _read_by_prep(go)
    assert rel_rms(got, want) < 1e-3
    _workspaces_zero()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_layer_of_open_sums(rows):
    """o -> norm -> gate/up -> act -> down -> norm -> q/k/v, every output open where it can be,
    against the same layer with every product's own output stage."""
    n, inter, K = 1024, 2816, 4
    o = rand_layer(n, n, K, 1, bias=True)
    gu = ops.join_linears([rand_layer(n, inter, K, 2), rand_layer(n, inter, K, 3)])
    down = rand_layer(inter, n, K, 4)
    qkv = ops.join_linears([rand_layer(n, n, K, 5), rand_layer(n, 256, K, 6), rand_layer(n, 256, K, 7)])
    w1, w2 = ((torch.rand(n, device=DEV) + 0.5).half() for _ in range(2))
    attn = torch.randn(rows, n, device=DEV).half()
    res = (torch.randn(rows, n, device=DEV) * 4).half()

    def layer(open_out: bool):
        a = ops.exl3_gemm(attn, o, open_out=open_out)
        h = ops.PendingNorm(a, w1, 1e-5, res)
        gate, up = ops.exl3_gemm_group(h, gu, open_out=open_out)
        d = ops.exl3_gemm(gate, down, up=up, open_out=open_out)
        h2 = ops.PendingNorm(d, w2, 1e-5, ops.as_sum(h))
        return (a, gate, d), ops.exl3_gemm_group(h2, qkv), ops.as_sum(h2)

    _, want, want_res = layer(False)
    opened, got, got_res = layer(True)
    assert all(isinstance(v, ops.OpenSums) and _read_by_prep(v) for v in opened)
    # the residual stream is fp16 sums of products whose split-k atomics add in a different order
    # each run: a last-bit flip per element is up to ~1e-3 relative (once measured 1.1e-3 at 3 rows)
    assert rel_rms(got_res.float(), want_res.float()) < 2e-3
    for y, z in zip(got, want):
        assert rel_rms(y.float(), z.float()) < 2e-3
    _workspaces_zero()


def test_open_sums_are_read_once():
    t, t2 = rand_layer(512, 512, 4, 11), rand_layer(512, 512, 4, 12)
    x = torch.randn(1, 512, device=DEV).half()
    o = ops.exl3_gemm(x, t, open_out=True)
    ops.exl3_gemm(o, t2)
    with pytest.raises(RuntimeError, match="read once"):
        o.value()
    # a reader that cannot take open sums finishes them instead (the torch reference here)
    o2 = ops.exl3_gemm(x, t, open_out=True)
    ref = ops.exl3_gemm(o2, t2, mode="torch")
    assert o2.region.finished is not None
    assert rel_rms(ref.float(), fmt.exl3_matmul_reference(ops.exl3_gemm(x, t).float(), t2)) < 2e-3
    _workspaces_zero()


def test_unread_open_sums_do_not_leak_into_the_next_product():
    t = rand_layer(1024, 1024, 4, 21)
    x = torch.randn(1, 1024, device=DEV).half()
    want = ops.exl3_gemm(x, t)
    o = ops.exl3_gemm(x, t, open_out=True)
    buf = o.region.buffer.data_ptr()
    del o
    gc.collect()
    assert buf in open_sums.POOL.dirty
    for _ in range(3):  # whichever buffer the next products take, they start from zero
        assert rel_rms(ops.exl3_gemm(x, t), want) < 1e-3
        o = ops.exl3_gemm(x, t, open_out=True)
        assert rel_rms(o.value(), want) < 1e-3
    _workspaces_zero()


def test_open_sums_stay_off_where_they_cannot_serve(monkeypatch):
    t = rand_layer(512, 640, 4, 31)
    x9 = torch.randn(9, 512, device=DEV).half()
    assert not isinstance(ops.exl3_gemm(x9, t, open_out=True), ops.OpenSums)  # the per-warp kernel's rows only
    monkeypatch.setattr(ops, "OPEN_SUMS", frozenset())
    assert not isinstance(ops.exl3_gemm(x9[:1], t, open_out=True), ops.OpenSums)
    assert not isinstance(ops.open_linear(x9[:1], t, 640), ops.OpenSums)
    monkeypatch.setattr(ops, "OPEN_SUMS", frozenset({"gated"}))
    assert not isinstance(ops.open_linear(x9[:1], t, 640), ops.OpenSums)  # a normed reader's kind
    monkeypatch.setattr(ops, "OPEN_SUMS", open_sums.KINDS)
    o = ops.open_linear(x9[:1], t, 640)
    assert isinstance(o, ops.OpenSums)
    o.value()
    assert not isinstance(ops.open_linear(x9[:1], t, 600), ops.OpenSums)  # a trimmed output
    _workspaces_zero()


def test_graph_decode_with_open_sums(ref_fixtures, monkeypatch):
    """The fixture model's replayed decode steps leave outputs open (o_proj, gate/up, down) and
    give the logits of the same steps without open sums."""
    from engine.models import load_model

    model = load_model(ref_fixtures / "exl3" / "llama-4.0bpw-mul1-h6", device="cuda")
    made = []
    real = open_sums.wrap
    monkeypatch.setattr(open_sums, "wrap", lambda *a, **k: made.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=g).cuda()
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(ops, "OPEN_SUMS", open_sums.KINDS if on else frozenset())
        made.clear()
        logits[on] = replayed_logits(model, ids)
        assert bool(made) == on
    for a, b in zip(logits[True], logits[False]):
        assert rel_rms(a.float(), b.float()) < 1e-2
        assert same_top(a, b)
    _workspaces_zero()
