"""engine.ops on a CPU-only install: every op falls back to the torch reference, nothing compiles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.formats import exl3 as fmt
from engine.errors import TrellisError
from engine.ops import build


@pytest.fixture(autouse=True)
def no_compiler(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("CPU tensors must never trigger a kernel build")

    monkeypatch.setattr(build, "load_extension", refuse)


def rand_layer(n_in, n_out, K, cb, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (n_in // 16, n_out // 16, 16 * K), generator=g, dtype=torch.int32).short()
    suh = torch.randn(n_in, generator=g).half()
    svh = torch.randn(n_out, generator=g).half()
    b = torch.randn(n_out, generator=g).half() if bias else None
    return fmt.EXL3Tensors(trellis, suh, svh, cb, b)


@pytest.mark.parametrize("cb", ["3inst", "mcg", "mul1"])
def test_gemm_falls_back_to_reference(cb):
    t = rand_layer(256, 128, 3, cb, bias=True)
    x = torch.randn(2, 5, 256)
    got = ops.exl3_gemm(x, t)
    want = fmt.exl3_matmul_reference(x, t)
    assert torch.equal(got, want)
    # The padded-input contract: a shorter x is zero-extended.
    short = x[..., :200]
    assert torch.allclose(ops.exl3_gemm(short, t), fmt.exl3_matmul_reference(F.pad(short, (0, 56)), t))


def test_linear_trims_and_keeps_dtype():
    t = rand_layer(256, 256, 2, "mul1")
    x = torch.randn(3, 256)
    y = ops.exl3_linear(x, t, out_features=200)
    assert y.shape == (3, 200) and y.dtype == x.dtype
    assert torch.allclose(y, fmt.exl3_matmul_reference(x, t)[:, :200])


def test_reconstruct_and_hadamard_are_the_reference():
    t = rand_layer(128, 256, 4, "3inst")
    assert torch.equal(ops.exl3_reconstruct(t.trellis, "3inst"), fmt.reconstruct(t.trellis, "3inst"))
    x = torch.randn(4, 256)
    h = ops.hadamard128(x)
    assert torch.allclose(h, fmt.hadamard128(x))
    assert torch.allclose(ops.hadamard128(h), x, atol=1e-5)


def test_norms_activations_rope():
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    w = torch.rand(64) + 0.5
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), want, atol=1e-6)
    y, s = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.allclose(y, ops.rms_norm(x + r, w, 1e-6))
    g, u = torch.randn(4, 10), torch.randn(4, 10)
    assert torch.allclose(ops.gated_act(g, u, "silu"), F.silu(g) * u)
    assert torch.allclose(ops.gated_act(g, u, "gelu_pytorch_tanh"), F.gelu(g, approximate="tanh") * u)
    with pytest.raises(ValueError):
        ops.gated_act(g, u, "relu6")
    from engine.errors import ConfigError
    from engine.models.layers import check_activation
    assert check_activation("gelu_pytorch_tanh") == "gelu_pytorch_tanh"
    with pytest.raises(ConfigError):
        check_activation("relu6")  # a model with it fails at load, not at its first forward
    # RoPE on the projections' [B, T, heads, D] layout, rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 1, 8)
    ang = torch.randn(5, 8)
    qr, kr = ops.rope_qk(q, k, ang.cos(), ang.sin())
    for x, xr in ((q, qr), (k, kr)):
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :4], x[..., 4:]
        want = torch.cat((x1 * c[..., :4] - x2 * s[..., :4], x2 * c[..., 4:] + x1 * s[..., 4:]), dim=-1)
        assert xr.shape == x.shape and torch.allclose(xr, want, atol=1e-6)


def test_kernels_disabled_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ops.kernels_available()
    monkeypatch.setenv("TRELLIS_KERNELS", "torch")
    assert not ops.kernels_enabled()


def test_kernel_status_says_once_why_a_gpu_runs_the_pytorch_path(monkeypatch, capsys):
    """A GPU whose kernels cannot be built (here: no nvcc) runs the PyTorch path; the status says
    why in one line, and stderr says so once, not at every call."""
    assert ops.kernel_status("cpu") == ops.KernelStatus("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "_ext", None)
    monkeypatch.setattr(ops, "_ext_error", None)
    builds = []

    def no_nvcc(verbose=False):
        builds.append(1)
        raise build.KernelBuildError("cannot build the CUDA kernels: nvcc not found (install the CUDA toolkit)")

    monkeypatch.setattr(build, "load_extension", no_nvcc)
    assert not ops.kernels_settled()
    status = ops.kernel_status("cuda:0")
    assert status.kernels == "torch" and status.note.startswith("cannot build the CUDA kernels: nvcc not found")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nvcc not found" in err and "PyTorch path runs instead" in err
    assert ops.kernels_settled()
    assert ops.kernel_status("cuda:0") == status and builds == [1] and capsys.readouterr().err == ""
    monkeypatch.setenv("TRELLIS_KERNELS", "torch")
    assert ops.kernel_status("cuda:0") == ops.KernelStatus("torch", "TRELLIS_KERNELS=torch is set")


def test_kernel_obstacle_says_what_stands_in_the_way(monkeypatch):
    """Without building anything: no nvcc, or a GPU older than sm_80, is named in one line; with
    nvcc (or a prebuilt extension) nothing stands in the way."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(build, "_prebuilt", lambda: False)
    monkeypatch.setattr(build, "_find_nvcc", lambda: None)
    assert build.kernel_obstacle().startswith("cannot build the CUDA kernels: nvcc not found")
    assert "'nvidia-nvvm==12.*'" not in build.kernel_obstacle()  # CUDA 12 has no one-prefix wheels
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "or its wheels, pip install 'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*'" in build.kernel_obstacle()
    monkeypatch.setattr(torch.version, "cuda", "13.2")  # pinned to PyTorch's release, not the newest 13.x
    assert "'nvidia-cuda-crt==13.2.*' 'nvidia-cuda-cccl==13.2.*'" in build.kernel_obstacle()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(build, "_find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert build.kernel_obstacle() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "7.5 is too old" in build.kernel_obstacle()
    monkeypatch.setattr(build, "_prebuilt", lambda: True)
    assert build.kernel_obstacle() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "need a CUDA GPU" in build.kernel_obstacle()


def test_a_toolkit_from_pypi_wheels_stands_in_for_a_missing_one(monkeypatch, tmp_path):
    """Without a system nvcc, CUDA 13's toolkit wheels (one prefix, site-packages/nvidia/cu13) are
    found on sys.path and handed to torch's extension builder as CUDA_HOME, with a libcudart.so
    link beside the build for its -lcudart; a CUDA 12 PyTorch does not take them. Without either,
    the obstacle names the wheels to install."""
    import torch.utils.cpp_extension as cpp

    site = tmp_path / "site"
    prefix = site / "nvidia" / "cu13"
    for d in ("bin", "nvvm/bin", "include/crt", "lib"):
        (prefix / d).mkdir(parents=True)
    for f in ("bin/nvcc", "include/cuda_runtime.h", "lib/libcudart.so.13"):
        (prefix / f).write_bytes(b"")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert build._find_nvcc() is None and "'nvidia-cuda-nvcc==13.0.*'" in build.pip_toolkit_hint()
    monkeypatch.setattr(build.sys, "path", [str(tmp_path / "elsewhere"), str(site)])
    assert build.pip_toolkit() == prefix and build._find_nvcc() == str(prefix / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", "")  # restored after the test: _use_pip_toolkit sets it
    monkeypatch.setattr(cpp, "CUDA_HOME", None)
    flags = build._use_pip_toolkit(prefix, tmp_path / "build")
    assert cpp.CUDA_HOME == str(prefix) and flags == [f"-L{tmp_path / 'build' / 'cudart'}"]
    assert (tmp_path / "build" / "cudart" / "libcudart.so").resolve() == (prefix / "lib" / "libcudart.so.13").resolve()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert build.pip_toolkit() is None and build.pip_toolkit_hint() == ""


def test_needs_compile_looks_for_a_cached_build(monkeypatch, tmp_path):
    """The load progress says "compiling" only where no build is cached for this GPU (a .so, or a
    .pyd on Windows) and none is installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(build, "_prebuilt", lambda: False)
    monkeypatch.setattr(build, "cache_dir", lambda arch: tmp_path / f"sm{arch}")
    (tmp_path / "sm89").mkdir()
    assert build.needs_compile()
    (tmp_path / "sm89" / f"{build.EXT_NAME}.pyd").write_bytes(b"")
    assert not build.needs_compile()
    monkeypatch.setattr(build, "_prebuilt", lambda: True)
    (tmp_path / "sm89" / f"{build.EXT_NAME}.pyd").unlink()
    assert not build.needs_compile()


def test_debug_variants_are_a_build_of_their_own(monkeypatch):
    """TRELLIS_DEBUG_VARIANTS=1 (the GPU tests' and benchmarks' setting) adds the products' debug
    variants to the build, under a cache key of its own; a user's build compiles the shipped
    kernels alone."""
    monkeypatch.setenv("TRELLIS_DEBUG_VARIANTS", "0")
    assert "-DTRELLIS_DEBUG_VARIANTS" not in build.nvcc_flags(["89"])
    plain = build.cache_dir("89")
    monkeypatch.setenv("TRELLIS_DEBUG_VARIANTS", "1")
    assert "-DTRELLIS_DEBUG_VARIANTS" in build.nvcc_flags(["89"])
    assert build.cache_dir("89") != plain and build.cache_dir("89").name == plain.name + "-dbg"


def test_ab_defines_make_a_build_of_their_own(monkeypatch):
    """A benchmark's A/B build (TRELLIS_NVCC_DEFINES) compiles its macros under a cache key of its
    own, and takes macro names only."""
    monkeypatch.delenv("TRELLIS_NVCC_DEFINES", raising=False)
    plain_flags, plain = build.nvcc_flags(["90"]), build.cache_dir("90")
    assert not any(f.startswith("-DTRELLIS_FLUSH") for f in plain_flags)
    monkeypatch.setenv("TRELLIS_NVCC_DEFINES", "TRELLIS_FLUSH_ATOMIC, TRELLIS_TWO_GROUP_STAGE")
    flags = build.nvcc_flags(["90"])
    assert "-DTRELLIS_FLUSH_ATOMIC" in flags and "-DTRELLIS_TWO_GROUP_STAGE" in flags
    assert build.cache_dir("90").name == plain.name + "-flush_atomic-two_group_stage"
    for bad in ("TRELLIS_X=1", "-O0", "trellis_flush_atom", "OTHER_MACRO", "TRELLIS_X;rm"):
        monkeypatch.setenv("TRELLIS_NVCC_DEFINES", bad)
        with pytest.raises(build.KernelBuildError, match="TRELLIS_NVCC_DEFINES"):
            build.nvcc_flags(["90"])


def test_a_debug_variant_missing_from_the_build_is_a_clear_error(monkeypatch):
    """Asking a user's build (no debug variants) for a probe says how to get one; the variants
    that take shipped kernels (10: one k row everywhere; 30 / 31: block-shared on / off) still run.
    Which variants a build has is the extension's to say (exl3_gemv_geom.cuh,
    debug_variant_built); here a stand-in build has the shipped ones."""
    set_to = []

    class UserBuild:
        def debug_variant_built(self, v):
            return v in (0, 10, 30, 31)

        def set_mm_debug_variant(self, v):
            set_to.append(v)

    monkeypatch.setattr(ops, "extension", lambda: UserBuild())
    with pytest.raises(TrellisError, match="TRELLIS_DEBUG_VARIANTS=1"):
        with ops.debug_variant(7):
            pass
    assert set_to == []
    with ops.debug_variant(10):
        pass
    assert set_to == [10, 0]


def test_build_inputs_for_setup_py():
    srcs = build.extension_sources()
    names = {s.rsplit("/", 1)[-1] for s in srcs}
    assert "bindings.cpp" in names and {f"exl3_mm_k{k}.cu" for k in range(1, 9)} <= names
    # K = 4's MUL1 products compile apart, in parallel (TRELLIS_GV_MUL1_*, exl3_gemv_sa.cuh)
    assert {"exl3_gv_k4_mul1_f16.cu", "exl3_gv_k4_mul1_i8.cu"} <= names
    flags = build.nvcc_flags()
    assert "-gencode=arch=compute_80,code=sm_80" in flags and "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.nvcc_flags(["90"])  # wgmma (csrc/wgmma.cuh)
    assert "-DTRELLIS_SM90A" in build.nvcc_flags(["90"]) and "-DTRELLIS_SM90A" not in build.nvcc_flags(["89"])


def test_cuda_11_builds_hopper_without_wgmma(monkeypatch):
    """sm_90a needs CUDA 12: with an older CUDA the build targets plain sm_90 (and its PTX) and
    leaves the host's wgmma switch (TRELLIS_SM90A) off."""
    monkeypatch.setattr(build, "_cuda_major", lambda: 11)
    flags = build.nvcc_flags(["90"])
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-DTRELLIS_SM90A" not in flags
    assert not any("90a" in f for f in flags)


def test_route_quant_linears_keeps_logits(tmp_path):
    from bench.synth import SHAPES, write_synth_model
    from engine.models import load_model
    from engine.ops.model_patch import route_quant_linears

    d = write_synth_model(tmp_path / "tiny", SHAPES["tiny"], 3.0, head_bits=4, codebook="mcg")
    model = load_model(d)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.inference_mode():
        want = model(ids)
        assert route_quant_linears(model) == 2 * 7 + 1
        got = model(ids)
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_argmax_on_cpu_is_torch_argmax():
    x = torch.randn(3, 7, 11)
    x[0, 0, [2, 9]] = 5.0
    assert torch.equal(ops.argmax(x), torch.argmax(x, dim=-1))


def test_an_empty_integer_setting_keeps_its_default(monkeypatch):
    # `TRELLIS_GV_WGMMA=` in a script used to mean 0 (wgmma off) while other knobs kept their
    # defaults; empty now always means the default, and a bad value names the knob.
    monkeypatch.setenv("TRELLIS_GV_WGMMA", "")
    assert ops._int_setting("TRELLIS_GV_WGMMA", 1) == 1
    monkeypatch.setenv("TRELLIS_GV_WGMMA", " 0 ")
    assert ops._int_setting("TRELLIS_GV_WGMMA", 1) == 0
    monkeypatch.delenv("TRELLIS_GV_WGMMA")
    assert ops._int_setting("TRELLIS_GV_WGMMA", 1) == 1
    monkeypatch.setenv("TRELLIS_GV_WGMMA", "yes")
    with pytest.raises(TrellisError, match="TRELLIS_GV_WGMMA must be an integer, not 'yes'"):
        ops._int_setting("TRELLIS_GV_WGMMA", 1)
