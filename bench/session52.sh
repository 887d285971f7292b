#!/bin/bash
# Session 52's device call, a record: it ran once (an H200, CALL_S=450) at b5ba4ef, whose debug
# variants 65-67 are gone since (measured slower; csrc/PERF_NOTES.md, session 52). Carry
# .devcarry/shared; at most ~CALL_S seconds, default 480:
# 1. On an H200 (and not GOALS=0): the goals (bench/h200_goals.sh QUICK=1, on the debug
#    build, whose variant 0 is the shipped code); nothing has run on an H200 since session 43.
# 2. Debug variants 66 / 67 at 32 rows (K = 4 MUL1's four-tile wgmma form, the goal's 32-row
#    product): each state's raw value alone in a register and two wgmmas a k row and tile, the odd
#    steps against the slice 16 bytes further on (the prep writes it N-major), so no PRMT packs a
#    pair (SASS: 132 instructions a k row of 4 tiles against 140). 67 swaps the descriptor's
#    strides, in case the N-major layout reads them the other way; first their errors against the
#    reference, then the A/B (two passes), their GPU tests, decode at batch 32 under 0 / 66.
# 3. Debug variant 65 against the shipped per-warp fp16 kernel at 5 and 8 rows: MUL1's raw decode
#    with one weight a register, half2(1024 + t, 0) straight from its IDP4A, and two MMAs a tile
#    (the odd steps against B shifted down a half) instead of a PRMT packing each weight pair. Why:
#    the 8-row goal (0.35x of fp16 at 8192x28672) is the furthest from its figure; that product
#    issues on 76% of cycles with the ALU pipe 64% busy and the tensor pipe 13% (ncu, session 43),
#    and the PRMTs are 4 of its ~45 instructions a tile, all on the ALU pipe (SASS: the CFG 10
#    loop 1,456 -> 1,368 instructions for 32 tiles). K = 4 MUL1, two passes; the GPU tests of the
#    decode forms (the new one reads which kernel ran); whole-model decode at batch 8 under
#    TRELLIS_GV_VARIANT 0 and 65; a third pass and the whole GPU suite if the clock allows.
# Ran (H200): goals 1 / 8 / 32 rows 0.399-0.404x / 0.469x / 0.621-0.623x of fp16, decode 419.8 and
# 388.6 tok/s, prefill 35,882 tok/s; 66 right (67 wrong: the strides are as 66 has them) but
# 20-26% slower at 32 rows; 65 5-7% slower at 5..8 rows of the large layers; decode at batch 8 /
# 32 1-3% / 7-9% slower; the 11 GPU tests of the forms passed; no time was left for the suite.
# Since session 53 its tests and decode rounds go through session_start.sh's some_gpu_tests and
# decode_rounds, the same commands (the batch-8 step's clock gate was 80 s, now 60).
source bench/session_start.sh  # the card, left, the goals on an H200, the debug build
ab65() {
  echo "== shipped / variant 65 (unpacked MUL1 pairs) at 5 and 8 rows, pass $1 $(el)s" | tee -a $L
  timeout 150 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 14336x4096 4096x14336 4096x4096 4096x6144 --m 5 8 --variants 65 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
echo "== variants 66 / 67: errors against the reference at 32 rows $(el)s" | tee -a $L
timeout 90 python3 -c '
import torch
from engine import ops
from engine.formats import exl3 as fmt
from tests.gpu_layers import rand_layer, rel_rms
t = rand_layer(4096, 28672, 4, "mul1", seed=66, bias=True)
x = torch.randn(32, 4096, device="cuda").half()
want = fmt.exl3_matmul_reference(x.float(), t)
for v in (0, 66, 67):
    with ops.debug_variant(v):
        y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
    print("variant", v, "rel_rms", rel_rms(y, want), "finite", bool(torch.isfinite(y).all()))
' 2>&1 | tail -4 | tee -a $L
ab66() {
  echo "== shipped / variants 66, 67 (unpacked wgmma) at 32 rows, pass $1 $(el)s" | tee -a $L
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
    --shapes 8192x28672 4096x28672 28672x8192 8192x14336 --m 32 --variants 66 67 2>&1 \
    | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
ab66 1
ab65 1
[ $(left) -gt 200 ] && ab66 2
[ $(left) -gt 200 ] && ab65 2
some_gpu_tests 150 pytest_forms.txt "unpacked or decode_forms" tests/test_ops_gpu.py tests/test_gemv_wgmma_gpu.py
[ $(left) -gt 120 ] && synth_llama
decode_rounds 60 "8 48 65" "32 32 66"
[ $(left) -gt 60 ] && { ab66 3; ab65 3; }
[ $(left) -gt 200 ] && gpu_tests $(( $(left) - 20 )) pytest_gpu.txt
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-480} left" | tee -a $L
