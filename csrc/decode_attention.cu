// Attention for one-token decode steps: one query per sequence against its KV cache.
//
// Why a kernel of our own: at batch 1 a layer's decode attention reads a few hundred KB (Llama-
// 3.1-8B at 256 cached slots: 1 MB), a fraction of a microsecond of bandwidth, yet SDPA's kernels
// took ~5.3 us per layer (csrc/PERF_NOTES.md, session 5), and SDPA cannot be launched as a
// programmatic dependent of the RoPE/cache-write kernel before it, as this kernel is (its launch
// then overlaps that kernel). Measured: the same 5.3 us per call in isolation, 1-4% faster decode.
//
// Shape of the work: block (split, kv head x head group, batch) of 8 warps; a head group is up
// to 4 query heads that share a kv head (grouped-query attention), so K and V are read once for
// all of them. Each warp walks its share of the block's keys (decode_attention_walks.cuh: on the
// tensor cores for head dims 64 and 128, and 256 where set_attn_mma_d256 allows it; with scalar
// FMAs otherwise). At batch 1 and short caches the GPU is nearly idle here, so the split counts
// weigh memory round trips and the merge's cost, not bandwidth; long caches are bandwidth work.
// The warps' partial results merge in shared memory; when there are several splits, each block
// writes its partial (o, max, sum) to a workspace and the last block to finish a (batch, head
// group) merges them (a completion counter, as the product's output stage does), so one launch
// does it all.
// At a decode step the kernel also does the token's RoPE and KV-cache write (DecodeAttnArgs::pos),
// and Qwen3's and Gemma 3's per-head q/k norm before it (two norm kernels less per layer):
// q is rotated as it is loaded, and the block whose split holds the token's slot writes the
// rotated k and v there before its warps read keys. One kernel boundary less per layer. The
// tensor-core walk then fetches its first K/V stages before the kernel's PDL wait (the rows of
// earlier steps are complete by then) and patches the token's row in from shared memory.
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "decode_attention_walks.cuh"
#include "exl3_mm.cuh"    // pdl helpers, launch_pdl, fence_acq_rel_gpu
#include "exl3_prep.cuh"  // lane_xh, store_i8_chunk (the chain into o_proj)
#include "kernels.h"

namespace trellis {

// Rotate-half RoPE of a row whose lane holds DL consecutive halves: the pair (i, i + D/2) sits on
// lanes l and l ^ 16. Rounds as rope_kernel does (x*cos and rot(x)*sin each rounded, then their
// sum), so the rotated bits are the same whichever kernel rotates.
template <int DL>
__device__ __forceinline__ typename HalfRow<DL>::T rope_row(typename HalfRow<DL>::T x, typename HalfRow<DL>::T c,
                                                            typename HalfRow<DL>::T s, int lane) {
    typename HalfRow<DL>::T p;
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(&x);
    uint32_t* pw = reinterpret_cast<uint32_t*>(&p);
#pragma unroll
    for (int i = 0; i < DL / 2; ++i) pw[i] = __shfl_xor_sync(0xffffffffu, xw[i], 16);
    const bool upper = lane & 16;  // holds x[i + D/2]: rot(x) = +x[i]; the lower half gets -x[i + D/2]
    const half* xh = reinterpret_cast<const half*>(&x);
    const half* ph = reinterpret_cast<const half*>(&p);
    const half* ch = reinterpret_cast<const half*>(&c);
    const half* sh = reinterpret_cast<const half*>(&s);
    typename HalfRow<DL>::T r;
    half* rh = reinterpret_cast<half*>(&r);
#pragma unroll
    for (int i = 0; i < DL; ++i)
        rh[i] = __hadd_rn(__hmul_rn(xh[i], ch[i]), __hmul_rn(upper ? ph[i] : __hneg(ph[i]), sh[i]));
    return r;
}

// RMSNorm of one head row spread over the warp as above (DL consecutive halves per lane), with
// rms_norm_kernel's roundings and its order of summation at n = D: that kernel runs 128 threads,
// thread t holding pair t; each warp of 32 pairs sums by an xor butterfly, then the block adds
// (w0 + w2) + (w1 + w3), where a warp without pairs adds 0. So a step's q/k norm done here (Qwen3,
// Gemma 3) gives the bits the norm kernel it replaces gave.
template <int DL>
__device__ __forceinline__ typename HalfRow<DL>::T head_rms_norm(typename HalfRow<DL>::T x, typename HalfRow<DL>::T w,
                                                                 float eps) {
    constexpr int P = DL / 2;  // pairs per lane: lane l holds the norm kernel's threads P*l .. P*l + P - 1
    const half2* x2 = reinterpret_cast<const half2*>(&x);
    float ss[P];
#pragma unroll
    for (int e = 0; e < P; ++e) ss[e] = pair_square_sum(__half22float2(x2[e]));
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {  // the warp's butterfly: pair t adds pair t ^ s
        if (s >= P) {
#pragma unroll
            for (int e = 0; e < P; ++e) ss[e] += __shfl_xor_sync(0xffffffffu, ss[e], s / P);
        } else {  // a pair of this lane's own
            float t[P];
#pragma unroll
            for (int e = 0; e < P; ++e) t[e] = ss[e] + ss[e ^ s];
#pragma unroll
            for (int e = 0; e < P; ++e) ss[e] = t[e];
        }
    }
    // The block's sum: lanes of the kernel's warp w sit at lanes 8w.. (DL 8) or 16w.. (DL 4).
    float total = ss[0];
    if constexpr (DL == 8) {
        total += __shfl_xor_sync(0xffffffffu, total, 16);  // w0 + w2, w1 + w3
        total += __shfl_xor_sync(0xffffffffu, total, 8);
    } else if constexpr (DL == 4) {
        total += __shfl_xor_sync(0xffffffffu, total, 16);
    }
    const float inv = rsqrtf(total / (32 * DL) + eps);
    typename HalfRow<DL>::T y;
    half2* y2 = reinterpret_cast<half2*>(&y);
    const half2* w2 = reinterpret_cast<const half2*>(&w);
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const float2 f = __half22float2(x2[e]);
        y2[e] = __hmul2(w2[e], __floats2half2_rn(f.x * inv, f.y * inv));
    }
    return y;
}

