#!/bin/bash
# Session 33: how the products' work meets the SMs (TRELLIS_GV_GRID_FILL), one process per
# setting, alternating; carry .devcarry/shared. ~230 s on an H100 with the GPU suite (SUITE=1),
# ~130 s without (then the grid-fill test alone). NO_PRODUCTS=1 leaves out the products' timing.
#   0: the min-units cap's grid as it comes (before session 33); 1 (shipped): every resident block
#   where the cap leaves more blocks than SMs but fewer than two per SM; 2: every resident block.
# Shapes: Llama-3.1-8B's one-row decode products that the setting touches (q/k/v as one
# 4096x6144 product: 192 blocks under the cap on 132 SMs; o 4096x4096: 128; down 14336x4096:
# 224); whole-model decode at batch 1 (two passes) and 4.
# Session 33's first run also timed whole units per warp and a split of the work by k rows (see
# csrc/PERF_NOTES.md); neither is here any more.
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py::test_grid_fill_settings_give_the_same_product \
  2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
LIN="timeout 100 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused"
[ -z "$NO_PRODUCTS" ] && echo "== products by grid fill $(el)s" | tee -a $L
[ -z "$NO_PRODUCTS" ] && for f in 0 1 2; do
  TRELLIS_GV_GRID_FILL=$f $LIN --shapes 4096x6144 4096x4096 14336x4096 --m 1 2>&1 | python3 -c "$SUM" | grep "^linear" \
    | sed "s/^/fill $f /" | tee -a $L
done
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode by grid fill $(el)s" | tee -a $L
decode_by_setting TRELLIS_GV_GRID_FILL fill 0 1
DECODE_BATCH=4 DECODE_TOKENS=64 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_GRID_FILL fill 0 1
echo "== done $(el)s" | tee -a $L
