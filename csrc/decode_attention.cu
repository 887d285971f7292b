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
// all of them. Each warp walks its share of the block's keys with an online softmax in base 2,
// one of two ways:
// - the tensor-core walk (head dim 64 or 128, the default; see decode_attention_kernel's MMA
//   branch): 16 keys a step, scores and weighted values as MMAs, K and V rows staged through
//   shared memory by cp.async ahead of use;
// - the scalar walk (head dim 256, or set_attn_mma_slots(0)): loading 16 keys at a time (one
//   memory round trip) and scoring them 8 at a time: a lane owns D/32 dimensions, so every K and
//   V row is one coalesced read; the 32 partial dot products of a step (4 heads x 8 keys) are
//   summed across lanes with a transposing butterfly (31 shuffles, lane l ends with sum l).
// Steps whose keys are all masked (-inf: slots past the position, outside a window) are skipped.
// At batch 1 and short caches the GPU is nearly idle here, so the split counts weigh memory round
// trips and the merge's cost, not bandwidth; long caches are bandwidth work. The
// warps' partial results merge in shared memory; when there are several splits, each block writes its
// partial (o, max, sum) to a workspace and the last block to finish a (batch, head group) merges
// them (a completion counter, as the product's output stage does), so one launch does it all.
// At a decode step the kernel also does the token's RoPE and KV-cache write (DecodeAttnArgs::pos):
// q is rotated as it is loaded, and the block whose split holds the token's slot writes the
// rotated k and v there before its warps read keys. One kernel boundary less per layer.
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "exl3_mm.cuh"  // pdl helpers, launch_pdl, fence_acq_rel_gpu
#include "exl3_prep.cuh"  // lane_xh, store_i8_chunk (the chain into o_proj)
#include "kernels.h"

