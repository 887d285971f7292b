#!/bin/bash
# Session 47's calls, on whatever card comes; carry .devcarry/shared. At most ~CALL_S seconds
# (default 540). `bash bench/session47.sh` (the second call, ran on an H100):
# - On an H200: first the goals (bench/h200_goals.sh, its own shipped build), which have
#   not run there since the 32-row kernel took A12 (session 45); then the debug build and, in what
#   time is left, the GPU tests of the files that session 47's removal of debug variant 52 touched
#   (prep_frag's integer form, the per-warp kernel's dispatch).
# - Elsewhere: the debug build and the whole GPU suite (gpu_common.sh), then batch-1 decode.
# `bash bench/session47.sh profile` (ran on an H100): on an H200 the goals first (as above); then,
# on any card, the shipped build and ncu of the 32- and 8-row K = 4 products of 8192x28672 with
# their stall samples per SASS instruction ($OUT/ncu_src_m32.csv, _m8.csv). Why: the 32-row product (the wgmma form,
# A12 since session 45) issues on 66% of the H200's cycles with 0.91 warps per issue waiting on fixed
# latencies (session 43); where in its loop they wait says what a next formulation has to change.
# `bash bench/session47.sh flush` (any card; ran on an H100 at fe4adf1, whose gv_flush_f16 had the
# form measured, removed after it: csrc/PERF_NOTES.md, session 47): the fp16 path's flush with one
# pointer and row test per row (the profile found the per-sum form at ~490 instructions for a
# 32-row flush's 64 adds and 10.5% of that product's stall samples) against the form before
# (TRELLIS_FLUSH_PER_ELEMENT, an A/B build made beside the debug build): the GPU suite on the new
# form; bench.linear at 8, 12, 16, 17, 24 and 32 rows (dense fp16 in the same run), one process per
# build, two passes; whole-model decode at batch 32 and 8 (synthetic Llama-3.1-8B, context 0),
# alternating builds.
# `bash bench/session47.sh slice` (on an H200 with CALL_S >= 500 the goals first): the wgmma tests
# (test_gemv_wgmma_gpu.py, variant 56's among them), then debug variants 54 (the 32-row product's
# A12 wgmma form without its activation slice), 55 (the slice copied, no passes over it; both
# probes with wrong results) and 56 (the slice in one pass) against the shipped form at 17, 24 and
# 32 rows of 8192x28672 and 4096x28672, two passes. (Its first run, at c352a63, had variant 54 alone.)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-540} - ($(date +%s) - t_call) )); }
h200=0; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && h200=1
if [ "$1" = slice ]; then
  [ $h200 = 1 ] && [ ${CALL_S:-540} -ge 500 ] && bash bench/h200_goals.sh
  if [ $(left) -lt 150 ]; then echo "== no time left for the probes" | tee -a $OUT/log.txt; exit 0; fi
  export SKIP_GPU_TESTS=1
  source bench/gpu_common.sh  # the debug build
  echo "== tests: test_gemv_wgmma_gpu.py $(el)s" | tee -a $L
  timeout 60 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/test_gemv_wgmma_gpu.py > $OUT/pytest_slice.txt 2>&1
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/pytest_slice.txt | head -12 | tee -a $L
  for pass in 1 2; do
    [ $(left) -gt 40 ] || break
    echo "== shipped / variants 54 (no slice), 55 (copy only), 56 (one pass), pass $pass $(el)s" | tee -a $L
    timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
      --shapes 8192x28672 4096x28672 --m 17 24 32 --variants 54 55 56 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
  done
elif [ "$1" = flush ]; then
  (TRELLIS_NVCC_DEFINES=TRELLIS_FLUSH_PER_ELEMENT TRELLIS_DEBUG_VARIANTS=1 TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=8 \
    timeout 240 python3 -c "from engine import ops; ops.extension(); print('per-element build ready')" > $OUT/build_old.txt 2>&1) &
  export TRELLIS_NVCC_DEFINES=
  source bench/gpu_common.sh  # the debug build (new flush) and the whole GPU suite
  wait
  tail -n 1 $OUT/build_old.txt | tee -a $L
  declare -A DEF=([new]= [old]=TRELLIS_FLUSH_PER_ELEMENT)
  M=/tmp/llama3-8b
  timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
  products() {
    for b in new old; do
      [ $(left) -gt 60 ] || return
      echo "== products, flush $b, pass $1 $(el)s" | tee -a $L
      TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 \
        --K 4 --codebook mul1 --paths fused --shapes 8192x28672 4096x14336 14336x4096 --m 8 12 16 17 24 32 2>&1 \
        | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
    done
  }
  products 1
  for batch in 32 8; do
    [ $(left) -gt 120 ] || break
    echo "== decode batch $batch, flush new / old $(el)s" | tee -a $L
    DECODE_PASSES=1 DECODE_BATCH=$batch DECODE_TOKENS=48 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_FLUSH_PER_ELEMENT
  done
  products 2
elif [ "$1" = profile ]; then
  [ $h200 = 1 ] && bash bench/h200_goals.sh
  # exported, not a prefix of `source` (bash restores those after it, and ncu's python would then
  # build the debug kernels under the profiler)
  export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
  source bench/gpu_common.sh
  for m in 32 8; do
    [ $(left) -gt 100 ] || break
    echo "== ncu, $m rows of 8192x28672 $(el)s" | tee -a $L
    timeout 120 ncu --clock-control none -k regex:exl3_gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight \
      --section SchedulerStats --section WarpStateStats --section SourceCounters --section InstructionStats \
      --metrics smsp__inst_executed.sum -o /tmp/ncu_m$m -f python3 -m bench.linear --once --shapes 8192x28672 --K 4 \
      --m $m > $OUT/ncu_log_m$m.txt 2>&1
    timeout 60 ncu -i /tmp/ncu_m$m.ncu-rep > $OUT/ncu_m$m.txt 2>&1
    timeout 60 ncu -i /tmp/ncu_m$m.ncu-rep --page source --csv --print-source sass > $OUT/ncu_src_m$m.csv 2>&1
    grep -E "exl3_gemv|Duration|SM Frequency|DRAM Throughput|Issue Slots Busy|Eligible Warps|No Eligible|inst_executed" \
      $OUT/ncu_m$m.txt | cut -c1-150 | head -12 | tee -a $L
  done
elif [ $h200 = 1 ]; then
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
