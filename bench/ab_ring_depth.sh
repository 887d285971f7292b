#!/bin/bash
# Session 34: debug variant 24 (CFG 16: CFG 10's four-k-row units with a third ring stage, room
# made by a k row's activations holding the one row's 8 lanes) against the shipped one-row product,
# each checked against the reference first; carry .devcarry/shared. ~200 s with a fresh build.
# Why: ncu's stall samples of the shipped product (session 34, H100, one row of 8192x28672) put 21%
# of warp samples on the wait for the next stage's data. SUITE=1 adds the GPU suite (~40 s more).
# Session 35 (H100): 24 was 5-15% slower at every shape, and decode 6% slower through the setting
# that took it (since removed); the variant stays for an H200 check.
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py::test_one_row_deeper_ring_matches_reference \
  2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
echo "== one row, variants 0 (shipped) / 24, twice $(el)s" | tee -a $L
timeout 200 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
  --shapes 8192x28672 4096x28672 14336x4096 4096x6144 --m 1 --variants 0 24 0 24 2>&1 | python3 -c "$SUM" \
  | grep linear_tune | tee -a $L
echo "== done $(el)s" | tee -a $L
