#!/bin/bash
# Session 54's second device call (carry .devcarry/shared; ~CALL_S seconds, default 240; GOALS=0
# unless asked). Session 54's stamps: of each SM's two blocks the one placed first ends first on
# every SM, ~13.5 us before the other; weighting it (74) lost, as the misplaced SMs straggle.
# 1. The per-warp kernel's shipped forms in blocks of 16 warps, one an SM (debug variant 77),
#    against the shipped two blocks of 8 at 1 / 4 / 8 rows of the three largest shapes, two passes
#    (bench.linear checks each variant's product against the reference first).
# 2. Stamps of wide block-shared blocks (76: 61 with stamps) at 32 rows of 8192x28672: do a
#    block's four teams end together?
# 3. The GPU tests of the block variants (76 among them).
export CALL_S=${CALL_S:-240}
GOALS=${GOALS:-0} source bench/session_start.sh  # the card, left, the debug build
ab77() {
  echo "== shipped / 77 at 1 4 8 rows, pass $1 $(el)s" | tee -a $L
  timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 100 --warmup 10 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 28672x8192 4096x28672 --m 1 4 8 --variants 77 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab77 1
echo "== stamps of wide blocks (76) and shipped (72), 32 rows of 8192x28672 $(el)s" | tee -a $L
timeout 40 python3 -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 76 72 --calls 2 --dump $OUT/teams.jsonl 2>&1 | tail -4 | tee -a $L
[ $(left) -gt 60 ] && some_gpu_tests 40 pytest_variants.txt "block_variants" tests/test_gemv_wgmma_gpu.py
[ $(left) -gt 40 ] && ab77 2
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-240} left" | tee -a $L
