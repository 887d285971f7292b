// Elementwise glue around the products: the gated activation (SwiGLU / GeGLU) and RoPE with the
// step's KV-cache write.
#include <math.h>

#include "exl3_mm.cuh"
#include "exl3_prep.cuh"
#include "kernels.h"

namespace trellis {

// ---------------------------------------------------------------------------------------------
// Gated activation: y = fp16(act(gate)) * up, as the PyTorch fp16 modules round.

__global__ void gated_act_kernel(const half* __restrict__ gate, const half* __restrict__ up,
                                 half* __restrict__ y, int rows, int n, int ld_gate, int ld_up,
                                 int act) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const long total = (long)rows * n;
    for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long)gridDim.x * blockDim.x) {
        const int r = (int)(idx / n);
        const int c = (int)(idx - (long)r * n);
        y[idx] = gated_value(gate[(size_t)r * ld_gate + c], up[(size_t)r * ld_up + c], act);
    }
}

cudaError_t gated_act(const half* gate, const half* up, half* y, int rows, int n, int ld_gate,
                      int ld_up, int act, cudaStream_t stream) {
    if (rows < 1 || n < 1 || act < 0 || act > 2) return cudaErrorInvalidValue;
    const long total = (long)rows * n;
    const long blocks = (total + 255) / 256;
    return launch_glue(gated_act_kernel, dim3((unsigned)(blocks < 65535 * 8 ? blocks : 65535 * 8)), dim3(256),
                       stream, gate, up, y, rows, n, ld_gate, ld_up, act);
}

// ---------------------------------------------------------------------------------------------
// RoPE, rotate-half convention, on q and k in one launch and in place. Blocks (token, slice);
// each thread rotates one pair (i, i + d/2) of some head. Rounds like the PyTorch fp16 ops it
// replaces (x*cos and rot(x)*sin each rounded, then their sum), so both paths give the same bits.

// W: pairs per thread. 2 (half2 loads and stores) wherever every row and head starts 4-byte
// aligned: one pair per thread moved ~0.9 TB/s in a 4,096-token prefill (99 us a layer, where its
// ~120 MB take ~28 us at copy speed; csrc/PERF_NOTES.md, session 17). The same bits either way.
template <int W>
__global__ void rope_kernel(half* __restrict__ q, half* __restrict__ k, const half* __restrict__ cos,
                            const half* __restrict__ sin, int T, int hq, int hk, int d,
                            long q_batch, long q_tok, long k_batch, long k_tok, KvStore st) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const int b = blockIdx.x / T, t = blockIdx.x - b * T;
    // With a KV store: this token's slot in the cache (its position lives on the device, so a
    // replayed CUDA graph writes where the cache has got to).
    half* kc = nullptr;
    half* vc = nullptr;
    const half* vrow = nullptr;
    const long slot = st.kc ? *st.pos + t : 0;
    if (st.kc && slot >= 0 && slot < st.slots) {
        kc = st.kc + b * st.c_batch + slot * st.c_tok;
        vc = st.vc + b * st.c_batch + slot * st.c_tok;
        vrow = st.v + b * st.v_batch + t * st.v_tok;
    }
    const int half_d = d >> 1;
    const half* c = cos + (size_t)t * d;
    const half* s = sin + (size_t)t * d;
    half* qrow = q + b * q_batch + t * q_tok;
    half* krow = k + b * k_batch + t * k_tok;
    const int pairs = (hq + hk) * half_d;
    // One thread per rotated pair, then (with a store) one per value copied into the cache,
    // spread over blockIdx.y: a decode step's one token fills ~30 blocks instead of looping in one.
    const int p = (blockIdx.y * blockDim.x + threadIdx.x) * W;
    using V = std::conditional_t<W == 2, half2, half>;
    auto at = [](const half* ptr, int i) { return *reinterpret_cast<const V*>(ptr + i); };
    auto put = [](half* ptr, int i, V v) { *reinterpret_cast<V*>(ptr + i) = v; };
    if (p < pairs) {
        const int head = p / half_d, i = p - head * half_d;  // W = 2: half_d is even, so i + 1 is this head's
        half* base = head < hq ? qrow + (size_t)head * d : krow + (size_t)(head - hq) * d;
        const V lo = at(base, i), hi = at(base, i + half_d);
        // _rn forms: a plain mul + add may be contracted into one fma, which rounds once less
        V r0, r1;
        if constexpr (W == 2) {
            r0 = __hadd2_rn(__hmul2_rn(lo, at(c, i)), __hmul2_rn(__hneg2(hi), at(s, i)));
            r1 = __hadd2_rn(__hmul2_rn(hi, at(c, i + half_d)), __hmul2_rn(lo, at(s, i + half_d)));
        } else {
            r0 = __hadd_rn(__hmul_rn(lo, c[i]), __hmul_rn(__hneg(hi), s[i]));
            r1 = __hadd_rn(__hmul_rn(hi, c[i + half_d]), __hmul_rn(lo, s[i + half_d]));
        }
        put(base, i, r0);
        put(base, i + half_d, r1);
        if (kc && head >= hq) {
            half* dst = kc + (size_t)(head - hq) * st.c_head;
            put(dst, i, r0);
            put(dst, i + half_d, r1);
        }
    } else if (vc && p - pairs < hk * d) {
        const int e = p - pairs, head = e / d, i = e - head * d;
        put(vc + (size_t)head * st.c_head, i, at(vrow + (size_t)head * d, i));
    }
}

// Whether every row, head and table start the kernel touches is 4-byte aligned (rope_kernel<2>).
static bool rope_pairs_aligned(const half* q, const half* k, const half* cos, const half* sin, int d, long q_batch,
                               long q_tok, long k_batch, long k_tok, const KvStore& st) {
    auto even = [](long v) { return v % 2 == 0; };
    auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 4 == 0; };
    bool ok = d % 4 == 0 && aligned(q) && aligned(k) && aligned(cos) && aligned(sin) && even(q_batch) &&
              even(q_tok) && even(k_batch) && even(k_tok);
    if (st.kc) {
        ok = ok && aligned(st.kc) && aligned(st.vc) && aligned(st.v) && even(st.c_batch) && even(st.c_head) &&
             even(st.c_tok) && even(st.v_batch) && even(st.v_tok);
    }
    return ok;
}

cudaError_t rope_qk(half* q, half* k, const half* cos, const half* sin, int batch, int T, int hq,
                    int hk, int d, long q_batch, long q_tok, long k_batch, long k_tok,
                    const KvStore& store, cudaStream_t stream) {
    if (batch < 1 || T < 1 || d % 2 || hq < 0 || hk < 0) return cudaErrorInvalidValue;
    const int work = (hq + hk) * (d / 2) + (store.kc ? hk * d : 0);
    const int threads = 128;
    const bool pairs2 = rope_pairs_aligned(q, k, cos, sin, d, q_batch, q_tok, k_batch, k_tok, store);
    const int per_thread = pairs2 ? 2 : 1;
    const dim3 grid((unsigned)(batch * T), (unsigned)((work + threads * per_thread - 1) / (threads * per_thread)));
    return launch_glue(pairs2 ? rope_kernel<2> : rope_kernel<1>, grid, dim3(threads), stream, q, k, cos, sin, T, hq,
                       hk, d, q_batch, q_tok, k_batch, k_tok, store);
}

}  // namespace trellis
