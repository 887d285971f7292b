#!/bin/bash
# Session 42's change checked on whatever card comes, and its unrun finish-spread setting timed;
# carry .devcarry/shared. ~480 s (written in session 42, not yet run).
# The change: products pad their shared memory to two blocks an SM (gemv_block_cap default 1), the
# two-group kernel drops its output stage (kTwoGroupsInFinish false), and the kernels that keep the
# stage (the decode chains) flush by `red` (kFlushRed true). "old" is the build and setting shipped
# until then: TRELLIS_NVCC_DEFINES=TRELLIS_TWO_GROUP_STAGE,TRELLIS_FLUSH_ATOMIC with
# TRELLIS_GV_BLOCK_CAP=0.
# 0. bench/occupancy_probe.cu, now with its "small" lines: where a small dependent grid (the finish
#    kernels' 4 to 32 blocks) lands after a kernel that fills every SM.
# 1. Builds at once: new (shipped), new with the debug variants (for the tests), old.
# 2. The GPU suite on the new debug build.
# 3. Decode (synthetic 4.0 bpw Llama-3.1-8B, CUDA graphs, 64 tokens), new against old,
#    alternating, two passes: batch 16, then 1.
# 4. bench.linear, K = 4 MUL1, new against old, alternating processes, one pass (session 42's first
#    call timed the parts): 12 and 16 rows of the mid-size layers; 1 / 16 / 32 rows of 8192x28672.
# 5. TRELLIS_FINISH_SPREAD 0 / 1 (the finish kernels of small grids padded to one block an SM), new
#    build, decode at batch 1 with the layer's critical path by kernel site (--breakdown) and at
#    batch 4, alternating, two passes.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
echo "== occupancy probe" | tee -a $OUT/log.txt
nvcc -O3 -std=c++17 -arch=sm_90 bench/occupancy_probe.cu -o /tmp/occupancy_probe && timeout 30 /tmp/occupancy_probe \
  | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES= TRELLIS_CACHE=/tmp/trellis-cache
OLD_DEFINES=TRELLIS_TWO_GROUP_STAGE,TRELLIS_FLUSH_ATOMIC
build_bg() {  # build_bg NAME DEBUG DEFINES
  (TRELLIS_DEBUG_VARIANTS=$2 TRELLIS_NVCC_DEFINES=$3 MAX_JOBS=6 timeout 300 python3 -c \
    "from engine import ops; ops.extension(); print('$1 built')" > $OUT/build_$1.txt 2>&1) &
}
build_bg old 0 $OLD_DEFINES
build_bg new_dbg 1 ""
source bench/gpu_common.sh
wait
tail -qn 1 $OUT/build_*.txt | tee -a $L
echo "== gpu tests, new debug build $(el)s" | tee -a $L
TRELLIS_DEBUG_VARIANTS=1 timeout 200 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests > $OUT/pytest_gpu.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_gpu.txt | head -20 | tee -a $L
declare -A DEF=([new]= [old]=$OLD_DEFINES)
declare -A CAP=([new]=1 [old]=0)
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 16 1; do
  echo "== decode batch $batch, new / old $(el)s" | tee -a $L
  for pass in 1 2; do
    for b in new old; do
      TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.decode --model-dir $M \
        --contexts 0 --tokens 64 --batch $batch --paths cuda-graph 2>&1 | grep '"tokens_per_s\|error' | cut -c1-150 \
        | sed "s/^/$b /" | tee -a $L
    done
  done
done
for b in new old; do
  echo "== products, $b $(el)s" | tee -a $L
  TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold \
    --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused --shapes 4096x14336 14336x4096 4096x4096 --m 12 16 \
    2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -m bench.linear --timing graph --cache cold \
    --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused --shapes 8192x28672 --m 1 16 32 2>&1 | python3 -c "$SUM" \
    | grep -v '^{' | sed "s/^/$b /" | tee -a $L
done
for batch in 1 4; do
  echo "== decode batch $batch, finish spread 0 / 1 $(el)s" | tee -a $L
  for pass in 1 2; do
    for v in 0 1; do
      TRELLIS_FINISH_SPREAD=$v timeout 120 python3 -m bench.decode --model-dir $M --contexts 0 --tokens 64 --batch $batch \
        --paths cuda-graph $([ $batch = 1 ] && echo --breakdown) > /tmp/spread.txt 2>&1
      grep '"tokens_per_s\|error' /tmp/spread.txt | grep -v '"critical_path"' | cut -c1-150 | sed "s/^/spread $v /" | tee -a $L
      grep '"critical_path"' /tmp/spread.txt | head -1 | python3 -c 'import sys, json
for l in sys.stdin:
  c = json.loads(l)["critical_path"]; print("  layer_us", c.get("layer_us"), c.get("error", ""))
  for s in c.get("sites", []): print("    ", s["critical_us"], s["us"], s["kernel"][:60])' | tee -a $L
    done
  done
done
echo "== done $(el)s" | tee -a $L
