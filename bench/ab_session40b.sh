#!/bin/bash
# The first call of a session after session 40 (written without device time, not yet run), on
# whatever card comes; carry .devcarry/shared. ~350 s.
# 1. The debug build, timed: session 40 split the K = 4 file in three (exl3_gv_k4_mul1_*.cu), its
#    long pole, so this build should take about half its ~170 s.
# 2. The whole GPU suite: session 39's test refactor (04dc9b6), session 40's seeded chain test and
#    its new test of debug variant 48 have not run.
# 3. Debug variant 48 against the shipped kernels: the block-shared kernel's wgmma form with MUL1's
#    byte sums by MMAs (2 IMMA a tile instead of 8 IDP4A; session 32 found them 3-5% slower beside
#    four synchronous MMAs a tile, which wgmma has since taken off the warps). bench.linear
#    --variants checks each product against the reference (`check`) and times it cold; 17, 24 and
#    32 rows of the shapes the wgmma form serves in Llama-3.1-8B and the goal shape; two passes.
#    Then decode at batch 32 (synthetic 4.0 bpw Llama-3.1-8B) with TRELLIS_GV_VARIANT 0 / 48.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
source bench/gpu_common.sh
echo "== variant 48 against 0 $(el)s" | tee -a $L
for pass in 1 2; do
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --variants 0 48 \
    --shapes 8192x28672 4096x28672 4096x14336 --m 17 24 32 --K 4 --paths fused 2>&1 | python3 -c "$SUM" \
    | grep -v '^{' | grep linear_tune | tee -a $L
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode batch 32, TRELLIS_GV_VARIANT 0 / 48 $(el)s" | tee -a $L
DECODE_BATCH=32 DECODE_TOKENS=32 decode_by_setting TRELLIS_GV_VARIANT var 0 48
echo "== done $(el)s" | tee -a $L
