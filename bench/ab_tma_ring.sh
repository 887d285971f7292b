#!/bin/bash
# Session 35: debug variant 25 (the integer path's ring filled by the TMA: one tensor copy of a
# unit's trellis and one bulk copy of its activations a stage, issued by lane 0 on an mbarrier,
# exl3_gemv_tma.cuh) against the shipped cp.async ring; carry .devcarry/shared. ~260 s with a
# fresh build and the variant's tests (SUITE=1: the whole GPU suite instead, ~50 s more).
# Why: the one-row product issues ~2.5 of its ~27 instructions a tile in the producer (SASS,
# session 32) and is issue-bound on the H200; on an H100 it streams at ~76% of DRAM's rate (ncu,
# session 35), so fewer, larger requests may also stream better there.
# Steps: the variant's tests; products at 1 and 4 rows under 0 / 25 twice, one process per list;
# whole-model decode at batch 1 under TRELLIS_GV_VARIANT 0 / 25, one process each, alternating;
# ncu of one row of 8192x28672 under each (instructions, issue, DRAM).
[ -z "$SUITE" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
[ -z "$SUITE" ] && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py tests/test_chain_gpu.py \
  -k "tma_ring or decode_forms or decode_variants" 2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -20 | tee -a $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
echo "== products, variants 0 (shipped) / 25 (TMA ring), twice $(el)s" | tee -a $L
timeout 200 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused \
  --shapes 8192x28672 4096x28672 14336x4096 4096x6144 4096x4096 --m 1 4 --variants 0 25 0 25 2>&1 | python3 -c "$SUM" \
  | grep linear_tune | tee -a $L
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode, batch 1, TRELLIS_GV_VARIANT 0 / 25, twice $(el)s" | tee -a $L
decode_by_setting TRELLIS_GV_VARIANT variant 0 25
echo "== ncu, one row of 8192x28672: variants 0 / 25 $(el)s" | tee -a $L
for v in 0 25; do
  TRELLIS_GV_VARIANT=$v timeout 60 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --metrics smsp__inst_executed.sum \
    python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > /tmp/ncu_v$v.txt 2>&1
  echo "variant $v" | tee -a $L
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|inst_executed" /tmp/ncu_v$v.txt | head -8 | tee -a $L
  (echo "=== variant $v"; cat /tmp/ncu_v$v.txt) >> $OUT/ncu_tma.txt
done
echo "== done $(el)s" | tee -a $L
