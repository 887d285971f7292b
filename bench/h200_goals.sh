#!/bin/bash
# The goals on an H200, and nothing on any other GPU: it stops after nvidia-smi unless the
# card is an H200, so a call that lands on an H100 costs only the machine's start. Why: the lent
# machines are mostly H100s, and the goals (and the last figures in csrc/PERF_NOTES.md) are the
# H200's. Carry .devcarry/shared. ~300 s on an H200 with a fresh build (80 s with a cached one,
# session 37):
#   the shipped build (no debug variants); the 8192x28672 K = 4 products at 1, 8 and 32 rows twice,
#   dense fp16 in the same runs; batch-1 decode twice (CUDA graphs, synthetic 4.0 bpw
#   Llama-3.1-8B shapes) and its layer's critical path by kernel (--breakdown); prefill of 4,096
#   tokens; bench/stream_probe.cu (how fast the one-row product's ring reads its trellis with no
#   decode, against a plain read: on the H200 30.3 us against 27.6, session 37); ncu of the
#   one-row product (issue, stalls, DRAM) and its stall samples per SASS instruction
#   ($OUT/ncu_src.csv). QUICK=1 stops after the prefill (no probe, no ncu: ~100 s less);
#   PRODUCTS=1 after the goal products (~80 s with a fresh shipped build, for a short budget).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "not an H200: stopped" | tee -a $OUT/log.txt; exit 0; fi
# gpu_common.sh runs no tests and by default builds the shipped kernels alone; a caller that wants
# the debug build afterwards may pass TRELLIS_DEBUG_VARIANTS=1 (its variant 0 is the shipped code).
export TRELLIS_DEBUG_VARIANTS=${TRELLIS_DEBUG_VARIANTS:-0} SKIP_GPU_TESTS=1
source bench/gpu_common.sh
echo "== goal products $(el)s" | tee -a $L
for p in 1 2; do
  timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 100 --warmup 10 --K 4 --paths fused \
    --shapes 8192x28672 --m 1 8 32 2>&1 | grep '"us"' | cut -c1-400 | tee -a $L
done
[ "${PRODUCTS:-0}" = 1 ] && { echo "== goal products done $(el)s" | tee -a $L; exit 0; }
M=/tmp/llama3-8b
timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
echo "== decode, batch 1 $(el)s" | tee -a $L
# --breakdown: after each path's timed tokens, a profiled 8 (the layer's critical path by kernel site)
timeout 120 python3 -m bench.decode --model-dir $M --contexts 0 --tokens 128 --paths cuda-graph cuda-graph --breakdown \
  > /tmp/decode_b1.txt 2>&1
grep '"tokens_per_s\|error' /tmp/decode_b1.txt | grep -v '"critical_path"' | cut -c1-170 | tee -a $L
echo "== decode layer's critical path by kernel site $(el)s" | tee -a $L
grep '"critical_path"' /tmp/decode_b1.txt | head -1 | python3 -c 'import sys, json
for l in sys.stdin:
  c = json.loads(l)["critical_path"]; print("layer_us", c.get("layer_us"), c.get("error", ""))
  for s in c.get("sites", []): print("  ", s["critical_us"], s["us"], s["kernel"])' | tee -a $L
echo "== prefill 4096 $(el)s" | tee -a $L
timeout 60 python3 -m bench.prefill --paths cuda --lengths 4096 --modes last_logits 2>&1 | tail -1 | tee -a $L
[ "${QUICK:-0}" = 1 ] && { echo "== goals done (quick) $(el)s" | tee -a $L; exit 0; }
echo "== stream probe $(el)s" | tee -a $L  # the ring's read rate without the product's work
nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc bench/stream_probe.cu -o /tmp/stream_probe && timeout 60 /tmp/stream_probe 20 0 100 \
  | cut -c1-160 | tee -a $L
echo "== ncu, one row of 8192x28672 $(el)s" | tee -a $L
timeout 90 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section SchedulerStats --section WarpStateStats --section SourceCounters --metrics smsp__inst_executed.sum \
  -o /tmp/ncu_goal -f python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > $OUT/ncu_log.txt 2>&1
timeout 60 ncu -i /tmp/ncu_goal.ncu-rep > $OUT/ncu.txt 2>&1
grep -E "SM Frequency|Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|No Eligible|inst_executed|Stall" $OUT/ncu.txt \
  | head -24 | tee -a $L
timeout 60 ncu -i /tmp/ncu_goal.ncu-rep --page source --csv --print-source sass > $OUT/ncu_src.csv 2>&1
echo "== done $(el)s" | tee -a $L
