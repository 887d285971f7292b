"""q/k/v sums into decode attention on the GPU (pytest -m gpu; engine/ops/chain.py, AttentionSums):
the q/k/v product of a decode step leaves its split-k sums, and the attention kernel applies the
output transform to the rows it reads, where gv_finish_chain_kernel used to write q, k and v.

- the kernel: the same bits as attention over the rows the finish kernel writes (finish_sums),
  for the output, the cache rows it writes and o_proj's input; the sums stay until o_proj's
  product zeroes them.
- whole models: decode with the sums against decode with the finish kernel, and the fallback
  (attention declines the sums, finish_sums writes q, k and v) against both."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from engine.ops import chain, open_sums  # noqa: E402
from tests.gpu_layers import kernel_names, workspaces_zero  # noqa: E402
from tests.test_self_prep_gpu import rand_layer, rel_rms  # noqa: E402

DEV = torch.device("cuda")
D = 128


@pytest.fixture
def chains(monkeypatch):
    monkeypatch.setattr(ops, "CHAIN", chain.LINKS)
    monkeypatch.setattr(ops, "ATTN_QKV_SUMS", True)


def _sums_case(heads: int, kv_heads: int, bias: bool, normed: bool, seed: int):
    """Random q/k/v sums of one row: (z, svh, bias, part, eps), in = 1024 for the part."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out_f = (heads + 2 * kv_heads) * D
    z = torch.randn(1, out_f, generator=g, device=DEV) * 3
    svh = (torch.rand(out_f, generator=g, device=DEV) + 0.5).half()
    b = (torch.randn(out_f, generator=g, device=DEV) / 4).half() if bias else None
    part = (torch.rand(1, 8, generator=g, device=DEV) * 200 + 10) if normed else None
    return z, svh, b, part, 1e-5


def _views(y: torch.Tensor, heads: int, kv_heads: int):
    """q [1, 1, H, D], k, v [1, 1, Hkv, D] as views of a [1, out] row (the grouped product's order)."""
    q = y[:, :heads * D].view(1, 1, heads, D)
    k = y[:, heads * D:(heads + kv_heads) * D].view(1, 1, kv_heads, D)
    v = y[:, (heads + kv_heads) * D:].view(1, 1, kv_heads, D)
    return q, k, v


