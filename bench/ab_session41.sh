#!/bin/bash
# Ran in session 41 on an H100 (csrc/PERF_NOTES.md) with `red` in every kernel's flush; since then
# TRELLIS_FLUSH_RED reaches only the kernels that carry the output stage (bench/ab_session42.sh).
# Session 41's A/B: the split products' flushes as explicit `red` (TRELLIS_FLUSH_RED,
# csrc/exl3_gemv.cuh add_to_workspace) against the shipped atomics. Why: session 41's first calls
# found every flush as ATOMG 13% slower at 8 rows and 38% at 32 rows of 8192x28672 (H100), and the
# shipped kernels that carry the output stage still flush by ATOMG: the integer path's decode
# chain kernels (batch-1..4 decode) and the per-warp two-group kernel (9..16 rows of mid-size
# layers). Two shipped builds at once; the GPU suite on the red build (every product against the
# torch reference); bench.linear at 1, 4, 12 and 16 rows (dense fp16 in the same run), one process
# per build, one pass; whole-model decode (synthetic 4.0 bpw Llama-3.1-8B) at batch 1 (two passes)
# and 4 (one), alternating builds. ~280 s. Carry .devcarry/shared.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES=
(TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED MAX_JOBS=8 timeout 240 python3 -c "from engine import ops; ops.extension(); print('red built')" \
  > $OUT/build_red.txt 2>&1) &
source bench/gpu_common.sh
wait
tail -n 1 $OUT/build_red.txt | tee -a $L
echo "== gpu tests, red build $(el)s" | tee -a $L
TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED timeout 150 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests > $OUT/pytest_red.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_red.txt | head -20 | tee -a $L
declare -A DEF=([base]= [red]=TRELLIS_FLUSH_RED)
for pass in 1; do
  for b in base red; do
    echo "== products, build $b, pass $pass $(el)s" | tee -a $L
    TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
      --codebook mul1 --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 1 4 12 16 2>&1 | python3 -c "$SUM" \
      | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 1 4; do
  echo "== decode batch $batch, base / red $(el)s" | tee -a $L
  DECODE_PASSES=$(( batch == 1 ? 2 : 1 )) DECODE_BATCH=$batch DECODE_TOKENS=64 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_FLUSH_RED
done
echo "== done $(el)s" | tee -a $L
