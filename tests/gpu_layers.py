"""Random EXL3 layers on the GPU and the error measure the kernel tests share (imported by the
GPU test modules after their CUDA check; not a test module itself)."""
from __future__ import annotations

import torch

from engine.formats import exl3 as fmt

DEV = torch.device("cuda")


def rand_layer(n_in, n_out, K, cb, seed, bias=False):
    """A layer of random trellis words (every state valid) with random signs/scales and bias."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (n_in // 16, n_out // 16, 16 * K), generator=g, device=DEV,
                            dtype=torch.int32).short()
    suh = (torch.randn(n_in, generator=g, device=DEV) * 0.5).half()
    svh = (torch.randn(n_out, generator=g, device=DEV) * 0.5).half()
    b = torch.randn(n_out, generator=g, device=DEV).half() if bias else None
    return fmt.EXL3Tensors(trellis, suh, svh, cb, b)


def rel_rms(a, b):
    """Relative RMS error of a against b (and a must be finite)."""
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def capture(fn):
    """fn() captured in a CUDA graph after one warm-up call (workspaces and the extension exist
    before capture): (graph, what the captured call returned)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def kernel_names(fn) -> list[str]:
    """The names of the CUDA kernels fn() launches, one per launch, as the profiler reports them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernels_run(fn, name_part: str = "gemv") -> set[str]:
    """Names of the CUDA kernels fn() launches whose name contains name_part (the profiler's
    demangled names carry the template arguments, so a test can check which instantiation ran)."""
    return {n for n in kernel_names(fn) if name_part in n}


def template_args(names, kernel: str) -> list[list[str]]:
    """The template arguments of each instantiation of `kernel` among the (demangled) kernel names,
    in declaration order, as strings."""
    return [n.split(kernel + "<")[1].split(">")[0].split(", ") for n in names if kernel + "<" in n]


# The block-shared kernel's CFG bits (csrc/exl3_gemv_sa_kernel.cuh: kSaA12, kSaTcSum, kSaTwoTiles,
# kSaInFinish, kSaWgmma, kSaProducts, kSaWide, kSaRotate, kSaStamp, kSaTwin, kSaSteal).
SA_A12, SA_TC_SUM, SA_TWO_TILES, SA_IN_FINISH, SA_WGMMA, SA_PRODUCTS = 64, 128, 512, 2048, 4096, 8192
SA_WIDE, SA_ROTATE, SA_STAMP, SA_TWIN, SA_STEAL = 524288, 1048576, 4194304, 16777216, 33554432


def sa_cfgs(names) -> list[int]:
    """The CFG template argument (its last) of each block-shared kernel among the kernel names."""
    return [int(a[-1]) for a in template_args(names, "exl3_gemv_sa_kernel")]


def workspaces_zero() -> bool:
    """Every pooled workspace of the fused product is zero again (each product, or the reader of
    its open sums, leaves the one it used so)."""
    from engine import ops

    return all(float(w.abs().max()) == 0.0 for w in ops.workspaces())


def same_top(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a's top token is b's, or one whose logit in b is within the two's difference of b's top:
    a random test model has near ties that fp16 rounding may break either way."""
    a, b = a.float(), b.float()
    pick = a.argmax(-1, keepdim=True)
    return bool((b.gather(-1, pick) >= b.max(-1, keepdim=True).values - 2 * (a - b).abs().max()).all())


def replayed_logits(model, ids: torch.Tensor, prompt: int = 30, max_len: int = 64) -> list[torch.Tensor]:
    """Logits of a prefill of ids[:, :prompt] and then one graph-replayed step per further token
    (a fresh GraphDecoder, which must not have fallen back to eager steps)."""
    from engine.generate.graph_decode import GraphDecoder
    from tests.test_static_cache import decode_logits

    decoder = GraphDecoder(model)
    logits = decode_logits(model, decoder.new_cache(ids.shape[0], max_len), ids, prompt=prompt, step=decoder.step)
    assert decoder.disabled is None, decoder.disabled
    return logits


def static_steps(model, ids: torch.Tensor, prompt: int, max_len: int = 64) -> list[torch.Tensor]:
    """Logits of a prefill of ids[:, :prompt] and then eager one-token steps over a StaticKVCache
    (the graphs' cache, so the steps take the decode kernels' paths)."""
    from tests.test_static_cache import decode_logits

    return decode_logits(model, model.new_static_cache(ids.shape[0], max_len, min_span=16), ids, prompt=prompt)


def step_kernel_names(model, ids: torch.Tensor, prompt: int, max_len: int = 64) -> list[str]:
    """The kernels one eager decode step launches over a StaticKVCache, after a prefill of
    ids[:, :prompt]: the step takes token ids[:, prompt]."""
    cache = model.new_static_cache(ids.shape[0], max_len, min_span=16)
    with torch.inference_mode():
        model(ids[:, :prompt], cache)
        return kernel_names(lambda: model(ids[:, prompt:prompt + 1], cache))
