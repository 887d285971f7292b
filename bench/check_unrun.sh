#!/bin/bash
# GPU checks and A/Bs for the features sessions 21-23 wrote without a GPU (run in sessions 23 and
# 24, which set the defaults from them: csrc/PERF_NOTES.md), in two or three device calls, each
# with .devcarry/shared carried (see gpu_session.sh):
#   bash bench/check_unrun.sh 1   the build, the whole GPU suite (which forces every feature below
#                                 on where it tests it), Qwen3 decode, attention alone at head dim 256;
#   bash bench/check_unrun.sh 2   Gemma 2 decode A/Bs (SKIP_GPU_TESTS=1 is set: part 1 ran them);
#   bash bench/check_unrun.sh 3   the compact ring's cost on the H200, Gemma 3 decode all on / off.
# Each feature is measured against its own switch in the same process:
# - Qwen3's q/k norms inside decode attention (ops.ATTN_HEAD_NORMS, on; session 21);
# - head dim 256 (Gemma) on the tensor-core decode walk (ops.ATTN_MMA_D256, on; session 21);
# - Gemma's post-norms inside the next product's prep (ops.PREP_DOUBLE_NORM, off: slower; session 22);
# - the attention -> o_proj chain at head dim 256 (ops.ATTN_CHAIN_D256, off: slower; session 22;
#   session 24 measured it as "+nochain", Gemma's only chain link);
# - Gemma 2's prefill attention probabilities in one kernel (ops.CAPPED_SOFTMAX, on; session 22);
# - sliding-window layers' decode walking only their window (ops.ATTN_WINDOW, on; session 22);
# - the products' compact ring for GPUs with less shared memory (ops.GV_COMPACT; session 23): part
#   1's suite forces it on the H200 (tests/test_gemv_compact_gpu.py), part 3 times it.
# About 5-8 minutes a part.
part=${1:-1}
[ "$part" != 1 ] && export SKIP_GPU_TESTS=1
source bench/gpu_common.sh
if [ "$part" = 1 ]; then
echo "== synth $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 90 python3 -m bench.synth --shape qwen3-8b --bits 4 --out /tmp/q8b --device cuda 2>&1 | tail -1 | tee -a $L
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
elif [ "$part" = 2 ]; then
timeout 90 python3 -m bench.synth --shape gemma2-9b --bits 4 --out /tmp/g9b --device cuda 2>&1 | tail -1 | tee -a $L
# One process, one model load, each path twice: the tensor-core walk at head dim 256 with its o_proj
# chain / the scalar walk / the tensor-core walk without the chain; the post-norms in the next prep / as kernels.
echo "== gemma 2 decode A/Bs $(( $(date +%s)-t0 ))s" | tee -a $L
P="cuda-graph-pipelined+attnmmad256+attnchaind256 cuda-graph-pipelined+noattnmmad256 cuda-graph-pipelined+attnmmad256+noattnchaind256 \
  cuda-graph-pipelined+doublenorm cuda-graph-pipelined+nodoublenorm"
timeout 360 python3 -m bench.decode --model-dir /tmp/g9b --contexts 0 4096 --tokens 96 --paths $P $P 2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
# Past Gemma 2's 4,096-slot window: the sliding layers walk their window / the whole span.
timeout 150 python3 -m bench.decode --model-dir /tmp/g9b --contexts 7680 --tokens 96 --paths cuda-graph-pipelined+attnwindow \
  cuda-graph-pipelined+noattnwindow cuda-graph-pipelined+attnwindow cuda-graph-pipelined+noattnwindow 2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
echo "== gemma 2 prefill: capped probabilities in one kernel / four passes $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 150 python3 -m bench.prefill --model-dir /tmp/g9b --lengths 4096 8192 --modes last_logits --paths cuda-cappedsoftmax \
  cuda-nocappedsoftmax cuda-cappedsoftmax cuda-nocappedsoftmax 2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
else  # part 3, if device time is left: the compact ring's cost on the H200; Gemma 3 all on / all off
# The products on the compact ring (what an RTX or A100 runs, TRELLIS_GV_COMPACT=1) against the
# shipped one (2), one process each, back to back; its correctness is in part 1's GPU suite.
echo "== products: compact ring / shipped ring $(( $(date +%s)-t0 ))s" | tee -a $L
for c in 1 2; do
  TRELLIS_GV_COMPACT=$c timeout 90 python3 -m bench.linear --timing graph --cache cold --calls 40 --warmup 5 --K 4 8 \
    --paths fused --shapes 8192x28672 4096x4096 --m 1 8 32 2>&1 | python3 -c "$SUM" | sed "s/^/compact=$c /" | tee -a $L
done
# Gemma 3 (q/k norms, head dim 256, post-norms, its 1,024-slot window) all on / all off
timeout 120 python3 -m bench.synth --shape gemma3-12b --bits 4 --out /tmp/g12b --device cuda 2>&1 | tail -1 | tee -a $L
echo "== gemma 3 decode: all / none $(( $(date +%s)-t0 ))s" | tee -a $L
timeout 300 python3 -m bench.decode --model-dir /tmp/g12b --contexts 0 4096 16384 --tokens 96 --paths \
  cuda-graph-pipelined+attnnorms+attnmmad256+doublenorm+attnwindow \
  cuda-graph-pipelined+noattnnorms+noattnmmad256+nodoublenorm+noattnwindow \
  cuda-graph-pipelined+attnnorms+attnmmad256+doublenorm+attnwindow \
  cuda-graph-pipelined+noattnnorms+noattnmmad256+nodoublenorm+noattnwindow \
  2>&1 | grep tokens_per_s | cut -c1-200 | tee -a $L
fi
echo "== done $(( $(date +%s)-t0 ))s" | tee -a $L
