#!/bin/bash
# The kernels built with CUDA's PyPI toolkit wheels instead of a system toolkit, on the GPU machine
# (the README's install line for users without nvcc). The wheels (~97 MB for 13.0) exceed one
# device call's 64 MiB carry, so they travel in two calls, back to back while the machine is warm:
#   bash bench/check_pip_toolkit.sh fetch   here: download the wheels of this PyTorch's CUDA release
#                                           (CUDA_RELEASE=13.x to choose; 13.0 where python3 has no
#                                           torch) into .devcarry/tk1 (nvvm) and .devcarry/tk2;
#   bash bench/check_pip_toolkit.sh 1       device, carry .devcarry/tk1: park nvvm in /tmp/tk;
#   bash bench/check_pip_toolkit.sh 2       device, carry .devcarry/tk2 and .devcarry/shared: install
#                                           the wheels, hide the system toolkit (PATH, CUDA_HOME,
#                                           /usr/local/cuda*), build, run two GPU test files.
# Part 2 leaves the machine without its toolkit: run it last in a session.
set -u
part=${1:-}
if [ "$part" = fetch ]; then
  release=${CUDA_RELEASE:-$(python3 -c "import torch; print('.'.join(torch.version.cuda.split('.')[:2]))" 2>/dev/null || echo 13.0)}
  mkdir -p .devcarry/tk1 .devcarry/tk2
  python3 -m pip download --no-deps -d .devcarry/tk1 "nvidia-nvvm==$release.*" &&
    python3 -m pip download --no-deps -d .devcarry/tk2 "nvidia-cuda-nvcc==$release.*" "nvidia-cuda-crt==$release.*" "nvidia-cuda-cccl==$release.*"
  exit
fi
L=$OUT/log.txt; t0=$(date +%s); el() { echo $(( $(date +%s)-t0 )); }
mkdir -p /tmp/tk
if [ "$part" = 1 ]; then cp .devcarry/tk1/*.whl /tmp/tk/ && ls -la /tmp/tk | tee -a $L; exit; fi
cp .devcarry/tk2/*.whl /tmp/tk/ && ls /tmp/tk | tee -a $L
SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if python3 -m pip --version > /dev/null 2>&1; then
  python3 -m pip install --no-index --no-deps /tmp/tk/*.whl 2>&1 | tail -2 | tee -a $L
else  # a venv without pip: a wheel is a zip of site-packages files (zipfile drops the exec bits)
  for w in /tmp/tk/*.whl; do python3 -m zipfile -e "$w" "$SP"; done
  chmod +x "$SP"/nvidia/cu13/bin/* "$SP"/nvidia/cu13/nvvm/bin/* && echo "unzipped into $SP" | tee -a $L
fi
ls $SP/nvidia/cu13 $SP/nvidia/cu13/bin $SP/nvidia/cu13/lib 2>&1 | tee -a $L
for d in /usr/local/cuda*; do [ -e "$d" ] && mv "$d" "$d.hidden" && echo "hid $d" | tee -a $L; done
export PATH=$(echo "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd:); unset CUDA_HOME CUDA_PATH
echo "PATH=$PATH; which nvcc: $(which nvcc)" | tee -a $L
export TRELLIS_DEBUG_VARIANTS=0 PYTHONUNBUFFERED=1 TRELLIS_SHARED=$PWD/.devcarry/shared TRELLIS_CACHE=/tmp/tkcache MAX_JOBS=16
timeout 400 python3 -c "
from engine.ops import build; print('nvcc', build._find_nvcc(), 'obstacle', build.kernel_obstacle())
import time; from engine import ops; t=time.time(); e=ops.extension(); print('build_s', round(time.time()-t,1)); print('status', ops.kernel_status('cuda'))
import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)" 2>&1 | tail -12 | tee -a $L
ldd /tmp/tkcache/ext/*/trellis*.so 2>/dev/null | grep -i "cuda\|not found" | tee -a $L
timeout $(( 585 - $(el) )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_decode_gpu.py tests/test_gemv_compact_gpu.py > $OUT/pytest_toolkit.txt 2>&1
tail -1 $OUT/pytest_toolkit.txt | tee -a $L; grep -E "^(FAILED|ERROR)" $OUT/pytest_toolkit.txt | head | tee -a $L
echo "== done $(el)s" | tee -a $L