// Blocks per SM: the tensor-core walk's ring takes most of an SM's shared memory, so one; the
// scalar walk two, which caps it at 128 registers (at head dim 256 ptxas would otherwise take 172
// and one block per SM: 17% slower at 32,768 slots, csrc/PERF_NOTES.md session 19).
// MODE: kAttnPlain; kAttnCapped, Gemma 2's score soft cap (a.softcap > 0), a variant of its own so
// the other models' walks keep their registers (the head-dim-256 scalar walk is at its cap of
// 128); kAttnHeadNormed, the per-head q/k norms before the step's RoPE (a.q_norm), also a variant
// of its own, so the plain kernels stay the ones measured before it. No model has both.
constexpr int kAttnPlain = 0, kAttnCapped = 1, kAttnHeadNormed = 2;
// WIN: a sliding-window layer's step (a.window with a.pos): the splits share only the window's
// slots of the span. A variant of its own, so the kernels without it keep their code.
template <int DL, int MODE, bool MMA, int NS = kAttnMmaMaxStages, bool WIN = false>
__global__ void __launch_bounds__(kAttnWarps * 32, MMA ? 1 : 2) decode_attention_kernel(const DecodeAttnArgs a) {
    constexpr int D = 32 * DL;
    constexpr bool CAP = MODE == kAttnCapped, QKN = MODE == kAttnHeadNormed;
    extern __shared__ __align__(128) unsigned char attn_ring[];
    constexpr int PS = kAttnHeads * (D + 2);  // floats per block partial: o, then max, then sum
    __shared__ float sm_o[kAttnWarps][kAttnHeads][D];
    __shared__ float sm_m[kAttnWarps][kAttnHeads], sm_l[kAttnWarps][kAttnHeads];
    __shared__ int sm_last;
    using Row = typename HalfRow<DL>::T;
    __shared__ __align__(16) Row sm_new[2][32];  // MMA: this step's token's K and V rows, for the walks' patch

    if (a.early_trigger) pdl_launch_dependents();  // the next kernel waits for this grid anyway
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nhg = (a.G + kAttnHeads - 1) / kAttnHeads;
    const int kvh = blockIdx.y / nhg, hg = blockIdx.y - kvh * nhg, b = blockIdx.z;
    const int g0 = hg * kAttnHeads;
    const int ng = min(kAttnHeads, a.G - g0);  // real heads in this group
    // The slots the splits share: the span, or (WIN) a sliding window's slots of it. *pos is
    // read before the PDL wait: the step before this one advanced it, in a kernel that completed
    // before this grid's primary started.
    int lo = 0, len = a.S;
    if constexpr (WIN) {
        lo = (int)max(0L, (long)*a.pos - a.window + 1);
        len = min(a.S - lo, a.window);
    }
    const int per_split = (len + a.n_split - 1) / a.n_split;
    const int s0 = lo + blockIdx.x * per_split, s1 = min(lo + len, s0 + per_split);
    // Whole 8-key steps per warp (the tensor-core walk masks the keys of its 16-key steps past j_end).
    const int per_warp = ((s1 - s0 + kAttnWarps - 1) / kAttnWarps + kAttnKeys - 1) / kAttnKeys * kAttnKeys;
    const int j_begin = s0 + warp * per_warp, j_end = min(s1, j_begin + per_warp);
    const half* kp = a.k + (size_t)b * a.kv_b + (size_t)kvh * a.kv_h + lane * DL;
    const half* vp = a.v + (size_t)b * a.kv_b + (size_t)kvh * a.kv_h + lane * DL;
    const half* mrow = a.mask ? a.mask + (size_t)b * a.mask_b : nullptr;
    auto q_at = [&](int h) {  // this lane's halves of the group's query head h
        return load_row<DL>(a.q + (size_t)b * a.q_b + (size_t)(kvh * a.G + g0 + h) * a.q_h + lane * DL);
    };

    // Chain into o_proj: the input signs of the head this warp merges (warps 0..3), a weight, so
    // read before the wait. A head is D / 128 of o_proj's input chunks; a lane takes 4 values of
    // each. Head dim 256 chains only from the tensor-core walk (the scalar one would spill more).
    constexpr int kChunks = D >= 128 ? D / 128 : 1;
    constexpr bool kChains = DL == 4 || (DL == 8 && MMA);
    uint2 next_s[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        next_s[c] = make_uint2(0u, 0u);
        if (kChains && a.next_xb && warp < ng)
            next_s[c] = __ldg(reinterpret_cast<const uint2*>(a.next_suh + (kvh * a.G + g0 + warp) * D + c * 128 + lane * 4));
    }
    const AttnWarpKeys keys{kp, vp, mrow, a.kv_t, j_begin, j_end, ng, a.scale, a.softcap * kLog2e};
    unsigned char* ring = attn_ring + warp * NS * attn_mma_stage_bytes(DL);
    // MMA with this step's RoPE ours (a.pos): the walk's first stages before the wait. The cache
    // rows of earlier steps were written by kernels that completed before this grid started (its
    // primary, the q/k/v product, passed its own wait before this grid could launch), and the one
    // row written this step, the token's, is this kernel's: it is patched into its stage after the
    // write below. Without a.pos the kernel before this one may have written the token's row
    // (rope_qk_store), so the walk fetches after the wait.
    const bool early = MMA && a.pos != nullptr;
    if constexpr (MMA) {
        if (early) attn_mma_prefetch<DL, NS>(keys, lane, ring);
    }
    Row qn{}, kn{};  // QKN: the q and k head norms' weights, read before the wait
    if constexpr (QKN) {
        qn = load_row<DL>(a.q_norm + lane * DL);
        kn = load_row<DL>(a.k_norm + lane * DL);
    }
    pdl_wait_primary();  // q, the cache and the mask come from the kernels before this one
    Row rc{}, rs{};
    long p = -1;  // this step's slot, when the RoPE is ours
    Row qraw[kAttnHeads];  // MMA: the query rows, loaded with the RoPE's inputs
    if constexpr (MMA) {
#pragma unroll
        for (int h = 0; h < kAttnHeads; ++h)
            qraw[h] = h < ng ? q_at(h) : Row{};
    }
    if (a.pos) {  // RoPE here: rotate q below, and write the token's k and v if this split reads its slot
        rc = load_row<DL>(a.cos + lane * DL);
        rs = load_row<DL>(a.sin + lane * DL);
        p = *a.pos;
        if (p >= s0 && p < s1) {  // block-uniform
            if (warp == 0) {
                const size_t at = (size_t)b * a.nk_b + (size_t)kvh * a.nk_h + lane * DL;
                Row kraw = load_row<DL>(a.new_k + at);
                if constexpr (QKN) kraw = head_rms_norm<DL>(kraw, kn, a.head_norm_eps);
                const Row kr = rope_row<DL>(kraw, rc, rs, lane);
                const Row vr = load_row<DL>(a.new_v + at);
                // the cache this kernel reads: one pointer for both (blocks of other head groups
                // of this kv head write the same bits)
                *reinterpret_cast<Row*>(const_cast<half*>(kp) + (size_t)p * a.kv_t) = kr;
                *reinterpret_cast<Row*>(const_cast<half*>(vp) + (size_t)p * a.kv_t) = vr;
                if constexpr (MMA) sm_new[0][lane] = kr, sm_new[1][lane] = vr;
            }
            __syncthreads();  // the block's warps read the slot after this
        }
    }
    // The warp's walk over its keys into the block's merge buffers. It reads the group's query
    // head h (h < ng) through q_row, rotated here if this step's RoPE is ours; the scalar walk
    // loads each head where it uses it (loaded up front, the four rows' registers made the
    // head-dim-256 walk spill).
    auto q_row = [&](int h) {
        Row r;
        if constexpr (MMA) {
            r = qraw[h];
        } else {
            r = q_at(h);
        }
        if constexpr (QKN) r = head_rms_norm<DL>(r, qn, a.head_norm_eps);
        if (a.pos) r = rope_row<DL>(r, rc, rs, lane);
        return r;
    };
    const AttnWarpOut<D> out{sm_o[warp], sm_m[warp], sm_l[warp]};
    if constexpr (MMA) {
        attn_walk_mma<DL, CAP, NS>(keys, q_row, lane, ring, out, early, p >= s0 && p < s1 ? p : -1,
                              reinterpret_cast<const half*>(sm_new));
    } else {
        attn_walk_scalar<DL, CAP>(keys, q_row, lane, out);
    }
    __syncthreads();
    const int g = warp;  // warps 0..3 merge one head each; the others only take part in the count
    const bool merges = g < kAttnHeads;
    float M = -INFINITY, L = 0.f, O[DL];
#pragma unroll
    for (int d = 0; d < DL; ++d) O[d] = 0.f;
    if (merges) {
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm_m[w][g]);
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
            const float c = M == -INFINITY ? 0.f : exp2f(sm_m[w][g] - M);
            L = fmaf(c, sm_l[w][g], L);
#pragma unroll
            for (int d = 0; d < DL; ++d) O[d] = fmaf(c, sm_o[w][g][lane * DL + d], O[d]);
        }
    }
    auto write_out = [&](const float* acc, float sum) {
        const size_t at = (size_t)b * a.o_b + (size_t)(kvh * a.G + g0 + g) * a.o_h + lane * DL;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        typename HalfRow<DL>::T raw;
        half2* h = reinterpret_cast<half2*>(&raw);
#pragma unroll
        for (int i = 0; i < DL / 2; ++i) h[i] = __floats2half2_rn(acc[2 * i] * inv, acc[2 * i + 1] * inv);
        *reinterpret_cast<typename HalfRow<DL>::T*>(a.out + at) = raw;
        if constexpr (kChains) {
            if (a.next_xb) {  // o_proj's input chunks of head `head` from these bits, as its prep would
                const int head = kvh * a.G + g0 + g;
#pragma unroll
                for (int c = 0; c < kChunks; ++c) {
                    // Lane L of chunk c takes the head's values c 128 + 4 L .. + 3: its own at head dim
                    // 128; at 256 the low or high half (L odd) of lane c 16 + L / 2's eight.
                    uint2 mine;
                    if constexpr (DL == 4) {
                        mine = raw;
                    } else {
                        const int src = c * 16 + (lane >> 1);
                        const uint2 lo = make_uint2(__shfl_sync(0xffffffffu, raw.x, src), __shfl_sync(0xffffffffu, raw.y, src));
                        const uint2 hi = make_uint2(__shfl_sync(0xffffffffu, raw.z, src), __shfl_sync(0xffffffffu, raw.w, src));
                        mine = lane & 1 ? hi : lo;
                    }
                    half2 x0, x1;
                    lane_xh(mine, next_s[c], lane, x0, x1);
                    const float f[4] = {__low2float(x0), __high2float(x0), __low2float(x1), __high2float(x1)};
                    store_i8_chunk(a.next_xb, a.next_scales, a.next_csum, 0, kChunks * head + c, kChunks * a.Hkv * a.G, 1,
                                   lane, f);
                }
            }
        }
    };
    if (a.n_split == 1) {
        if (merges && g < ng) write_out(O, L);
        return;
    }

    // Several splits: publish this block's partial; the last block of the group merges them.
    const size_t group = (size_t)b * gridDim.y + blockIdx.y;
    if (merges) {
        float* part_ws = a.ws + (group * a.n_split + blockIdx.x) * PS;
#pragma unroll
        for (int d = 0; d < DL; ++d) part_ws[g * D + lane * DL + d] = O[d];
        if (lane == 0) {
            part_ws[kAttnHeads * D + g] = M;
            part_ws[kAttnHeads * D + kAttnHeads + g] = L;
        }
    }
    fence_acq_rel_gpu();  // release: the partial before the count
    __syncthreads();
    if (threadIdx.x == 0) sm_last = atomicAdd(a.counters + group, 1) == a.n_split - 1;
    __syncthreads();
    if (!sm_last) return;
    fence_acq_rel_gpu();  // acquire: every counted partial is visible
    if (merges && g < ng && a.merge_online) {
        // One pass with a running max, 8 partials' loads in flight at a time: ~n_split / 8 L2
        // round trips, where the max first and then the sums took 1 + n_split / 4 (the compiler's
        // unroll of that loop; at 4,096 slots, 16 splits: 2 against 5).
        const float* ws0 = a.ws + group * a.n_split * PS;
        float MM = -INFINITY, LL = 0.f, OO[DL];
#pragma unroll
        for (int d = 0; d < DL; ++d) OO[d] = 0.f;
        constexpr int kBatch = 8;
        for (int sp0 = 0; sp0 < a.n_split; sp0 += kBatch) {
            float m[kBatch], l[kBatch], op[kBatch][DL];
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {  // every load of the batch before any use
                const bool here = sp0 + j < a.n_split;
                const float* pw = ws0 + (here ? sp0 + j : 0) * PS;
                m[j] = here ? __ldcg(pw + kAttnHeads * D + g) : -INFINITY;
                l[j] = here ? __ldcg(pw + kAttnHeads * D + kAttnHeads + g) : 0.f;
#pragma unroll
                for (int d = 0; d < DL; ++d) op[j][d] = here ? __ldcg(pw + g * D + lane * DL + d) : 0.f;
            }
            // The running max moves once per batch, so the batch's weights are independent (a
            // move per partial made a serial chain of exp2s: slower at 33 splits).
            float mn = MM;
#pragma unroll
            for (int j = 0; j < kBatch; ++j) mn = fmaxf(mn, m[j]);
            const bool none = mn == -INFINITY;  // every key so far masked: nothing to weigh
            const float c_old = none ? 0.f : exp2f(MM - mn);
            LL *= c_old;
#pragma unroll
            for (int d = 0; d < DL; ++d) OO[d] *= c_old;
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const float c = none ? 0.f : exp2f(m[j] - mn);
                LL = fmaf(c, l[j], LL);
#pragma unroll
                for (int d = 0; d < DL; ++d) OO[d] = fmaf(c, op[j][d], OO[d]);
            }
            MM = mn;
        }
        write_out(OO, LL);
    } else if (merges && g < ng) {  // the previous two-pass merge (set_attn_merge_online(false))
        const float* ws0 = a.ws + group * a.n_split * PS;
        float MM = -INFINITY;
        for (int sp = lane; sp < a.n_split; sp += 32) MM = fmaxf(MM, __ldcg(ws0 + sp * PS + kAttnHeads * D + g));
#pragma unroll
        for (int o32 = 16; o32 > 0; o32 >>= 1) MM = fmaxf(MM, __shfl_xor_sync(0xffffffffu, MM, o32));
        float LL = 0.f, OO[DL];
#pragma unroll
        for (int d = 0; d < DL; ++d) OO[d] = 0.f;
        for (int sp = 0; sp < a.n_split; ++sp) {
            const float* pw = ws0 + sp * PS;
            const float m = __ldcg(pw + kAttnHeads * D + g);
            const float c = MM == -INFINITY ? 0.f : exp2f(m - MM);
            LL = fmaf(c, __ldcg(pw + kAttnHeads * D + kAttnHeads + g), LL);
#pragma unroll
            for (int d = 0; d < DL; ++d) OO[d] = fmaf(c, __ldcg(pw + g * D + lane * DL + d), OO[d]);
        }
        write_out(OO, LL);
    }
    if (threadIdx.x == 0) a.counters[group] = 0;  // ready for the next call
}

