#!/bin/bash
# One GPU-machine session in one command: build the kernels, run the GPU tests, and the kernel,
# Viterbi and decode benchmarks. Usage (device tool): copy ../shared/fixtures into
# .devcarry/shared/fixtures (the GPU tests compare whole-model logits with the reference fixtures),
# carry .devcarry, and run `bash bench/gpu_session.sh`. Logs land in $OUT/log.txt.
# The converter quality run is bench/convert_session.sh: the SmolLM2 GGUF (98 MB) is over the 64 MiB
# carry limit, so it goes over in two parts in back-to-back calls (see that script).
source bench/gpu_common.sh
echo "== decode $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 240 python3 -m bench.decode --paths cuda-graph cuda-graph-pipelined cuda-graph-fp16 cuda-graph-nopdl cuda-graph-nogroup cuda-graph-sdpa cuda-graph cuda-graph-pipelined --contexts 0 4096 --tokens 128 --breakdown 2>&1 | grep -v Warn | tee $OUT/decode.jsonl | cut -c1-1500 | tail -9 | tee -a $L
# The previous version in the same run: a copy of an earlier commit's engine/csrc/bench under
# .devcarry/prev (git archive <commit> engine csrc bench | tar -x -C .devcarry/prev), if present.
if [ -d .devcarry/prev/engine ]; then (cd .devcarry/prev && timeout 150 python3 -m bench.decode --paths cuda-graph --contexts 0 4096 --tokens 128 2>&1 | grep tokens_per_s | sed "s/^/previous version /" | tee -a $L); fi
echo "== generation loop and sampler $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 120 python3 -m bench.generate --tokens 256 --passes 2 2>&1 | grep '"generate"' | tee -a $L
timeout 90 python3 -m bench.sampling --device cuda --profile --calls 30 2>&1 | grep '"sampling' | cut -c1-400 | tee -a $L
echo "== prefill $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 60 python3 -m bench.prefill --paths cuda --lengths 4096 --modes last_logits 2>&1 | tail -3 | tee -a $L; TRELLIS_GROUP=0 timeout 60 python3 -m bench.prefill --paths cuda --lengths 4096 --modes last_logits 2>&1 | tail -2 | sed "s/^/nogroup /" | tee -a $L
echo "== linear $(( $(date +%s)-t0 ))s" | tee -a $L
TRELLIS_INT8=0 timeout 60 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 32 --paths fused fused2 --cache cold --calls 100 --warmup 10 2>&1 | tee $OUT/linear.jsonl | python3 -c "$SUM" | tee -a $L
TRELLIS_INT8=0 timeout 40 python3 -m bench.linear --shapes 8192x28672 --K 2 3 5 6 --m 1 --paths fused --cache cold --calls 100 --warmup 10 2>&1 | grep '"us"' | tee -a $OUT/linear.jsonl | python3 -c "$SUM" | tee -a $L
TRELLIS_INT8=1 timeout 30 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 --paths fused --cache cold --calls 100 --warmup 10 2>&1 | grep '"us"' | python3 -c "$SUM" | sed 's/^/int8 /' | tee -a $L
TRELLIS_INT8=0 timeout 60 python3 -m bench.linear --shapes 8192x28672 --K 4 2 --m 1 --cache cold --probe --paths fused --calls 100 --warmup 10 2>&1 | grep probe | python3 -c "$SUM" | tee -a $L
echo "== linear, graph-replay timing (no host cost), grid cap sweep for small layers $(( $(date +%s)-t0 ))s" | tee -a $L
for U in 8 4 2; do TRELLIS_INT8=0 timeout 40 python3 -m bench.linear --timing graph --min-units $U --shapes 4096x1024 4096x4096 4096x14336 14336x4096 8192x28672 --K 4 --m 1 --paths fused --cache cold --calls 50 --warmup 5 2>&1 | grep '"us"' | python3 -c "$SUM" | sed "s/^/graph min_units=$U /" | tee -a $L; done
echo "== viterbi $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 40 python3 -m bench.viterbi 2>&1 | tail -10 | tee -a $L
echo "== ncu $(( $(date +%s)-t0 ))s" | tee -a $L
TRELLIS_INT8=0 timeout 120 ncu --clock-control none -k regex:gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > $OUT/ncu.txt 2>&1; grep -E "Throughput|Duration|Achieved Occupancy|Registers|Stall|Issue|Theoretical Occ|DRAM|Eligible|Active Warps" $OUT/ncu.txt | head -40 | tee -a $L
echo "== done $(( $(date +%s)-t0 ))s" | tee -a $L
echo "== decode, grid cap sweep $(( $(date +%s)-t0 ))s" | tee -a $L
for U in 4 2; do TRELLIS_GV_MIN_UNITS=$U timeout 90 python3 -m bench.decode --paths cuda-graph --contexts 0 --tokens 64 2>&1 | grep tokens_per_s | sed "s/^/min_units=$U /" | tee -a $L; done
echo "== ncu int8 path and small layer $(( $(date +%s)-t0 ))s" | tee -a $L
STALL='--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
TRELLIS_INT8=1 timeout 120 ncu --clock-control none -k regex:gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats $STALL python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > $OUT/ncu_int8.txt 2>&1; grep -E "Duration|Throughput|Issue|Eligible|Registers|ratio" $OUT/ncu_int8.txt | sort -k3 -n -r | head -30 | tee -a $L
TRELLIS_GV_MIN_UNITS=2 timeout 120 ncu --clock-control none -k regex:gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section SchedulerStats $STALL python3 -m bench.linear --once --shapes 4096x4096 --K 4 --m 1 > $OUT/ncu_small.txt 2>&1; grep -E "Duration|Throughput|Issue|Eligible|ratio" $OUT/ncu_small.txt | head -40 | tee -a $L
echo "== all done $(( $(date +%s)-t0 ))s" | tee -a $L
