// Fused tail-biting Viterbi encoder for EXL3 tiles (spec 5.6): the algorithm of
// engine/quantize/viterbi.py in one kernel, with the same fp32 arithmetic, so it picks the same
// states as the torch path.
//
// Why the results match torch bit for bit: targets and codebook values are fp16, so w·l and l·l
// are exact in fp32 and the step error l² − 2wl is rounded once whichever way it is evaluated
// (torch's addcmul, fused or not, and our fmaf); the predecessor cost is then added with one
// more rounding, as torch's add_ does. Ties go to the lowest index (strict < while scanning up),
// as torch.min / argmin do.
//
// Layout (see viterbi.py): state s = k·N + e, N = 2^(16−K) edges, nk = 2^K; with e = m·nk + j the
// predecessor edge of s is k·M + m (M = N / nk). One block of 512 threads encodes one tile at a
// time (a persistent loop over tiles). Each thread owns a fixed set of 128 states, so their
// codebook values stay in registers for the whole kernel (64 registers of half2: the register file
// holds the 65536-entry codebook once per SM); a step then reads the predecessor costs from shared
// memory, adds each owned state's error, keeps the min over k per edge and writes the new costs to
// the other buffer (double-buffered, one barrier per step). K = 1 needs 2 × 128 KB of costs,
// more than shared memory, so it keeps them in global memory (L1/L2).
//
// A thread's states: m = g·(MT·MV) + mt·MV + v (g < MG, v < MV), j = jg·JB + jj (jj < JB), and
// k = kk·KSPLIT + ks (kk < KB). Threads with consecutive lanes read consecutive predecessor
// vectors (coalesced, conflict-free) and write MV·JB consecutive new costs. For K >= 6 an edge
// has more predecessors than a thread can hold, so KSPLIT adjacent lanes split its k (interleaved)
// and merge their minima with shuffles.
//
// Back-pointers (the k of the best state entering each edge) are packed per thread into a 32- or
// 64-bit word per step and stored in a global scratch; pass A stores only its last `lookahead`
// steps, which is all its traceback reads. The traceback copies chunks of records into shared
// memory (coalesced) and one thread walks them.
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

namespace trellis {
namespace {

constexpr int kSteps = 256;
constexpr int kVThreads = 512;
constexpr int kMinTracebackBytes = 64 * 1024;

// Per-K thread geometry: MV m's per vector load, MG m-groups, JB consecutive symbols, KSPLIT
// lanes per edge. Every thread owns MG·MV·JB·KB = 128 states.
template <int K> struct VCfg;
template <> struct VCfg<1> { static constexpr int MV = 4, MG = 8, JB = 2, KSPLIT = 1; };
template <> struct VCfg<2> { static constexpr int MV = 4, MG = 2, JB = 4, KSPLIT = 1; };
template <> struct VCfg<3> { static constexpr int MV = 2, MG = 1, JB = 8, KSPLIT = 1; };
template <> struct VCfg<4> { static constexpr int MV = 1, MG = 1, JB = 8, KSPLIT = 1; };
template <> struct VCfg<5> { static constexpr int MV = 1, MG = 1, JB = 4, KSPLIT = 1; };
template <> struct VCfg<6> { static constexpr int MV = 1, MG = 1, JB = 4, KSPLIT = 2; };
template <> struct VCfg<7> { static constexpr int MV = 1, MG = 1, JB = 4, KSPLIT = 4; };
template <> struct VCfg<8> { static constexpr int MV = 1, MG = 1, JB = 4, KSPLIT = 8; };

// GC: keep the step costs in global memory (K = 1 always; K = 2 on GPUs with less than 128 KB of
// shared memory per block).
template <int K_, bool GC>
struct Geo : VCfg<K_> {
    using C = VCfg<K_>;
    static constexpr int K = K_;
    static constexpr int NK = 1 << K;
    static constexpr int N = 1 << (16 - K);
    static constexpr int M = N >> K;
    static constexpr int KB = NK / C::KSPLIT;            // predecessors scanned per thread
    static constexpr int JG = NK / C::JB;
    static constexpr int MT = M / (C::MG * C::MV);
    static constexpr int RUN = C::MV * C::JB;             // consecutive edges written per m-group
    static constexpr int PB = K == 1 ? 1 : K == 2 ? 2 : K <= 4 ? 4 : 8;  // bits per back-pointer
    static constexpr int WBITS = C::MG * RUN * PB;        // back-pointer bits per writer and step
    static constexpr int WRITERS = kVThreads / C::KSPLIT;
    static constexpr int REC_WORDS = WRITERS * WBITS / 32;  // one step's back-pointers
    static constexpr bool GLOBAL_COSTS = GC;
    // K = 2, 3 write 16 consecutive costs per thread: without the swizzle that is a 4-way bank
    // conflict. Their strides (M, MT·MV, MT·MV·NK) are multiples of 256 floats, so the swizzle of
    // a thread's base address carries over to every access.
    static constexpr bool SWZ = K == 2 || K == 3;
    static constexpr int COST_SMEM_BYTES = GLOBAL_COSTS ? 0 : 2 * N * 4;
    static constexpr int SMEM_BYTES =
        COST_SMEM_BYTES > kMinTracebackBytes ? COST_SMEM_BYTES : kMinTracebackBytes;

