// How a warp of the decode attention kernel (decode_attention.cu) walks its share of a block's
// keys: the scores of the block's query heads, an online softmax in base 2, and the weighted sum
// of values, left unnormalized with the running max and sum for the block's merge. Two walks:
// - attn_walk_mma (head dim 64 or 128, the default; 256 with set_attn_mma_d256): 16 keys a step
//   (8 at head dim 256) on the tensor cores, K and V rows staged through shared memory by cp.async
//   ahead of use;
// - attn_walk_scalar (head dim 256 by default, or set_attn_mma_slots(0)): 16 keys per load into
//   registers (one memory round trip), scored 8 at a time with fp32 FMAs.
// Steps whose keys are all masked (-inf: slots past the position, outside a window) are skipped.
// Each walk has a CAP variant for Gemma 2's soft cap: softcap * tanh(score / softcap) before the
// mask (attn_softcap2).
#pragma once
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "exl3_mm.cuh"  // cp_async_commit / cp_async_wait, mma_16816

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

// A warp's share of a block's keys: K and V rows j_begin .. j_end - 1 of one kv head (this lane's
// D/32 halves of row j at k + j * kv_t), the sequence's additive mask row (or null), how many of the
// block's kAttnHeads query heads are real, the softmax scale, and the soft cap in the walks'
// base-2 units (softcap * log2 e; read where the walk's CAP is set). The walks read query head
// h < ng through q_row(h): the lane's D/32 halves of its row.
struct AttnWarpKeys {
    const half* k;
    const half* v;
    const half* mask;
    long kv_t;
    int j_begin, j_end, ng;
    float scale;
    float cap2;
};

// Gemma 2's soft cap of a base-2 score s (scale and log2 e included): cap2 * tanh(s / cap2), the
// natural-units softcap * tanh(score / softcap) in base-2 units. tanhf (a few ulp), not
// tanh.approx: its 2^-11 relative error would move a capped score near 50 by ~0.02 before exp.
__device__ __forceinline__ float attn_softcap2(float s, float cap2) { return cap2 * tanhf(s / cap2); }
// Where a warp leaves its result for the block's merge: o [kAttnHeads][D] (unnormalized), and per
// head the running max (base 2) and sum.
template <int D>
struct AttnWarpOut {
    float (*o)[D];
    float* m;
    float* l;
};

