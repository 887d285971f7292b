"""Building the CUDA extension (csrc/) on first GPU use, or from setup.py with TRELLIS_BUILD_EXT=1.

Why JIT: a CPU install or CI must never need a compiler, while a GPU user should not have to
run a separate build step. The build is cached under ~/.cache/trellis/ext, keyed by the torch
version, the CUDA version, the GPU architecture and a hash of the sources, so it happens once.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from engine.errors import TrellisError

EXT_NAME = "trellis_ext"
CSRC = Path(__file__).resolve().parents[2] / "csrc"


class KernelBuildError(TrellisError):
    """The CUDA kernels could not be compiled or loaded."""


def extension_sources() -> list[str]:
    """Translation units of the extension (setup.py and the JIT build use the same list)."""
    cu = sorted(str(p) for p in CSRC.glob("*.cu"))
    return [str(CSRC / "bindings.cpp"), *cu]


def debug_variants() -> bool:
    """TRELLIS_DEBUG_VARIANTS=1: also build the products' debug variants (timing probes, occupancy
    configurations, earlier forms) that the GPU tests and benchmarks use. Off, the first-use build
    compiles the shipped kernels alone, which roughly halves the K = 4 files (exl3_mm_k4.cu and
    exl3_gv_k4_mul1_*.cu)."""
    return os.environ.get("TRELLIS_DEBUG_VARIANTS", "0") == "1"


def ab_defines() -> list[str]:
    """TRELLIS_NVCC_DEFINES="NAME ...": macros for a benchmark's A/B build (csrc/ kernels in a form
    that ships nowhere, e.g. TRELLIS_FLUSH_ATOMIC), each compiled as -DNAME into a cache entry of its
    own, so that alternating processes can time two builds. Names only, upper case: a value or an
    option here would be a way to pass anything to nvcc."""
    names = os.environ.get("TRELLIS_NVCC_DEFINES", "").replace(",", " ").split()
    for n in names:
        if not (n.startswith("TRELLIS_") and n.replace("_", "").isalnum() and n.isupper()):
            raise KernelBuildError(f"TRELLIS_NVCC_DEFINES: {n!r} is not a TRELLIS_ macro name")
    return sorted(set(names))


def nvcc_flags(archs: list[str] | None = None) -> list[str]:
    """nvcc flags; archs like ["80", "90"] (default: sm_80 + sm_90a machine code + sm_90 PTX).
    Compute capability 9.0 builds as sm_90a, the Hopper-only target that has the warpgroup MMA
    (csrc/wgmma.cuh) the many-row products use there; its machine code runs on 9.0 devices alone.
    The PTX stays plain compute_90 so that newer GPUs can still compile it (without wgmma)."""
    hopper = "90a" if _cuda_major() >= 12 else "90"  # sm_90a needs CUDA 12
    archs = [(hopper if a == "90" else a) for a in (archs or ["80", "90"])]
    flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
    if debug_variants():
        flags.append("-DTRELLIS_DEBUG_VARIANTS")
    flags += [f"-D{n}" for n in ab_defines()]
    if "90a" in archs:  # the host may launch the wgmma kernels (csrc/wgmma.cuh, wgmma_available)
        flags.append("-DTRELLIS_SM90A")
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    # PTX for the newest target, plain compute_90 for sm_90a; a build for this one Hopper GPU
    # (first use) skips it, since a second virtual target would double the device compile.
    if len(archs) > 1 or not archs[-1].endswith("a"):
        ptx = archs[-1].removesuffix("a")
        flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


def _cuda_major() -> int:
    """The CUDA major version torch was built with (the extension must be built with the same);
    12 where torch has none or is absent (nothing is compiled then)."""
    try:
        import torch
    except ImportError:
        return 12
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else 12


def _source_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*")):
        if p.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def cache_dir(arch: str) -> Path:
    import torch

    root = Path(os.environ.get("TRELLIS_CACHE", Path.home() / ".cache" / "trellis"))
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch}-{_source_hash()}"
    if debug_variants():
        tag += "-dbg"
    for n in ab_defines():
        tag += "-" + n.removeprefix("TRELLIS_").lower()
    return root / "ext" / tag


def _system_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for name in ("nvcc", "nvcc.exe"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return shutil.which("nvcc")


def pip_toolkit() -> Path | None:
    """A CUDA toolkit installed from PyPI, for machines without one. CUDA 13's wheels
    (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl) unpack
    into one prefix, site-packages/nvidia/cu13, that works as CUDA_HOME (its nvcc compiles all of
    csrc/). Only the CUDA major this PyTorch was built with will do."""
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return None
    for entry in sys.path:
        prefix = Path(entry or ".") / "nvidia" / f"cu{major}"
        if all((prefix / p).exists() for p in ("bin/nvcc", "nvvm/bin", "include/crt", "include/cuda_runtime.h")):
            return prefix
    return None


def pip_toolkit_hint() -> str:
    """How to install pip_toolkit's wheels for this PyTorch's CUDA ("" where none exist: before 13).
    Pinned to PyTorch's CUDA minor: the wheels do not pin each other to one release, so an unpinned
    nvcc would be the newest 13.x, compiling against the runtime headers of PyTorch's older one."""
    import torch

    parts = (torch.version.cuda or "").split(".")
    if not parts[0].isdigit() or int(parts[0]) < 13:
        return ""
    release = ".".join(parts[:2])
    names = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl")
    return "pip install " + " ".join(f"'{n}=={release}.*'" for n in names)


