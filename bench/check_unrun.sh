#!/bin/bash
# GPU checks for work that landed without a GPU run (session 21 had no device): one device call,
# `bash bench/check_unrun.sh` with .devcarry/shared carried (see gpu_session.sh). It builds the
# kernels, runs the whole GPU suite (which forces both features on where it tests them), then
# measures each feature against its own off switch in the same process:
# - Qwen3's q/k norms inside decode attention (ops.ATTN_HEAD_NORMS, off by default);
# - head dim 256 (Gemma) on the tensor-core decode walk (ops.ATTN_MMA_D256, off by default).
# Turn a default on only if its tests pass and it measures faster. About 8-9 minutes of one call.
source bench/gpu_common.sh
echo "== synth $(( $(date +%s)-t0 ))s" | tee -a $L
for s in "qwen3-8b q8b" "gemma2-9b g9b" "gemma3-12b g12b"; do set -- $s; timeout 90 python3 -m bench.synth --shape $1 --bits 4 --out /tmp/$2 --device cuda 2>&1 | tail -1 | tee -a $L; done
echo "== qwen3 decode: head norms in attention / apart $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 150 python3 -m bench.decode --model-dir /tmp/q8b --contexts 0 4096 --tokens 128 --paths cuda-graph-pipelined+attnnorms \
  cuda-graph-pipelined+noattnnorms cuda-graph-pipelined+attnnorms cuda-graph-pipelined+noattnnorms 2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
echo "== attention alone, head dim 256: tensor-core / scalar walk $(( $(date +%s)-t0 ))s" | tee -a $L
for cap in "" "--softcap 50"; do
  timeout 120 python3 -m bench.attention --dim 256 --heads 16 --kv-heads 8 --slots 128 256 1024 4096 8192 32768 $cap \
    --paths mma scalar mma scalar 2>&1 | grep '"us"' | cut -c1-260 | tee -a $L
done
for one in 0 256 512; do  # one split up to 128 (the shipped rule at 256), never, and up to 256 slots
  timeout 60 python3 -m bench.attention --dim 256 --heads 16 --kv-heads 8 --slots 128 256 512 --paths mma --mma-one-split $one \
    2>&1 | grep '"us"' | cut -c1-200 | sed "s/^/one_split=$one /" | tee -a $L
done
echo "== gemma decode: head dim 256 on the tensor-core / scalar walk $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 200 python3 -m bench.decode --model-dir /tmp/g9b --contexts 0 7680 --tokens 96 --paths cuda-graph-pipelined+attnmmad256 \
  cuda-graph-pipelined+noattnmmad256 cuda-graph-pipelined+attnmmad256 cuda-graph-pipelined+noattnmmad256 2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
echo "== gemma 3 decode (q/k norms and head dim 256): both / neither $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 200 python3 -m bench.decode --model-dir /tmp/g12b --contexts 0 4096 --tokens 96 --paths \
  cuda-graph-pipelined+attnnorms+attnmmad256 cuda-graph-pipelined+noattnnorms+noattnmmad256 \
  cuda-graph-pipelined+attnnorms+attnmmad256 cuda-graph-pipelined+noattnnorms+noattnmmad256 \
  2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
echo "== done $(( $(date +%s)-t0 ))s" | tee -a $L
