#!/bin/bash
# A record: ran in session 50 on an H100 (csrc/PERF_NOTES.md); debug variants 62 and 63 are removed
# since, so it no longer builds what it times. Written in session 49 (as ab_session49.sh, unrun);
# session 50 added variant 63. Carry .devcarry/shared. At most ~CALL_S
# seconds (default 560); each part after the A/B's first two passes runs only if the call's clock
# leaves it room.
# 1. On an H200 (and not GOALS=0): the goals (bench/h200_goals.sh QUICK=1: its own shipped
#    build, the 1 / 8 / 32-row products with dense fp16 in the same runs, batch-1 decode, prefill);
#    nothing has run on an H200 since session 43.
# 2. The debug build; the shipped product against debug variants 62 (kSaThree: at 17..32 rows two
#    tiles a unit and the wgmma form three blocks to an SM, 6 warps a scheduler instead of 4, with
#    smaller slices) at 17, 24 and 32 rows of 8192x28672, 4096x28672, 28672x8192, 4096x14336 and
#    14336x4096 (K = 4 MUL1), two passes; then the whole GPU suite
#    (test_block_shape_variants_match_shipped checks variants 61-63), a third pass.
# 3. Whole-model decode (synthetic Llama-3.1-8B, context 0, CUDA graphs) at batch 32, 24 and 17
#    under TRELLIS_GV_VARIANT 0, 62 and 63 (62 and 63 keep the shipped rules of which layers take the
#    block-shared kernel), one process each, alternating; a second pass if time is left.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - t_call) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
SKIP_GPU_TESTS=1 source bench/gpu_common.sh  # the debug build
ab() {
  echo "== shipped / variants 62, 63, pass $1 $(el)s" | tee -a $L
  timeout 130 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 17 24 32 --variants 62 63 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab 1
ab 2
[ $(left) -gt 80 ] && gpu_tests 150 pytest_gpu.txt
[ $(left) -gt 40 ] && ab 3
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for round in 1 2; do
  for batch in 32 24 17; do
    [ $(left) -gt 60 ] || break 2
    echo "== decode batch $batch, variant 0 / 62 / 63, round $round $(el)s" | tee -a $L
    DECODE_PASSES=1 DECODE_BATCH=$batch DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_VARIANT variant 0 62 63
  done
done
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
