#!/bin/bash
# The next device call (written in session 54, which ran out of device time; carry
# .devcarry/shared; ~CALL_S seconds, default 480; GOALS=0 unless asked).
# Session 54's stamps (H100): of each SM's two blocks the one placed first ends first on every
# SM, ~13.5 us before the other, whose warps then run alone; static weights (74) lost, since the
# start order is decided at run time. Here, blocks whose warps all start together:
#   77 the per-warp kernel's shipped forms (1..8 rows) in blocks of 16 warps, one an SM
#   78 the block-shared kernel's grid blocks two to a launched block of 16 warps (kSaTwin)
#   79 78 with stamps, 76 wide blocks (61) with stamps, 72 the shipped form with stamps
# 1. 77 against shipped at 1 / 4 / 8 rows, 78 at 32 rows and at 12 / 17 / 24 rows, of the three
#    largest shapes (bench.linear checks each variant's product against the reference first).
# 2. Stamps (teams dumped to $OUT/teams.jsonl) of 72 / 79 / 76 at 32 rows of 8192x28672.
# 3. The GPU tests of the block variants, stamps and 77; then a second pass of 1; decode at batch
#    16 / 32 under 0 / 78 and at batch 1 / 8 under 0 / 77 (decode chains take 77 too at the
#    default split finish, 5).
GOALS=${GOALS:-0} source bench/session_start.sh  # the card, left, the debug build
variant_ab "pass 1" 77 "1 4 8" 8192x28672 28672x8192 4096x28672
variant_ab "pass 1" 78 32 8192x28672 28672x8192 4096x28672
echo "== stamps 72 / 79 / 76, 32 rows of 8192x28672 $(el)s" | tee -a $L
timeout 60 python3 -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 72 79 76 --calls 2 --dump $OUT/teams.jsonl 2>&1 | tail -6 | tee -a $L
variant_ab "pass 1" 78 "12 17 24" 8192x28672 28672x8192 4096x28672
some_gpu_tests 150 pytest_variants.txt "block_variants or reordered or stamps or sixteen_warps" tests/test_gemv_wgmma_gpu.py \
  tests/test_ops_gpu.py
variant_ab "pass 2" 77 "1 4 8" 8192x28672 28672x8192 4096x28672
variant_ab "pass 2" 78 32 8192x28672 28672x8192 4096x28672
[ $(left) -gt 100 ] && synth_llama
decode_rounds 60 "32 32 78" "16 32 78" "1 128 77" "8 64 77"
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
