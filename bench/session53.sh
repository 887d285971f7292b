#!/bin/bash
# Session 53's device call. Carry .devcarry/shared; at most ~CALL_S seconds, default 480; GOALS=0
# unless asked (the goals ran on an H200 in session 52).
# Question: what the 32-row product's flushes into the workspace cost in the wgmma form (it is
# 3.5% from its goal, 0.62x of fp16 at 8192x28672 on the H200), and whether the k slices' teams
# flushing the same columns at the same time is that cost. Debug variants (K = 4 MUL1, block-shared
# forms under the shipped rules):
#   68 probe: no flush at all (wrong results): the bound of any flush change
#   69 probe: no flush of each team's last column unit (wrong results): the end-of-kernel burst
#   70 each k slice's unit list rotated by nsl-ths of its column units (right results), so that
#      slices flush different columns at any moment
#   71 70 in wide blocks (61: 16 warps, one block an SM, slices twice as deep; never run on an H200)
#   72 / 73 the shipped / rotated forms with each team's start, first unit, last flush and end
#      times (bench/sa_stamps.py): which SMs sit idle at the end, and why (session 47's ncu: 8%)
# 1. The kernels' times at 32 rows of 8192x28672 (profiler: prep, product, finish); the teams'
#    stamps under 72 / 73 at 32 rows of 8192x28672 and 28672x8192; then at 32 rows three shapes,
#    the shipped product and dense fp16 in the same process, two passes, with the goal's calls and
#    warm-up (so 8192x28672 gives the 32-row goal's figure under each variant); at 12 / 17 / 24
#    rows of the two largest shapes under 0 / 61 / 70 / 71. bench.linear checks each variant's
#    product against the reference at each row count first (the "check" column).
# 2. The GPU tests of the block variants; decode at batch 32 and 16 under TRELLIS_GV_VARIANT 0 / 70;
#    if the clock allows, ncu's SM active and elapsed cycles of the 32-row product under 0 and 70.
GOALS=${GOALS:-0} source bench/session_start.sh  # the card, left, the debug build
echo "== kernel times at 32 rows of 8192x28672 (profiler, shipped, 20 calls) $(el)s" | tee -a $L
timeout 90 python3 -c '
import torch
from engine import ops
from tests.gpu_layers import rand_layer
t = rand_layer(8192, 28672, 4, "mul1", seed=5)
x = torch.randn(32, 8192, device="cuda").half()
for _ in range(5): ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(20): ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
    torch.cuda.synchronize()
for e in p.key_averages():
    if e.device_type == torch.autograd.DeviceType.CUDA and e.count >= 20:
        print(f"{e.key[:70]:70s} n={e.count} avg_us={e.device_time_total / e.count:.2f}")
' 2>&1 | tail -8 | tee -a $L
echo "== stamps of every team at 32 rows of 8192x28672 and 28672x8192, variants 72 / 73 $(el)s" | tee -a $L
for shape in 8192x28672 28672x8192; do
  timeout 60 python3 -m bench.sa_stamps --shape $shape --m 32 --variants 72 73 --calls 3 2>&1 | tail -6 | tee -a $L
done
ab32() {
  echo "== shipped / 68 69 70 71 61 at 32 rows, pass $1 $(el)s" | tee -a $L
  timeout 170 python3 -m bench.linear --timing graph --cache cold --calls 100 --warmup 10 --K 4 --codebook mul1 --paths fused dense \
    --shapes 8192x28672 28672x8192 4096x28672 --m 32 --variants 68 69 70 71 61 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
abrows() {
  echo "== shipped / 70 71 61 at 12 17 24 rows, pass $1 $(el)s" | tee -a $L
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 28672x8192 --m 12 17 24 --variants 70 71 61 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab32 1
[ $(left) -gt 170 ] && ab32 2
[ $(left) -gt 130 ] && abrows 1
some_gpu_tests 120 pytest_variants.txt "block_variants or rotated or stamps" tests/test_gemv_wgmma_gpu.py
[ $(left) -gt 100 ] && synth_llama
decode_rounds 60 "32 32 70" "16 32 70"
# SM active against elapsed cycles (ncu's SpeedOfLight) of the 32-row product under TRELLIS_GV_VARIANT
# $1: session 47 had the SMs active on 92% of the elapsed cycles (H100), ~8% of the time some idle
ncu_active() {
  echo "== ncu, 32 rows of 8192x28672, variant $1 $(el)s" | tee -a $L
  TRELLIS_GV_VARIANT=$1 timeout 90 ncu --clock-control none -k regex:exl3_gemv_sa --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --metrics smsp__inst_executed.sum python3 -m bench.linear --once --shapes 8192x28672 \
    --K 4 --m 32 > $OUT/ncu_v$1.txt 2>&1
  grep -E "Duration|SM Frequency|SM Active Cycles|Elapsed Cycles|inst_executed" $OUT/ncu_v$1.txt | cut -c1-150 | tee -a $L
}
[ $(left) -gt 150 ] && { ncu_active 0; ncu_active 70; }
[ $(left) -gt 130 ] && abrows 2
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
