#!/bin/bash
# Session 32: K = 4 decode forms against the shipped one (A12 and, on the integer path, the tiles'
# words by ldmatrix: shipped since session 32), one process per step, alternating; an H200 wanted
# (the goals are the H200's); carry .devcarry/shared.
#   8: A12 with the words by shared loads; 22: session 31's decode (two masks, shared loads);
#   39: A12 in the block-shared kernel (17..32 rows of large layers); 40: that with MUL1's byte
#     sums by two MMAs a tile instead of an IDP4A a weight (mul1_f16_by_mma); 21: the same on the
#     per-warp fp16 path (9..16 rows, and 17..32 of smaller layers).
# Steps: build + the GPU suite; the goal shapes at 1 and 8 rows, 32 rows on the block-shared
# kernel, 16 on the per-warp fp16 path; whole-model decode at batch 1 and 4; ncu of the one-row
# product under 0 / 8 / 22 (instructions executed, issue slots busy, pipe use).
# SHORT=1: the variants' GPU tests only, not the suite. NO_DECODE=1 / NO_PRODUCTS=1: skip the
# decode / the products. NCU_SOURCE=1: the shipped product's stalls per SASS instruction
# ($OUT/ncu_src.csv). The whole script takes ~300 s on an H100.
[ -n "$SHORT" ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
if [ -n "$SHORT" ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py tests/test_gemv_shared_gpu.py \
    tests/test_chain_gpu.py -k "decode_forms or split_between or every_row_group or decode_variants or row_sums" > $OUT/pytest_variants.txt 2>&1
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_variants.txt | head -30 | tee -a $L
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $L
LIN="timeout 200 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --paths fused"
if [ -z "$NO_PRODUCTS" ]; then
echo "== products: variants 0 (shipped: A12 + ldmatrix) / 8 (A12) / 22 (session 31), twice $(el)s" | tee -a $L
$LIN --shapes 8192x28672 14336x4096 4096x4096 --m 1 8 --variants 0 8 22 0 8 22 2>&1 | python3 -c "$SUM" | grep linear_tune | tee -a $L
echo "== 32 rows, block-shared kernel: variants 30 (shipped) / 39 (A12) / 40 (A12 + byte sums by MMAs), twice $(el)s" | tee -a $L
$LIN --shapes 8192x28672 --m 32 --variants 30 39 40 30 39 40 2>&1 | python3 -c "$SUM" | grep linear_tune | tee -a $L
echo "== 16 rows, per-warp fp16 path: variants 0 / 21 (A12 + byte sums by MMAs), twice $(el)s" | tee -a $L
$LIN --shapes 8192x28672 14336x4096 --m 16 --variants 0 21 0 21 2>&1 | python3 -c "$SUM" | grep linear_tune | tee -a $L
fi
if [ -z "$NO_DECODE" ]; then
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
DEC="timeout 120 python3 -m bench.decode --model-dir $M --contexts 0"
KEEP='"tokens_per_s\|error'
echo "== decode, batch 1 $(el)s" | tee -a $L
$DEC --tokens 96 --paths cuda-graph cuda-graph-a12 cuda-graph-s31dec cuda-graph cuda-graph-a12 cuda-graph-s31dec 2>&1 | grep "$KEEP" | cut -c1-170 | tee -a $L
echo "== decode, batch 4 $(el)s" | tee -a $L
$DEC --tokens 64 --batch 4 --paths cuda-graph cuda-graph-s31dec cuda-graph cuda-graph-s31dec 2>&1 | grep "$KEEP" | cut -c1-190 | tee -a $L
fi
echo "== ncu, one row of 8192x28672: variants 0 / 8 / 22 $(el)s" | tee -a $L
for v in 0 8 22; do
  TRELLIS_GV_VARIANT=$v timeout 60 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum \
    python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > /tmp/ncu_v$v.txt 2>&1
  echo "variant $v" | tee -a $L
  grep -E "Duration|Issue Slots Busy|Eligible Warps|No Eligible|inst_executed|ALU|FMA" /tmp/ncu_v$v.txt | head -12 | tee -a $L
  (echo "=== variant $v"; cat /tmp/ncu_v$v.txt) >> $OUT/ncu_variants.txt
done
if [ -n "$NCU_SOURCE" ]; then  # where the shipped one-row product's warps stall, per SASS instruction
  echo "== ncu source counters, variant 0 $(el)s" | tee -a $L
  timeout 120 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats -o /tmp/ncu_src -f python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > $OUT/ncu_src_log.txt 2>&1
  timeout 60 ncu -i /tmp/ncu_src.ncu-rep --page source --csv --print-source sass > $OUT/ncu_src.csv 2>&1
  echo "source page: $(wc -l < $OUT/ncu_src.csv) lines" | tee -a $L
fi
echo "== done $(el)s" | tee -a $L