def _find_nvcc() -> str | None:
    nvcc = _system_nvcc()
    if nvcc is None and (prefix := pip_toolkit()) is not None:
        nvcc = str(prefix / "bin" / "nvcc")
    return nvcc


def _use_pip_toolkit(prefix: Path, build_dir: Path) -> list[str]:
    """Point torch's extension builder at a PyPI toolkit; the extra link flags it needs. The
    builder reads CUDA_HOME from a module global set at its import. The toolkit's lib/ holds only
    the versioned libcudart (libcudart.so.13), which the builder's -lcudart does not find: a link
    named libcudart.so in the build folder stands in for it."""
    import torch.utils.cpp_extension as cpp

    os.environ["CUDA_HOME"] = str(prefix)
    cpp.CUDA_HOME = str(prefix)
    libs = build_dir / "cudart"
    libs.mkdir(parents=True, exist_ok=True)
    link = libs / "libcudart.so"
    versioned = sorted((prefix / "lib").glob("libcudart.so.*"))
    if versioned and not link.exists():
        link.symlink_to(versioned[0])
    return [f"-L{libs}"]


def _prebuilt() -> bool:
    import importlib.util

    return importlib.util.find_spec("trellis_ext") is not None


def _cached(arch: str) -> bool:
    return any(p.suffix in (".so", ".pyd") for p in cache_dir(arch).glob(f"{EXT_NAME}*"))


def kernel_obstacle() -> str | None:
    """Why this machine's CUDA device cannot have the kernels, in one line, or None when it can (a
    prebuilt extension, or nvcc to compile or load a cached build): load_extension's own checks.
    Cheap, it builds nothing, so the worker can tell the app's planner at its start whether a
    model's weights will stay compressed."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA kernels need a CUDA GPU and a CUDA build of PyTorch"
    if torch.version.cuda is None:
        return "this PyTorch has no CUDA support; install a CUDA build to use the kernels"
    if _prebuilt():
        return None
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"GPU compute capability {major}.{minor} is too old: the kernels need sm_80 or newer"
    if _find_nvcc() is not None:
        return None
    wheels = pip_toolkit_hint()
    return ("cannot build the CUDA kernels: nvcc not found (install the CUDA toolkit" +
            (f" or its wheels, {wheels}" if wheels else "") +
            ", set CUDA_HOME, or set TRELLIS_KERNELS=torch to use the slower PyTorch path)")


def needs_compile() -> bool:
    """Whether the next load_extension() compiles (minutes) rather than loads a build: no prebuilt
    extension is installed and none is cached for this GPU and these sources. Lets a caller say so
    before the wait, which the app's user would otherwise take for a hang."""
    import torch

    if _prebuilt() or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability()
    return not _cached(f"{major}{minor}")


def load_extension(verbose: bool = False):
    """Import the prebuilt extension (setup.py build) or compile it for the current GPU."""
    try:
        import trellis_ext  # type: ignore[import-not-found]  # built by setup.py

        return trellis_ext
    except ImportError:
        pass
    import torch

    obstacle = kernel_obstacle()
    if obstacle is not None:
        raise KernelBuildError(obstacle)
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    build_dir = cache_dir(arch)
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not _cached(arch)
    if fresh:
        print(f"trellis: compiling CUDA kernels for sm_{arch} (once, cached in {build_dir}) ...", file=sys.stderr, flush=True)
    from torch.utils.cpp_extension import load

    ldflags = []
    if _system_nvcc() is None and (prefix := pip_toolkit()) is not None:
        ldflags = _use_pip_toolkit(prefix, build_dir)
    try:
        ext = load(
            name=EXT_NAME,
            sources=extension_sources(),
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=nvcc_flags([arch]),
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # compiler errors arrive as RuntimeError / subprocess errors
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise KernelBuildError(f"building the CUDA kernels failed ({first}); see {build_dir}") from e
    if fresh:
        print("trellis: CUDA kernels ready", file=sys.stderr, flush=True)
    return ext
