#!/bin/bash
# Debug variants 49 and 50 (written in session 43, not yet run) against the shipped block-shared
# wgmma kernel, on whatever card comes (the goal card is the H200); carry .devcarry/shared. ~300 s.
# 49: its K = 4 MUL1 decode with the states' A masked once (A12); 50: through the integer path's
# products (A12 and one window's mask by an IMAD). nvdisasm of the loop: 38.0 instructions a tile
# against 39.0, ALU ops 14.9 / 13.9 against 15.9 (csrc/PERF_NOTES.md, session 43). Why: ncu puts
# the 32-row product on the H200 at 66% issue, the ALU pipe its busiest; 0.6x of fp16 needs ~10%.
# 1. The debug build, and tests/test_gemv_wgmma_gpu.py (the new variants' test among them).
# 2. bench.linear --variants 30 49 50 (30: the shipped block-shared kernel) in one process, twice:
#    K = 4 MUL1 at 17, 24 and 32 rows of 8192x28672 and 4096x28672, dense fp16 in the same run.
# 2b. The integer path at 5 and 8 rows (TRELLIS_INT8=1) as shipped (CFG 0) and as debug variant 51
#    (CFG 13: four k rows of 4 tiles a unit), and the fp16 path (the shipped choice) in the same run.
# 3. On an H200, then the goals (bench/h200_goals.sh, its own shipped build).
# 4. If time is left (under 470 s so far): ncu of 8 rows of 8192x28672 on the integer path
#    (TRELLIS_INT8=1: 78 against 52 us on the fp16 path, session 37, on paper 30 against 45
#    instructions a tile) and on the fp16 path: registers, occupancy, issue, pipes, stalls, to say
#    why the integer path loses at 5..8 rows.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export SKIP_GPU_TESTS=1  # the wgmma tests alone, below
source bench/gpu_common.sh
echo "== wgmma tests $(el)s" | tee -a $L
timeout 150 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_gemv_wgmma_gpu.py tests/test_ops_gpu.py -k "wgmma or four_row_units" > $OUT/pytest_wgmma.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_wgmma.txt | head -12 | tee -a $L
for pass in 1 2; do
  echo "== variants 30 / 49 / 50, pass $pass $(el)s" | tee -a $L
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 --m 17 24 32 --variants 30 49 50 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
done
echo "== integer path at 5 / 8 rows: shipped (CFG 0) against variant 51 (CFG 13), fp16 path in the same run $(el)s" | tee -a $L
for pass in 1 2; do
  TRELLIS_INT8=1 timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 --variants 0 51 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
  timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed 's/^/f16 /' | tee -a $L
done
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash bench/h200_goals.sh; fi
if [ $(el) -lt 470 ]; then
  for i8 in 1 0; do
    echo "== ncu 8 rows, TRELLIS_INT8=$i8 $(el)s" | tee -a $L
    TRELLIS_INT8=$i8 timeout 60 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum \
      python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 8 > $OUT/ncu_m8_i8_$i8.txt 2>&1
    grep -E "exl3_gemv|Duration|Registers Per|Achieved Occ|Theoretical Occ|Block Limit|Issue Slots Busy|Eligible|No Eligible|inst_executed|Pipe|Stall|Local|spill" \
      $OUT/ncu_m8_i8_$i8.txt | head -40 | tee -a $L
  done
fi
echo "== done $(el)s" | tee -a $L
