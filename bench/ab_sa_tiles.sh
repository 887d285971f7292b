#!/bin/bash
# Session 37 (written after its device time was spent; not run): where the block-shared kernel
# (17..32 rows of large layers) could go beyond the shipped rule. Carry .devcarry/shared; ~450 s
# with a fresh debug build on an H100 (the build ~180 s of it).
# 1. Two tiles per unit (kSaTwoTiles) against four, through TRELLIS_GV_SA_TILES (0 four tiles
#    everywhere, 1 the rule: 25..32 rows under 4096 x 18432 weights, K <= 4; 2 two tiles
#    everywhere), one process per setting, alternating, two passes: K = 4, 6 x 3INST / MUL1 at 20
#    and 32 rows of 4096x14336, 14336x4096 and 8192x28672 (session 37 on the H200: K = 6 3INST 4-5%
#    slower with two, K = 6 MUL1 2-4% faster; 17..24 rows 0-7% slower at K = 4 MUL1). Then decode
#    at batch 20 (0, 2) and 32 (0, 1, 2), one pass.
# 2. Debug variant 45 (kSaSkipEmpty: no MMAs for row groups without rows, the fourth at 17..24
#    rows) against 30 (the same kernel with them), K = 4 MUL1, 17, 20 and 24 rows.
# SUITE=1 runs the whole GPU suite first (~50 s more); otherwise tests/test_gemv_shared_gpu.py.
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_shared_gpu.py \
  2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
echo "== products by TRELLIS_GV_SA_TILES $(el)s" | tee -a $L
for pass in 1 2; do
  for v in 0 2; do
    TRELLIS_GV_SA_TILES=$v timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 30 --warmup 5 \
      --K 4 6 --codebook 3inst mul1 --paths fused --shapes 4096x14336 14336x4096 8192x28672 --m 20 32 2>&1 \
      | python3 -c "$SUM" | grep "^linear" | sed "s/^/tiles=$v /" | tee -a $L
  done
done
echo "== variant 45 (no MMAs for empty row groups) against 30 $(el)s" | tee -a $L
timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 30 --warmup 5 --K 4 --paths fused \
  --shapes 8192x28672 4096x28672 4096x14336 14336x4096 --m 17 20 24 --variants 30 45 30 45 2>&1 \
  | python3 -c "$SUM" | grep "^linear_tune" | tee -a $L
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode batch 20 / 32 $(el)s" | tee -a $L
DECODE_BATCH=20 DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_SA_TILES tiles 0 2
DECODE_BATCH=32 DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_SA_TILES tiles 0 1 2
echo "== done $(el)s" | tee -a $L
