#!/bin/bash
# A wider rule for the block-shared kernel against the rule before session 39 (1) and everywhere
# (2). Session 39 ran it with a setting 4 (today's default 3 plus 5..8 rows of layers of 4096 x 4096
# to fewer than 4096 x 8192 weights): decode at batch 8 lost 15% and setting 4 was dropped, so the
# script now runs 3 in its place: the GPU suite on a debug build; products of the small layers that
# 5..8-row rule reached or bordered, at K = 2 / 6 and with 3INST too (session 39's second call
# measured K = 4 MUL1 only), one process per setting; decode at batch 8 and 12 under 1 / 3, two
# passes. Carry .devcarry/shared. ~270 s.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
source bench/gpu_common.sh
echo "== products by TRELLIS_GV_SHARED $(el)s" | tee -a $L
for v in 1 3 2; do
  TRELLIS_GV_SHARED=$v timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 2 6 \
    --codebook mul1 3inst --paths fused --shapes 4096x2048 4096x4096 4096x6144 --m 5 8 2>&1 | python3 -c "$SUM" \
    | grep -v '^{' | sed "s/^/shared $v /" | tee -a $L
  TRELLIS_GV_SHARED=$v timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
    --paths fused --shapes 4096x1024 4096x2048 --m 5 8 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/shared $v /" | tee -a $L
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for b in 8 12; do
  echo "== decode batch $b, TRELLIS_GV_SHARED 1 / 3 $(el)s" | tee -a $L
  DECODE_BATCH=$b DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_SHARED shared 1 3
done
echo "== done $(el)s" | tee -a $L
