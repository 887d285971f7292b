# The start every GPU-machine script shares (sourced by gpu_session.sh, gpu_tune.sh,
# check_unrun.sh and the ab_*.sh A/Bs): the environment, the log ($OUT/log.txt as $L, seconds
# since $t0, which `el` prints), the kernel build, the GPU tests (gpu_tests; full output in
# $OUT/pytest_gpu.txt; skipped with SKIP_GPU_TESTS=1; debug variants unless TRELLIS_DEBUG_VARIANTS=0),
# synth_llama (the synthetic model at $M, made once a machine), decode_by_setting (an A/B of one
# setting on whole-model decode), and $SUM, a one-line-per-row
# summary of bench.linear's JSON lines (other lines pass through).
export TRELLIS_DEBUG_VARIANTS=${TRELLIS_DEBUG_VARIANTS:-1} PYTHONUNBUFFERED=1 TRELLIS_SHARED=${TRELLIS_SHARED:-$PWD/.devcarry/shared} TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=${MAX_JOBS:-16}
L=$OUT/log.txt
t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
timeout 240 python3 -c "from engine import ops; import time; t=time.time(); ops.extension(); print('build_s', round(time.time()-t,1))" 2>&1 | tail -15 | tee -a $L
# The whole GPU suite (or, after LABEL, these pytest arguments) within TIMEOUT seconds, its output
# in $OUT/FILE, its failures and count in the log: gpu_tests TIMEOUT FILE [LABEL [ARG...]]  (an A/B
# build's suite: TRELLIS_NVCC_DEFINES=... gpu_tests ...)
gpu_tests() {
  local limit=$1 file=$2 label=$3
  shift $(( $# < 3 ? $# : 3 ))
  echo "== gpu tests${label:+, $label} $(el)s" | tee -a $L
  timeout $limit python3 -m pytest -q -rfs -m gpu -p no:cacheprovider "${@:-tests}" > $OUT/$file 2>&1
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/$file | head -30 | tee -a $L
}
# SKIP_GPU_TESTS=1: a second call of a session, its tests already run (or a script that runs them later)
[ -z "$SKIP_GPU_TESTS" ] && gpu_tests 300 pytest_gpu.txt
SUM='import sys,json
for l in sys.stdin:
  try: r=json.loads(l)
  except Exception: print(l.strip()); continue
  if "us" in r: print(r["bench"],r.get("variant",""),r["path"],r["shape"],r["codebook"],"m",r["m"],"K",r["K"],"us",r["us"],"fp16",r["fp16_us"],"ratio",r["ratio_vs_fp16"],"ref",r["reference_ratio_vs_fp16"],"GBps",r["trellis_GBps"],"check",r.get("check_rel_rms"))
  else: print(l.strip())'
# The synthetic 4.0 bpw Llama-3.1-8B model that decode_by_setting reads, made once a machine:
#   [ $(left) -gt 120 ] && synth_llama
M=/tmp/llama3-8b
synth_llama() {
  [ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
}
# Whole-model decode (synthetic Llama-3.1-8B shapes at $M, context 0, CUDA graphs) under each value
# of one environment setting, one process per value, alternating; batch 1, 96 tokens, two passes
# unless DECODE_BATCH, DECODE_TOKENS or DECODE_PASSES say otherwise:
#   [DECODE_BATCH=4 ...] decode_by_setting NAME LABEL VALUE...   (each line prefixed "LABEL VALUE")
decode_by_setting() {
  local name=$1 label=$2 pass v; shift 2
  for pass in $(seq ${DECODE_PASSES:-2}); do
    for v in "$@"; do
      env "$name=$v" timeout 90 python3 -m bench.decode --model-dir $M --contexts 0 --tokens ${DECODE_TOKENS:-96} \
        --batch ${DECODE_BATCH:-1} --paths cuda-graph 2>&1 | grep '"tokens_per_s\|error' | cut -c1-150 \
        | sed "s/^/$label $v /" | tee -a $L
    done
  done
}