// The scalar walk: a lane owns D/32 dimensions, so every K and V row is one coalesced read; the
// 32 partial dot products of a step (4 heads x 8 keys) are summed across lanes with a transposing
// butterfly (31 shuffles, lane l ends with sum l). Lane l tracks head l / 8.
template <int DL, bool CAP, typename QRow>
__device__ __forceinline__ void attn_walk_scalar(const AttnWarpKeys& w, QRow&& q_row, int lane,
                                                 const AttnWarpOut<32 * DL>& out) {
    const half* kp = w.k;
    const half* vp = w.v;
    const int j_begin = w.j_begin, j_end = w.j_end;
    float q[kAttnHeads][DL];
#pragma unroll
    for (int g = 0; g < kAttnHeads; ++g) {
        if (g < w.ng) {
            halves_to_floats<DL>(q_row(g), q[g]);
#pragma unroll
            for (int d = 0; d < DL; ++d) q[g][d] *= w.scale * kLog2e;  // scores in base-2 units
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
            if (jm < j_end) mk[h] = w.mask ? __half2float(w.mask[jm]) * kLog2e : 0.f;
            any |= mk[h] != -INFINITY;
        }
        if (!__any_sync(0xffffffffu, any)) continue;  // nothing here may be attended: no K/V reads
        typename HalfRow<DL>::T kr[KB], vr[KB];
#pragma unroll
        for (int i = 0; i < KB; ++i) {
            if (jb + i < j_end) {
                kr[i] = load_row<DL>(kp + (size_t)(jb + i) * w.kv_t);
                vr[i] = load_row<DL>(vp + (size_t)(jb + i) * w.kv_t);
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
            float s = transpose_sum32(part, lane);  // head my_head, key my_key
            if constexpr (CAP) s = attn_softcap2(s, w.cap2);
            s += mk[h];
            if (my_head >= w.ng) s = -INFINITY;
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

    if (my_key == 0) {
        out.m[my_head] = m_run;
        out.l[my_head] = l_run;
    }
#pragma unroll
    for (int g = 0; g < kAttnHeads; ++g)
#pragma unroll
        for (int d = 0; d < DL; ++d) out.o[g][lane * DL + d] = o[g][d];
}

// The tensor-core key walk (MMA, D = 64 or 128, and 256 with set_attn_mma_d256, whose form is
// attn_mma_step_d256's; set_attn_mma_slots). Why: at 32,768 slots the
// scalar walk spent ~1,000 instructions per 16 keys and warp (fp32 dot products, a transposing
// butterfly, the values' FMAs) and moved 3.0 TB/s where torch's SDPA moved 3.5; this walk moves
// 3.4, and is faster than the scalar one at every span measured, 256 slots included
// (bench.attention, csrc/PERF_NOTES.md session 19). A warp takes 16 keys per step: the scores are
// m16n8k16 MMAs with the block's (up to 4) query heads as rows 0..3 of A and the keys' K rows as B, the
// probabilities go back in as A (the score accumulators are already in A's layout) against V, and
// the K and V rows reach the MMAs through ldmatrix from a ring of NS shared-memory stages per
// warp, which cp.async fills ahead (16-byte chunks XOR-swizzled by row, so the 8 rows an ldmatrix
// phase reads sit in 8 different bank groups). Three stages (192 KB a block at D = 128: one block
// per SM) where they fit, as on the H100/H200; two where a block gets less shared memory (A100:
// 163 KB); none (the scalar walk) below that.
constexpr int kAttnMmaKeys = 16;  // keys per step at head dims 64 and 128
constexpr int kAttnMmaMaxStages = 3;
// Keys per step at head dim 32 dl: 16, or 8 at head dim 256, so that a stage stays at 8 KB and
// three per warp still fit a block's shared memory (the walk's head-dim-256 form, below).
__host__ __device__ constexpr int attn_mma_keys(int dl) { return dl <= 4 ? kAttnMmaKeys : kAttnMmaKeys / 2; }
// Bytes of one ring stage (K rows, then V rows) and of a block's rings, at head dim 32 dl.
__host__ __device__ constexpr int attn_mma_stage_bytes(int dl) {
    return 2 * attn_mma_keys(dl) * 32 * dl * 2;
}
__host__ __device__ constexpr int attn_mma_smem_bytes(int dl, int ns) {
    return kAttnWarps * ns * attn_mma_stage_bytes(dl);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}
// d += a b for one m16n8k8 tile (fp16 in, fp32 accumulators): a0 rows 0..7, a1 rows 8..15.
__device__ __forceinline__ void mma_1688(float d[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// Steps of attn_mma_keys(DL) keys in a warp's share.
template <int DL>
__device__ __forceinline__ int attn_mma_steps(const AttnWarpKeys& w) {
    constexpr int SK = attn_mma_keys(DL);
    return w.j_end > w.j_begin ? (w.j_end - w.j_begin + SK - 1) / SK : 0;
}
// Step t's K and V rows into ring stage t % NS (chunk c of row r at c ^ (r & 7); rows past j_end
// read nothing: zero fill). Every call commits a group, so the waits count alike.
template <int DL, int NS>
__device__ __forceinline__ void attn_mma_issue(const AttnWarpKeys& w, int lane, uint32_t ring_sa, int t, int nsteps) {
    constexpr int D = 32 * DL, RC = D / 8, SB = attn_mma_stage_bytes(DL), SK = attn_mma_keys(DL);
    constexpr int VOFF = SK * RC * 16;
    if (t < nsteps) {
        const int j0 = w.j_begin + t * SK;
        const uint32_t dst = ring_sa + (uint32_t)((t % NS) * SB);
#pragma unroll
        for (int c0 = 0; c0 < 2 * SK * RC; c0 += 32) {
            const int c = c0 + lane;
            const bool is_v = c >= SK * RC;
            const int cw = is_v ? c - SK * RC : c;  // the chunk within K's or V's rows
            const int r = cw / RC, ch = cw % RC;
            const int j = j0 + r;
            const half* src = (is_v ? w.v : w.k) - lane * DL + (size_t)(j < w.j_end ? j : j0) * w.kv_t + ch * 8;
            const uint32_t at = dst + (is_v ? VOFF : 0) + (uint32_t)((r * RC + (ch ^ (r & 7))) * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                         "r"(j < w.j_end ? 16 : 0));
        }
    }
    cp_async_commit();
}
// The walk's prologue on its own, for a kernel that issues it before its PDL wait (the cache rows
// of earlier steps are complete by then; see attn_walk_mma's `prefetched`).
template <int DL, int NS>
__device__ __forceinline__ void attn_mma_prefetch(const AttnWarpKeys& w, int lane, unsigned char* ring) {
    const uint32_t ring_sa = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    const int nsteps = attn_mma_steps<DL>(w);
#pragma unroll
    for (int t = 0; t < NS - 1; ++t) attn_mma_issue<DL, NS>(w, lane, ring_sa, t, nsteps);
}

// The masks (base 2) of the N keys a lane holds at the step from key jb: keys jb + 8 (i / 2) +
// 2 cq + i % 2 (the score accumulators' columns), -inf past the warp's share. Whether any key of
// the warp's step may be attended (if none, the step reads nothing).
template <int N>
__device__ __forceinline__ bool attn_mma_masks(const AttnWarpKeys& w, int jb, int cq, float (&mk)[N]) {
    bool any = false;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int j = jb + 8 * (i / 2) + 2 * cq + i % 2;
        mk[i] = j < w.j_end ? (w.mask ? __half2float(w.mask[j]) * kLog2e : 0.f) : -INFINITY;
        any |= mk[i] != -INFINITY;
    }
    return __any_sync(0xffffffffu, any);
}

// One step's online softmax of head g over the N keys this lane holds (raw scores s, masks mk;
// the head's other keys are on the lanes of the same g): the scaled (CAP: capped) scores' max
// over the head moves m_run, the probabilities go to p and this lane's part of the head's sum to
// l_run. Returns alpha, the rescale of what the head summed before.
template <bool CAP, int N>
__device__ __forceinline__ float attn_mma_softmax(const float (&s)[N], const float (&mk)[N], const AttnWarpKeys& w,
                                                  float& m_run, float& l_run, float (&p)[N]) {
    const float qscale = w.scale * kLog2e;
    float x[N], mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if constexpr (CAP) {
            x[i] = attn_softcap2(s[i] * qscale, w.cap2) + mk[i];
        } else {
            x[i] = fmaf(s[i], qscale, mk[i]);
        }
        mx = fmaxf(mx, x[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const bool none = m_new == -INFINITY;  // every key so far masked for this head
    const float alpha = none ? 1.f : exp2f(m_run - m_new);
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = none ? 0.f : exp2f(x[i] - m_new);
    l_run = l_run * alpha + (p[0] + p[1]);
#pragma unroll
    for (int i = 2; i < N; i += 2) l_run = l_run + (p[i] + p[i + 1]);
    m_run = m_new;
    return alpha;
}

// One step of the head-dim-256 walk (attn_walk_mma at DL 8): 8 keys, whose stage is ring stage
// `st`. 16 keys of K and V at head dim 256 would take 16 KB a stage, too much for three stages per
// warp, and the 16 x 256 output accumulators of the D <= 128 form (P as A against V) would take
// 128 registers per lane. So the values' product is turned around: O^T += V^T P^T, m16n8k8 MMAs
// with 16 of the head's dimensions as rows (V^T from ldmatrix.trans), the 8 keys as k, and the
// query heads as the columns: the probabilities of head g for keys 2 cq, 2 cq + 1, which this lane
// holds as the scores' accumulators left them, are exactly its fragment of B. 16 MMAs a step and
// 64 accumulator registers; a lane holds heads 2 cq, 2 cq + 1 (real for cq < 2) of dimensions
// 16 mt + g and 16 mt + g + 8.
template <bool CAP>
__device__ __forceinline__ void attn_mma_step_d256(const AttnWarpKeys& w, const uint32_t (&qa)[16][2], uint32_t st,
                                                   int jb, int lane, float (&o)[16][4], float& m_run, float& l_run) {
    constexpr int RC = 32, VOFF = 8 * RC * 16;
    const int cq = lane & 3;
    float mk[2];  // this lane's keys jb + 2 cq + e
    if (!attn_mma_masks(w, jb, cq, mk)) return;  // nothing here may be attended
    // Scores: ldmatrix rows: lane t reads key t & 7, chunk 2 ks + (t >> 3): B of k steps ks, ks + 1.
    const int kr_ = lane & 7, kc = lane >> 3;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // even and odd k steps: two chains
#pragma unroll
    for (int ks = 0; ks < 16; ks += 2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(st + (uint32_t)((kr_ * RC + ((2 * ks + kc) ^ kr_)) * 16), b0, b1, b2, b3);
        mma_16816(sc[0], qa[ks][0], 0u, qa[ks][1], 0u, b0, b1);
        mma_16816(sc[1], qa[ks + 1][0], 0u, qa[ks + 1][1], 0u, b2, b3);
    }
    const float s[2] = {sc[0][0] + sc[1][0], sc[0][1] + sc[1][1]};
    float p[2];
    const float alpha = attn_mma_softmax<CAP>(s, mk, w, m_run, l_run, p);
    const uint32_t pb = pack_half2(p[0], p[1]);
    // The rescale of the columns this lane holds: heads 2 cq and 2 cq + 1, whose alpha is on lanes 8 cq, 8 cq + 4.
    const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * cq), a1 = __shfl_sync(0xffffffffu, alpha, 8 * cq + 4);
    // V^T: ldmatrix.trans rows: lane t reads key t & 7, chunk 2 mt + (t >> 3): A of m tiles mt, mt + 1.
#pragma unroll
    for (int mt = 0; mt < 16; mt += 2) {
        uint32_t v0, v1, v2, v3;
        ldmatrix_x4_trans(st + VOFF + (uint32_t)((kr_ * RC + ((2 * mt + kc) ^ kr_)) * 16), v0, v1, v2, v3);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            o[mt + i][0] *= a0, o[mt + i][1] *= a1, o[mt + i][2] *= a0, o[mt + i][3] *= a1;
        }
        mma_1688(o[mt], v0, v1, pb);
        mma_1688(o[mt + 1], v2, v3, pb);
    }
}

// prefetched: attn_mma_prefetch already issued the prologue; then the row of slot patch_slot (this
// step's token, -1: none) is replaced by new_rows (its K row, then its V row, D halves each, in
// shared memory) if the prologue fetched it.
template <int DL, bool CAP, int NS, typename QRow>
__device__ __forceinline__ void attn_walk_mma(const AttnWarpKeys& w, QRow&& q_row, int lane, unsigned char* ring,
                                              const AttnWarpOut<32 * DL>& out, bool prefetched = false,
                                              long patch_slot = -1, const half* new_rows = nullptr) {
    static_assert(DL == 2 || DL == 4 || DL == 8, "the tensor-core walk: D = 64, 128 or 256");
    using Row = typename HalfRow<DL>::T;
    constexpr int D = 32 * DL;
    const int j_begin = w.j_begin, j_end = w.j_end;
    constexpr int KS = D / 16;  // k steps of the scores
    constexpr int NT = D / 8;   // n tiles of the output (D <= 128)
    constexpr int RC = D / 8;   // 16-byte chunks per K or V row
    constexpr int SB = attn_mma_stage_bytes(DL);
    constexpr int SK = attn_mma_keys(DL);
    constexpr int VOFF = SK * RC * 16;  // the stage's V rows
    const int g = lane >> 2, cq = lane & 3;       // MMA fragment coordinates
    const uint32_t ring_sa = static_cast<uint32_t>(__cvta_generic_to_shared(ring));

    // The query heads through the last stage's first KB into A fragments: row g = head g (rows
    // 4..15 zero), halves 16 ks + 2 cq (+1) and + 8.
    half* sq = reinterpret_cast<half*>(ring + (NS - 1) * SB);  // the stage the prologue leaves empty
#pragma unroll
    for (int h = 0; h < kAttnHeads; ++h) *reinterpret_cast<Row*>(sq + h * D + lane * DL) = h < w.ng ? q_row(h) : Row{};
    __syncwarp();
    uint32_t qa[KS][2];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(sq + (g < kAttnHeads ? g : 0) * D);
        qa[ks][0] = g < kAttnHeads ? row[(16 * ks + 2 * cq) / 2] : 0u;
        qa[ks][1] = g < kAttnHeads ? row[(16 * ks + 8 + 2 * cq) / 2] : 0u;
    }
    __syncwarp();  // the ring's stages overwrite sq next

    const int nsteps = attn_mma_steps<DL>(w);
    auto issue = [&](int t) { attn_mma_issue<DL, NS>(w, lane, ring_sa, t, nsteps); };
    if (!prefetched) {
#pragma unroll
        for (int t = 0; t < NS - 1; ++t) issue(t);
    }
    // This step's token row (slot `patch_slot`, written by this kernel after its prefetch) into the
    // stage the prologue fetched it to: the prefetch read the slot before the write.
    if (prefetched && patch_slot >= j_begin && patch_slot < j_end && patch_slot < j_begin + (NS - 1) * SK) {
        cp_async_wait<0>();
        __syncwarp();
        const int t = (patch_slot - j_begin) / SK, r = (patch_slot - j_begin) % SK;
        unsigned char* st = ring + (t % NS) * SB;
        for (int c = lane; c < 2 * RC; c += 32) {  // K's chunks, then V's
            const int ch = c % RC;
            const uint4 v = reinterpret_cast<const uint4*>(new_rows + (c / RC) * D)[ch];
            *reinterpret_cast<uint4*>(st + (c / RC) * VOFF + (r * RC + (ch ^ (r & 7))) * 16) = v;
        }
        __syncwarp();
    }

    if constexpr (DL == 8) {
        float o[16][4];
#pragma unroll
        for (int mt = 0; mt < 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
        float m_run = -INFINITY, l_run = 0.f;  // head g's, as in the D <= 128 form below
        for (int t = 0; t < nsteps; ++t) {
            cp_async_wait<NS - 2>();
            __syncwarp();
            issue(t + NS - 1);  // into the stage read at step t - 1
            attn_mma_step_d256<CAP>(w, qa, ring_sa + (uint32_t)((t % NS) * SB), j_begin + t * SK, lane, o, m_run, l_run);
        }
        cp_async_wait<0>();
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
        if (g < kAttnHeads && cq == 0) {
            out.m[g] = m_run;
            out.l[g] = l_run;
        }
        if (cq < 2) {  // heads 2 cq, 2 cq + 1: dimensions 16 mt + g (+ 8)
#pragma unroll
            for (int mt = 0; mt < 16; ++mt) {
                out.o[2 * cq][16 * mt + g] = o[mt][0];
                out.o[2 * cq + 1][16 * mt + g] = o[mt][1];
                out.o[2 * cq][16 * mt + 8 + g] = o[mt][2];
                out.o[2 * cq + 1][16 * mt + 8 + g] = o[mt][3];
            }
        }
    } else {
        // ldmatrix rows: K (non-transposed, B of the scores): lane t reads key (t >> 4) * 8 + (t & 7),
        // chunk 2 ks + ((t >> 3) & 1); V (transposed, B of the output): key ((t >> 3) & 1) * 8 + (t & 7),
        // chunk nt + (t >> 4).
        const int kr_ = (lane >> 4) * 8 + (lane & 7), kc = (lane >> 3) & 1;
        const int vr_ = ((lane >> 3) & 1) * 8 + (lane & 7), vc = lane >> 4;
        float o[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
        float m_run = -INFINITY, l_run = 0.f;  // head g's (lanes of one g agree on m_run; l_run is this lane's part)
        for (int t = 0; t < nsteps; ++t) {
            cp_async_wait<NS - 2>();
            __syncwarp();
            issue(t + NS - 1);  // into the stage read at step t - 1
            const int jb = j_begin + t * kAttnMmaKeys;
            float mk[4];  // this lane's 4 keys: jb + 8 kt + 2 cq + e at 2 kt + e
            if (!attn_mma_masks(w, jb, cq, mk)) continue;  // nothing here may be attended
            const uint32_t st = ring_sa + (uint32_t)((t % NS) * SB);
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
            const float s[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
            float p[4];
            const float alpha = attn_mma_softmax<CAP>(s, mk, w, m_run, l_run, p);
            const uint32_t pa0 = pack_half2(p[0], p[1]), pa2 = pack_half2(p[2], p[3]);
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
                out.m[g] = m_run;
                out.l[g] = l_run;
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                out.o[g][8 * nt + 2 * cq] = o[nt][0];
                out.o[g][8 * nt + 2 * cq + 1] = o[nt][1];
            }
        }
    }
}

}  // namespace trellis