def _cache(kv_heads: int, slots: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    keys = torch.randn(1, kv_heads, slots, D, generator=g, device=DEV).half()
    values = torch.randn(1, kv_heads, slots, D, generator=g, device=DEV).half()
    ang = torch.rand(D // 2, generator=g, device=DEV) * 6
    cos = torch.cat([ang.cos(), ang.cos()]).half().view(1, D)
    sin = torch.cat([ang.sin(), ang.sin()]).half().view(1, D)
    return keys, values, cos, sin


@pytest.mark.parametrize("bias,normed", [(False, True), (True, True), (True, False)])
def test_finish_sums_is_the_output_transform(bias, normed):
    z, svh, b, part, eps = _sums_case(8, 2, bias, normed, 7)
    y = torch.empty(1, z.shape[1], device=DEV).half()
    zz = z.clone()
    ops.extension().finish_sums(zz, y, svh, b, part, eps)
    assert float(zz.abs().max()) == 0.0  # left zero, as the finish kernel leaves the workspace
    inv = float(torch.rsqrt(part.sum() / 1024 + eps)) if normed else 1.0
    want = (fmt.hadamard128(z) * inv).half() * svh
    if b is not None:
        want = want + b
    assert rel_rms(y.float(), want.float()) < 2e-3
    if not normed:  # had128 does the same operations in the same order
        assert torch.equal(y, ops.extension().had128(z.clone(), None, svh, b))


@pytest.mark.parametrize("heads,kv_heads,slots,pos", [(32, 8, 300, 200), (4, 2, 17, 16), (8, 8, 1000, 3), (28, 4, 64, 40)])
@pytest.mark.parametrize("bias,normed", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("walk", ["mma", "scalar"])
def test_attention_on_sums_is_attention_on_the_finished_rows(chains, heads, kv_heads, slots, pos, bias, normed, walk,
                                                             request):
    """decode_attention with q/k/v sums against decode_attention over the rows finish_sums writes:
    the output, the cache rows (the token's RoPE'd k and its v) and o_proj's input bit for bit;
    the sums stay until o_proj's product zeroes them, and nothing reads the stand-in."""
    ext = ops.extension()
    if walk == "scalar":
        ext.set_attn_mma_slots(0)
        request.addfinalizer(lambda: ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS))
    z, svh, b, part, eps = _sums_case(heads, kv_heads, bias, normed, heads + slots)
    mask = torch.zeros(1, slots, device=DEV).half()
    mask[0, pos + 1:] = float("-inf")
    position = torch.tensor([pos], device=DEV)
    scale = 1 / math.sqrt(D)
    o = rand_layer(heads * D, 1024, 4, heads, bias=True)

    y = torch.empty(1, z.shape[1], device=DEV).half()
    ext.finish_sums(z.clone(), y, svh, b, part, eps)
    keys_a, values_a, cos, sin = _cache(kv_heads, slots, slots)
    q, k, v = _views(y, heads, kv_heads)
    rope_a = ops.PendingRope(q.transpose(1, 2), keys_a, values_a, k, v, cos, sin, position)
    assert rope_a.serves(mask)
    out_a, d_a = ops.attention_into_chain(rope_a.q, keys_a, values_a, mask, scale, o, 1024, rope_a)

    stand_in = torch.full((1, z.shape[1]), float("nan"), device=DEV).half()  # never read
    zs = z.clone()
    sums = chain.AttentionSums(open_sums.Region(zs, svh, b, zs.reshape(-1)), stand_in, part, eps)
    keys_b, values_b, _, _ = _cache(kv_heads, slots, slots)
    q, k, v = _views(stand_in, heads, kv_heads)
    rope_b = ops.PendingRope(q.transpose(1, 2), keys_b, values_b, k, v, cos, sin, position)
    names = kernel_names(lambda: ops.decode_attention(rope_b.q, keys_b, values_b, mask, scale, None, rope_b, None,
                                                      sums))
    assert [n for n in names if "decode_attention_kernel" in n and (", true, " in n) == (walk == "mma")], names
    assert torch.equal(zs, z)  # the attention kernel only reads the sums
    keys_b.copy_(_cache(kv_heads, slots, slots)[0])  # the token's slot again as before the call above
    values_b.copy_(_cache(kv_heads, slots, slots)[1])
    out_b, d_b = ops.attention_into_chain(rope_b.q, keys_b, values_b, mask, scale, o, 1024, rope_b, None, sums)
    assert torch.equal(out_a, out_b)
    assert torch.equal(keys_a, keys_b) and torch.equal(values_a, values_b)
    # o_proj's input: its steps and sums (xb's words for the fragment's rows past the one real row
    # are never written); the product below covers the int8 values
    assert torch.equal(d_a.x.scales, d_b.x.scales) and torch.equal(d_a.x.csum, d_b.x.csum)
    assert d_b.zero_after is sums and torch.equal(zs, z)
    ya, yb = ops.as_tensor(d_a), ops.as_tensor(d_b)  # o_proj: d_b's product zeroes the sums
    assert rel_rms(yb, ya) < 5e-4  # the products' split-k atomics apart
    assert float(zs.abs().max()) == 0.0
    assert sums.region.read and zs.data_ptr() not in open_sums.POOL.held
    assert workspaces_zero()


def test_attention_declines_sums_it_cannot_take(chains):
    """Head dim 64, or no pending RoPE: attention_into_chain declines the sums (nothing launched),
    and decode_attention refuses sums without the RoPE."""
    z, svh, b, part, eps = _sums_case(4, 2, False, True, 3)
    sums = chain.AttentionSums(open_sums.Region(z, svh, b, z.reshape(-1)), torch.empty(1, z.shape[1], device=DEV).half(),
                               part, eps)
    q = torch.randn(1, 4, 1, D, device=DEV).half()
    keys = torch.randn(1, 2, 32, D, device=DEV).half()
    o = rand_layer(4 * D, 512, 4, 1)
    assert ops.attention_into_chain(q, keys, keys.clone(), None, 0.1, o, 512, None, None, sums) is None
    with pytest.raises(ValueError, match="pending RoPE"):
        ops.decode_attention(q, keys, keys.clone(), None, 0.1, None, None, None, sums)
    sums.finish()  # releases the region, z zero
    assert float(z.abs().max()) == 0.0


def _synth(tmp_path, family: str):
    from bench.synth import Shape, write_synth_model

    return write_synth_model(tmp_path / family, Shape(512, 1024, 3, 4, 2, 512, 128, family=family), 4.0, 6, "mul1",
                             seed=9)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_decode_on_sums_matches_the_finish_kernel(chains, tmp_path, monkeypatch, family):
    """Decode steps of a synthetic model of head dim 128 with the q/k/v sums (every layer but the
    first, whose input is not a chain), against the finish kernel writing q, k and v, and against
    the fallback where attention declines the sums and finish_sums writes them."""
    from engine.models import load_model
    from tests.test_static_cache import decode_logits

    model = load_model(_synth(tmp_path, family), device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4)).cuda()
    served = {"sums": 0, "declined": 0}
    real_open, real_attn = ops.open_qkv, ops.attention_into_chain

    def opened(*args):
        r = real_open(*args)
        served["sums"] += r is not None
        return r

    monkeypatch.setattr(ops, "open_qkv", opened)
    runs = {}
    runs["sums"] = decode_logits(model, model.new_static_cache(1, 64), ids, 20)
    assert served["sums"] == 10 * 2  # 10 steps, layers 1 and 2
    assert workspaces_zero()

    def declines(*args, **kwargs):
        if len(args) > 9 and args[9] is not None:
            served["declined"] += 1
            return None
        return real_attn(*args, **kwargs)

    monkeypatch.setattr(ops, "attention_into_chain", declines)
    runs["fallback"] = decode_logits(model, model.new_static_cache(1, 64), ids, 20)
    assert served["declined"] == 10 * 2
    assert workspaces_zero()
    monkeypatch.setattr(ops, "attention_into_chain", real_attn)
    monkeypatch.setattr(ops, "ATTN_QKV_SUMS", False)
    runs["finish"] = decode_logits(model, model.new_static_cache(1, 64), ids, 20)
    assert served["sums"] == 40  # none more
    for name in ("sums", "fallback"):
        agree = 0
        for a, b in zip(runs[name], runs["finish"]):
            assert rel_rms(a.float(), b.float()) < 2e-3  # the split-k atomics' order apart
            agree += int(torch.equal(a.argmax(-1), b.argmax(-1)))
        assert agree >= len(runs[name]) - 1  # a near tie may flip one
    # one decode step: q/k/v's finish kernel (the only one-row chain finish kernel that writes no
    # link) runs without the sums and not with them
    step = lambda: decode_logits(model, model.new_static_cache(1, 64), ids[:, :22], 20)  # noqa: E731
    finish = "gv_finish_chain_kernel<0, false>"
    assert any(finish in n for n in kernel_names(step))
    monkeypatch.setattr(ops, "ATTN_QKV_SUMS", True)
    assert not any(finish in n for n in kernel_names(step))
