#!/bin/bash
# Session 42's change checked on whatever card comes; carry .devcarry/shared. ~330 s.
# The change: products pad their shared memory to two blocks an SM (gemv_block_cap default 1), the
# two-group kernel drops its output stage (kTwoGroupsInFinish false), and the kernels that keep the
# stage (the decode chains) flush by `red` (kFlushRed true). "old" is the build and setting shipped
# until then: TRELLIS_NVCC_DEFINES=TRELLIS_TWO_GROUP_STAGE,TRELLIS_FLUSH_ATOMIC with
# TRELLIS_GV_BLOCK_CAP=0.
# 1. Builds at once: new (shipped), new with the debug variants (for the tests), old.
# 2. The GPU suite on the new debug build.
# 3. Decode (synthetic 4.0 bpw Llama-3.1-8B, CUDA graphs, 64 tokens), new against old,
#    alternating, two passes: batch 16, then 1.
# 4. bench.linear, K = 4 MUL1, new against old, alternating processes, one pass (session 42's first
#    call timed the parts): 12 and 16 rows of the mid-size layers; 1 / 16 / 32 rows of 8192x28672.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
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
for pass in 1; do
  for b in new old; do
    echo "== products, $b, pass $pass $(el)s" | tee -a $L
    TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold \
      --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused --shapes 4096x14336 14336x4096 4096x4096 --m 12 16 \
      2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
    TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -m bench.linear --timing graph --cache cold \
      --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused --shapes 8192x28672 --m 1 16 32 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
done
echo "== done $(el)s" | tee -a $L