    static_assert(MT * JG * C::KSPLIT == kVThreads, "threads must cover every (m, j, k-split)");
    static_assert(C::MG * RUN * KB == 128, "128 states per thread");
    static_assert(C::MV == 1 || JG == 1, "a thread's outputs of one m-group must be contiguous");
    static_assert(RUN % 4 == 0 && C::JB % 2 == 0, "float4 stores, half2 codebook pairs");
    static_assert(WBITS == 32 || WBITS == 64, "one or two back-pointer words per writer");
    static_assert(!SWZ || (M % 256 == 0 && (MT * C::MV) % 256 == 0 && JG == 1 && RUN <= 32),
                  "swizzle must commute with the strides and the store offsets");
};

// Swap float4 slots within each 128-byte row (an involution), so strided float4 stores spread
// over all banks while row-contiguous reads stay conflict-free.
__device__ __forceinline__ int swz(int e) {
    const int f = e >> 2;
    return ((f ^ ((f >> 3) & 7)) << 2) | (e & 3);
}

template <class G>
__device__ __forceinline__ int cost_addr(int e) {
    return G::SWZ ? swz(e) : e;
}

// half2 -> two floats, redone every step on purpose: left to itself the compiler hoists the
// conversion of the loop-invariant codebook registers out of the step loop, and 128 fp32 values
// per thread do not fit in registers (they spill).
__device__ __forceinline__ float2 unpack_lut(half2 h) {
    float2 f;
    asm volatile("{\n\t.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\t"
                 "cvt.f32.f16 %1, hi;\n\t}"
                 : "=f"(f.x), "=f"(f.y)
                 : "r"(*reinterpret_cast<const uint32_t*>(&h)));
    return f;
}

template <int MV>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[MV]) {
    if constexpr (MV == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else if constexpr (MV == 2) {
        const float2 t = *reinterpret_cast<const float2*>(p);
        v[0] = t.x; v[1] = t.y;
    } else {
        v[0] = *p;
    }
}

// The thread's place in the geometry.
struct Slot {
    int mt, jg, ks;
    int load_base;   // cost address of (k = ks, m = mt·MV)
    int store_base;  // cost address of the first edge of m-group 0
    int writer;      // back-pointer word index, valid where ks == 0
};

template <class G>
__device__ __forceinline__ Slot make_slot(int tid) {
    Slot s;
    s.ks = tid % G::KSPLIT;
    s.jg = (tid / G::KSPLIT) % G::JG;
    s.mt = tid / (G::KSPLIT * G::JG);
    s.load_base = s.ks * G::M + cost_addr<G>(s.mt * G::MV);
    s.store_base = cost_addr<G>(s.mt * G::MV * G::NK + s.jg * G::JB);
    s.writer = tid / G::KSPLIT;
    return s;
}

// One trellis step: cur[e] = min_k prev[k·M + m] + (l² − 2wl) over the states k·N + e.
template <class G>
__device__ __forceinline__ void viterbi_step(const float* prev, float* cur,
                                             float w2, uint32_t* __restrict__ rec,
                                             const half2 (&lr)[64], const Slot& sl) {
    constexpr int MV = G::MV, JB = G::JB, KB = G::KB, RUN = G::RUN, KSPLIT = G::KSPLIT;
    uint32_t word[G::WBITS / 32];
#pragma unroll
    for (int i = 0; i < G::WBITS / 32; ++i) word[i] = 0;
#pragma unroll
    for (int g = 0; g < G::MG; ++g) {
        float best[RUN];
        int arg[RUN];
#pragma unroll
        for (int kk = 0; kk < KB; ++kk) {
            float pv[MV];
            load_vec<MV>(prev + kk * KSPLIT * G::M + g * G::MT * MV + sl.load_base, pv);
#pragma unroll
            for (int v = 0; v < MV; ++v) {
#pragma unroll
                for (int jj = 0; jj < JB; jj += 2) {
                    const float2 l = unpack_lut(lr[((g * KB + kk) * MV + v) * (JB / 2) + jj / 2]);
                    const float c0 = __fadd_rn(__fmaf_rn(w2, l.x, __fmul_rn(l.x, l.x)), pv[v]);
                    const float c1 = __fadd_rn(__fmaf_rn(w2, l.y, __fmul_rn(l.y, l.y)), pv[v]);
                    const int o = v * JB + jj;
                    if (kk == 0) {
                        best[o] = c0; arg[o] = 0;
                        best[o + 1] = c1; arg[o + 1] = 0;
                    } else {
                        if (c0 < best[o]) { best[o] = c0; arg[o] = kk; }
                        if (c1 < best[o + 1]) { best[o + 1] = c1; arg[o + 1] = kk; }
                    }
                }
            }
        }
#pragma unroll
        for (int o = 0; o < RUN; ++o) arg[o] = arg[o] * KSPLIT + sl.ks;
#pragma unroll
        for (int off = 1; off < KSPLIT; off <<= 1) {
#pragma unroll
            for (int o = 0; o < RUN; ++o) {
                const float ov = __shfl_xor_sync(0xffffffffu, best[o], off);
                const int oa = __shfl_xor_sync(0xffffffffu, arg[o], off);
                if (ov < best[o] || (ov == best[o] && oa < arg[o])) { best[o] = ov; arg[o] = oa; }
            }
        }
        if (KSPLIT == 1 || sl.ks == 0) {
            float* dst = cur + g * G::MT * MV * G::NK;
#pragma unroll
            for (int q = 0; q < RUN / 4; ++q) {
                const int a = G::SWZ ? (sl.store_base ^ (4 * q)) : sl.store_base + 4 * q;
                *reinterpret_cast<float4*>(dst + a) =
                    make_float4(best[4 * q], best[4 * q + 1], best[4 * q + 2], best[4 * q + 3]);
            }
#pragma unroll
            for (int o = 0; o < RUN; ++o) {
                const int bit = (g * RUN + o) * G::PB;
                word[bit >> 5] |= (uint32_t)arg[o] << (bit & 31);
            }
        }
    }
    if (rec != nullptr && (KSPLIT == 1 || sl.ks == 0)) {
        if constexpr (G::WBITS == 64) {
            reinterpret_cast<uint2*>(rec)[sl.writer] = make_uint2(word[0], word[1]);
        } else {
            rec[sl.writer] = word[0];
        }
    }
}

// The back-pointer of edge e in one step record: the inverse of the packing in viterbi_step.
template <class G>
__device__ __forceinline__ int read_pointer(const uint32_t* rec, int e) {
    const int j = e & (G::NK - 1), m = e >> G::K;
    const int jg = j / G::JB, jj = j % G::JB;
    const int g = m / (G::MT * G::MV), r = m % (G::MT * G::MV);
    const int mt = r / G::MV, v = r % G::MV;
    const int bit = (mt * G::JG + jg) * G::WBITS + ((g * G::MV + v) * G::JB + jj) * G::PB;
    return (rec[bit >> 5] >> (bit & 31)) & (G::NK - 1);
}

// Lowest-cost edge (lowest index among equal costs), returned to every thread.
template <class G>
__device__ int block_argmin(const float* costs, float* s_val, int* s_idx) {
    const int tid = threadIdx.x;
    float bv = INFINITY;
    int be = 0x7fffffff;
    for (int a = 4 * tid; a < G::N; a += 4 * kVThreads) {
        const float4 c4 = *reinterpret_cast<const float4*>(costs + a);
        const float c[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int e = cost_addr<G>(a + i);  // the swizzle is its own inverse
            if (c[i] < bv || (c[i] == bv && e < be)) { bv = c[i]; be = e; }
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oe = __shfl_xor_sync(0xffffffffu, be, off);
        if (ov < bv || (ov == bv && oe < be)) { bv = ov; be = oe; }
    }
    if ((tid & 31) == 0) { s_val[tid >> 5] = bv; s_idx[tid >> 5] = be; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < kVThreads / 32; ++w) {
            if (s_val[w] < s_val[0] || (s_val[w] == s_val[0] && s_idx[w] < s_idx[0])) {
                s_val[0] = s_val[w];
                s_idx[0] = s_idx[w];
            }
        }
    }
    __syncthreads();
    const int e = s_idx[0];
    __syncthreads();  // s_idx is reused
    return e;
}

// Walk records [0, T) backwards from edge e after the last one; writes the states (if `out`) and
// returns the edge before record 0 to every thread.
template <class G>
__device__ int traceback(const uint32_t* recs, int T, int e, int32_t* out, uint32_t* buf,
                         int buf_words, int* s_edge) {
    const int tid = threadIdx.x;
    const int per = buf_words / G::REC_WORDS;
    for (int hi = T; hi > 0; hi -= per) {
        const int lo = hi - per > 0 ? hi - per : 0;
        __syncthreads();  // the walker is done with the previous chunk
        const uint4* src = reinterpret_cast<const uint4*>(recs + (size_t)lo * G::REC_WORDS);
        uint4* dst = reinterpret_cast<uint4*>(buf);
        const int n4 = (hi - lo) * G::REC_WORDS / 4;
        for (int i = tid; i < n4; i += kVThreads) dst[i] = __ldcg(src + i);
        __syncthreads();
        if (tid == 0) {
            for (int p = hi - 1; p >= lo; --p) {
                const int k = read_pointer<G>(buf + (p - lo) * G::REC_WORDS, e);
                const int s = (k << (16 - G::K)) | e;
                if (out) out[p] = s;
                e = s >> G::K;
            }
        }
    }
    if (tid == 0) *s_edge = e;
    __syncthreads();
    const int r = *s_edge;
    __syncthreads();
    return r;
}

// Every edge's cost set to 0 (free start) or, with e_star >= 0, inf except edge e_star.
template <class G>
__device__ __forceinline__ void init_costs(float* costs, int e_star) {
    for (int a = 4 * threadIdx.x; a < G::N; a += 4 * kVThreads) {
        float c[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] = e_star < 0 || cost_addr<G>(a + i) == e_star ? 0.f : INFINITY;
        *reinterpret_cast<float4*>(costs + a) = make_float4(c[0], c[1], c[2], c[3]);
    }
}

// records: per block (lookahead + 256) steps; gcosts (K = 1): per block 2·N floats.
template <int K, bool GC>
__global__ void __launch_bounds__(kVThreads, 1)
viterbi_kernel(const float* __restrict__ targets, int n_tiles, const half* __restrict__ lut,
               int warmup, int lookahead, int32_t* __restrict__ states, uint32_t* __restrict__ records,
               float* __restrict__ gcosts) {
    using G = Geo<K, GC>;
    extern __shared__ float4 smem_v4[];
    float* smem = reinterpret_cast<float*>(smem_v4);
    __shared__ float s_w2[kSteps];
    __shared__ float s_val[kVThreads / 32];
    __shared__ int s_idx[kVThreads / 32];

    const int tid = threadIdx.x;
    const Slot sl = make_slot<G>(tid);

    half2 lr[64];
#pragma unroll
    for (int g = 0; g < G::MG; ++g)
#pragma unroll
        for (int kk = 0; kk < G::KB; ++kk)
#pragma unroll
            for (int v = 0; v < G::MV; ++v)
#pragma unroll
                for (int jj = 0; jj < G::JB; jj += 2) {
                    const int k = kk * G::KSPLIT + sl.ks;
                    const int m = g * G::MT * G::MV + sl.mt * G::MV + v;
                    const int e = m * G::NK + sl.jg * G::JB + jj;
                    lr[((g * G::KB + kk) * G::MV + v) * (G::JB / 2) + jj / 2] =
                        *reinterpret_cast<const half2*>(lut + k * G::N + e);
                }

    float* buf0 = G::GLOBAL_COSTS ? gcosts + (size_t)blockIdx.x * 2 * G::N : smem;
    float* buf1 = buf0 + G::N;
    uint32_t* recs = records + (size_t)blockIdx.x * (lookahead + kSteps) * G::REC_WORDS;
    uint32_t* tb = reinterpret_cast<uint32_t*>(smem);
    const int tb_words = G::SMEM_BYTES / 4;
    const int TA = warmup + lookahead;

    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        if (tid < kSteps) s_w2[tid] = -2.f * targets[(size_t)tile * kSteps + tid];

        // Pass A: free start at step 256 − warmup, through 255 and `lookahead` steps past the wrap.
        init_costs<G>(buf0, -1);
        __syncthreads();
        float* prev = buf0;
        float* cur = buf1;
        for (int p = 0; p < TA; ++p) {
            const float w2 = s_w2[(p + kSteps - warmup) & (kSteps - 1)];
            uint32_t* rec = p >= warmup ? recs + (size_t)(p - warmup) * G::REC_WORDS : nullptr;
            viterbi_step<G>(prev, cur, w2, rec, lr, sl);
            __syncthreads();
            float* t = prev; prev = cur; cur = t;
        }
        const int end = block_argmin<G>(prev, s_val, s_idx);
        const int e_star = traceback<G>(recs, lookahead, end, nullptr, tb, tb_words, s_idx);

        // Pass B: 0..255 from e_star, traced back from e_star: a closed cycle.
        init_costs<G>(buf0, e_star);
        __syncthreads();
        prev = buf0;
        cur = buf1;
        uint32_t* recs_b = recs + (size_t)lookahead * G::REC_WORDS;
        for (int p = 0; p < kSteps; ++p) {
            viterbi_step<G>(prev, cur, s_w2[p], recs_b + (size_t)p * G::REC_WORDS, lr, sl);
            __syncthreads();
            float* t = prev; prev = cur; cur = t;
        }
        traceback<G>(recs_b, kSteps, e_star, states + (size_t)tile * kSteps, tb, tb_words, s_idx);
    }
}

// Static shared memory of the kernel (s_w2 and the argmin slots), with room to spare.
constexpr int kStaticSmem = 2048;

// K = 1 always keeps its costs in global memory; K = 2 does where a block cannot have 128 KB of
// shared memory (sm_86/89/120). K >= 3 needs at most 64 KB, which every sm_80+ GPU has.
template <int K>
bool global_costs() {
    if constexpr (K == 1) return true;
    if constexpr (K == 2) return Geo<K, false>::SMEM_BYTES + kStaticSmem > current_device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
    return false;
}

template <int K>
size_t scratch_bytes_k(int lookahead, int blocks) {
    using G = Geo<K, K == 1>;  // record size and N do not depend on where the costs live
    size_t per = (size_t)(lookahead + kSteps) * G::REC_WORDS * 4;
    if (global_costs<K>()) per += (size_t)2 * G::N * 4;
    return per * blocks;
}

template <int K, bool GC>
cudaError_t launch_kg(const float* targets, int n, const half* lut, int warmup, int lookahead,
                      int32_t* states, void* scratch, int blocks, cudaStream_t stream) {
    using G = Geo<K, GC>;
    cudaError_t err = cudaFuncSetAttribute(viterbi_kernel<K, GC>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, G::SMEM_BYTES);
    if (err != cudaSuccess) return err;
    uint32_t* records = static_cast<uint32_t*>(scratch);
    float* gcosts = reinterpret_cast<float*>(records + (size_t)blocks * (lookahead + kSteps) * G::REC_WORDS);
    viterbi_kernel<K, GC><<<blocks, kVThreads, G::SMEM_BYTES, stream>>>(targets, n, lut, warmup,
                                                                         lookahead, states, records, gcosts);
    return cudaGetLastError();
}

template <int K>
cudaError_t launch_k(const float* targets, int n, const half* lut, int warmup, int lookahead,
                     int32_t* states, void* scratch, int blocks, cudaStream_t stream) {
    if constexpr (K <= 2) {
        if (global_costs<K>())
            return launch_kg<K, true>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
    }
    if constexpr (K == 1) {
        return cudaErrorInvalidValue;  // unreachable
    } else {
        return launch_kg<K, false>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
    }
}

}  // namespace

