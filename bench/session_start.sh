# The start a session's device script shares (sourced by bench/session51.sh to session55b.sh): the
# card's name in $OUT/log.txt, left (seconds of the call's CALL_S, default 480, still to go), the
# issue's goals on an H200 unless GOALS=0 (bench/h200_goals.sh QUICK=1, on the debug build, whose
# variant 0 is the shipped code), then the debug build without the GPU tests (bench/gpu_common.sh;
# cached when the goals built it), which gives the script $L, el, gpu_tests, synth_llama,
# decode_by_setting and $SUM. Then three helpers of its own, which read left:
#   some_gpu_tests LIMIT FILE EXPR PATH...  gpu_tests of PATH... that match -k EXPR, within LIMIT
#     seconds and the call's clock
#   variant_ab LABEL VARIANT ROWS SHAPES...  K = 4 MUL1 products of SHAPES at ROWS, shipped and VARIANT
#     timed in one process (bench.linear checks VARIANT's product first), while more than
#     AB_MIN_LEFT (default 60) s are left
#   decode_rounds MIN "BATCH TOKENS VARIANT"...  two rounds of whole-model decode under
#     TRELLIS_GV_VARIANT 0 and VARIANT at each batch, one process each, while more than MIN s are left
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-480} - ($(date +%s) - t_call) )); }
export TRELLIS_DEBUG_VARIANTS=1
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
SKIP_GPU_TESTS=1 source bench/gpu_common.sh
some_gpu_tests() {
  local limit=$1 file=$2 expr=$3; shift 3
  gpu_tests $(( $(left) > limit ? limit : $(left) - 10 )) $file "$expr" "$@" -k "$expr"
}
variant_ab() {  # LABEL VARIANT ROWS SHAPES...: bench.linear of K = 4 MUL1, shipped and VARIANT in one process
  local label=$1 v=$2 rows=$3; shift 3
  [ $(left) -gt ${AB_MIN_LEFT:-60} ] || return 0
  echo "== shipped / $v at $rows rows, $label $(el)s" | tee -a $L
  timeout 120 python3 -m bench.linear --timing graph --cache cold --calls 100 --warmup 10 --K 4 --codebook mul1 --paths fused \
    --shapes "$@" --m $rows --variants $v 2>&1 | python3 -c "$SUM" | grep -v '^{' | tee -a $L
}
decode_rounds() {
  local min=$1 round spec b t v; shift
  for round in 1 2; do
    for spec in "$@"; do
      read -r b t v <<< "$spec"
      [ $(left) -gt $min ] || return 0
      echo "== decode batch $b, variant 0 / $v, round $round $(el)s" | tee -a $L
      DECODE_PASSES=1 DECODE_BATCH=$b DECODE_TOKENS=$t decode_by_setting TRELLIS_GV_VARIANT variant 0 $v
    done
  done
}
