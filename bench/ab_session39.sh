#!/bin/bash
# Session 39: where the block-shared kernel pays now that it has no dead output stage. Session 39's
# first call (H100) measured setting 3 of TRELLIS_GV_SHARED (9..16 rows of layers of at least
# 4096 x 28672 weights also on it) 12-20% faster there than the per-warp kernel and decode at batch
# 12 / 16 +6% / +3%. This asks the wider question, setting by setting (1 the rule before, 3, 2
# everywhere), one process per setting, two passes, dense fp16 in the same runs: K = 4 MUL1 products
# at 5, 8, 12 and 16 rows of the Llama-3.1-8B and -70B layer shapes; decode at batch 8, 12 and 16.
# The shipped build; no tests. Carry .devcarry/shared. ~300 s.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
source bench/gpu_common.sh
echo "== products by TRELLIS_GV_SHARED $(el)s" | tee -a $L
for pass in 1 2; do
  for v in 1 3 2; do
    TRELLIS_GV_SHARED=$v timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --paths fused --shapes 4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 8192x8192 8192x28672 28672x8192 \
      --m 5 8 12 16 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/shared $v /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for b in 8 12 16; do
  echo "== decode batch $b, TRELLIS_GV_SHARED 1 / 3 / 2 $(el)s" | tee -a $L
  DECODE_BATCH=$b DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_SHARED shared 1 3 2
done
echo "== done $(el)s" | tee -a $L
