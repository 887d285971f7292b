#!/bin/bash
# What session 39 could not run for want of device time, on whatever card comes (~330 s with the
# shipped build). Carry .devcarry/shared.
# 1. tests/test_chain_gpu.py::test_normed_chain_into_a_group, the case that failed once in
#    session 39's last call (rel RMS 1.0027e-3 against its 1e-3 bound, chain against plain, a
#    one-row K = 6 product that the session's changes do not reach; it passed in the three calls
#    before). Session 40 seeded its inputs (they were unseeded, so each run drew new ones) and set
#    the bound to 1.5e-3 from its error budget; it passed in session 41's GPU suite (H100), and
#    this one run repeats it.
# 2. The wgmma form against the synchronous MMAs (TRELLIS_GV_WGMMA 1 / 0) on whole-model decode at
#    batch 17, 24 and 32 (synthetic 4.0 bpw Llama-3.1-8B shapes), and on the products it serves
#    but session 39 timed only at K = 4 MUL1: K = 2 and 3, 3INST and MCG, 8192x28672 at 24 and 32.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $OUT/log.txt
export TRELLIS_DEBUG_VARIANTS=0 SKIP_GPU_TESTS=1
source bench/gpu_common.sh
echo "== the chain test $(el)s" | tee -a $L
for i in 1; do
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_chain_gpu.py -k "test_normed_chain_into_a_group and 512" \
    2>&1 | grep -E "passed|failed|^E  +assert" | head -3 | tr '\n' ' ' | sed 's/$/\n/' | tee -a $L
done
echo "== products by TRELLIS_GV_WGMMA $(el)s" | tee -a $L
for v in 1 0 1 0; do
  TRELLIS_GV_WGMMA=$v timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 2 3 --codebook mul1 \
    3inst mcg --paths fused --shapes 8192x28672 --m 24 32 2>&1 | python3 -c "$SUM" | grep -v '^{' | sed "s/^/wgmma $v /" | tee -a $L
done
M=/tmp/llama3-8b
timeout 60 python3 -m bench.synth --shape llama3-8b --bits 4 --out $M --device cuda 2>&1 | tail -1 | tee -a $L
for b in 17 24 32; do
  echo "== decode batch $b, TRELLIS_GV_WGMMA 1 / 0 $(el)s" | tee -a $L
  DECODE_BATCH=$b DECODE_TOKENS=32 decode_by_setting TRELLIS_GV_WGMMA wgmma 1 0
done
echo "== done $(el)s" | tee -a $L
