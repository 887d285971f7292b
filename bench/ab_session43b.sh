#!/bin/bash
# Session 43's second call, on whatever card comes; carry .devcarry/shared. ~250 s on an H100,
# ~300 s on an H200.
# 1. On an H200: the goals (bench/h200_goals.sh), and nothing else (the session's device
#    time is short).
# On any other card:
# 2. The 8192x28672 K = 4 MUL1 products at 1, 8, 16 and 32 rows, dense fp16 in the same run.
# 3. ncu of the 32-row product (the block-shared kernel on Hopper's warpgroup MMA, shipped since
#    session 39, never profiled) and of the 8-row one (the per-warp fp16 kernel): issue, eligible
#    warps, stall reasons and pipe utilisation ($OUT/ncu_m*.txt, every raw metric in
#    $OUT/ncu_raw_m*.csv), for the "what limits each kernel".
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && { bash bench/h200_goals.sh; exit 0; }
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
source bench/gpu_common.sh
echo "== products $(el)s" | tee -a $L
timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
  --shapes 8192x28672 --m 1 8 16 32 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
for m in 32 8; do
  echo "== ncu, $m rows of 8192x28672 $(el)s" | tee -a $L
  timeout 120 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
    --section LaunchStats -o /tmp/ncu_m$m -f python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m $m \
    > $OUT/ncu_log_m$m.txt 2>&1
  timeout 60 ncu -i /tmp/ncu_m$m.ncu-rep > $OUT/ncu_m$m.txt 2>&1
  timeout 60 ncu -i /tmp/ncu_m$m.ncu-rep --page raw --csv > $OUT/ncu_raw_m$m.csv 2>&1
  grep -E "exl3_gemv|Duration|SM Frequency|DRAM Throughput|Issue Slots Busy|Issued Ipc|Eligible Warps|No Eligible|Active Warps Per|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" \
    $OUT/ncu_m$m.txt | cut -c1-150 | head -16 | tee -a $L
done
echo "== done $(el)s" | tee -a $L
