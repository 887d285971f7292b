#!/bin/bash
# Session 34: CFG 16 (CFG 10's four-k-row units with a third ring stage, room made by a k row's
# activations holding the one row's 8 lanes) against the shipped one-row product; carry
# .devcarry/shared. ~250 s with a fresh build.
# Why: ncu's stall samples of the shipped product (session 34, H100, one row of 8192x28672) put 21%
# of warp samples on the wait for the next stage's data.
# Steps: CFG 16's tests (SUITE=1: the whole GPU suite instead, ~40 s more); debug variant 24
# against variant 0 at one row, each checked against the reference first; the setting
# TRELLIS_GV_ONE_ROW_RING=0/1 (shipped launch: the products that take CFG 10 take CFG 16) on the
# products and on whole-model decode at batch 1, one process per setting, alternating.
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py tests/test_chain_gpu.py \
  -k "deeper_ring or one_row_ring" 2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
LIN="timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused"
echo "== one row, variants 0 (shipped) / 24, twice $(el)s" | tee -a $L
$LIN --shapes 8192x28672 4096x28672 14336x4096 4096x6144 --m 1 --variants 0 24 0 24 2>&1 | python3 -c "$SUM" \
  | grep linear_tune | tee -a $L
echo "== one row, TRELLIS_GV_ONE_ROW_RING 0 / 1 $(el)s" | tee -a $L
for r in 0 1; do
  TRELLIS_GV_ONE_ROW_RING=$r $LIN --shapes 8192x28672 4096x28672 14336x4096 --m 1 2>&1 | python3 -c "$SUM" \
    | grep "^linear" | sed "s/^/ring $r /" | tee -a $L
done
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode, batch 1, TRELLIS_GV_ONE_ROW_RING 0 / 1, twice $(el)s" | tee -a $L
decode_by_setting TRELLIS_GV_ONE_ROW_RING ring 0 1
echo "== done $(el)s" | tee -a $L