size_t viterbi_scratch_bytes(int K, int lookahead, int blocks) {
    switch (K) {
        case 1: return scratch_bytes_k<1>(lookahead, blocks);
        case 2: return scratch_bytes_k<2>(lookahead, blocks);
        case 3: return scratch_bytes_k<3>(lookahead, blocks);
        case 4: return scratch_bytes_k<4>(lookahead, blocks);
        case 5: return scratch_bytes_k<5>(lookahead, blocks);
        case 6: return scratch_bytes_k<6>(lookahead, blocks);
        case 7: return scratch_bytes_k<7>(lookahead, blocks);
        case 8: return scratch_bytes_k<8>(lookahead, blocks);
        default: return 0;
    }
}

cudaError_t viterbi_encode(const float* targets, int n, int K, const half* lut, int warmup,
                           int lookahead, int32_t* states, void* scratch, int blocks,
                           cudaStream_t stream) {
    if (warmup < 1 || warmup > kSteps || lookahead < 0 || lookahead > kSteps || blocks < 1)
        return cudaErrorInvalidValue;
    if (n <= 0) return cudaSuccess;
    switch (K) {
        case 1: return launch_k<1>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 2: return launch_k<2>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 3: return launch_k<3>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 4: return launch_k<4>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 5: return launch_k<5>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 6: return launch_k<6>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 7: return launch_k<7>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        case 8: return launch_k<8>(targets, n, lut, warmup, lookahead, states, scratch, blocks, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace trellis
