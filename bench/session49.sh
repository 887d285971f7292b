#!/bin/bash
# Session 49's second GPU call, on whatever card comes; carry .devcarry/shared. It ran once, on an
# H100 (csrc/PERF_NOTES.md, session 49, call 2); TRELLIS_SA_WIDE_SHIPPED is gone since (wide blocks
# did not ship), so its second build now repeats the first and the script is a record. At most
# ~CALL_S seconds (default 560); each part after the A/B's first two passes runs only if the
# call's clock leaves it room (the tests come after them, so that a short call still times the
# variant).
# 1. On an H200 (and not GOALS=0): the goals (bench/h200_goals.sh QUICK=1: its own shipped
#    build, the 1 / 8 / 32-row products with dense fp16 in the same runs, batch-1 decode, prefill).
# 2. The debug build, and beside it a debug build with TRELLIS_SA_WIDE_SHIPPED (every shipped
#    block-shared form at two and four row groups in wide blocks).
# 3. The shipped product against debug variant 61 (kSaWide: the same forms in blocks of 16 warps,
#    one to an SM, slices twice as deep, so fewer k slices and workspace flushes) at 9, 12, 16, 17,
#    24 and 32 rows of 8192x28672, 4096x28672, 28672x8192, 4096x14336 and 14336x4096 (K = 4
#    MUL1; the last two take the two-tile wgmma form at 25..32 rows), two passes; then the whole
#    GPU suite of the debug build (test_wide_blocks_match_shipped, since merged into
#    test_block_shape_variants_match_shipped, checks variant 61), a third pass,
#    and the whole suite of the wide-shipped build.
# 4. Whole-model decode (synthetic Llama-3.1-8B, context 0, CUDA graphs) at batch 32, 24, 16 and 12
#    under TRELLIS_GV_VARIANT 0 and 61 (61 keeps the shipped rules of which layers take the
#    block-shared kernel), one process each, alternating; a second pass if time is left.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - t_call) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
(TRELLIS_NVCC_DEFINES=TRELLIS_SA_WIDE_SHIPPED TRELLIS_DEBUG_VARIANTS=1 TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=6 \
  timeout 300 python3 -c "from engine import ops; ops.extension(); print('wide-shipped build ready')" > $OUT/build_wide.txt 2>&1) &
export MAX_JOBS=10
SKIP_GPU_TESTS=1 source bench/gpu_common.sh  # the debug build
ab() {
  echo "== shipped / variant 61, pass $1 $(el)s" | tee -a $L
  timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 9 12 16 17 24 32 --variants 61 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab 1
ab 2
[ $(left) -gt 80 ] && gpu_tests 150 pytest_gpu.txt
[ $(left) -gt 40 ] && ab 3
wait
tail -n 1 $OUT/build_wide.txt | tee -a $L
[ $(left) -gt 100 ] && TRELLIS_NVCC_DEFINES=TRELLIS_SA_WIDE_SHIPPED gpu_tests 150 pytest_gpu_wide.txt TRELLIS_SA_WIDE_SHIPPED
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for pass in 1 2; do
  for batch in 32 24 16 12; do
    [ $(left) -gt 45 ] || break 2
    echo "== decode batch $batch, variant 0 / 61, pass $pass $(el)s" | tee -a $L
    DECODE_PASSES=1 DECODE_BATCH=$batch DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_VARIANT variant 0 61
  done
done
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
