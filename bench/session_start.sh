# The start a session's device script shares (sourced by bench/session51.sh to session53.sh): the
# card's name in $OUT/log.txt, left (seconds of the call's CALL_S, default 480, still to go), the
# issue's goals on an H200 unless GOALS=0 (bench/h200_goals.sh QUICK=1, on the debug build, whose
# variant 0 is the shipped code), then the debug build without the GPU tests (bench/gpu_common.sh;
# cached when the goals built it), which gives the script $L, el, gpu_tests, synth_llama,
# decode_by_setting and $SUM.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
t_call=$(date +%s)
left() { echo $(( ${CALL_S:-480} - ($(date +%s) - t_call) )); }
export TRELLIS_DEBUG_VARIANTS=1
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${GOALS:-1}" = 1 ] && QUICK=1 bash bench/h200_goals.sh
SKIP_GPU_TESTS=1 source bench/gpu_common.sh
