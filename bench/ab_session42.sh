#!/bin/bash
# RUN in session 42 (H100; csrc/PERF_NOTES.md) and kept as its record: its macros are gone since
# (TRELLIS_FLUSH_RED and TRELLIS_LEAN_TWO_GROUPS are the shipped forms now, the block cap the
# default), so today it would time one build under several names. bench/ab_session42c.sh compares
# against the earlier forms.
# For the session after 41 (written in session 41, not yet run), on whatever card comes; carry
# .devcarry/shared. ~500 s (four builds at once: ~200 s); then bench/ab_session42b.sh (decode) on
# the same warm machine.
# Two questions about the per-warp products (csrc/PERF_NOTES.md, session 41):
# A. TRELLIS_FLUSH_RED (A/B build): an explicit `red` in the flushes of the kernels that carry the
#    warps' output stage (the two-group kernels, the decode chain kernels), which flush by ATOMG
#    otherwise; every other kernel's SASS is as shipped.
# B. TRELLIS_GV_BLOCK_CAP=1 (a runtime setting): products pad their shared memory so an SM holds
#    at most the two blocks their grid is sized for (per-warp and block-shared kernels).
#    Hypothesis: kernels at 80 registers with rings under ~75 KB (the compact ring, CFG 9 at
#    3INST / MCG, the two-group kernel without its stage: TRELLIS_LEAN_TWO_GROUPS) fit three
#    blocks, and the scheduler packs the 2 x SMs grid three to an SM, idling a third of them: the
#    stage-less two-group kernel's 112 against 80 us. If lean2 + cap is as fast as base (or
#    faster: the dead stage cost other kernels 1-11%), the hypothesis holds and the two-group
#    kernel can drop its stage.
# 0. bench/occupancy_probe.cu: where the scheduler puts 2 x SMs blocks that fit three to an SM
#    (alone, and as a programmatic dependent of a short kernel), against blocks padded to two.
# 1. Four builds at once: base, red, lean2 (shipped) and red with the debug variants (for tests).
# 2. The GPU suite on the red debug build (includes test_block_cap_gives_the_same_product).
# 3. bench.linear, K = 4, MUL1 and 3INST, 6 / 12 / 16 / 32 rows of the mid-size layers (compact
#    ring, CFG 9, two-group kernel; at 32 rows the block-shared kernel, a control at 112 KB) and
#    1 / 16 rows of 8192x28672 (controls: 128 and 96 registers), one process per setting, two
#    passes: base, base + cap, lean2, lean2 + cap, red.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
echo "== occupancy probe" | tee -a $OUT/log.txt
nvcc -O3 -std=c++17 -arch=sm_90 bench/occupancy_probe.cu -o /tmp/occupancy_probe && timeout 30 /tmp/occupancy_probe \
  | tee -a $OUT/log.txt
# gpu_common.sh's cache, set before the background builds start (session 41's script built its red
# kernels into the default cache, and its tests built them again).
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES= TRELLIS_CACHE=/tmp/trellis-cache
build_bg() {  # build_bg NAME DEBUG DEFINES
  (TRELLIS_DEBUG_VARIANTS=$2 TRELLIS_NVCC_DEFINES=$3 MAX_JOBS=6 timeout 300 python3 -c \
    "from engine import ops; ops.extension(); print('$1 built')" > $OUT/build_$1.txt 2>&1) &
}
build_bg red 0 TRELLIS_FLUSH_RED
build_bg lean2 0 TRELLIS_LEAN_TWO_GROUPS
build_bg red_dbg 1 TRELLIS_FLUSH_RED
source bench/gpu_common.sh
wait
tail -qn 1 $OUT/build_*.txt | tee -a $L
echo "== gpu tests, red debug build $(el)s" | tee -a $L
TRELLIS_DEBUG_VARIANTS=1 TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED timeout 200 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests \
  > $OUT/pytest_red.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_red.txt | head -20 | tee -a $L
declare -A DEF=([base]= [cap]= [lean2]=TRELLIS_LEAN_TWO_GROUPS [lean2cap]=TRELLIS_LEAN_TWO_GROUPS [red]=TRELLIS_FLUSH_RED)
declare -A CAP=([base]=0 [cap]=1 [lean2]=0 [lean2cap]=1 [red]=0)
for pass in 1 2; do
  for b in base cap lean2 lean2cap red; do
    echo "== products, $b, pass $pass $(el)s" | tee -a $L
    TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold \
      --calls 40 --warmup 5 --K 4 --codebook mul1 3inst --paths fused --shapes 4096x14336 14336x4096 4096x4096 --m 6 12 16 32 \
      2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
    TRELLIS_GV_BLOCK_CAP=${CAP[$b]} TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -m bench.linear --timing graph --cache cold \
      --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused --shapes 8192x28672 --m 1 16 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
done
echo "== done $(el)s" | tee -a $L
