#!/bin/bash
# Session 54's device call (ran at 70caf20, on an H100; variants 74 / 75 and --sa-old-weight have
# been removed since, so it runs no longer). Carry .devcarry/shared; at most ~CALL_S seconds,
# default 480; GOALS=0 unless asked.
# Question: session 54's stamps (H100, 32 rows of 8192x28672) had the k slices' mean ends 14 us
# apart and half the teams done 13.6 us before the last while SMs idled only 4%: does one block of
# each SM (the one placed first?) finish early, leaving the other's teams alone at half the warps?
# Debug variants 74 / 75 (kSaWaveWeights: each slice's blocks interleaved across the grid, the
# first `SMs` blocks weighted old_w / 256; 75 with stamps).
# 1. Stamps with every team dumped ($OUT/teams.jsonl) at 32 rows of 8192x28672: the shipped grid
#    (72), then 75 at weights 256 (interleaved only), 320 and 384.
# 2. At 32 rows of three shapes: shipped, dense fp16 and 74 in one process per weight (256, 320,
#    384, 448), two passes; then 17 / 24 rows of the two largest.
# 3. The GPU tests of the block variants and stamps.
GOALS=${GOALS:-0} source bench/session_start.sh  # the card, left, the debug build
echo "== stamps, 32 rows of 8192x28672: 72, then 75 at weights 256 320 384 $(el)s" | tee -a $L
timeout 40 python3 -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 72 --calls 3 --dump $OUT/teams.jsonl 2>&1 | tail -3 | tee -a $L
for w in 256 320 384; do
  timeout 40 python3 -m bench.sa_stamps --shape 8192x28672 --m 32 --variants 75 --calls 2 --old-weight $w --dump $OUT/teams.jsonl 2>&1 | tail -2 | tee -a $L
done
timeout 40 python3 -m bench.sa_stamps --shape 28672x8192 --m 32 --variants 72 75 --calls 2 --old-weight 320 2>&1 | tail -4 | tee -a $L
ab_weights() {  # pass, rows, shapes...
  local pass=$1 rows=$2 w; shift 2
  for w in 256 320 384 448; do
    [ $(left) -gt 60 ] || return 0
    echo "== shipped / 74 at weight $w, $rows rows, pass $pass $(el)s" | tee -a $L
    timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 100 --warmup 10 --K 4 --codebook mul1 --paths fused \
      --shapes "$@" --m $rows --variants 74 --sa-old-weight $w 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
  done
}
ab_weights 1 32 8192x28672 28672x8192 4096x28672
ab_weights 2 32 8192x28672 28672x8192 4096x28672
some_gpu_tests 120 pytest_variants.txt "block_variants or reordered or stamps" tests/test_gemv_wgmma_gpu.py
ab_weights 1 "17 24" 8192x28672 28672x8192
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
