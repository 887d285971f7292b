// The fused product's configurations (exl3_gemv.cuh): tiles per unit, ring stages, k rows per
// unit and blocks per SM, the shared memory each takes, and which one a product takes on the GPU
// at hand. Apart from the kernels, so that host code deciding a product's path (exl3_misc.cu)
// reads the same numbers without building them.
#pragma once
#include <cuda_runtime.h>

#include "exl3_mm.cuh"  // kSpSlots, kSpSlotWords, gv_two_rows, gv_four_rows
#include "kernels.h"

namespace trellis {

// Debug variants (timing probes, occupancy configurations, earlier forms kept for A/Bs: the
// `variant` of launch_gemv_ng and launch_gemv_f16) are built only where TRELLIS_DEBUG_VARIANTS is
// defined, as the GPU tests and benchmarks ask (engine/ops/build.py). The build a user's first
// model load waits for then compiles the shipped kernels alone: about half of the K = 4 file's
// kernels are variants. Variant 10 (CFG 0 everywhere), the block-shared modes 30 / 31 and 44 (the
// block-shared kernel with two tiles per unit) take shipped kernels, so every build has them.
#ifdef TRELLIS_DEBUG_VARIANTS
constexpr bool kDebugVariants = true;
#else
constexpr bool kDebugVariants = false;
#endif
constexpr int kSaVarTwoTiles = 44;  // the block-shared kernel with two tiles per unit (kSaTwoTiles)
constexpr int kSaVarSkipEmpty = 45;  // debug: no MMAs for its empty row groups (kSaSkipEmpty)
constexpr int kSaVarInFinish = 46;   // debug: its warps' output stage compiled in (kSaInFinish), run split
constexpr int kSaVarWgmmaTcSum = 48;  // debug: its wgmma form with MUL1's byte sums by MMAs (kSaTcSum)
constexpr int kSaVarWgmmaA12 = 49;       // debug: its wgmma form with the states' A masked once (kSaA12; the shipped K = 4 MUL1 form since session 45)
constexpr int kSaVarWgmmaProducts = 50;  // debug: its wgmma form on the integer path's products (kSaProducts)
constexpr int kGvVarI8FourRows = 51;     // debug: the integer path's 5..8 rows in four-k-row units (CFG 13)
constexpr int kSaVarWgmmaNoA12 = 53;     // debug: its wgmma form without A12 (shipped until session 45)
constexpr int kSaVarNoSlice = 54;        // debug probe (wrong results): its A12 form without the activation slice (kSaNoSlice)
// 55 and 56 (session 47): the slice copied without passes over it (a probe), and in one pass (every form, session 48, before its parts)
// 57-60 (sessions 48-49): other fills of the slice's parts, and a probe with half of them (removed)
constexpr int kSaVarWide = 61;           // debug: its shipped forms in blocks of 16 warps with slices twice as deep (kSaWide), under the shipped rules
// 62 and 63 (sessions 49-50): the two-tile wgmma form three blocks an SM, without and with A12 (removed: 8-21% slower on the largest layers)
// 65-67 (session 52): MUL1's raw values one a register (no PRMT packs a pair) and two MMAs a tile on the per-warp fp16 path (65),
// two wgmmas a k row against an N-major slice in the four-tile wgmma form at 32 rows (66; 67 its strides swapped, wrong results);
// removed: 5-7% and 20-26% slower on the H200 (csrc/PERF_NOTES.md, session 52; the code is in b5ba4ef)
constexpr int kSaVarNoTail = 68;         // debug probe (wrong results): its shipped four-group forms without any flush (kSaNoTail)
constexpr int kSaVarNoLastFlush = 69;    // debug probe (wrong results): the same without each team's last flush (kSaNoLastFlush)
constexpr int kSaVarRotate = 70;         // debug: its shipped forms with each k slice's units rotated by whole column units (kSaRotate)
constexpr int kSaVarWideRotate = 71;     // debug: 61 and 70 together (kSaWide | kSaRotate)
constexpr int kSaVarStamp = 72;          // debug: its shipped four-group forms with each team's times (kSaStamp, bench/sa_stamps.py)
constexpr int kSaVarRotateStamp = 73;    // debug: 70 with them (kSaRotate | kSaStamp)
// 74 and 75 (session 54): the blocks placed first given more units (removed: 6-26% slower; the code is in 70caf20)
constexpr int kSaVarWideStamp = 76;      // debug: 61 with stamps (kSaWide | kSaStamp)
// 77 (session 54): the per-warp kernel in blocks of 16 warps (removed: no gain, decode 6-9% slower; see below)
constexpr int kSaVarTwin = 78;           // debug: its shipped forms with the grid's blocks two to a launched block of 16 warps (kSaTwin)
constexpr int kSaVarTwinStamp = 79;      // debug: 78 with stamps (kSaTwin | kSaStamp)
constexpr int kSaVarSteal = 80;          // debug: its shipped four-group forms with units claimed at run time (kSaSteal)
inline bool debug_variant_built(int variant) {
    return kDebugVariants || variant == 0 || variant == 10 || variant == 30 || variant == 31 ||
           variant == kSaVarTwoTiles;
}
// Debug variant 8 decodes K = 4 with A masked once (lane_states_k4's A12) and the integer path's
// words by shared loads (on the fp16 path, which takes A12 since session 51, it runs the shipped
// kernels), 21 takes MUL1's byte sums by MMAs on the fp16 path (kTcSum), 22 is session 31's
// integer-path decode (two masks, shared loads; the shipped one reads the words by ldmatrix,
// kLdsm), 64 the fp16 path's states without A12 (its form until session 51); otherwise they run
// as the shipped kernels do (configurations, compact ring, split finish), so that an A/B against
// variant 0 times the decode alone.
// Debug variant 41 keeps the shipped schedule with MUL1's constant term where it was until session
// 36: added by the integer-path product's warp that holds a column group's k row 0, which gathers
// the input's chunk sums at its flush, on the product's tail (now the finish kernel does, GvC0).
// Right results; a decode step under it keeps its chains.
// Debug variant 47 (kGvVarInFinish) is the shipped kernel with its warps' output stage compiled in
// (gv_in_finish), as every kernel had it until session 38: the baseline of that change, and the
// form a shipped-schedule product takes when it runs unsplit (gemv_split_finish below its path's
// setting; debug builds only, a shipped build splits regardless).
// Debug variant 77 (session 54, removed in session 55; the code is in fb4940b): the shipped
// kernels in blocks of 16 warps, one an SM. H100: large layers within 1% at 1..8 rows,
// 4096x28672 4-8% slower, decode at batch 1 9% and batch 8 6% slower (csrc/PERF_NOTES.md).
constexpr int kGvVarA12 = 8, kGvVarTcSum = 21, kGvVarS31 = 22, kGvVarC0Tail = 41, kGvVarInFinish = 47,
              kGvVarF16NoA12 = 64;
__host__ __device__ constexpr bool gv_shipped_schedule(int var) {
    return var == 0 || var == kGvVarA12 || var == kGvVarTcSum || var == kGvVarS31 || var == kGvVarC0Tail ||
           var == kGvVarInFinish || var == kGvVarF16NoA12;
}
// Whether a per-warp kernel has its warps' output stage (the warp that completes a 128-column block
// transforms it, finish_rows > 0): those that may run unsplit (decode chains, CH; the debug
// variants off the shipped schedule; kGvVarInFinish). Why: in the split products, where it never
// runs, its code cost time. Without it (H100, session 38, csrc/PERF_NOTES.md): one row 1-5% faster,
// 8 rows 2-11%, 32 rows of 4096x6144 10%, batch-1 decode 2.3%, and the block-shared kernel at 32
// rows of 8192x28672 8% (kSaInFinish). The two-group kernel (9..16 rows) kept it until session 42:
// it took 112 us against 81 at 16 rows of 8192x28672 without it, its main loop the same length (250
// against 248 instructions a unit, no spills). Why (H100, session 42): without the stage it has 80
// registers, so three of its 64 KB blocks fit an SM, and a 2 x SMs grid launched as a programmatic
// dependent (every product: after its prep or finish kernel) is packed three to an SM on 66 SMs,
// two on 33, none on 33 (bench/occupancy_probe.cu). With products padded to two blocks an SM
// (gemv_block_cap, exl3_mm.cuh) the two-group kernel runs without the stage: 12 and 16 rows of
// 4096x14336, 14336x4096 and 4096x4096 (MUL1 and 3INST) 4.6-11.5% faster than with it.
// TRELLIS_TWO_GROUP_STAGE (an A/B build, engine/ops/build.py's TRELLIS_NVCC_DEFINES): the stage
// back in, as shipped until session 42, to measure against.
#ifdef TRELLIS_TWO_GROUP_STAGE
constexpr bool kTwoGroupsInFinish = true;
#else
constexpr bool kTwoGroupsInFinish = false;
#endif
__host__ __device__ constexpr bool gv_in_finish(int var, bool ch, int ng) {
    return ch || (kTwoGroupsInFinish && ng == 2) || !gv_shipped_schedule(var) || var == kGvVarInFinish;
}

// Ring depth (stages per warp): about 64-100 KB of ring per 8-warp block at every K, so two
// blocks fit on an H200 SM and ~150 KB of trellis is in flight per SM. GPUs with less shared
// memory per SM take the compact configuration instead (gv_pick).
template <int K>
__host__ __device__ constexpr int gv_stages() {
    return K <= 4 ? 8 : 5;
}

// Configurations (CFG, a template argument). A configuration trades the tiles per unit (CT), the
// ring depth (NS) and the k rows per unit (kr) for resident blocks per SM (MINB, which also caps
// the registers at 65536 / (256 MINB)). Shipped: 0 (8 tiles, one k row, 2 blocks), 9 (two k
// rows) for large layers, 10 (four k rows, two stages) for the largest on the integer path. For
// K = 4 the debug variant 10 + CFG (bench.linear --variants,
// TRELLIS_GV_VARIANT) selects one, to measure what a GPU prefers: on the H200 more blocks per SM
// never paid for the fewer tiles per unit they need (csrc/PERF_NOTES.md, session 5), nor did three
// blocks at 80 registers (sessions 10 and 30; on an H100, one row of 8192x28672: two k rows per
// unit 26-66% slower than CFG 10, their loops spilling; four k rows of 4 tiles 8% slower, and 4%
// faster only at 14336x4096).
// CFG 13 (debug variant 51, session 44): the integer path's two row groups (5..8 rows)
// in CFG 10's four-k-row units of its own 4 tiles. Why: there it runs CFG 0, one k row of 4 tiles a
// unit, and took 78 us at 8 rows of 8192x28672 against the fp16 path's 52 (H100, session 37)
// though on paper it needs ~30 instructions a tile against ~45: the per-unit work (ring wait and
// issue, B loads, loop) is paid once per 4 tiles there, once per 32 in CFG 10.
// Session 45 (H100): CFG 13 60.4-61.2 us at 5 / 8 rows of 8192x28672 against CFG 0's 75.8-76.4,
// still behind the fp16 path's 52.5-53.1. Session 47 (H100) measured CFG 13 with its activations
// stored once instead of 4 times (debug variant 52, removed): 61.7-62.7 us there, and never ahead
// of the fp16 path at 5 / 8 rows of 4096x14336 or 14336x4096 either.
struct GvTune {
    int ct, ns, minb, kr = 1;  // kr: k rows per unit (one ring stage), so per-unit work is paid once per kr rows
};
__host__ __device__ constexpr GvTune gv_tune(int cfg) {
    return cfg == 1   ? GvTune{4, 5, 3}
           : cfg == 2 ? GvTune{8, 5, 3}
           : cfg == 3 ? GvTune{4, 4, 4}
           : cfg == 4 ? GvTune{4, 8, 2}
           : cfg == 5 ? GvTune{2, 6, 3}
           : cfg == 6 ? GvTune{4, 7, 3}
           : cfg == 7 ? GvTune{8, 6, 3}
           : cfg == 8 ? GvTune{8, 4, 2, 2}
           : cfg == 9 ? GvTune{8, 3, 2, 2}
           : cfg == 10 ? GvTune{8, 2, 2, 4}
           : cfg == 13 ? GvTune{4, 2, 2, 4}
                       : GvTune{0, 0, 2};
}

enum GvPath : int { GV_I8 = 0, GV_F16 = 1 };

// Static shape of one instantiation: CT column tiles per unit, NG groups of B columns (I8: 4 x
// rows of 2 passes each; F16: 8 rows each), words of activations per lane per group per k row.
template <int PATH, int NG, int CFG = 0>
struct GvShape {
    static constexpr int CT = gv_tune(CFG).ct ? gv_tune(CFG).ct
                              : PATH == GV_I8 ? (NG == 1 ? 8 : 4) : (NG == 1 ? 8 : (NG == 2 ? 4 : 2));
    static constexpr int BW = PATH == GV_I8 ? 4 : 2;  // words per lane per group
    static constexpr int ROWS_PER_GROUP = PATH == GV_I8 ? 4 : 8;
    static constexpr int MINB = gv_tune(CFG).minb;
    static constexpr int KR = gv_tune(CFG).kr;
};

// Words of one k row in a stage (its tiles, then its activations unless the product preps its
// own input, SP); a stage holds KR of them.
template <int K, int PATH, int NG, int CFG = 0, bool SP = false>
__host__ __device__ constexpr int gv_row_words() {
    return GvShape<PATH, NG, CFG>::CT * 8 * K + (SP ? 0 : NG * 32 * GvShape<PATH, NG, CFG>::BW);
}
template <int K, int PATH, int NG, int CFG = 0, bool SP = false>
__host__ __device__ constexpr int gv_stage_words() {
    return GvShape<PATH, NG, CFG>::KR * gv_row_words<K, PATH, NG, CFG, SP>();
}
// The compact configuration: CFG 0's units (one k row, CFG 0's tiles) with as many ring stages,
// at most CFG 0's, as fit a block in kGvCompactBytes beside its chunk slots. Why: the shipped
// rings are sized for the H200's 228 KB of shared memory per SM. An RTX 30/40/50 SM has 100 KB
// (99 KB at most per block), an A100 SM 164 KB. There a shipped ring gives one block per SM, and
// the grid, sized for two, runs in two waves; at K = 8 the integer path's 100 KB block would not
// launch at all. 48 KB keeps two blocks per SM there, with the 1 KB each that the system
// reserves. Those GPUs stream 1-2 TB/s, so one or two 2-2.5 KB stages in flight per warp (16
// warps per SM) still cover their memory latency (an estimate; not measured on such a GPU).
constexpr int kGvCompact = 12;
constexpr int kGvCompactBytes = 48 * 1024;

// Ring stages per warp of a configuration (the one place that says: the compact one's depth is
// not its gv_tune entry's).
template <int K, int PATH, int NG, int CFG = 0, bool SP = false>
__host__ __device__ constexpr int gv_ring_stages() {
    if constexpr (CFG == kGvCompact) {
        constexpr int shipped = gv_ring_stages<K, PATH, NG, 0, SP>();
        constexpr int room = kGvCompactBytes / 4 / kGvWarps - (SP ? kSpSlots * kSpSlotWords : 0);
        constexpr int fit = room / gv_stage_words<K, PATH, NG, CFG, SP>();
        return fit < shipped ? fit : shipped;
    } else {
        return gv_tune(CFG).ns ? gv_tune(CFG).ns : gv_stages<K>();
    }
}

// Shared memory of a block: the warps' rings, then (SP) their chunk slots.
template <int K, int PATH, int NG, int CFG = 0, bool SP = false>
__host__ __device__ constexpr int gv_smem_words() {
    return kGvWarps * (gv_ring_stages<K, PATH, NG, CFG, SP>() * gv_stage_words<K, PATH, NG, CFG, SP>() +
                       (SP ? kSpSlots * kSpSlotWords : 0));
}

// Whether an instantiation has a compact twin of its own: one that fits two stages, with fewer
// stages than CFG 0 (where CFG 0 already fits kGvCompactBytes, it is its own compact form).
template <int K, int PATH, int NG, bool SP>
__host__ __device__ constexpr bool gv_has_compact() {
    return gv_ring_stages<K, PATH, NG, kGvCompact, SP>() >= 2 &&
           gv_ring_stages<K, PATH, NG, kGvCompact, SP>() < gv_ring_stages<K, PATH, NG, 0, SP>();
}

// A GPU's shared memory: the most a block may opt into, an SM's, and what the system reserves
// of it per block. Zero where unknown.
struct SmemLimits {
    int per_block = 0, per_sm = 0, reserved = 0;
};
inline SmemLimits device_smem_limits() {
    return {current_device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(),
            current_device_attr<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(),
            current_device_attr<cudaDevAttrReservedSharedMemoryPerBlock>()};
}

// A product launch's dynamic shared memory: smem, or under gemv_block_cap (exl3_mm.cuh) at least
// smem with which at most the minb blocks its grid is sized for fit on an SM (with the system's
// reservation per block), where the device says how much an SM has and that many such blocks
// still fit. Why: the block scheduler packs a programmatic dependent's blocks as deep as they fit
// (bench/occupancy_probe.cu, session 42), and padding is the one way a launch can say how many
// may share an SM.
inline size_t gv_capped_smem(size_t smem, int minb) {
    if (!gemv_block_cap()) return smem;
    const SmemLimits lim = device_smem_limits();
    if (lim.per_sm <= 0 || minb <= 0) return smem;
    const size_t need = ((size_t)lim.per_sm / (minb + 1) - lim.reserved + 1 + 127) / 128 * 128;
    if (need <= smem || need > (size_t)lim.per_block || (need + lim.reserved) * minb > (size_t)lim.per_sm) return smem;
    return need;
}

// Whether `minb` blocks of `bytes` of dynamic shared memory each fit on one SM (and one fits the
// per-block limit). Unknown limits: yes, as before this check existed. The kernels' static shared
// memory (256 bytes with self prep, else none) fits in what the 48 KB budget leaves of 100 KB.
inline bool gv_fits(long bytes, int minb, const SmemLimits& lim) {
    if (lim.per_block <= 0 || lim.per_sm <= 0) return true;
    return bytes <= lim.per_block && minb * (bytes + lim.reserved) <= lim.per_sm;
}

// When a product takes the compact configuration (set_gemv_compact): kGvCompactTwoBlocks (default)
// wherever the shipped block does not fit twice on an SM (RTX 30/40/50, some A100 products; never
// on an H200); kGvCompactNeeded only where the shipped block cannot launch at all (K = 8 on the
// integer path of an RTX GPU); kGvCompactAlways where an instantiation has one (a test knob: the
// H200 then runs what an RTX GPU would; session 23's GPU run checked the compact kernels so);
// kGvCompactNever (the shipped rings everywhere, as before it existed).
constexpr int kGvCompactNeeded = 0, kGvCompactAlways = 1, kGvCompactNever = 2, kGvCompactTwoBlocks = 3;
inline int& gemv_compact() {
    static int v = kGvCompactTwoBlocks;
    return v;
}

// Small products on the compact ring on every GPU (set_gemv_lean_units): a product of one group of
// rows (up to 4 on the integer path, 8 on the fp16 path; more with gemv_lean_groups) that would
// take CFG 0 with fewer than this many units per resident warp (two blocks of 8 warps per SM)
// takes the compact one instead (unless gemv_compact is kGvCompactNever); 0: never. 16
// covers the shapes below. On the H200 at one row, K = 4, Llama-3.1-8B's q/k/v (6 units per warp)
// and o_proj (4) ran 8% and 13% faster so, and its decode 2.7% faster, while a deep ring still
// paid at 8192x28672 at 8 rows (108 per warp: 18% slower compact; csrc/PERF_NOTES.md, sessions 24
// and 26). Why is not established: a small product's grid gives each warp 8 units (gv_blocks),
// which an 8-stage ring requests all at once, and the smaller block leaves the SM more L1.
inline int& gemv_lean_units() {
    static int v = 16;
    return v;
}
// The most groups of rows a product may have and still take the compact ring by the lean rule
// (set_gemv_lean_groups; default 1). Four (the fp16 path's 32 rows) left decode at batch 4-32 the
// same or up to 2% slower on an H100 (csrc/PERF_NOTES.md, session 27).
inline int& gemv_lean_groups() {
    static int v = 1;
    return v;
}

// The configuration a product takes, its block's shared memory, and how many of its blocks fit on
// an SM of a GPU with these limits (0: it cannot launch there). Shipped: four k rows per unit
// (CFG 10) for the largest one-group layers, two (CFG 9) for large ones, else one (CFG 0), each
// only where it fits as the setting asks (gemv_compact); then the compact one, which small
// products take in place of CFG 0 (gemv_lean_units). Debug variants
// keep the shipped rings (gv_shipped_schedule: all of the shipped choices). one_row: debug
// variant 10, CFG 0 everywhere.
struct GvPick {
    int cfg;
    int smem_bytes;
    int blocks_per_sm;  // at most 2, the blocks per SM the grid is sized for
};
template <int K, int PATH, int NG, bool SP, bool CH = false, int VAR = 0>
GvPick gv_pick(int in, int out, int num_sms, bool one_row, const SmemLimits& lim) {
    static_assert(SP || gv_has_compact<K, PATH, NG, SP>() || gv_smem_words<K, PATH, NG, 0, SP>() * 4 <= kGvCompactBytes,
                  "every product without self prep fits two blocks in 100 KB one way or the other");
    const int mode = gv_shipped_schedule(VAR) ? gemv_compact() : kGvCompactNever;
    auto fits = [&](int words) {
        return mode == kGvCompactNever ||
               (mode != kGvCompactAlways && gv_fits(4L * words, mode == kGvCompactTwoBlocks ? 2 : 1, lim));
    };
    auto pick = [&](int cfg, int words) {
        const long bytes = 4L * words;
        return GvPick{cfg, (int)bytes, gv_fits(bytes, 2, lim) ? 2 : gv_fits(bytes, 1, lim) ? 1 : 0};
    };
    if constexpr (NG == 1 && K <= kGvFourRowMaxK && !SP && !CH && (gv_shipped_schedule(VAR) || VAR == 7)) {
        constexpr int w = gv_smem_words<K, PATH, NG, 10, SP>();
        if (!one_row && gv_four_rows(in, out, K, num_sms) && fits(w)) return pick(10, w);
    }
    if constexpr (NG == 1 && K <= kGvTwoRowMaxK) {
        constexpr int w = gv_smem_words<K, PATH, NG, 9, SP>();
        if (!one_row && gv_two_rows(in, out, K, num_sms) && fits(w)) return pick(9, w);
    }
    constexpr int w0 = gv_smem_words<K, PATH, NG, 0, SP>();
    if constexpr (gv_shipped_schedule(VAR) && gv_has_compact<K, PATH, NG, SP>()) {
        const long units = (long)(out / 16 / GvShape<PATH, NG, 0>::CT) * (in / 16);
        const bool lean = NG <= gemv_lean_groups() && mode != kGvCompactNever && units < gemv_lean_units() * gv_resident_warps(num_sms);
        if (!one_row && (lean || !fits(w0))) return pick(kGvCompact, gv_smem_words<K, PATH, NG, kGvCompact, SP>());
    }
    return pick(0, w0);
}

}  // namespace trellis
