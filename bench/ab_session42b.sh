#!/bin/bash
# RUN in session 42 (H100; csrc/PERF_NOTES.md) and kept as its record: its macros are gone since
# (TRELLIS_FLUSH_RED and TRELLIS_LEAN_TWO_GROUPS are the shipped forms now, the block cap the
# default), so today it would time one build under several names. bench/ab_session42c.sh compares
# against the earlier forms.
# The decode half of bench/ab_session42.sh (written in session 41, not yet run): run it right after
# that script on the same warm machine (its builds are then cached; cold, it builds base and red
# again, ~120 s more). Carry .devcarry/shared. ~330 s warm.
# Whole-model decode (synthetic 4.0 bpw Llama-3.1-8B, CUDA graphs, 64 tokens, alternating
# processes, two passes): TRELLIS_GV_BLOCK_CAP 0 / 1 at batch 1 (a control: the one-row kernels
# have 128 registers, two blocks at most), 8 and 16; the red build against base at batch 1, 12
# and 16 (session 41's every-kernel red was 2-3% slower at batch 1).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1 TRELLIS_NVCC_DEFINES= TRELLIS_CACHE=/tmp/trellis-cache
(TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_RED MAX_JOBS=8 timeout 300 python3 -c "from engine import ops; ops.extension(); print('red built')" \
  > $OUT/build_red.txt 2>&1) &
source bench/gpu_common.sh
wait
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 1 8 16; do
  echo "== decode batch $batch, block cap 0 / 1 $(el)s" | tee -a $L
  DECODE_BATCH=$batch DECODE_TOKENS=64 decode_by_setting TRELLIS_GV_BLOCK_CAP cap 0 1
done
for batch in 1 12 16; do
  echo "== decode batch $batch, base / red $(el)s" | tee -a $L
  DECODE_BATCH=$batch DECODE_TOKENS=64 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_FLUSH_RED
done
echo "== done $(el)s" | tee -a $L
