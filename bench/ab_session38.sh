#!/bin/bash
# Session 38's H100-only and unrun work, on whatever card comes (an H200 wanted: the goals' card).
# Carry .devcarry/shared; ~420 s with a fresh debug build (the build ~140 s of it).
# 1. The GPU suite (~50 s): among it session 38's two tests not yet run in their final form (the
#    output-stage forms at 1, 8, 16 and 32 rows; setting 3 of TRELLIS_GV_SHARED).
# 2. The products without their warps' dead output stage (shipped since session 38) against the
#    forms with it (debug variants 47 per-warp, 46 block-shared; H100: 32 rows of 8192x28672 79.3
#    against 86.7 us, decode +2.3%): 8192x28672 at 1, 8 and 32 rows, two passes, dense fp16 in the
#    same runs; batch-1 decode under TRELLIS_GV_VARIANT 0 / 47, two passes.
# 3. TRELLIS_GV_SHARED 1 / 3 (3: also 9..16 rows of layers of at least 4096 x 28672 weights on the
#    block-shared kernel): products at 9, 12 and 16 rows of 4096x28672, 8192x28672 and 28672x8192,
#    one process per setting, two passes; decode at batch 12 and 16.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
source bench/gpu_common.sh
echo "== 0 against the forms with the output stage (47, 46) $(el)s" | tee -a $L
for pass in 1 2; do
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
    --shapes 8192x28672 --m 1 8 32 --variants 0 47 46 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
done
echo "== products by TRELLIS_GV_SHARED $(el)s" | tee -a $L
for pass in 1 2; do
  for v in 1 3; do
    TRELLIS_GV_SHARED=$v timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --paths fused --shapes 4096x28672 8192x28672 28672x8192 --m 9 12 16 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/shared $v /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode batch 1, variant 0 / 47 $(el)s" | tee -a $L
decode_by_setting TRELLIS_GV_VARIANT var 0 47
for b in 12 16; do
  echo "== decode batch $b, TRELLIS_GV_SHARED 1 / 3 $(el)s" | tee -a $L
  DECODE_BATCH=$b DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_SHARED shared 1 3
done
echo "== done $(el)s" | tee -a $L
