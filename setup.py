"""Plain installs compile nothing. TRELLIS_BUILD_EXT=1 adds the CUDA extension from csrc/
(the kernels are also compiled on first GPU use, so this is only a convenience)."""
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("TRELLIS_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

    from engine.ops.build import extension_sources, nvcc_flags  # noqa: E402

    ext_modules.append(
        CUDAExtension("trellis_ext", extension_sources(), extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags()})
    )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
