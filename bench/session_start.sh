# The start a session's device script shares (sourced by bench/session51.sh, session52.sh): the
# card's name in $OUT/log.txt, left (seconds of the call's CALL_S, default 480, still to go), the
# issue's goals on an H200 unless GOALS=0 (bench/h200_goals.sh QUICK=1, on the debug build, whose
# variant 0 is the shipped code), then the debug build without the GPU tests (bench/gpu_common.sh;
# cached when the goals built it), which gives the script $L, el, gpu_tests, decode_by_setting
# and $SUM; and synth_llama, the synthetic 4.0 bpw Llama-3.1-8B model at $M that
# decode_by_setting reads (made once a machine).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-480} - ($(date +%s) - t_call) )); }
export TRELLIS_DEBUG_VARIANTS=1
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
SKIP_GPU_TESTS=1 source bench/gpu_common.sh
M=/tmp/llama3-8b
synth_llama() {
  [ -d $M ] || timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
}
