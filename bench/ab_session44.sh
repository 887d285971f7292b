#!/bin/bash
# Session 44's one call, on whatever card comes; carry .devcarry/shared. At most ~570 s (CALL_S): each part
# after the first runs only if the call's clock leaves it room.
# 1. On an H200, first the goals (bench/h200_goals.sh, its own shipped build).
# 2. The debug build; the wgmma tests and variant 51's (tests/test_gemv_wgmma_gpu.py, the
#    four_row_units test of tests/test_ops_gpu.py).
# 3. Debug variants 49 and 50 (written in session 43, not yet run) against the shipped block-shared
#    wgmma kernel (bench.linear's plain rows; variant 30 is that kernel's synchronous form, not it):
#    49, its K = 4 MUL1 decode with the states' A masked once (A12); 50, through the integer path's
#    products (A12 and one window's mask by an IMAD). nvdisasm of the
#    loop: 38.0 instructions a tile against 39.0, ALU ops 14.9 / 13.9 against 15.9 (csrc/
#    PERF_NOTES.md, session 43). Why: ncu puts the 32-row product on the H200 at 66% issue, the ALU
#    pipe its busiest; 0.6x of fp16 needs ~10%. K = 4 MUL1 at 17, 24 and 32 rows of 8192x28672 and
#    4096x28672, dense fp16 in the same run.
# 4. The integer path at 5 and 8 rows (TRELLIS_INT8=1) as shipped (CFG 0, one k row of 4 tiles a
#    unit) and as debug variant 51 (CFG 13: four k rows), and the fp16 path (the shipped choice)
#    in the same run. Why: at 8 rows of 8192x28672 it took 78 us against the fp16 path's 52 (H100,
#    session 37) though on paper it needs ~30 instructions a tile against ~45.
# 5. ncu of 8 rows of 8192x28672 on the integer path and on the fp16 path (registers, occupancy,
#    issue, pipes, stalls), to say why the integer path loses there.
# 6. Second passes of 3 and 4 where time is left.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - t_call) )); }
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash bench/h200_goals.sh; fi
export SKIP_GPU_TESTS=1  # the tests below alone
source bench/gpu_common.sh
if [ $(left) -gt 150 ]; then
  echo "== tests: wgmma, variant 51 $(el)s" | tee -a $L
  timeout 120 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_gemv_wgmma_gpu.py tests/test_ops_gpu.py \
    -k "wgmma or four_row_units" > $OUT/pytest_wgmma.txt 2>&1
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_wgmma.txt | head -12 | tee -a $L
fi
variants_pass() {
  echo "== shipped (plain rows) / variants 49 / 50, pass $1 $(el)s" | tee -a $L
  timeout 100 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 --m 17 24 32 --variants 49 50 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
int8_pass() {
  echo "== integer path at 5 / 8 rows: shipped (plain rows) and variant 51; fp16 path, pass $1 $(el)s" | tee -a $L
  TRELLIS_INT8=1 timeout 80 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 --variants 51 2>&1 | python3 -c "$SUM" \
    | grep -v '^{' | tee -a $L
  timeout 50 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 2>&1 | python3 -c "$SUM" | grep -v '^{' \
    | sed 's/^/f16 /' | tee -a $L
}
[ $(left) -gt 110 ] && variants_pass 1
[ $(left) -gt 140 ] && int8_pass 1
if [ $(left) -gt 90 ]; then
  for i8 in 1 0; do
    echo "== ncu 8 rows, TRELLIS_INT8=$i8 $(el)s" | tee -a $L
    TRELLIS_INT8=$i8 timeout 45 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum \
      python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 8 > $OUT/ncu_m8_i8_$i8.txt 2>&1
    grep -E "exl3_gemv|Duration|Registers Per|Achieved Occ|Theoretical Occ|Block Limit|Issue Slots Busy|Eligible|No Eligible|inst_executed|Pipe|Stall|Local|spill" \
      $OUT/ncu_m8_i8_$i8.txt | head -40 | tee -a $L
  done
fi
[ $(left) -gt 110 ] && variants_pass 2
[ $(left) -gt 140 ] && int8_pass 2
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-570} left" | tee -a $L
