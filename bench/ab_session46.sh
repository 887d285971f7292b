#!/bin/bash
# Session 45's second call (written as ab_session45.sh, unrun; session 46 added part 6 and GOALS=0;
# ran in session 47 on an H100 with GOALS=0, after which variant 52 was removed, so its variant-52
# parts no longer time what they name: a record), on whatever card comes; carry .devcarry/shared. At most ~CALL_S seconds (default 540): each part
# after the first runs only if the call's clock leaves it room.
# 1. On an H200 with CALL_S >= 500 (and not GOALS=0), first the goals (bench/h200_goals.sh,
#    its own shipped build), which now include the K = 4 MUL1 wgmma form with A12 (session 45; variant 49 until then).
# 2. The debug build; the wgmma tests and variants 51 / 52's (test_gemv_wgmma_gpu.py; the
#    four_row_units and compact tests of test_ops_gpu.py), with the occupancy and grouped-product
#    tests beside them, and test_gemv_shared_gpu.py's two-tile dispatch and output-stage tests
#    (which read the block-shared kernel's CFG, A12 now included).
# 3. The shipped wgmma form (A12 now: bench.linear's plain rows) against debug variant 53 (the form
#    shipped until now) at 17, 24 and 32 rows of 8192x28672 and 4096x28672, dense fp16 in the same
#    run. Why: the first call (H100) measured 49 1.2-2.4% faster on 8192x28672; this confirms it
#    as shipped, on the same card as the goals where that is an H200.
# 4. The integer path at 5 and 8 rows (TRELLIS_INT8=1): variant 51 (CFG 13: four k rows of 4 tiles)
#    and 52 (CFG 14: the same with compact activations, gv_compact_b), and the fp16 path (the
#    shipped choice) in the same run. Why: 51 took 60.4-61.2 us at 8 rows of 8192x28672 against the
#    fp16 path's 52.5-53.1 (H100, first call) though its loop has ~27 instructions a tile against
#    ~38; its activations are 4x repeated in memory, 1 KB a k row beside 512 bytes of trellis.
# 5. ncu of 8 rows of 8192x28672 under 52 and 51: stalls per issue, pipes, L2, to say what holds
#    the integer path there if not the issue slots.
# 6. Whole-model decode at batch 5 and 8 (synthetic Llama-3.1-8B, context 0, CUDA graphs): shipped
#    (the fp16 path there) against the integer path under variants 52 and 51 (TRELLIS_INT8=1), one
#    process each (gpu_common.sh's decode_by_setting). Why: what part 4's products are worth in a
#    decode step.
# Order: 2, 4, 5, 6, 3, then second passes of 4 and 3 where time is left (4 before 2 where CALL_S < 400).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-540} - ($(date +%s) - t_call) )); }
# (the goals take ~300 s: under CALL_S 500 the experiments below come first, the goals not at all)
if [ "${GOALS:-1}" != 0 ] && [ ${CALL_S:-540} -ge 500 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash bench/h200_goals.sh; fi
export SKIP_GPU_TESTS=1  # the tests below alone
source bench/gpu_common.sh
run_tests() {
  echo "== tests: wgmma, variants 51 / 52 $(el)s" | tee -a $L
  timeout 150 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_gemv_wgmma_gpu.py tests/test_ops_gpu.py \
    tests/test_gemv_shared_gpu.py -k "wgmma or four_row_units or compact or occupancy or grouped or two_tiles or output_stage" \
    > $OUT/pytest_45.txt 2>&1
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_45.txt | head -12 | tee -a $L
}
wgmma_pass() {
  echo "== wgmma form: shipped (A12, plain rows) / variant 53 (before), pass $1 $(el)s" | tee -a $L
  timeout 80 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 --m 17 24 32 --variants 53 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
int8_pass() {
  echo "== integer path at 5 / 8 rows: variants 51 / 52; fp16 path, pass $1 $(el)s" | tee -a $L
  TRELLIS_INT8=1 timeout 80 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 --variants 51 52 2>&1 | python3 -c "$SUM" \
    | grep -v "^{" | tee -a $L
  timeout 50 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 \
    --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 5 8 2>&1 | python3 -c "$SUM" | grep -v '^{' \
    | sed 's/^/f16 /' | tee -a $L
}
# A short call (CALL_S < 400, ~80 s of it the build) times the integer path before the tests.
if [ ${CALL_S:-540} -lt 400 ]; then
  [ $(left) -gt 100 ] && int8_pass 1
  [ $(left) -gt 130 ] && run_tests
else
  [ $(left) -gt 130 ] && run_tests
  [ $(left) -gt 100 ] && int8_pass 1
fi
for v in 52 51; do
  [ $(left) -gt 50 ] || break
  echo "== ncu 8 rows, integer path, variant $v $(el)s" | tee -a $L
  TRELLIS_INT8=1 TRELLIS_GV_VARIANT=$v timeout 45 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active|smsp__inst_executed\.sum$' \
    python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 8 > $OUT/ncu_m8_v$v.txt 2>&1
  grep -E "exl3_gemv|Duration|Registers Per|Achieved Occ|L2 Cache|DRAM Through|Issue Slots Busy|Eligible Warps|inst_executed|stalled|pipe_|ERR|rror" \
    $OUT/ncu_m8_v$v.txt | awk '$NF != "0" && $NF != "0.00"' | head -40 | tee -a $L
done
if [ $(left) -gt 150 ]; then
  M=/tmp/llama3-8b
  [ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
  for b in 8 5; do  # gpu_common.sh's decode_by_setting: up to 90 s a process
    [ $(left) -gt 100 ] || break
    echo "== decode, batch $b: shipped (TRELLIS_INT8=auto) / integer path under 52 / 51 $(el)s" | tee -a $L
    DECODE_BATCH=$b DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_INT8 int8 auto
    [ $(left) -gt 190 ] || break
    TRELLIS_INT8=1 DECODE_BATCH=$b DECODE_TOKENS=48 DECODE_PASSES=1 decode_by_setting TRELLIS_GV_VARIANT var 52 51
  done
fi
[ $(left) -gt 70 ] && wgmma_pass 1
[ $(left) -gt 100 ] && int8_pass 2
[ $(left) -gt 70 ] && wgmma_pass 2
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-540} left" | tee -a $L
