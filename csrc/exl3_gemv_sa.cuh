// The block-shared product's host side: its grid (sa_grid), where it serves (sa_applies), which
// of its forms a product takes (sa_form; gemv_f16_acts asks the same for the prep), and the
// launches. The kernel, its forms (CFG bits) and their history are in exl3_gemv_sa_kernel.cuh.
#pragma once
#include "exl3_gemv_sa_kernel.cuh"

namespace trellis {

// k rows per slice: SaShape::KS, or what fits beside the rings where shared memory is short (a
// multiple of 8: slices are whole 128-input chunks, since the row sums come a chunk at a time; a
// block may opt into 99 KB on sm_86/89/120, 227 KB on sm_90; 0: too little for the kernel to pay).
// With the compact setting kGvCompactTwoBlocks, what fits in an SM's share of the blocks launched
// on it (SaShape::BLOCKS_PER_SM / HALVES; an SM has 100 KB on sm_86/89/120, 164 KB on sm_80; on
// sm_90 KS fits). kSaTwin: a launched block holds two of the grid's blocks, and the second's slice
// gets what the first's HALF_WORDS leave.
template <int K, int NG, int CFG = 0>
int sa_slice_rows(int tk) {
    using S = SaShape<K, NG, CFG>;
    const SmemLimits lim = device_smem_limits();
    const int sm_share = lim.per_sm / (S::BLOCKS_PER_SM / S::HALVES) - lim.reserved;
    const bool two = gemv_compact() == kGvCompactTwoBlocks && lim.per_sm > 0 && sm_share < lim.per_block;
    const int budget = (two ? sm_share : lim.per_block) - (S::HALVES - 1) * S::HALF_WORDS * 4;
    const int fit = (budget / 4 - S::RING_WORDS - S::EXTRA_WORDS) / S::BROW;
    const int ks = (fit < S::KS ? fit : S::KS) & ~7;
    return ks < 16 ? 0 : (ks < tk ? ks : tk);
}

// The slices: as few as shared memory allows, of equal size, but enough that a block has about 2
// column groups (a small layer otherwise copies a 64-row slice into every block for a fraction of
// one group). Fewer slices, fewer partial sums per output into the workspace: at 32 rows that
// traffic, its completion counts and the output stage took a quarter of 8192x28672's time and
// half of 4096x14336's (no-tail probe, session 28). Then blocks per slice for each segment, in
// proportion to its columns, with at least gemv_min_units() two-k-row units per warp, and never
// more blocks than fit at once (SaShape::BLOCKS_PER_SM per SM): one more would run in a second wave
// (4096x28672 at 17..32 rows: 265 blocks, 30% slower; csrc/PERF_NOTES.md).
// gemv_sa_grid() == 0: the rule before session 28, a benchmark baseline (about 8 column groups per
// block; blocks per slice rounded to nearest, so sometimes a block more than fits at once).
template <int K, int NG, int CFG = 0>
SaGrid sa_grid(const MmArgs& a) {
    using S = SaShape<K, NG, CFG>;
    SaGrid gd;
    const int tk = a.in / 16, tc = tk / 8;  // k rows, 128-input chunks
    const int groups = a.out / 16 / S::CT;
    const long target = (long)S::BLOCKS_PER_SM * (a.num_sms > 0 ? a.num_sms : 132);
    const int kc_fit = sa_slice_rows<K, NG, CFG>(tk) / 8;
    const bool old_rule = gemv_sa_grid() == 0;
    long nsl = (target * (old_rule ? 8 : 2) + groups - 1) / groups;
    if (nsl > tc) nsl = tc;
    if (nsl < (tc + kc_fit - 1) / kc_fit) nsl = (tc + kc_fit - 1) / kc_fit;
    gd.nsl = (int)nsl;
    gd.ks = 8 * (int)((tc + nsl - 1) / nsl);  // slice s: chunks [tc s / nsl, tc (s + 1) / nsl)
    const int cols[5] = {0, a.seg_cols[0], a.seg_cols[1], a.seg_cols[2], 0x7fffffff};
    gd.nseg = 0;
    for (int s = 0; s < 4 && cols[s] < a.out; ++s) {
        gd.seg_grp[s] = cols[s] / 16 / S::CT;
        gd.nseg = s + 1;
    }
    gd.seg_grp[gd.nseg] = groups;
    const int rows = gd.ks;
    for (int s = 0; s < gd.nseg; ++s) {
        const long gs = gd.seg_grp[s + 1] - gd.seg_grp[s];
        long nb, by_units;
        if (old_rule) {
            nb = (target * gs + (long)groups * gd.nsl / 2) / ((long)groups * gd.nsl);
            by_units = gs * (rows / S::KR) / ((long)S::WARPS * gemv_min_units());
        } else {
            nb = target * gs / ((long)groups * gd.nsl);
            by_units = gs * (rows / 2) / ((long)S::WARPS * gemv_min_units());
        }
        if (nb > by_units) nb = by_units;
        gd.seg_blocks[s] = (int)(nb > 0 ? nb : 1);
    }
    return gd;
}

// Whether every segment of a grouped product (each member after the first) starts on a multiple of
// `cols` columns: the block-shared kernel's column groups (128), the wgmma form's units.
inline bool segments_start_on(const MmArgs& a, int cols) {
    for (int s = 0; s < 3; ++s)
        if (a.seg_cols[s] < a.out && a.seg_cols[s] % cols) return false;
    return true;
}

// Whether the block-shared kernel serves this fp16-path product. gemv_shared_acts setting: 0
// never; 2 always; 1 17..32 rows (four fragment groups) of layers of at least 4096 x 14336 weights,
// the rule from session 8 to 38 (8192x28672: 103 against 125 us then, on the H200); 3 (default
// since session 39) that and 9..16 rows (two groups) of layers of at least 4096 x 28672 weights.
// Measured on an H100 in session 39 with neither kernel carrying a dead output stage
// (bench/ab_session38.sh, ab_session39.sh, ab_session39b.sh; K = 4 MUL1; us block-shared against
// per-warp):
// - 9..16 rows: 8192x28672 63.5 / 65.6 against 80.0 / 80.7 at 12 / 16 rows, 28672x8192 66.3 / 68.3
//   against 80.3 / 81.5, 4096x28672 38.2 / 40.0 against 44.4 / 45.5; decode (Llama-3.1-8B shapes,
//   where the gate and up projections' 4096x28672 is the layer it reaches) at batch 12 3,212-3,276
//   tok/s against 3,041-3,078 (+6%), at batch 16 3,876-4,017 against 3,788-3,837 (+3%).
//   8192x10240 (31.3 / 32.8 against 35.0 / 36.0) and 8192x8192 (27.5 / 29.5 against 29.1 / 30.2)
//   gained too, but only a 70B-shaped decode would show whether that carries over, and none ran;
//   14336x4096 and 4096x6144 lost 6-38%; 4096x4096 gained 6-12%.
// - 5..8 rows: faster alone on 4096x6144 and 4096x4096 (13.9 against 17.0 us at 8 rows), yet
//   decode at batch 8 with those layers on it fell from 2,591-2,595 to 2,198-2,202 tok/s (-15%):
//   left off. Larger layers lost 5-45% alone.
// Debug variants 30, 32-40, 44-46, 48-50, 53 and 54 force it on (sa_forced), 61 keeps these rules
// (sa_rules), 31 and the other variants (probes and configurations of the version-3 kernel) off.
// Segment starts must fall on its column groups.
constexpr bool sa_forced(int variant) {
    return variant == 30 || (variant >= 32 && variant <= 40) || variant == kSaVarTwoTiles || variant == kSaVarSkipEmpty ||
           variant == kSaVarInFinish || variant == kSaVarWgmmaTcSum || variant == kSaVarWgmmaA12 ||
           variant == kSaVarWgmmaProducts || variant == kSaVarWgmmaNoA12 || variant == kSaVarNoSlice;
}
// The variants under which products take the shipped rules and forms (61 changes only the blocks,
// 70 and 71 the order of a slice's units, 68 and 69 leave flushes out, 72 and 73 add stamps, 76
// stamps wide blocks, 78 and 79 launch blocks two to one, 80 claims units at run time).
constexpr bool sa_rules(int variant) {
    return variant == 0 || variant == kSaVarWide || (variant >= kSaVarNoTail && variant <= kSaVarRotateStamp) ||
           variant == kSaVarWideStamp || variant == kSaVarTwin || variant == kSaVarTwinStamp || variant == kSaVarSteal;
}
template <int K, int NG>
bool sa_applies(const MmArgs& a, int variant) {
    if (!sa_rules(variant) && !sa_forced(variant)) return false;
    if (a.zero_after) return false;  // the per-warp kernel zeroes the open sums its prep read
    const int mode = sa_rules(variant) ? gemv_shared_acts() : 2;
    if (mode == 0 || sa_slice_rows<K, NG>(a.in / 16) == 0) return false;
    if (mode != 2) {
        const long weights = (long)a.in * a.out;
        const bool four_groups = NG == 4 && weights >= 4096L * 14336;
        const bool two_groups = mode == 3 && NG == 2 && weights >= 4096L * 28672;
        if (!four_groups && !two_groups) return false;
    }
    return segments_start_on(a, 128);
}

// A debug build's unsplit products (gemv_split_finish 0) take the block-shared kernel's form with
// the warps' output stage (kSaInFinish).
inline bool sa_unsplit(const MmArgs& a) { return kDebugVariants && a.y && gemv_split_finish() < 1; }

template <int K, int CB, int NG, int CFG = 0>
cudaError_t launch_gemv_sa(const MmArgs& a, cudaStream_t stream) {
    using S = SaShape<K, NG, CFG>;
    if (sa_slice_rows<K, NG, CFG>(a.in / 16) < S::KR) return cudaErrorInvalidValue;
    // The prep wrote the activations in this form's layout, and MUL1's chunk sums (gemv_f16_acts)
    constexpr bool kRaw = CB == CB_MUL1 && !(CFG & kSaAffine);
    if (a.acts_wgmma != ((CFG & kSaWgmma) != 0) || (kRaw && !a.csum)) return cudaErrorInvalidValue;
    const SaGrid gd = sa_grid<K, NG, CFG>(a);
    long blocks = 0;
    for (int s = 0; s < gd.nseg; ++s) blocks += (long)gd.nsl * gd.seg_blocks[s];
    // kSaTwin: the grid's blocks two to a launched block, each half with shared memory of its own
    const size_t words = (size_t)(S::HALVES - 1) * S::HALF_WORDS + (size_t)gd.ks * S::BROW + S::RING_WORDS + S::EXTRA_WORDS;
    const size_t smem = gv_capped_smem(words * 4, S::BLOCKS_PER_SM / S::HALVES);
    // finish_rows 0: the kernel leaves the output transform to gv_finish_kernel (gemv_split_finish).
    // Unsplit (setting 0) takes the form with the warps' output stage, which only debug builds have;
    // a shipped build splits regardless.
    constexpr bool kInFinish = (CFG & kSaInFinish) != 0;
    if constexpr (!kInFinish && kDebugVariants && !(CFG & (kSaWgmma | kSaSteal))) {  // (sa_form: no wgmma form unsplit; kSaSteal splits)
        if (sa_unsplit(a)) return launch_gemv_sa<K, CB, NG, CFG | kSaInFinish>(a, stream);
    }
    const bool split = a.y && (!kInFinish || gemv_split_finish() >= 1);
    // kSaStamp: the stamps go where `counters` would (split products do not count), if they fit
    int* counters = a.counters;
    if constexpr ((CFG & kSaStamp) != 0)
        counters = blocks * S::TEAMS <= sa_stamp_slots() ? reinterpret_cast<int*>(sa_stamp_buffer()) : nullptr;
    // kSaSteal: the claim words, and a slice's units in 15 bits (a word's next unit may pass its
    // end by one, which must not carry into the end's half)
    if constexpr ((CFG & kSaSteal) != 0) {
        for (int s = 0; s < gd.nseg; ++s)
            if ((long)(gd.seg_grp[s + 1] - gd.seg_grp[s]) / S::GW * (gd.ks / S::KR) > 0x7fff) return cudaErrorInvalidValue;
        counters = reinterpret_cast<int*>(sa_claim_words(blocks * S::TEAMS, stream));
        if (!counters) return cudaErrorInvalidValue;
    }
    const cudaError_t e = launch_pdl_smem(exl3_gemv_sa_kernel<K, CB, NG, CFG>, dim3((unsigned)((blocks + S::HALVES - 1) / S::HALVES)),
                                          dim3(S::HALVES * S::WARPS * 32),
                                          smem, stream, a.pdl, a.xb, a.csum, a.trellis, a.z, a.m, a.in, a.out, a.y, a.ldy, a.svh,
                                          a.bias, counters, a.early_trigger, split ? 0 : gemv_finish_rows(), gd);
    return e != cudaSuccess || !split ? e : launch_gv_finish(a, stream);
}

// Whether a block-shared product takes two tiles per unit (kSaTwoTiles) instead of four: 25..32
// rows of layers of fewer than 4096 x 18432 weights at K <= 4, unless gemv_sa_tiles is 0.
// Measured on the H200 (session 37, csrc/PERF_NOTES.md), four tiles against two: K = 4 MUL1 at 28
// and 32 rows 4096x14336 32.3 / 33.7 us against 30.5 / 31.2, 14336x4096 34.3 / 35.3 against 32.5 /
// 33.1, 8192x8192 34.4 / 35.4 against 33.5 / 33.8, 5120x13824 36.2 / 37.8 against 35.6 / 36.5; at
// 24 rows within 1% (3584x18944 2% slower); at 17 and 20 rows two tiles 0-7% slower; 8192x10240
// 1-7% and 4096x28672 2% slower at every row count. At 32 rows of 4096x14336 and 14336x4096, K = 2
// and 4 gained 2-9% with 3INST and MUL1, K = 6 lost 4-5% with 3INST (gained 2-4% with MUL1).
// Setting 2 (a benchmark mode) takes two tiles wherever the kernel has four row groups.
template <int K>
bool sa_two_tiles(const MmArgs& a) {
    const int mode = gemv_sa_tiles();
    return mode == 2 || (mode == 1 && K <= 4 && a.m > 24 && (long)a.in * a.out < 4096L * 18432);
}

// Whether a block-shared product of four row groups takes the wgmma form (kSaWgmma): setting
// gemv_wgmma on (the default), K <= 4, a device of compute capability 9.0 (the build's sm_90a
// code), and every segment a whole number of the warpgroups' units (4 column groups of ct tiles).
template <int K>
bool sa_wgmma(const MmArgs& a, int ct) {
    if (!gemv_wgmma() || K > 4 || !wgmma_available()) return false;
    const int span = 4 * ct * 16;
    return a.out % span == 0 && segments_start_on(a, span);
}

// Which block-shared form serves the fp16-path product `a` under a debug variant (0: shipped):
// the dispatch (launch_gemv_f16) and what it asks of the prep (gemv_f16_acts: the wgmma forms read
// their activations in wgmma's layout) both come from here. The wgmma form serves the shipped
// four-group products where sa_wgmma says, and K = 4 MUL1's wgmma debug forms (variants 48-50, 53,
// 54) at four tiles; never unsplit (a debug setting whose warps' output stage it lacks).
struct SaForm {
    bool shared = false, two_tiles = false, wgmma = false;
};
constexpr bool sa_wgmma_variant(int variant) {
    return variant == kSaVarWgmmaTcSum || variant == kSaVarWgmmaA12 || variant == kSaVarWgmmaProducts ||
           variant == kSaVarWgmmaNoA12 || variant == kSaVarNoSlice;
}
template <int K, int NG>
SaForm sa_form(const MmArgs& a, int variant) {
    SaForm f;
    f.shared = sa_applies<K, NG>(a, variant);
    if (!f.shared || NG != 4) return f;
    f.two_tiles = variant == kSaVarTwoTiles || (sa_rules(variant) && sa_two_tiles<K>(a));
    const bool form = sa_rules(variant) || (kDebugVariants && K == 4 && a.codebook == CB_MUL1 && sa_wgmma_variant(variant));
    f.wgmma = form && !sa_unsplit(a) && sa_wgmma<K>(a, f.two_tiles ? 2 : 4);
    return f;
}

// The shipped decode bits of a block-shared form: K = 4 MUL1 masks the states' A once (kSaA12)
// where that measured faster, the wgmma form at four tiles a unit (session 45, debug variant 49
// against 53) and the synchronous form at two row groups (session 48, H100: 9 / 12 / 16 rows of
// 8192x28672 2.3-2.9% faster, variant 39 against the shipped CFG 0); no others have been timed
// with it since session 32, where the synchronous four-group form ran no faster.
template <int K, int CB, int NG, bool WGMMA_FOUR_TILES>
constexpr int sa_decode_cfg() {
    return K == 4 && CB == CB_MUL1 && (WGMMA_FOUR_TILES || NG == 2) ? kSaA12 : 0;
}

// A debug form of the block-shared kernel (DECODE: kSaTcSum, kSaA12 or kSaProducts, debug variants
// 48-50; 0, variant 53: the wgmma form without A12, shipped until session 45; kSaA12 | kSaNoSlice,
// the probe variant 54): in the wgmma form where sa_form says, else the synchronous.
template <int K, int CB, int NG, int DECODE>
cudaError_t launch_gemv_sa_decode(const MmArgs& a, bool wgmma, cudaStream_t stream) {
    if constexpr (NG == 4) {
        if (wgmma) return launch_gemv_sa<K, CB, NG, kSaWgmma | DECODE>(a, stream);
    }
    return launch_gemv_sa<K, CB, NG, DECODE>(a, stream);
}

// The shipped form that sa_form chose (f.shared), with the bits EXTRA (debug variant 61: kSaWide).
template <int K, int CB, int NG, int EXTRA>
cudaError_t launch_gemv_sa_shipped(const MmArgs& a, const SaForm& f, cudaStream_t stream) {
    if constexpr (NG == 4) {
        if constexpr (K <= 4) {
            if (f.wgmma)
                return f.two_tiles ? launch_gemv_sa<K, CB, NG, kSaTwoTiles | kSaWgmma | EXTRA>(a, stream)
                                   : launch_gemv_sa<K, CB, NG, kSaWgmma | sa_decode_cfg<K, CB, NG, true>() | EXTRA>(a, stream);
        }
        if (f.two_tiles) return launch_gemv_sa<K, CB, NG, kSaTwoTiles | EXTRA>(a, stream);
    }
    return launch_gemv_sa<K, CB, NG, sa_decode_cfg<K, CB, NG, false>() | EXTRA>(a, stream);
}

// The fp16 path of the version-3 product for one K, codebook and group count.
template <int K, int CB, int NG>
cudaError_t launch_gemv_f16(const MmArgs& a, int variant, cudaStream_t stream) {
    if (!debug_variant_built(variant)) return cudaErrorNotSupported;  // not built without TRELLIS_DEBUG_VARIANTS
    const SaForm f = sa_form<K, NG>(a, variant);
    if (f.shared) {
        if (variant == 0) return launch_gemv_sa_shipped<K, CB, NG, 0>(a, f, stream);
        if constexpr (kDebugVariants && K == 4 && CB == CB_MUL1 && NG >= 2) {
            if (variant == kSaVarWide) return launch_gemv_sa_shipped<K, CB, NG, kSaWide>(a, f, stream);
            if (variant == kSaVarRotate) return launch_gemv_sa_shipped<K, CB, NG, kSaRotate>(a, f, stream);
            if (variant == kSaVarTwin) return launch_gemv_sa_shipped<K, CB, NG, kSaTwin>(a, f, stream);
            if (variant == kSaVarTwinStamp) return launch_gemv_sa_shipped<K, CB, NG, kSaTwin | kSaStamp>(a, f, stream);
            if constexpr (NG == 4) {
                if (variant == kSaVarWideRotate) return launch_gemv_sa_shipped<K, CB, NG, kSaWide | kSaRotate>(a, f, stream);
                if (variant == kSaVarNoTail) return launch_gemv_sa_shipped<K, CB, NG, kSaNoTail>(a, f, stream);
                if (variant == kSaVarNoLastFlush) return launch_gemv_sa_shipped<K, CB, NG, kSaNoLastFlush>(a, f, stream);
                if (variant == kSaVarStamp) return launch_gemv_sa_shipped<K, CB, NG, kSaStamp>(a, f, stream);
                if (variant == kSaVarRotateStamp) return launch_gemv_sa_shipped<K, CB, NG, kSaRotate | kSaStamp>(a, f, stream);
                if (variant == kSaVarWideStamp) return launch_gemv_sa_shipped<K, CB, NG, kSaWide | kSaStamp>(a, f, stream);
                // (at two row groups the form spills: ptxas, 384 bytes)
                if (variant == kSaVarSteal) return launch_gemv_sa_shipped<K, CB, NG, kSaSteal>(a, f, stream);
            }
        }
        if constexpr (NG == 4) {
            if (f.two_tiles) return launch_gemv_sa<K, CB, NG, kSaTwoTiles>(a, stream);
        }
        if constexpr (kDebugVariants && K == 4 && CB == CB_MUL1) {  // the benchmark configurations
            if (variant == 32) return launch_gemv_sa<K, CB, NG, 1>(a, stream);
            if (variant == 33) return launch_gemv_sa<K, CB, NG, 2>(a, stream);
            if (variant == 34) return launch_gemv_sa<K, CB, NG, 3>(a, stream);
            if (variant == 35) return launch_gemv_sa<K, CB, NG, kSaAffine>(a, stream);
            if (variant == 36) return launch_gemv_sa<K, CB, NG, kSaNoTail>(a, stream);
            if (variant == 37) return launch_gemv_sa<K, CB, NG, kSaTwoRows>(a, stream);
            if (variant == 39) return launch_gemv_sa<K, CB, NG, kSaA12>(a, stream);
            if (variant == 40) return launch_gemv_sa<K, CB, NG, kSaTcSum>(a, stream);
            if (variant == kSaVarSkipEmpty) return launch_gemv_sa<K, CB, NG, kSaSkipEmpty>(a, stream);
            if (variant == kSaVarInFinish) return launch_gemv_sa<K, CB, NG, kSaInFinish>(a, stream);
            const bool wg = f.wgmma;
            if (variant == kSaVarWgmmaTcSum) return launch_gemv_sa_decode<K, CB, NG, kSaTcSum>(a, wg, stream);
            if (variant == kSaVarWgmmaA12) return launch_gemv_sa_decode<K, CB, NG, kSaA12>(a, wg, stream);
            if (variant == kSaVarWgmmaProducts) return launch_gemv_sa_decode<K, CB, NG, kSaProducts>(a, wg, stream);
            if (variant == kSaVarWgmmaNoA12) return launch_gemv_sa_decode<K, CB, NG, 0>(a, wg, stream);
            if (variant == kSaVarNoSlice) return launch_gemv_sa_decode<K, CB, NG, kSaA12 | kSaNoSlice>(a, wg, stream);
        }
        return launch_gemv_sa<K, CB, NG, sa_decode_cfg<K, CB, NG, false>()>(a, stream);
    }
    return launch_gemv_ng<K, CB, GV_F16, NG>(a, variant == 31 ? 0 : variant, stream);
}

// MUL1's products of one K as explicit instantiations (PREFIX extern: declared only), so that a K
// file can leave them to files of their own, which compile in parallel with it. Why: K = 4 has
// most of the debug variants; as one translation unit it took 129 s to compile (debug build; the
// next largest files 53-58 s), the long pole of a build on the GPU machine's 16 cores. Split in
// three (exl3_mm_k4.cu, exl3_gv_k4_mul1_f16.cu, exl3_gv_k4_mul1_i8.cu), its largest part takes 58 s
// (csrc/PERF_NOTES.md, session 40).
#define TRELLIS_GV_MUL1_F16(PREFIX, K)                                                             \
    PREFIX template cudaError_t launch_gemv_f16<K, CB_MUL1, 1>(const MmArgs&, int, cudaStream_t); \
    PREFIX template cudaError_t launch_gemv_f16<K, CB_MUL1, 2>(const MmArgs&, int, cudaStream_t); \
    PREFIX template cudaError_t launch_gemv_f16<K, CB_MUL1, 4>(const MmArgs&, int, cudaStream_t);
#define TRELLIS_GV_MUL1_I8(PREFIX, K)                                                                     \
    PREFIX template cudaError_t launch_gemv_ng<K, CB_MUL1, GV_I8, 1>(const MmArgs&, int, cudaStream_t); \
    PREFIX template cudaError_t launch_gemv_ng<K, CB_MUL1, GV_I8, 2>(const MmArgs&, int, cudaStream_t);

// One K: a.scales != null or self prep selects the MUL1 integer path (m <= 8), else the fp16 path
// (m <= 32).
template <int K>
cudaError_t launch_gemv_k(const MmArgs& a, int variant, cudaStream_t stream) {
    if (a.scales || a.self_prep) {
        if (a.m <= 4) return launch_gemv_ng<K, CB_MUL1, GV_I8, 1>(a, variant, stream);
        return launch_gemv_ng<K, CB_MUL1, GV_I8, 2>(a, variant, stream);
    }
#define TRELLIS_GV_CASE(CBV)                                                        \
    if (a.m <= 8) return launch_gemv_f16<K, CBV, 1>(a, variant, stream);            \
    if (a.m <= 16) return launch_gemv_f16<K, CBV, 2>(a, variant, stream);           \
    return launch_gemv_f16<K, CBV, 4>(a, variant, stream);
    switch (a.codebook) {
        case CB_3INST: TRELLIS_GV_CASE(CB_3INST)
        case CB_MCG: TRELLIS_GV_CASE(CB_MCG)
        case CB_MUL1: TRELLIS_GV_CASE(CB_MUL1)
        default: return cudaErrorInvalidValue;
    }
#undef TRELLIS_GV_CASE
}

}  // namespace trellis
