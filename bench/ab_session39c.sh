#!/bin/bash
# Session 39's wgmma form of the block-shared product (kSaWgmma, 17..32 rows at K <= 4 on a 9.0
# device) in priority order, for a call with little device time left: the debug build; its own
# tests and the block-shared kernel's; products with TRELLIS_GV_WGMMA 1 / 0 (one process per
# setting, dense fp16 in the same runs) on 8192x28672 at 17, 24 and 32 rows and the Llama-3.1-8B
# MLP shapes at 32; then the rest of the GPU suite. Carry .devcarry/shared. ~250 s.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
SKIP_GPU_TESTS=1 source bench/gpu_common.sh
echo "== wgmma and block-shared tests $(el)s" | tee -a $L
timeout 90 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_gemv_wgmma_gpu.py tests/test_gemv_shared_gpu.py \
  > $OUT/pytest_wgmma.txt 2>&1; grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_wgmma.txt | head -30 | tee -a $L
echo "== products by TRELLIS_GV_WGMMA $(el)s" | tee -a $L
for v in 1 0 1 0; do
  TRELLIS_GV_WGMMA=$v timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
    --shapes 8192x28672 --m 17 24 32 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/wgmma $v /" | tee -a $L
  TRELLIS_GV_WGMMA=$v timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
    --shapes 4096x28672 14336x4096 4096x14336 --m 32 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/wgmma $v /" | tee -a $L
done
echo "== gpu suite $(el)s" | tee -a $L
timeout 150 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests --ignore=tests/test_gemv_wgmma_gpu.py \
  --ignore=tests/test_gemv_shared_gpu.py > $OUT/pytest_gpu.txt 2>&1; grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_gpu.txt | head -30 | tee -a $L
echo "== done $(el)s" | tee -a $L
