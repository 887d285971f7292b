#!/bin/bash
# Session 51's device call (carry .devcarry/shared; at most ~CALL_S seconds, default 480):
# 1. On an H200 (and not GOALS=0): the goals (bench/h200_goals.sh QUICK=1, on the debug
#    build, whose variant 0 is the shipped code); nothing has run on an H200 since session 43.
# 2. The block-shared kernel at 5 and 8 rows (one row group), against the per-warp fp16 kernel
#    that serves them: debug variant 30 forces the block-shared kernel's synchronous form, 39 the
#    same with A12. Why: the 8-row goal (0.35x of fp16 at 8192x28672) is the furthest from its
#    figure (0.479x, session 43), and the block-shared structure paid at 9..16 rows of the largest
#    layers (session 39) but has not been timed at 5..8 rows of them since session 38's probe
#    (51.7 against the shipped kernel's 54.7 us at 8 rows, before the slice in parts and A12).
#    K = 4 MUL1, two passes, more if the call's clock allows.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-480} - ($(date +%s) - t_call) )); }
export TRELLIS_DEBUG_VARIANTS=1
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
SKIP_GPU_TESTS=1 source bench/gpu_common.sh  # the debug build (cached when the goals built it)
ab() {
  echo "== shipped / variants 30, 39 at 5 and 8 rows, pass $1 $(el)s" | tee -a $L
  timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 5 8 --variants 30 39 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab 1
ab 2
[ $(left) -gt 120 ] && ab 3
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
