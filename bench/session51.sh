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
#    K = 4 MUL1, two passes, more if the call's clock allows. Ran once (call 4, an H100): 6-23%
#    slower than the per-warp kernel at every shape (csrc/PERF_NOTES.md, session 51).
# `bash bench/session51.sh a12` runs, after 1., this instead of 2.: the per-warp fp16 path now
# takes K = 4's states with A masked once (lane_states_k4's A12, kF16A12); debug variant 64 keeps
# the form before (two masks). Why: session 32 measured A12 there 0.9-2.9% faster at 8 rows on an
# H100 (debug variant 8, csrc/PERF_NOTES.md), and the fp16 path never took it; the 8-row goal is
# the furthest from its figure. The shipped product against 64 at 1..16 rows (at 1 row the
# integer path, the same kernel under both: a control; at 12 and 16 rows the largest layers take
# the block-shared kernel as shipped and the per-warp one under 64), two passes; the whole GPU
# suite (test_decode_forms_give_the_same_product runs 64 and 8 on the fp16 path); whole-model
# decode at batch 8 under TRELLIS_GV_VARIANT 0 and 64 (one process each, alternating). Ran once
# (call 5, an H100): 0.5-3.0% faster at 5..8 rows, decode the same within noise; shipped.
source bench/session_start.sh  # the card, left, the goals on an H200, the debug build
ab() {
  echo "== shipped / variants 30, 39 at 5 and 8 rows, pass $1 $(el)s" | tee -a $L
  timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 5 8 --variants 30 39 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
if [ "$1" = a12 ]; then
  ab64() {
    echo "== shipped (A12 on the fp16 path) / variant 64 (without), pass $1 $(el)s" | tee -a $L
    timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
      --shapes 8192x28672 4096x28672 14336x4096 4096x14336 4096x4096 4096x6144 --m 1 5 8 12 16 --variants 64 2>&1 \
      | python3 -c "$SUM" | grep -v '^{' | tee -a $L
  }
  ab64 1
  ab64 2
  [ $(left) -gt 150 ] && gpu_tests 140 pytest_gpu.txt
  [ $(left) -gt 120 ] && synth_llama
  for round in 1 2; do
    [ $(left) -gt 80 ] || break
    echo "== decode batch 8, variant 0 / 64, round $round $(el)s" | tee -a $L
    DECODE_PASSES=1 DECODE_BATCH=8 DECODE_TOKENS=48 decode_by_setting TRELLIS_GV_VARIANT variant 0 64
  done
  [ $(left) -gt 40 ] && ab64 3
else
  ab 1
  ab 2
  [ $(left) -gt 120 ] && ab 3
fi
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
