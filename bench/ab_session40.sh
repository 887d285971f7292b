#!/bin/bash
# Ran in session 41 on an H100 (csrc/PERF_NOTES.md). TRELLIS_FLUSH_ATOM was removed after it, so
# its atom and both builds now build base and lean2.
# Session 40's A/B (written without device time, not yet run): do the split products' atomics
# into the workspace cost less as ATOMG (the L2 answers each) than as the REDG ptxas makes of
# them? The one kernel that still flushes by ATOMG in the shipped build, the per-warp two-group
# kernel (9..16 rows), took 112 against 81 us at 16 rows of 8192x28672 on an H100 without its
# dead output stage (session 38), and its flush's ATOMG -> REDG is the one change in its SASS
# beyond the dead code (session 40, csrc/PERF_NOTES.md). Four shipped builds
# (TRELLIS_NVCC_DEFINES, engine/ops/build.py), built at once (~90 s):
#   base   the shipped kernels
#   atom   every product's flush as ATOMG (TRELLIS_FLUSH_ATOM)
#   lean2  the two-group kernel without its stage, REDG: session 38's 112-us form
#   both   lean2 with ATOMG
# Then, per build, the product's rel. RMS against the torch reference (K = 4 MUL1, 1..32 rows: must
# stay under 2e-3), and bench.linear (K = 4 MUL1, dense fp16 in the same run) on the goal shape and
# Llama-3.1-8B's MLP shapes at 1, 8, 16 and 32 rows, one process per build, two passes, with
# TRELLIS_GV_SHARED=1 so that 16 rows of 8192x28672 run the per-warp two-group kernel as in session
# 38 (the shipped rule gives them the block-shared one); and whole-model decode (synthetic 4.0 bpw
# Llama-3.1-8B, shipped rules) at batch 1 and 16 for base / atom / both. ~450 s. Carry
# .devcarry/shared.
# Read: atom against base at 1, 8 and 32 rows (the goal products); lean2 against both at 16 rows
# (the hypothesis); both against base at 16 rows (whether the two-group kernel can drop its stage).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES=
source bench/gpu_common.sh
declare -A DEF=([base]= [atom]=TRELLIS_FLUSH_ATOM [lean2]=TRELLIS_LEAN_TWO_GROUPS
                [both]=TRELLIS_FLUSH_ATOM,TRELLIS_LEAN_TWO_GROUPS)
echo "== the other three builds, at once $(el)s" | tee -a $L
for b in atom lean2 both; do
  TRELLIS_NVCC_DEFINES=${DEF[$b]} MAX_JOBS=6 timeout 240 python3 -c "from engine import ops; ops.extension(); print('$b built')" \
    > $OUT/build_$b.txt 2>&1 &
done
wait
tail -n 2 $OUT/build_*.txt | tee -a $L
for b in base atom lean2 both; do
  TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -c "
from bench.linear import check_once
print('$b check', *[f'{s} m{m} {check_once(*s, 4, \"mul1\", m):.2e}' for s in ((8192, 28672), (4096, 14336)) for m in (1, 8, 16, 32)])" \
    2>&1 | tail -1 | tee -a $L
done
for pass in 1 2; do
  for b in base atom lean2 both; do
    echo "== products, build $b, pass $pass $(el)s" | tee -a $L
    TRELLIS_GV_SHARED=1 TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --codebook mul1 --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 1 8 16 32 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 1 16; do
  echo "== decode batch $batch, base / atom / both $(el)s" | tee -a $L
  DECODE_BATCH=$batch DECODE_TOKENS=64 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_FLUSH_ATOM \
    TRELLIS_FLUSH_ATOM,TRELLIS_LEAN_TWO_GROUPS
done
echo "== done $(el)s" | tee -a $L