namespace trellis {

constexpr int kAttnWarps = 8;
constexpr int kAttnHeads = 4;  // query heads per block
constexpr int kAttnKeys = 8;   // keys per warp step (the 4 x 8 scores of one transposed sum)
// Keys a warp loads at once: two steps' worth, so one memory round trip serves 16 keys (one
// step for D = 256, whose rows would take too many registers).
template <int DL>
__host__ __device__ constexpr int attn_batch_keys() {
    return DL <= 4 ? 2 * kAttnKeys : kAttnKeys;
}
constexpr float kLog2e = 1.4426950408889634f;

template <int DL>
struct HalfRow;
template <>
struct HalfRow<2> {
    using T = unsigned int;
};
template <>
struct HalfRow<4> {
    using T = uint2;
};
template <>
struct HalfRow<8> {
    using T = uint4;
};

// DL consecutive halves at p (aligned to their size), as floats.
template <int DL>
__device__ __forceinline__ void halves_to_floats(const typename HalfRow<DL>::T& raw, float f[DL]) {
    const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
    for (int i = 0; i < DL / 2; ++i) {
        const float2 t = __half22float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// Coherent loads, not __ldg: q and the cache are written by the kernel just before this one,
// which under programmatic dependent launch may still run when this grid starts; the
// non-coherent path may serve lines from before its writes.
template <int DL>
__device__ __forceinline__ typename HalfRow<DL>::T load_row(const half* p) {
    return *reinterpret_cast<const typename HalfRow<DL>::T*>(p);
}

// One round of the transposing butterfly: lanes with bit W set keep the upper W of the 2W values
// they hold, the others the lower W, each adding its partner's copy of the half it keeps.
template <int W>
__device__ __forceinline__ void transpose_round(float v[32], int lane) {
    const bool upper = (lane & W) != 0;
#pragma unroll
    for (int i = 0; i < W; ++i) {
        const float lo = v[i], hi = v[i + W];
        const float send = upper ? lo : hi;
        const float keep = upper ? hi : lo;
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
}

// v[0..31] per lane -> the return value of lane l is the sum over lanes of v[l] (31 shuffles
// instead of 5 for each of the 32 sums).
__device__ __forceinline__ float transpose_sum32(float v[32], int lane) {
    transpose_round<16>(v, lane);
    transpose_round<8>(v, lane);
    transpose_round<4>(v, lane);
    transpose_round<2>(v, lane);
    transpose_round<1>(v, lane);
    return v[0];
}

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

// The tensor-core key walk (MMA, D = 64 or 128; set_attn_mma_slots). Why: at 32,768 slots the
// scalar walk spent ~1,000 instructions per 16 keys and warp (fp32 dot products, a transposing
// butterfly, the values' FMAs) and moved 3.0 TB/s where torch's SDPA moved 3.5; this walk moves
// 3.4, and is faster than the scalar one at every span measured, 256 slots included
// (bench.attention, csrc/PERF_NOTES.md session 19). A warp takes 16 keys per step: the scores are
// m16n8k16 MMAs with the block's (up to 4) query heads as rows 0..3 of A and the keys' K rows as B, the
// probabilities go back in as A (the score accumulators are already in A's layout) against V, and
// the K and V rows reach the MMAs through ldmatrix from a ring of kAttnMmaStages shared-memory
// stages per warp, which cp.async fills ahead (16-byte chunks XOR-swizzled by row, so the 8 rows
// an ldmatrix phase reads sit in 8 different bank groups).
constexpr int kAttnMmaKeys = 16;   // keys per step
constexpr int kAttnMmaStages = 3;  // ring stages per warp
template <int DL>
__host__ __device__ constexpr int attn_mma_stage_bytes() {
    return 2 * kAttnMmaKeys * 32 * DL * 2;  // K rows, then V rows
}
template <int DL>
__host__ __device__ constexpr int attn_mma_smem_bytes() {
    return kAttnWarps * kAttnMmaStages * attn_mma_stage_bytes<DL>();
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

template <int DL, bool MMA>
__global__ void __launch_bounds__(kAttnWarps * 32) decode_attention_kernel(const DecodeAttnArgs a) {
    constexpr int D = 32 * DL;
    static_assert(!MMA || DL == 2 || DL == 4, "the tensor-core walk: D = 64 or 128");
    extern __shared__ __align__(128) unsigned char attn_ring[];
    constexpr int PS = kAttnHeads * (D + 2);  // floats per block partial: o, then max, then sum
    __shared__ float sm_o[kAttnWarps][kAttnHeads][D];
    __shared__ float sm_m[kAttnWarps][kAttnHeads], sm_l[kAttnWarps][kAttnHeads];
    __shared__ int sm_last;

    if (a.early_trigger) pdl_launch_dependents();  // the next kernel waits for this grid anyway
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nhg = (a.G + kAttnHeads - 1) / kAttnHeads;
    const int kvh = blockIdx.y / nhg, hg = blockIdx.y - kvh * nhg, b = blockIdx.z;
    const int g0 = hg * kAttnHeads;
    const int ng = min(kAttnHeads, a.G - g0);  // real heads in this group
    const int per_split = (a.S + a.n_split - 1) / a.n_split;
    const int s0 = blockIdx.x * per_split, s1 = min(a.S, s0 + per_split);
    const int per_warp = ((s1 - s0 + kAttnWarps - 1) / kAttnWarps + kAttnKeys - 1) / kAttnKeys * kAttnKeys;  // whole steps
    const int j_begin = s0 + warp * per_warp, j_end = min(s1, j_begin + per_warp);
    const half* kp = a.k + (size_t)b * a.kv_b + (size_t)kvh * a.kv_h + lane * DL;
    const half* vp = a.v + (size_t)b * a.kv_b + (size_t)kvh * a.kv_h + lane * DL;
    const half* mrow = a.mask ? a.mask + (size_t)b * a.mask_b : nullptr;

    // Chain into o_proj: the input signs of the head this warp merges (warps 0..3), a weight, so
    // read before the wait.
    uint2 next_s = make_uint2(0u, 0u);
    if (DL == 4 && a.next_xb && warp < ng)
        next_s = __ldg(reinterpret_cast<const uint2*>(a.next_suh + (kvh * a.G + g0 + warp) * D + lane * DL));
    pdl_wait_primary();  // q, the cache and the mask come from the kernels before this one
    using Row = typename HalfRow<DL>::T;
    Row rc{}, rs{};
    if (a.pos) {  // RoPE here: rotate q below, and write the token's k and v if this split reads its slot
        rc = load_row<DL>(a.cos + lane * DL);
        rs = load_row<DL>(a.sin + lane * DL);
        const long p = *a.pos;
        if (p >= s0 && p < s1) {  // block-uniform
            if (warp == 0) {
                const size_t at = (size_t)b * a.nk_b + (size_t)kvh * a.nk_h + lane * DL;
                const Row kr = rope_row<DL>(load_row<DL>(a.new_k + at), rc, rs, lane);
                const Row vr = load_row<DL>(a.new_v + at);
                // the cache this kernel reads: one pointer for both (blocks of other head groups
                // of this kv head write the same bits)
                *reinterpret_cast<Row*>(const_cast<half*>(kp) + (size_t)p * a.kv_t) = kr;
                *reinterpret_cast<Row*>(const_cast<half*>(vp) + (size_t)p * a.kv_t) = vr;
            }
            __syncthreads();  // the block's warps read the slot after this
        }
    }
    if constexpr (MMA) {
        constexpr int KS = D / 16;  // k steps of the scores
        constexpr int NT = D / 8;   // n tiles of the output
        constexpr int RC = D / 8;   // 16-byte chunks per K or V row
        constexpr int SB = attn_mma_stage_bytes<DL>();
        constexpr int VOFF = kAttnMmaKeys * RC * 16;  // the stage's V rows
        const int g = lane >> 2, cq = lane & 3;       // MMA fragment coordinates
        unsigned char* ring = attn_ring + warp * kAttnMmaStages * SB;
        const uint32_t ring_sa = static_cast<uint32_t>(__cvta_generic_to_shared(ring));

        // Query heads g0..g0+ng-1 (rotated here if this step's RoPE is ours) through the ring's
        // first KB into A fragments: row g = head g (rows 4..15 zero), halves 16 ks + 2 cq (+1)
        // and + 8.
        half* sq = reinterpret_cast<half*>(ring);
#pragma unroll
        for (int h = 0; h < kAttnHeads; ++h) {
            Row qr{};
            if (h < ng) {
                qr = load_row<DL>(a.q + (size_t)b * a.q_b + (size_t)(kvh * a.G + g0 + h) * a.q_h + lane * DL);
                if (a.pos) qr = rope_row<DL>(qr, rc, rs, lane);
            }
            *reinterpret_cast<Row*>(sq + h * D + lane * DL) = qr;
        }
        __syncwarp();
        uint32_t qa[KS][2];
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const uint32_t* row = reinterpret_cast<const uint32_t*>(sq + (g < kAttnHeads ? g : 0) * D);
            qa[ks][0] = g < kAttnHeads ? row[(16 * ks + 2 * cq) / 2] : 0u;
            qa[ks][1] = g < kAttnHeads ? row[(16 * ks + 8 + 2 * cq) / 2] : 0u;
        }
        __syncwarp();  // the ring's stages overwrite sq next

        const half* kbase = kp - lane * DL;
        const half* vbase = vp - lane * DL;
        const int nsteps = j_end > j_begin ? (j_end - j_begin + kAttnMmaKeys - 1) / kAttnMmaKeys : 0;
        // Step t's K and V rows into stage t % kAttnMmaStages; chunk c of row r at c ^ (r & 7); rows
        // past j_end read nothing (zero fill). Every call commits a group, so the waits count alike.
        auto issue = [&](int t) {
            if (t < nsteps) {
                const int j0 = j_begin + t * kAttnMmaKeys;
                const uint32_t dst = ring_sa + (uint32_t)((t % kAttnMmaStages) * SB);
#pragma unroll
                for (int c0 = 0; c0 < 2 * kAttnMmaKeys * RC; c0 += 32) {
                    const int c = c0 + lane;
                    const bool is_v = c >= kAttnMmaKeys * RC;
                    const int w = is_v ? c - kAttnMmaKeys * RC : c;
                    const int r = w / RC, ch = w % RC;
                    const int j = j0 + r;
                    const half* src = (is_v ? vbase : kbase) + (size_t)(j < j_end ? j : j0) * a.kv_t + ch * 8;
                    const uint32_t at = dst + (is_v ? VOFF : 0) + (uint32_t)((r * RC + (ch ^ (r & 7))) * 16);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                                 "r"(j < j_end ? 16 : 0));
                }
            }
            cp_async_commit();
        };
#pragma unroll
        for (int t = 0; t < kAttnMmaStages - 1; ++t) issue(t);

        // ldmatrix rows: K (non-transposed, B of the scores): lane t reads key (t >> 4) * 8 + (t & 7),
        // chunk 2 ks + ((t >> 3) & 1); V (transposed, B of the output): key ((t >> 3) & 1) * 8 + (t & 7),
        // chunk nt + (t >> 4).
        const int kr_ = (lane >> 4) * 8 + (lane & 7), kc = (lane >> 3) & 1;
        const int vr_ = ((lane >> 3) & 1) * 8 + (lane & 7), vc = lane >> 4;
        const float qscale = a.scale * kLog2e;
        float o[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
        float m_run = -INFINITY, l_run = 0.f;  // head g's (lanes of one g agree on m_run; l_run is this lane's part)
        for (int t = 0; t < nsteps; ++t) {
            cp_async_wait<kAttnMmaStages - 2>();
            __syncwarp();
            issue(t + kAttnMmaStages - 1);  // into the stage read at step t - 1
            const int jb = j_begin + t * kAttnMmaKeys;
            // This lane's 4 keys: jb + 8 kt + 2 cq + e.
            float mk[2][2];
            bool any = false;
#pragma unroll
            for (int kt = 0; kt < 2; ++kt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = jb + 8 * kt + 2 * cq + e;
                    mk[kt][e] = j < j_end ? (mrow ? __half2float(mrow[j]) * kLog2e : 0.f) : -INFINITY;
                    any |= mk[kt][e] != -INFINITY;
                }
            if (!__any_sync(0xffffffffu, any)) continue;  // nothing here may be attended
            const uint32_t st = ring_sa + (uint32_t)((t % kAttnMmaStages) * SB);
            float sc[2][4];
#pragma unroll
            for (int kt = 0; kt < 2; ++kt) sc[kt][0] = sc[kt][1] = sc[kt][2] = sc[kt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                uint32_t b00, b01, b10, b11;
                ldmatrix_x4(st + (uint32_t)((kr_ * RC + ((2 * ks + kc) ^ (kr_ & 7))) * 16), b00, b01, b10, b11);
                mma_16816(sc[0], qa[ks][0], 0u, qa[ks][1], 0u, b00, b01);
                mma_16816(sc[1], qa[ks][0], 0u, qa[ks][1], 0u, b10, b11);
            }
            // Online softmax of head g over the 16 keys (its 4 here, the rest on lanes g*4..g*4+3).
            float s4[2][2], mx = -INFINITY;
#pragma unroll
            for (int kt = 0; kt < 2; ++kt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s4[kt][e] = fmaf(sc[kt][e], qscale, mk[kt][e]);
                    mx = fmaxf(mx, s4[kt][e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run, mx);
            const bool none = m_new == -INFINITY;  // every key so far masked for this head
            const float alpha = none ? 1.f : exp2f(m_run - m_new);
            float p[2][2];
#pragma unroll
            for (int kt = 0; kt < 2; ++kt)
#pragma unroll
                for (int e = 0; e < 2; ++e) p[kt][e] = none ? 0.f : exp2f(s4[kt][e] - m_new);
            l_run = l_run * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
            m_run = m_new;
            const uint32_t pa0 = pack_half2(p[0][0], p[0][1]), pa2 = pack_half2(p[1][0], p[1][1]);
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                uint32_t v00, v01, v10, v11;
                const uint32_t va = st + VOFF + (uint32_t)((vr_ * RC + ((nt + vc) ^ (vr_ & 7))) * 16);
                ldmatrix_x4_trans(va, v00, v01, v10, v11);
                o[nt][0] *= alpha, o[nt][1] *= alpha, o[nt + 1][0] *= alpha, o[nt + 1][1] *= alpha;
                mma_16816(o[nt], pa0, 0u, pa2, 0u, v00, v01);
                mma_16816(o[nt + 1], pa0, 0u, pa2, 0u, v10, v11);
            }
        }
        cp_async_wait<0>();
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
        // This warp's partial of head g: rows 0..3 of the accumulators, columns 8 nt + 2 cq (+1).
        if (g < kAttnHeads) {
            if (cq == 0) {
                sm_m[warp][g] = m_run;
                sm_l[warp][g] = l_run;
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                sm_o[warp][g][8 * nt + 2 * cq] = o[nt][0];
                sm_o[warp][g][8 * nt + 2 * cq + 1] = o[nt][1];
            }
        }
    } else {
        float q[kAttnHeads][DL];
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g) {
            if (g < ng) {
                const half* qp = a.q + (size_t)b * a.q_b + (size_t)(kvh * a.G + g0 + g) * a.q_h + lane * DL;
                Row qr = load_row<DL>(qp);
                if (a.pos) qr = rope_row<DL>(qr, rc, rs, lane);
                halves_to_floats<DL>(qr, q[g]);
#pragma unroll
                for (int d = 0; d < DL; ++d) q[g][d] *= a.scale * kLog2e;  // scores in base-2 units
            } else {
#pragma unroll
                for (int d = 0; d < DL; ++d) q[g][d] = 0.f;
            }
        }
        float o[kAttnHeads][DL];
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g)
#pragma unroll
            for (int d = 0; d < DL; ++d) o[g][d] = 0.f;
        // Lane l tracks head l / 8 (the transposed sums put head g's 8 scores on lanes 8g..8g+7).
        float m_run = -INFINITY, l_run = 0.f;
        const int my_head = lane >> 3, my_key = lane & 7;

        constexpr int KB = attn_batch_keys<DL>();
        for (int jb = j_begin; jb < j_end; jb += KB) {
            float mk[KB / kAttnKeys];  // this lane's key (my_key) of each step, mask in base 2
            bool any = false;
#pragma unroll
            for (int h = 0; h < KB / kAttnKeys; ++h) {
                const int jm = jb + h * kAttnKeys + my_key;
                mk[h] = -INFINITY;
                if (jm < j_end) mk[h] = mrow ? __half2float(mrow[jm]) * kLog2e : 0.f;
                any |= mk[h] != -INFINITY;
            }
            if (!__any_sync(0xffffffffu, any)) continue;  // nothing here may be attended: no K/V reads
            typename HalfRow<DL>::T kr[KB], vr[KB];
#pragma unroll
            for (int i = 0; i < KB; ++i) {
                if (jb + i < j_end) {
                    kr[i] = load_row<DL>(kp + (size_t)(jb + i) * a.kv_t);
                    vr[i] = load_row<DL>(vp + (size_t)(jb + i) * a.kv_t);
                } else {
                    kr[i] = typename HalfRow<DL>::T{};
                    vr[i] = typename HalfRow<DL>::T{};
                }
            }
#pragma unroll
            for (int h = 0; h < KB / kAttnKeys; ++h) {
                float part[kAttnHeads * kAttnKeys];
#pragma unroll
                for (int i = 0; i < kAttnKeys; ++i) {
                    float kf[DL];
                    halves_to_floats<DL>(kr[h * kAttnKeys + i], kf);
#pragma unroll
                    for (int g = 0; g < kAttnHeads; ++g) {
                        float acc = 0.f;
#pragma unroll
                        for (int d = 0; d < DL; ++d) acc = fmaf(q[g][d], kf[d], acc);
                        part[g * kAttnKeys + i] = acc;
                    }
                }
                float s = transpose_sum32(part, lane) + mk[h];  // head my_head, key my_key
                if (my_head >= ng) s = -INFINITY;
                float bmax = s;
#pragma unroll
                for (int o8 = 1; o8 < 8; o8 <<= 1) bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, o8));
                const float m_new = fmaxf(m_run, bmax);
                const bool none = m_new == -INFINITY;  // every key so far masked for this head
                const float alpha = none ? 1.f : exp2f(m_run - m_new);
                const float p = none ? 0.f : exp2f(s - m_new);
                float psum = p;
#pragma unroll
                for (int o8 = 1; o8 < 8; o8 <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o8);
                l_run = l_run * alpha + psum;
                m_run = m_new;
#pragma unroll
                for (int g = 0; g < kAttnHeads; ++g) {
                    const float al = __shfl_sync(0xffffffffu, alpha, g * 8);
#pragma unroll
                    for (int d = 0; d < DL; ++d) o[g][d] *= al;
                }
#pragma unroll
                for (int i = 0; i < kAttnKeys; ++i) {
                    float vf[DL];
                    halves_to_floats<DL>(vr[h * kAttnKeys + i], vf);
#pragma unroll
                    for (int g = 0; g < kAttnHeads; ++g) {
                        const float pg = __shfl_sync(0xffffffffu, p, g * 8 + i);
#pragma unroll
                        for (int d = 0; d < DL; ++d) o[g][d] = fmaf(pg, vf[d], o[g][d]);
                    }
                }
            }
        }

        // Merge the block's warps: warp g < 4 then owns head g.
        if (my_key == 0) {
            sm_m[warp][my_head] = m_run;
            sm_l[warp][my_head] = l_run;
        }
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g)
#pragma unroll
            for (int d = 0; d < DL; ++d) sm_o[warp][g][lane * DL + d] = o[g][d];
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
        if constexpr (DL == 4) {
            if (a.next_xb) {  // o_proj's input chunk `head` from these bits, as its prep would
                const int head = kvh * a.G + g0 + g;
                half2 x0, x1;
                lane_xh(raw, next_s, lane, x0, x1);
                const float f[4] = {__low2float(x0), __high2float(x0), __low2float(x1), __high2float(x1)};
                store_i8_chunk(a.next_xb, a.next_scales, a.next_csum, 0, head, a.Hkv * a.G, 1, lane, f);
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

static int& attn_mma_slots() {
    static int slots = 1;
    return slots;
}
void set_attn_mma_slots(int slots) { attn_mma_slots() = slots > 0 ? slots : 0; }
static int& attn_mma_one_split() {
    static int slots = kAttnWarps * kAttnMmaKeys * (kAttnMmaStages - 1);
    return slots;
}
void set_attn_mma_one_split(int slots) { attn_mma_one_split() = slots > 0 ? slots : 0; }

bool decode_attention_takes_mma(const DecodeAttnArgs& a) {
    // cp.async moves 16-byte chunks: rows and bases 16-byte aligned, as a cache's are.
    const bool aligned = ((uintptr_t)a.k | (uintptr_t)a.v) % 16 == 0 && ((a.kv_t | a.kv_h | a.kv_b) * 2) % 16 == 0;
    return attn_mma_slots() > 0 && a.S >= attn_mma_slots() && (a.D == 64 || a.D == 128) && aligned;
}

static int& attn_one_load_splits() {
    static int splits = 10;
    return splits;
}
void set_attn_one_load_splits(int splits) { attn_one_load_splits() = splits > 0 ? splits : 0; }

int decode_attention_splits(int batch, int kv_heads, int groups, int slots, int sms, bool mma) {
    const int blocks_per_split = decode_attention_counters(batch, kv_heads, groups);
    if (mma) {
        // The tensor-core walk: one split (no merge through the workspace) while each warp needs at
        // most the steps its prologue fetches at once (256 slots); beyond that a split per step of
        // each warp, up to one block per SM (the ring is most of an SM's shared memory). Measured
        // (H200, Llama-3.1-8B heads, bench.attention, session 19): 256 slots 5.2 us in one split
        // against 6.3 in two; 512 slots 6.6 in four against 7.2 in two; 1,024 7.2 in eight against
        // 7.6 in four.
        if (slots <= attn_mma_one_split()) return 1;
        const int by_keys = (slots + kAttnWarps * kAttnMmaKeys - 1) / (kAttnWarps * kAttnMmaKeys);
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
    auto with_ring = [&](auto kern, int bytes) -> cudaError_t {
        const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        if (e != cudaSuccess) return e;
        return launch_pdl(kern, grid, block, (size_t)bytes, stream, pdl, a);
    };
    const bool mma = decode_attention_takes_mma(a);
    switch (a.D) {
        case 64:
            if (mma) return with_ring(decode_attention_kernel<2, true>, attn_mma_smem_bytes<2>());
            return launch_pdl(decode_attention_kernel<2, false>, grid, block, 0, stream, pdl, a);
        case 128:
            if (mma) return with_ring(decode_attention_kernel<4, true>, attn_mma_smem_bytes<4>());
            return launch_pdl(decode_attention_kernel<4, false>, grid, block, 0, stream, pdl, a);
        case 256: return launch_pdl(decode_attention_kernel<8, false>, grid, block, 0, stream, pdl, a);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace trellis
