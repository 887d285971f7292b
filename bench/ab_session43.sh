#!/bin/bash
# Session 43's second device call (it ran in 268 s on an H100), on whatever card comes; carry
# .devcarry/shared.
# The tree: session 42's shipped kernels less the finish spread (TRELLIS_FINISH_SPREAD, measured no
# faster in session 43's first call and removed; host code and tests only) and the occupancy probe
# with its illegal access mended.
# 1. Both builds at once: shipped and debug variants.
# 2. On an H200: the goals (bench/h200_goals.sh; the shipped build is then cached).
#    On any other card: bench/occupancy_probe.cu, whose "small" lines failed in the first call.
# 3. The GPU suite on the debug build.
# 4. Not on an H200: what bench/ab_session39d.sh (removed once this ran) left unrun: the wgmma
#    form against the synchronous MMAs (TRELLIS_GV_WGMMA 1 / 0) on products it serves but session
#    39 timed only at K = 4 MUL1
#    (K = 2 and 3 x MUL1, 3INST, MCG at 24 and 32 rows of 8192x28672), and on decode at batch 17,
#    24 and 32.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_CACHE=/tmp/trellis-cache TRELLIS_SHARED=$PWD/.devcarry/shared PYTHONUNBUFFERED=1
build_bg() {  # build_bg NAME DEBUG
  (TRELLIS_DEBUG_VARIANTS=$2 MAX_JOBS=8 timeout 300 python3 -c \
    "from engine import ops; ops.extension(); print('$1 built')" > $OUT/build_$1.txt 2>&1) &
}
build_bg shipped 0
build_bg debug 1
wait
tail -qn 1 $OUT/build_*.txt | tee -a $OUT/log.txt
H200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
if [ "$H200" = 1 ]; then
  bash bench/h200_goals.sh
else
  echo "== occupancy probe" | tee -a $OUT/log.txt
  nvcc -O3 -std=c++17 -arch=sm_90 bench/occupancy_probe.cu -o /tmp/occupancy_probe && timeout 30 /tmp/occupancy_probe \
    | tee -a $OUT/log.txt
fi
export TRELLIS_DEBUG_VARIANTS=1 SKIP_GPU_TESTS=1  # the build is cached: gpu_common.sh only loads it
source bench/gpu_common.sh
echo "== gpu tests, debug build $(el)s" | tee -a $L
timeout 200 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests > $OUT/pytest_gpu.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_gpu.txt | head -20 | tee -a $L
[ "$H200" = 1 ] && { echo "== done $(el)s" | tee -a $L; exit 0; }
export TRELLIS_DEBUG_VARIANTS=0
echo "== products by TRELLIS_GV_WGMMA $(el)s" | tee -a $L
for v in 1 0 1 0; do
  TRELLIS_GV_WGMMA=$v timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 2 3 --codebook mul1 \
    3inst mcg --paths fused --shapes 8192x28672 --m 24 32 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/wgmma $v /" | tee -a $L
done
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for b in 17 24 32; do
  echo "== decode batch $b, TRELLIS_GV_WGMMA 1 / 0 $(el)s" | tee -a $L
  DECODE_BATCH=$b DECODE_TOKENS=32 decode_by_setting TRELLIS_GV_WGMMA wgmma 1 0
done
echo "== done $(el)s" | tee -a $L