// Blocks per split: one per batch row, kv head and group of up to kAttnHeads query heads (each
// with its completion counter).
int decode_attention_counters(int batch, int kv_heads, int groups) {
    return batch * kv_heads * ((groups + kAttnHeads - 1) / kAttnHeads);
}

// Ring stages of the tensor-core walk: 0 (default) the most that fit, up to three; 2 or 3 those
// where they fit (a test knob for the two-stage kernel, which the H200 would not pick).
static int& attn_mma_stages() {
    static int stages = 0;
    return stages;
}
void set_attn_mma_stages(int stages) { attn_mma_stages() = stages == 2 || stages == 3 ? stages : 0; }

// The ring stages a block of the tensor-core walk gets at head dim D on this device (0: none fit).
static int attn_mma_stages_for(int D) {
    const int fixed = kAttnWarps * kAttnHeads * D * 4 + 2 * D * 2 + 1024;  // the static merge buffers and sm_new, with room
    const int room = current_device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>() - fixed;
    const int fit = room / attn_mma_smem_bytes(D / 32, 1);
    const int want = attn_mma_stages() ? attn_mma_stages() : kAttnMmaMaxStages;
    const int ns = fit < want ? fit : want;
    return ns >= 2 ? ns : 0;
}

static int& attn_mma_slots() {
    static int slots = 1;
    return slots;
}
void set_attn_mma_slots(int slots) { attn_mma_slots() = slots > 0 ? slots : 0; }
static int& attn_mma_one_split() {
    static int slots = kAttnWarps * kAttnMmaKeys * 2;
    return slots;
}
void set_attn_mma_one_split(int slots) { attn_mma_one_split() = slots > 0 ? slots : 0; }

