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


def kernels_run(fn, name_part: str = "gemv") -> set[str]:
    """Names of the CUDA kernels fn() launches whose name contains name_part (the profiler's
    demangled names carry the template arguments, so a test can check which instantiation ran)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if name_part in e.name}
