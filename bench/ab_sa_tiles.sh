#!/bin/bash
# Session 37: where two tiles per unit in the block-shared kernel (kSaTwoTiles) would pay beyond
# the shipped rule (25..32 rows of layers under 4096 x 18432 weights, K <= 4). One process per
# setting, alternating, two passes; carry .devcarry/shared. ~330 s with a fresh shipped build.
#   TRELLIS_GV_SA_TILES 0: four tiles everywhere; 1: the rule; 2: two tiles everywhere.
# Products: K = 4, 6, 8 x 3INST / MUL1 at 20 and 32 rows of 4096x14336, 14336x4096 and 8192x28672
# (session 37 on the H200: K = 6 3INST 4-5% slower with two, K = 6 MUL1 2-4% faster; 17..24 rows
# 0-7% slower at K = 4 MUL1). Then decode at batch 20 (0, 2) and 32 (0, 1, 2), one pass.
# SUITE=1 runs the GPU suite first (debug build, ~3 min more).
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1 TRELLIS_DEBUG_VARIANTS=0
source bench/gpu_common.sh
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_shared_gpu.py -k "two_tiles or second_wave" \
  2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
echo "== products by TRELLIS_GV_SA_TILES $(el)s" | tee -a $L
for pass in 1 2; do
  for v in 0 2; do
    TRELLIS_GV_SA_TILES=$v timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 30 --warmup 5 \
      --K 4 6 8 --codebook 3inst mul1 --paths fused --shapes 4096x14336 14336x4096 8192x28672 --m 20 32 2>&1 \
      | python3 -c "$SUM" | grep "^linear" | sed "s/^/tiles=$v /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode batch 20 / 32 $(el)s" | tee -a $L
DECODE_BATCH=20 DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_SA_TILES tiles 0 2
DECODE_BATCH=32 DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_SA_TILES tiles 0 1 2
echo "== done $(el)s" | tee -a $L
