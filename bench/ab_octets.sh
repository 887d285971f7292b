#!/bin/bash
# Session 35: debug variant 26 (a block's 8 warps take 8 adjacent column groups over the same k
# rows, so a block reads 8 KB of contiguous trellis a k row) against the shipped warp map (each
# warp a range of k rows of one group: 1 KB pieces ~50 k rows apart); carry .devcarry/shared.
# ~230 s with a fresh build (SUITE=1: the whole GPU suite instead of the variant's tests, ~40 s more).
# Why: on an H100 the one-row product of 8192x28672 streams at ~76% of DRAM's rate while dense
# fp16 reaches ~91%, and leaving the decode out does not make it faster (session 35's probes), so
# the way its reads fall on DRAM may be what limits it there.
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py tests/test_chain_gpu.py \
  -k "octet or decode_variants" 2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
echo "== products, variants 0 (shipped) / 26 (octets), twice $(el)s" | tee -a $L
timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
  --shapes 8192x28672 4096x28672 14336x4096 4096x6144 4096x4096 --m 1 --variants 0 26 0 26 2>&1 | python3 -c "$SUM" \
  | grep linear_tune | tee -a $L
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode, batch 1, TRELLIS_GV_VARIANT 0 / 26, twice $(el)s" | tee -a $L
decode_by_setting TRELLIS_GV_VARIANT variant 0 26
echo "== done $(el)s" | tee -a $L
