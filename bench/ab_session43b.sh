#!/bin/bash
# Session 43's second call, on whatever card comes; carry .devcarry/shared. ~350 s on an H100,
# ~300 s on an H200.
# On an H200: the goals (bench/h200_goals.sh), and nothing else (the session's device time
# is short). On any other card:
# 1. The shipped build, and the GPU tests of decode attention's new trigger points
#    (TRELLIS_ATTN_TRIGGER / set_attn_trigger: 1 at its start, 2 after its walks; 0, the default,
#    at its end) with the model-decode chain tests.
# 2. Decode at batch 1 (synthetic 4.0 bpw Llama-3.1-8B, CUDA graphs, 96 tokens) under
#    TRELLIS_ATTN_TRIGGER 0 / 1 / 2, alternating, two passes, with the layer's critical path by
#    kernel (--breakdown: does o_proj's fetch now overlap attention?); then at context 4,096
#    (attention reads the cache while o_proj fetches), 0 / 2.
# 3. ncu of the 32-row 8192x28672 K = 4 product (the block-shared kernel on Hopper's warpgroup MMA,
#    shipped since session 39, never profiled): issue, eligible warps, stall reasons, pipe
#    utilisation ($OUT/ncu_m32.txt; every raw metric in $OUT/ncu_raw_m32.csv).
# SHORT=1 (~190 s, for the end of a session's device time): 1, then 2 at context 0 only
# (0, 2, 1, 0, 2), on any card.
# Ran in session 43 as SHORT=1, on an H200 (123 s). The trigger setting measured slower and was
# removed after it, so today the A/B compares one setting with itself; the 32-row ncu ran by hand
# the same session (csrc/PERF_NOTES.md, calls 5 and 6).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
[ -z "$SHORT" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && { bash bench/h200_goals.sh; exit 0; }
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
source bench/gpu_common.sh
echo "== chain tests $(el)s" | tee -a $L
timeout 120 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_chain_gpu.py \
  -k "attention_trigger or attention_writes or model_decode_with_chains_matches_without" > $OUT/pytest_chain.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_chain.txt | head -12 | tee -a $L
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode batch 1, TRELLIS_ATTN_TRIGGER 0 / 1 / 2 $(el)s" | tee -a $L
ORDER="0 1 2 0 1 2"
[ -n "$SHORT" ] && ORDER="0 2 1 0 2"
for v in $ORDER; do
  TRELLIS_ATTN_TRIGGER=$v timeout 90 python3 -m bench.decode --model-dir $M --contexts 0 --tokens 96 --paths cuda-graph \
    --breakdown > /tmp/trig.txt 2>&1
  grep '"tokens_per_s\|error' /tmp/trig.txt | grep -v '"critical_path"' | cut -c1-150 | sed "s/^/trigger $v /" | tee -a $L
  grep '"critical_path"' /tmp/trig.txt | head -1 | python3 -c 'import sys, json
for l in sys.stdin:
  c = json.loads(l)["critical_path"]; print("  layer_us", c.get("layer_us"), c.get("error", ""))
  for s in c.get("sites", [])[:3]: print("    ", s["critical_us"], s["us"], s["kernel"][:60])' | tee -a $L
done
[ -n "$SHORT" ] && { echo "== done $(el)s" | tee -a $L; exit 0; }
echo "== decode batch 1, context 4096, TRELLIS_ATTN_TRIGGER 0 / 2 $(el)s" | tee -a $L
for pass in 1 2; do
  for v in 0 2; do
    TRELLIS_ATTN_TRIGGER=$v timeout 90 python3 -m bench.decode --model-dir $M --contexts 4096 --tokens 64 --paths cuda-graph \
      2>&1 | grep '"tokens_per_s\|error' | cut -c1-150 | sed "s/^/trigger $v /" | tee -a $L
  done
done
echo "== ncu, 32 rows of 8192x28672 $(el)s" | tee -a $L
timeout 120 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
  --section LaunchStats -o /tmp/ncu_m32 -f python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 32 \
  > $OUT/ncu_log_m32.txt 2>&1
timeout 60 ncu -i /tmp/ncu_m32.ncu-rep > $OUT/ncu_m32.txt 2>&1
timeout 60 ncu -i /tmp/ncu_m32.ncu-rep --page raw --csv > $OUT/ncu_raw_m32.csv 2>&1
grep -E "exl3_gemv|Duration|SM Frequency|DRAM Throughput|Issue Slots Busy|Issued Ipc|Eligible Warps|No Eligible|Active Warps Per|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" \
  $OUT/ncu_m32.txt | cut -c1-150 | head -16 | tee -a $L
echo "== done $(el)s" | tee -a $L
