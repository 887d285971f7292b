#!/bin/bash
# One GPU-machine session in one command: build the kernels, run the GPU tests, and every benchmark.
# Usage (device tool): copy ../shared/fixtures into .devcarry/shared/fixtures (the GPU tests compare
# whole-model logits with the reference fixtures), copy this script to .devcarry/, carry .devcarry,
# and run `bash .devcarry/gpu_session.sh`. Logs and JSON lines land in $OUT.
export PYTHONUNBUFFERED=1 TRELLIS_SHARED=$PWD/.devcarry/shared TRELLIS_CACHE=/tmp/trellis-cache MAX_JOBS=16
L=$OUT/log.txt
t0=$(date +%s)
timeout 240 python3 -c "from engine import ops; import time; t=time.time(); ops.extension(); print('build_s', round(time.time()-t,1))" 2>&1 | tail -30 | tee -a $L
echo "== gpu tests" | tee -a $L
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py 2>&1 | tail -30 | tee -a $L
echo "== linear $(( $(date +%s)-t0 ))s" | tee -a $L
SUM='import sys,json
for l in sys.stdin:
  try: r=json.loads(l)
  except Exception: print(l.strip()); continue
  if "us" in r: print(r["bench"],r.get("variant",""),r["shape"],r["cache"],r["codebook"],"m",r["m"],"K",r["K"],"us",r["us"],"fp16",r["fp16_us"],"ratio",r["ratio_vs_fp16"],"ref",r["reference_ratio_vs_fp16"],"GBps",r["trellis_GBps"])
  else: print(l.strip())'
TRELLIS_INT8=1 timeout 150 python3 -m bench.linear --cache both 2>&1 | tee $OUT/linear.jsonl | python3 -c "$SUM" | tee -a $L
echo "== codebooks+probe $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 60 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 32 --codebook mcg 3inst --cache cold 2>&1 | grep '"us"' | python3 -c "$SUM" | tee -a $L
TRELLIS_INT8=1 timeout 60 python3 -m bench.linear --shapes 8192x28672 --K 2 4 6 --m 1 8 32 --cache cold --probe 2>&1 | grep probe | python3 -c "$SUM" | tee -a $L
TRELLIS_INT8=0 timeout 30 python3 -m bench.linear --shapes 8192x28672 --K 4 --m 1 8 --cache cold 2>&1 | grep '"us"' | python3 -c "$SUM" | sed 's/^/int8off /' | tee -a $L
timeout 40 python3 -m bench.linear --shapes 8192x28672 4096x14336 --K 4 --m 48 64 128 --paths fused dense --cache cold 2>&1 | grep '"us"' | python3 -c "$SUM" | sed 's/^/bigm /' | tee -a $L
echo "== decode $(( $(date +%s)-t0 ))s" | tee -a $L
TRELLIS_INT8=1 timeout 150 python3 -m bench.decode --paths cuda-graph cuda torch --contexts 0 4096 --tokens 64 --profile 2>&1 | tail -60 | tee $OUT/decode.txt | tee -a $L
echo "== prefill $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 90 python3 -m bench.prefill --paths cuda --lengths 1024 4096 --modes last_logits --profile 2>&1 | tail -30 | tee $OUT/prefill.jsonl | tee -a $L
echo "== ncu $(( $(date +%s)-t0 ))s" | tee -a $L
export TRELLIS_INT8=1
for cb in mul1 mcg; do
timeout 60 ncu --clock-control none -k regex:exl3_mm --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats python3 -m bench.linear --once --shapes 8192x28672 --K 4 --m 1 --codebook $cb 2>&1 | grep -vE "^==PROF==|^\s*$|----" | tail -60 | tee -a $OUT/ncu.txt | grep -E "exl3_mm|Throughput|Duration|Achieved Occupancy|Registers|Stall|Warp Cycles|Issue|Block Limit|Theoretical Occ" | tee -a $L
done
echo "== done $(( $(date +%s)-t0 ))s" | tee -a $L
