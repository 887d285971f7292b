#!/bin/bash
# For the session after 41 (written in session 41, not yet run), on whatever card comes; carry
# .devcarry/shared. ~420 s.
# TRELLIS_FLUSH_RED as it is now: an explicit `red` in the flushes of the kernels that carry the
# warps' output stage (the per-warp two-group kernels, the decode chain kernels), which otherwise
# flush by ATOMG; every other kernel's SASS is as shipped (checked with nvdisasm here). In session
# 41, `red` in every kernel made 12- and 16-row products of 4096x14336 and 14336x4096 4-7% faster
# (one pass) and batch-1 decode 2-3% slower (two passes), and renumbered the registers of the
# one-row kernels, which this form leaves alone.
# 1. Three builds at once: base and red (shipped), red with the debug variants (for the tests).
# 2. The GPU suite on the red debug build.
# 3. bench.linear, one process per build, two passes: 9, 12 and 16 rows of the mid-size layers,
#    where the two-group kernel serves by default, and one row of 8192x28672 (a control: the same
#    kernel in both builds).
# 4. Decode (synthetic 4.0 bpw Llama-3.1-8B) at batch 1 (control), 12 and 16, alternating builds.
# If red wins at 9..16 rows and decode at batch 12 / 16 and batch 1 holds, make it the shipped form.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
# The cache gpu_common.sh uses, set before the background builds start (session 41's script built
# its red kernels into the default cache, and its tests built them again).
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES= TRELLIS_CACHE=/tmp/trellis-cache
(TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED MAX_JOBS=6 timeout 280 python3 -c "from engine import ops; ops.extension(); print('red built')" \
  > $OUT/build_red.txt 2>&1) &
(TRELLIS_DEBUG_VARIANTS=1 TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED MAX_JOBS=6 timeout 280 python3 -c "from engine import ops; ops.extension(); print('red debug built')" \
  > $OUT/build_red_dbg.txt 2>&1) &
source bench/gpu_common.sh
wait
tail -qn 1 $OUT/build_red.txt $OUT/build_red_dbg.txt | tee -a $L
echo "== gpu tests, red debug build $(el)s" | tee -a $L
TRELLIS_DEBUG_VARIANTS=1 TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED timeout 200 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests \
  > $OUT/pytest_red.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_red.txt | head -20 | tee -a $L
declare -A DEF=([base]= [red]=TRELLIS_FLUSH_RED)
for pass in 1 2; do
  for b in base red; do
    echo "== products, build $b, pass $pass $(el)s" | tee -a $L
    TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --codebook mul1 --paths fused --shapes 4096x14336 14336x4096 4096x6144 4096x4096 --m 9 12 16 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/$b /" | tee -a $L
    TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --codebook mul1 --paths fused --shapes 8192x28672 --m 1 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 1 12 16; do
  echo "== decode batch $batch, base / red $(el)s" | tee -a $L
  DECODE_BATCH=$batch DECODE_TOKENS=64 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_FLUSH_RED
done
echo "== done $(el)s" | tee -a $L
