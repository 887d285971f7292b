#!/bin/bash
# One GPU-machine call for a kernel change: build, the GPU tests, the product per layer with the
# shipped configuration and the one-row-per-unit one (debug variant 10), graph-replay timing of
# small layers next to the previous version (.devcarry/prev, see gpu_session.sh), whole-model
# decode with the attention kernel and with SDPA, self prep, decode chains and without preps (a probe), each
# with the trigger at the products' tail (default) and at their start, the previous version's
# decode, a kernel breakdown and ncu of the int8 product. QUICK=1 leaves out the K sweep, graph
# timing, prefill, the breakdown, ncu and the many-row products (8-32 rows per layer, batched
# decode) (a validation call on little device time). VARS adds
# gv_tune configurations (10 + CFG) to the per-layer and decode runs.
# Logs land in $OUT/log.txt.
VARS=${VARS:-"0 10"}
source bench/gpu_common.sh
echo "== linear, int8 at m=1 $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 120 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 --paths fused --cache cold --calls 100 --warmup 10 --variants $VARS 2>&1 | grep tune | tee $OUT/tune_i8.jsonl | python3 -c "$SUM" | tee -a $L
echo "== linear, fp16 path $(( $(date +%s)-t0 ))s" | tee -a $L
TRELLIS_INT8=0 timeout 150 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 32 --paths fused --cache cold --calls 100 --warmup 10 --variants $VARS 2>&1 | grep tune | tee $OUT/tune_f16.jsonl | python3 -c "$SUM" | tee -a $L
[ -n "$QUICK" ] || timeout 60 python3 -m bench.linear --shapes 8192x28672 --K 2 3 5 --m 1 --paths fused --cache cold --calls 100 --warmup 10 2>&1 | grep '"us"' | python3 -c "$SUM" | tee -a $L
echo "== many rows: graph timing, default / per-warp kernel only (31) / block-shared kernel everywhere (30) $(( $(date +%s)-t0 ))s" | tee -a $L
[ -n "$QUICK" ] || timeout 150 python3 -m bench.linear --timing graph --shapes 8192x28672 4096x14336 14336x4096 4096x4096 --K 4 --m 8 16 32 --paths fused --cache cold --calls 50 --warmup 5 --variants 0 31 30 2>&1 | grep tune | python3 -c "$SUM" | tee -a $L
[ -n "$QUICK" ] || timeout 120 python3 -m bench.decode --paths cuda-graph --contexts 0 --tokens 64 --batch 8 16 32 2>&1 | grep tokens_per_s | cut -c1-200 | sed "s/^/batched /" | tee -a $L
echo "== graph-replay timing, this version then the previous one $(( $(date +%s)-t0 ))s" | tee -a $L
GR="--timing graph --shapes 4096x4096 4096x14336 14336x4096 8192x28672 --K 4 --m 1 --paths fused --cache cold --calls 50 --warmup 5"
[ -n "$QUICK" ] || timeout 60 python3 -m bench.linear $GR 2>&1 | grep '"us"' | python3 -c "$SUM" | sed "s/^/graph now /" | tee -a $L
if [ -z "$QUICK" ] && [ -d .devcarry/prev/engine ]; then (cd .devcarry/prev && timeout 100 python3 -m bench.linear $GR 2>&1 | grep '"us"' | python3 -c "$SUM" | sed "s/^/graph prev /" | tee -a $L); fi
echo "== decode: attention kernel / SDPA, prep kernels / self prep / chains / none (probe), trigger at the tail (default) / start $(( $(date +%s)-t0 ))s" | tee -a $L
DEC="python3 -m bench.decode --paths cuda-graph cuda-graph-sdpa cuda-graph-selfprep cuda-graph-chain cuda-graph-noprep cuda-graph --contexts 0 4096 --tokens 128"
timeout 180 $DEC 2>&1 | grep tokens_per_s | cut -c1-160 | sed "s/^/trigger-tail /" | tee -a $L
TRELLIS_EARLY_TRIGGER=1 timeout 180 $DEC 2>&1 | grep tokens_per_s | cut -c1-160 | sed "s/^/trigger-start /" | tee -a $L
for V in $VARS; do [ "$V" = 0 ] || TRELLIS_GV_VARIANT=$V timeout 90 python3 -m bench.decode --paths cuda-graph --contexts 0 --tokens 128 2>&1 | grep tokens_per_s | cut -c1-160 | sed "s/^/variant=$V /" | tee -a $L; done
if [ -d .devcarry/prev/engine ]; then (cd .devcarry/prev && timeout 120 python3 -m bench.decode --paths cuda-graph --contexts 0 4096 --tokens 128 2>&1 | grep tokens_per_s | cut -c1-160 | sed "s/^/previous version /" | tee -a $L); fi
echo "== prefill $(( $(date +%s)-t0 ))s" | tee -a $L
[ -n "$QUICK" ] || timeout 60 python3 -m bench.prefill --paths cuda --lengths 4096 --modes last_logits 2>&1 | tail -2 | cut -c1-300 | tee -a $L
echo "== breakdown $(( $(date +%s)-t0 ))s" | tee -a $L
[ -n "$QUICK" ] || timeout 90 python3 -m bench.decode --paths cuda-graph-nopdl --contexts 0 --tokens 64 --breakdown 2>&1 | grep -v Warn | tee $OUT/breakdown.jsonl | grep breakdown | cut -c1-1500 | tee -a $L
echo "== ncu, int8 product $(( $(date +%s)-t0 ))s" | tee -a $L
M=sm__cycles_active.avg,smsp__inst_executed.sum,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
[ -n "$QUICK" ] || timeout 60 ncu --clock-control none -k regex:gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --metrics $M python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 > $OUT/ncu.txt 2>&1; grep -E "Duration|Frequency|sm__|smsp__|dram__|Stall|Registers" $OUT/ncu.txt | tee -a $L
echo "== all done $(( $(date +%s)-t0 ))s" | tee -a $L