static bool& attn_mma_d256() {
    static bool enabled = true;  // measured faster on Gemma 2 decode (session 24); engine.ops sets it
    return enabled;
}
void set_attn_mma_d256(bool enabled) { attn_mma_d256() = enabled; }

int decode_attention_mma_stages(const DecodeAttnArgs& a) {
    // cp.async moves 16-byte chunks: rows and bases 16-byte aligned, as a cache's are.
    const bool aligned = ((uintptr_t)a.k | (uintptr_t)a.v) % 16 == 0 && ((a.kv_t | a.kv_h | a.kv_b) * 2) % 16 == 0;
    const bool dim = a.D == 64 || a.D == 128 || (a.D == 256 && attn_mma_d256());
    const bool takes = attn_mma_slots() > 0 && a.S >= attn_mma_slots() && dim && aligned;
    return takes ? attn_mma_stages_for(a.D) : 0;
}

bool decode_attention_chains(const DecodeAttnArgs& a) {
    // The kernels with the chain code (kChains): head dim 128, and 256 on the tensor-core walk.
    return a.D == 128 || (a.D == 256 && decode_attention_mma_stages(a) > 0);
}

int decode_attention_mma_keys(const DecodeAttnArgs& a) {
    return decode_attention_mma_stages(a) > 0 ? attn_mma_keys(a.D / 32) : 0;
}

