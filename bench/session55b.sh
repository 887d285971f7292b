#!/bin/bash
# Session 55's second device call (carry .devcarry/shared; ~CALL_S seconds, default 420; GOALS=0
# unless asked). The first (bench/session55.sh, H100) timed 77 (no gain: decode 5-10% slower)
# but every twin launch (78 / 79) failed with "invalid argument": sa_slice_rows took an SM's share
# as half an SM for the twin's launched block too, so no slice fitted. Fixed; here again, with
# variant 80 (kSaSteal, units claimed at run time, written after the call):
# 1. 78 and 80 against shipped at 32 rows and at 12 / 17 / 24 rows of the three largest shapes
#    (bench.linear checks each variant's product against the reference first).
# 2. Stamps of 72 / 79 / 76 at 32 rows of 8192x28672 (teams in $OUT/teams.jsonl; the summary's
#    pair_end_gap_us says how far apart an SM's two grid blocks end).
# 3. The GPU tests of 78-80, a second pass at 32 rows, decode at batch 16 / 32 under 0 / 78 / 80.
export CALL_S=${CALL_S:-420}
GOALS=${GOALS:-0} source bench/session_start.sh  # the card, left, the debug build
AB_MIN_LEFT=20
variant_ab "pass 1" "78 80" 32 8192x28672 28672x8192 4096x28672
echo "== stamps 72 / 79 / 76, 32 rows of 8192x28672 $(el)s" | tee -a $L
timeout 60 python3 -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 72 79 76 --calls 2 --dump $OUT/teams.jsonl 2>&1 | tail -6 | tee -a $L
variant_ab "pass 1" "78 80" "12 17 24" 8192x28672 28672x8192 4096x28672
some_gpu_tests 70 pytest_variants.txt "block_variants or reordered or stamps or claimed" tests/test_gemv_wgmma_gpu.py
variant_ab "pass 2" "78 80" 32 8192x28672 28672x8192 4096x28672
[ $(left) -gt 100 ] && synth_llama
decode_rounds 40 "32 32 80" "32 32 78" "16 32 80" "16 32 78"
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-420} left" | tee -a $L
