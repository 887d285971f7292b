#!/bin/bash
# Session 47's second call, on whatever card comes; carry .devcarry/shared. At most ~CALL_S seconds
# (default 540).
# - On an H200: first the goals (bench/h200_goals.sh, its own shipped build), which have
#   not run there since the 32-row kernel took A12 (session 45); then the debug build and, in what
#   time is left, the GPU tests of the files that session 47's removal of debug variant 52 touched
#   (prep_frag's integer form, the per-warp kernel's dispatch).
# - Elsewhere: the debug build and the whole GPU suite (gpu_common.sh), then batch-1 decode.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-540} - ($(date +%s) - t_call) )); }
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash bench/h200_goals.sh
  SKIP_GPU_TESTS=1 source bench/gpu_common.sh
  if [ $(left) -gt 40 ]; then
    echo "== tests: test_ops_gpu.py, test_gemv_shared_gpu.py $(el)s, $(left) s left" | tee -a $L
    timeout $(( $(left) - 15 )) python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_ops_gpu.py \
      tests/test_gemv_shared_gpu.py > $OUT/pytest_47.txt 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_47.txt | head -12 | tee -a $L
  fi
else
  source bench/gpu_common.sh  # the debug build and the whole GPU suite
  M=/tmp/llama3-8b
  if [ $(left) -gt 100 ]; then
    timeout 40 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
    echo "== decode, batch 1 $(el)s" | tee -a $L
    DECODE_TOKENS=128 decode_by_setting TRELLIS_INT8 int8 auto
  fi
fi
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-540} left" | tee -a $L