static int& attn_one_load_splits() {
    static int splits = 10;
    return splits;
}
void set_attn_one_load_splits(int splits) { attn_one_load_splits() = splits > 0 ? splits : 0; }

int decode_attention_splits(int batch, int kv_heads, int groups, int slots, int sms, int mma_keys) {
    const int blocks_per_split = decode_attention_counters(batch, kv_heads, groups);
    if (mma_keys > 0) {
        // The tensor-core walk: one split (no merge through the workspace) up to 256 slots (two steps
        // per warp, both fetched by a three-stage ring's prologue); beyond that a split per step of
        // each warp, up to one block per SM (the ring is most of an SM's shared memory). Measured
        // (H200, Llama-3.1-8B heads, bench.attention, session 19): 256 slots 5.2 us in one split
        // against 6.3 in two; 512 slots 6.6 in four against 7.2 in two; 1,024 7.2 in eight against
        // 7.6 in four. Head dim 256 (8-key steps) scales both by its step, two steps per warp being
        // 128 slots there (not measured).
        if (slots <= attn_mma_one_split() * mma_keys / kAttnMmaKeys) return 1;
        const int by_keys = (slots + kAttnWarps * mma_keys - 1) / (kAttnWarps * mma_keys);
        const int cap = (sms > 0 ? sms : 132) / blocks_per_split;
        int n = by_keys < cap ? by_keys : cap;
        n = n < 64 ? n : 64;
        return n > 0 ? n : 1;
    }
    // A warp's keys cost a memory round trip per load of 16. Short caches take a split per 16 keys
    // per warp (one load each) while that is at most attn_one_load_splits() splits; longer ones
    // about 32 keys per warp (two loads), more splits only to fill the GPU, since every split
    // beyond one costs the merge through the workspace. Measured (H200, Llama-3.1-8B shapes,
    // csrc/PERF_NOTES.md session 16): 256 slots in 2 splits against 1 decoded 1.0-1.2% faster in
    // three calls; 1,280 in 10 against 5 0.5% faster in two calls and the same in a third; 1,280
    // in 8 splits (20 keys per warp, still two loads) 2.3% slower; 4,352 in 33 against 17 1.4%
    // slower.
    const int one_load = (slots + kAttnWarps * 16 - 1) / (kAttnWarps * 16);
    int n = one_load <= attn_one_load_splits() ? one_load : (slots + kAttnWarps * 32 - 1) / (kAttnWarps * 32);
    const int cap = (2 * (sms > 0 ? sms : 132) + blocks_per_split - 1) / blocks_per_split;  // ~2 blocks per SM
    n = n < cap ? n : cap;
    n = n < 64 ? n : 64;
    return n > 0 ? n : 1;
}

