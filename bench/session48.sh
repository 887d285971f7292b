#!/bin/bash
# Session 48's calls, on whatever card comes; carry .devcarry/shared. At most ~CALL_S seconds
# (default 560). `bash bench/session48.sh`:
# - On an H200: first the goals (bench/h200_goals.sh, its own shipped build).
# - Then the debug build and the whole GPU suite, beside it an A/B build of the shipped kernels
#   with the block-shared slice in three passes as before session 48 (TRELLIS_SA_THREE_PASS); the
#   products under each build (one process each, alternating, two passes): K = 4 MUL1 at 9, 12,
#   16, 17, 24 and 32 rows of 8192x28672, 4096x28672, 28672x8192, 4096x14336 and 14336x4096 (the
#   last two take the two-tile wgmma form at 25..32 rows), K = 2 3INST at 12 and 32 rows, dense fp16
#   in the same runs; debug variants 30 (the synchronous kernel without A12) and 39 (with) at
#   9..16 rows; whole-model decode at batch 12, 16 and 32 alternating builds.
# `bash bench/session48.sh parts` (on an H200 the goals first): the same products and decode, the
# slice in parts (this tree) against the one-pass form (a2717d6's engine, csrc and bench, carried as
# .devcarry/base48: `git archive a2717d6 csrc engine bench | tar -x -C .devcarry/base48`), after
# the debug build and the whole GPU suite; ran twice on H100s (the parts' first form, row sums
# before the main loop, and the one that ships). `final`: no tests or decode, three passes of the
# K = 4 products at three shapes (ran on an H100 at b3afec7).
# Its first call (H100, at 5febec8 plus the script) ran the whole suite and, at 9 / 12 / 16 rows of
# 8192x28672 and 4096x14336, the shipped product against debug variants 39 (A12) and 56 (A12 and
# the one-pass slice; gone since, every form's now). The second (H100, at 80300a1) ran the A/B
# above; the three-pass form and its define are gone since (csrc/PERF_NOTES.md, session 48), so the
# script is a record: its A/B build would now compile the one-pass form twice.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - t_call) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && bash bench/h200_goals.sh
if [ "$1" = parts ] || [ "$1" = final ]; then
  # the one-pass slice (a2717d6's engine, csrc and bench, carried as .devcarry/base48) against this
  # tree's slice in parts; both shipped builds beside the debug one (final: no debug build, tests
  # or decode; three passes of the K = 4 products at three shapes)
  B=.devcarry/base48
  jobs=5; [ "$1" = final ] && jobs=8
  (cd $B && TRELLIS_DEBUG_VARIANTS=0 TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=$jobs timeout 300 \
    python3 -c "from engine import ops; ops.extension(); print('one-pass build ready')" > $OUT/build_base.txt 2>&1) &
  (TRELLIS_DEBUG_VARIANTS=0 TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=$jobs timeout 300 \
    python3 -c "from engine import ops; ops.extension(); print('parts build ready')" > $OUT/build_parts.txt 2>&1) &
  export MAX_JOBS=6
  [ "$1" = final ] && export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
  source bench/gpu_common.sh  # the debug build and the whole GPU suite (final: the shipped build, no tests)
  wait
  tail -qn 1 $OUT/build_base.txt $OUT/build_parts.txt | tee -a $L
  export TRELLIS_DEBUG_VARIANTS=0
  declare -A DIR=([parts]=. [one]=$B)
  lin() { (cd ${DIR[$1]} && timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --paths fused "${@:2}" \
    2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$1 /" | tee -a $L); }
  products() {
    for b in parts one; do
      [ $(left) -gt 60 ] || return
      echo "== products, slice $b, pass $1 $(el)s" | tee -a $L
      lin $b --K 4 --codebook mul1 --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 9 12 16 17 24 32
      lin $b --K 2 --codebook 3inst --shapes 8192x28672 4096x14336 --m 12 32
    done
  }
  if [ "$1" = final ]; then
    for pass in 1 2 3; do
      for b in parts one; do
        [ $(left) -gt 40 ] || break 2
        echo "== products, slice $b, pass $pass $(el)s" | tee -a $L
        lin $b --K 4 --codebook mul1 --shapes 8192x28672 4096x28672 28672x8192 --m 9 12 16 17 24 32
      done
    done
    echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
    exit 0
  fi
  products 1
  M=/tmp/llama3-8b
  [ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
  for batch in 32 24 16 12; do
    [ $(left) -gt 90 ] || break
    echo "== decode batch $batch, slice parts / one pass $(el)s" | tee -a $L
    for b in parts one; do
      (cd ${DIR[$b]} && timeout 90 python3 -m bench.decode --model-dir $M --contexts 0 --tokens 48 --batch $batch \
        --paths cuda-graph 2>&1 | grep '"tokens_per_s\|error' | cut -c1-150 | sed "s/^/$b /" | tee -a $L)
    done
  done
  products 2
  echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
  exit 0
fi
# the A/B's two shipped builds (no debug variants), beside the debug build
for b in one three; do
  (TRELLIS_NVCC_DEFINES=$([ $b = three ] && echo TRELLIS_SA_THREE_PASS) TRELLIS_DEBUG_VARIANTS=0 \
    TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=5 timeout 300 python3 -c "from engine import ops; ops.extension(); print('$b-pass build ready')" \
    > $OUT/build_$b.txt 2>&1) &
done
export TRELLIS_NVCC_DEFINES= MAX_JOBS=6
source bench/gpu_common.sh  # the debug build (one-pass slice) and the whole GPU suite
wait
tail -qn 1 $OUT/build_one.txt $OUT/build_three.txt | tee -a $L
export TRELLIS_DEBUG_VARIANTS=0
declare -A DEF=([one]= [three]=TRELLIS_SA_THREE_PASS)
products() {
  for b in one three; do
    [ $(left) -gt 60 ] || return
    echo "== products, slice $b-pass, pass $1 $(el)s" | tee -a $L
    TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 90 python3 -m bench.linear --timing graph \
      --cache cold --calls 40 --warmup 5 --K 4 --codebook mul1 --paths fused \
      --shapes 8192x28672 4096x28672 28672x8192 4096x14336 14336x4096 --m 9 12 16 17 24 32 2>&1 \
      | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
    TRELLIS_NVCC_DEFINES=${DEF[$b]} timeout 60 python3 -m bench.linear --timing graph \
      --cache cold --calls 40 --warmup 5 --K 2 --codebook 3inst --paths fused --shapes 8192x28672 4096x14336 --m 12 32 2>&1 \
      | python3 -c "$SUM" | grep -v '^{' | sed "s/^/$b /" | tee -a $L
  done
}
products 1
if [ $(left) -gt 60 ]; then
  echo "== 9..16 rows, variants 30 (CFG 0) / 39 (A12) $(el)s" | tee -a $L
  TRELLIS_DEBUG_VARIANTS=1 timeout 60 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 \
    --codebook mul1 --paths fused --shapes 4096x28672 28672x8192 --m 9 12 16 --variants 30 39 30 39 2>&1 | python3 -c "$SUM" | grep tune | tee -a $L
fi
M=/tmp/llama3-8b
[ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for batch in 32 16 12; do
  [ $(left) -gt 100 ] || break
  echo "== decode batch $batch, slice one / three passes $(el)s" | tee -a $L
  DECODE_PASSES=1 DECODE_BATCH=$batch DECODE_TOKENS=48 decode_by_setting TRELLIS_NVCC_DEFINES build "" TRELLIS_SA_THREE_PASS
done
products 2
echo "== done $(el)s, $(left) s of the call's ${CALL_S:-560} left" | tee -a $L
