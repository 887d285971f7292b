#!/bin/bash
# Session 48's A/B for the next GPU call (written after its device time was spent), on whatever
# card comes; carry .devcarry/shared. Ran in session 49 on an H100 (csrc/PERF_NOTES.md): none of
# variants 57-60 paid, and they are gone since, so the script is a record. At most ~CALL_S
# seconds (default 560); each part after the first runs only if the call's clock leaves it room.
# 1. On an H200 (and not GOALS=0): the goals first (bench/h200_goals.sh, its own shipped
#    build): nothing has run there since session 43, before A12 (45), the one-pass slice (47) and
#    the slice in parts (48).
# 2. The debug build and the whole GPU suite (test_slice_fill_debug_forms_match_shipped checks
#    debug variants 57 and 58).
# 3. The shipped product against debug variants 57 (the synchronous forms' slice parts by every
#    thread's cp.async), 58 (the parts the teams start in copied first) and 60 (the block barrier
#    after the PDL wait, not before the ring's first copies) at 9, 12, 16, 17, 24
#    and 32 rows of 8192x28672, 4096x28672 and 28672x8192 (K = 4 MUL1), dense fp16 in the same
#    process, three passes. Why: the slice in parts measured 2.0% slower than the one-pass form at
#    9..16 rows (26 of 27 pairs, H100, bench/session48.sh final) and 1.1% faster at 17..32; 57 asks
#    whether the bulk copies' fill rate is what the synchronous form's 8 teams wait for, 58 whether
#    their order is, 60 whether the start's block barrier is.
# 4. Debug variants 54 (no slice) and 59 (half the slice's parts copied; both probes with wrong
#    results) against the shipped product at 17, 24 and 32 rows of 8192x28672 and 4096x28672, two
#    passes. Why: the parts gained less at 32 rows than 54 bounds; if 59 lands about halfway to 54,
#    the slice's bytes are what is left, and a slice shared by a cluster's blocks would pay.
# (No whole-model decode: a debug variant forces the block-shared kernel on every layer, the small
# ones included, which the shipped rule leaves to the per-warp kernel at 9..16 rows.)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - t_call) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && bash bench/h200_goals.sh
source bench/gpu_common.sh  # the debug build and the whole GPU suite
for pass in 1 2 3; do
  [ $(left) -gt 40 ] || break
  echo "== shipped / variants 57, 58, 60, pass $pass $(el)s" | tee -a $L
  timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 --m 9 12 16 17 24 32 --variants 57 58 60 2>&1 | python3 -c "$SUM" \
    | grep -v '^{' | tee -a $L
done
for pass in 1 2; do
  [ $(left) -gt 30 ] || break
  echo "== shipped / probes 54, 59, pass $pass $(el)s" | tee -a $L
  timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 --m 17 24 32 --variants 54 59 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
done
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