size_t decode_attention_ws_floats(int batch, int kv_heads, int groups, int head_dim, int n_split) {
    const size_t blocks = (size_t)decode_attention_counters(batch, kv_heads, groups);
    return n_split > 1 ? blocks * n_split * kAttnHeads * (head_dim + 2) : 0;
}

cudaError_t decode_attention(const DecodeAttnArgs& a, cudaStream_t stream) {
    if (a.B < 1 || a.Hkv < 1 || a.G < 1 || a.S < 1 || a.n_split < 1) return cudaErrorInvalidValue;
    if (a.n_split > 1 && (!a.ws || !a.counters)) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)a.n_split, (unsigned)(decode_attention_counters(1, a.Hkv, a.G)), (unsigned)a.B);
    const dim3 block(kAttnWarps * 32);
    const bool pdl = glue_pdl();
    auto with_ring = [&](auto kern, int bytes) {
        return launch_pdl_smem(kern, grid, block, (size_t)bytes, stream, pdl, a);
    };
    const int ns = decode_attention_mma_stages(a);
    // The kernel of head dim 32 DL, MODE C and window variant W: the tensor-core walk with its
    // ring stages, or the scalar one.
    auto launch = [&](auto dl, auto mode, auto win) {
        constexpr int DL = decltype(dl)::value, C = decltype(mode)::value;
        constexpr bool W = decltype(win)::value;
        if (ns == 3) return with_ring(decode_attention_kernel<DL, C, true, 3, W>, attn_mma_smem_bytes(DL, 3));
        if (ns == 2) return with_ring(decode_attention_kernel<DL, C, true, 2, W>, attn_mma_smem_bytes(DL, 2));
        return launch_pdl(decode_attention_kernel<DL, C, false, kAttnMmaMaxStages, W>, grid, block, 0, stream, pdl, a);
    };
    auto run_dim = [&](auto mode, auto win) {
        switch (a.D) {
            case 64:
                if constexpr (decltype(mode)::value == kAttnHeadNormed) {
                    return cudaErrorInvalidValue;  // not built: Qwen3's and Gemma 3's heads are 128 or 256
                } else {
                    return launch(std::integral_constant<int, 2>{}, mode, win);
                }
            case 128: return launch(std::integral_constant<int, 4>{}, mode, win);
            case 256: return launch(std::integral_constant<int, 8>{}, mode, win);
            default: return cudaErrorInvalidValue;
        }
    };
    auto run = [&](auto mode) {
        return a.window > 0 ? run_dim(mode, std::true_type{}) : run_dim(mode, std::false_type{});
    };
    if (a.window < 0 || (a.window > 0 && !a.pos)) return cudaErrorInvalidValue;
    if (a.q_norm && (!a.pos || !a.k_norm || a.softcap > 0.f)) return cudaErrorInvalidValue;
    if (a.softcap > 0.f) return run(std::integral_constant<int, kAttnCapped>{});
    if (a.q_norm) return run(std::integral_constant<int, kAttnHeadNormed>{});
    return run(std::integral_constant<int, kAttnPlain>{});
}

}  // namespace trellis
