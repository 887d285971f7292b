// EXL3 product for batches of up to 32 rows (fp16 path, any codebook) with the activations
// shared by a block instead of copied into every warp's ring. By default it serves the row counts
// and layer sizes where it measured faster (sa_applies); the version-3 kernel (exl3_gemv.cuh)
// serves the rest. Its host side (grid, rules, forms, launches) is exl3_gemv_sa.cuh.
//
// Why: the version-3 kernel streams each unit's k row of activations into the warp's own ring
// next to its trellis. At 32 rows that k row is 1 KB of fp16 fragments for 2 tiles (256 bytes at
// K = 4) of trellis: 470 MB of L2 -> shared traffic for a 117 MB layer (8192x28672), and ring
// space that limits a unit to 2 tiles. Here a block owns one slice of k rows (at most 64 KB of
// fragments, whole 128-input chunks) and copies it into shared memory once, in parts (see "The
// slice in parts" below); its 8 warps stream only trellis, in units of CT tiles x 2 or 4 k rows of
// that slice, and read their B fragments from the block's copy. Split-k,
// the atomics into z and the output stage (the warp that completes a 128-column block, here after
// its main loop) are the version-3 kernel's. Measured (H200, session 8): 8192x28672 at 32 rows
// 103 us against 125; for small layers the slice copy per block does not pay.
//
// Grid: for each segment of a grouped product (a block's activations are one segment's), for
// each k slice, `seg_blocks[s]` blocks; a block's units are a contiguous range of the slice's
// (column group, k row pair) list, column group major, cut into 8 equal warp ranges (2 warpgroup
// ranges in the wgmma form, whose units are 4 column groups wide).
#pragma once
#include "exl3_gemv.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

namespace trellis {

// CFG 0 (shipped): four k rows per unit at four row groups and K <= 4, else two. Per-unit work is
// paid once per 16 or 8 tiles: at 32 rows of 8192x28672 two k rows took 103 us against one's 117
// (session 8) and four 6% less than two (session 28, csrc/PERF_NOTES.md); at K > 4 a four-row
// stage would take ring space from the slice. Benchmark knobs (debug variants 32-34): 1 one k
// row per unit, 2 four tiles per unit at every NG, 3 both. CFG 4 (variant 35): MUL1's affine
// step per weight pair, as before session 27 (kSaAffine). CFG 16 (variant 37): two k rows per
// unit at four groups too, as before session 28 (kSaTwoRows). A timing probe with wrong results:
// CFG 8 (variant 36) no split-k tail at all (no atomics, count or output stage; kSaNoTail). Variant
// 38 was CFG 32 (kSaNoFinish: no in-kernel count or output stage, which split products never run;
// it measured that dead code's cost, 80.5 against 87.4 us at 32 rows of 8192x28672 on an H100).
// Since session 38 no kernel without kSaInFinish has that stage, so variant 38 runs CFG 0. CFG 64
// (variant 39): K = 4 states with A masked once (lane_states_k4's A12; at 32 rows of 8192x28672 the same
// speed as CFG 0 on an H100); CFG 128 (variant 40): A12 with MUL1's byte sums by MMAs
// (mul1_f16_by_mma, kSaTcSum; 3-5% slower there: six MMAs a tile instead of four). CFG 4224
// (variant 48, session 40): that with wgmma, where its four fp16 MMAs a tile no longer hold the
// warp (on a 9.0 device, 17..32 rows, four tiles a unit; elsewhere variant 48 runs CFG 128); it
// was 8-19% slower than the shipped wgmma form at 17..32 rows and decoded 11% slower at batch 32
// (H100, session 41).
// CFG 512 (kSaTwoTiles, shipped where sa_two_tiles says; debug variant 44 forces it): two tiles per
// unit at four row groups instead of four. CFG 1024 (variant 45, kSaSkipEmpty; written in session
// 37, not yet run): no MMAs for row groups without rows (the fourth at 17..24 rows), under a
// warp-uniform test; the accumulators stay. CFG 2048 (kSaInFinish): the warps' output stage (the
// warp that completes a 128-column block transforms it) compiled in. Only unsplit products need it
// (gemv_split_finish 0, a debug-build baseline); the split ones, every shipped product, run without
// its code: at 32 rows of 8192x28672 the kernel without it measured 8% faster (80.5 against
// 87.4 us on an H100, debug variant 38 against 30, csrc/PERF_NOTES.md session 38), though it never
// ran there. Debug variant 46 keeps it in and runs split (the baseline of that change).
// CFG 4096 (kSaWgmma, session 39; with CFG 0 or kSaTwoTiles, four row groups, K <= 4, on a device
// of compute capability 9.0; sa_wgmma says where): each k row's tiles go to Hopper's warpgroup MMA
// instead of 4 synchronous MMAs a tile. A warpgroup's 4 warps then take units together: adjacent
// column groups (warp wi of the 4 the group 4 G + wi), the same k rows, so that one m64n32k16
// wgmma covers their 4 tiles (the warps' decoded A fragments in registers) x 32 rows (B read by
// the instruction from the block's slice, which is rearranged once into wgmma's core-matrix
// layout). The wgmma runs while the warps decode the next k row (two A register sets). Measured
// on an H100 (session 39, bench/ab_session39c.sh; against the same kernel with synchronous MMAs,
// TRELLIS_GV_WGMMA=0, in the same call): 8192x28672 at 17 / 24 / 32 rows 69.2-69.6 / 70.2-70.6 /
// 73.3-75.6 us against 77.1-77.5 / 76.9-77.0 / 79.5-79.9; 4096x28672 at 32 rows 45.6-45.9 against
// 47.9-48.1; the two-tile form (4096x14336, 14336x4096 at 32 rows) 0.3-1% faster.
// CFG 8192 (kSaProducts, session 43, not yet run): MUL1's K = 4 decode through the integer path's
// products (gv_decode_f16's PX: A12 and one window's mask by an IMAD): by nvdisasm of the wgmma
// form's loop, 38.0 instructions a tile against 39.0, ALU ops 13.9 against 15.9. Why: ncu puts the
// 32-row product on the H200 at 66% issue with the ALU pipe its busiest (56%), and 0.6x of fp16
// needs ~10% off (csrc/PERF_NOTES.md, session 43). Debug variant 49 runs the wgmma form with A12
// alone (kSaA12), 50 with kSaProducts; without wgmma, the synchronous form with the same decode.
// Session 45 (H100, bench/ab_session44.sh, two passes against the shipped wgmma form in the same
// call): 49 1.2-2.4% faster at 17 / 24 / 32 rows of 8192x28672 (66.5-73.1 us against 68.1-74.1)
// and 0.1-2.1% at 4096x28672; 50 0-3.1% faster, about the same. So K = 4 MUL1's wgmma form (four
// tiles a unit) ships with A12 alone, the smaller change, since then (sa_wgmma_cfg); debug variant
// 53 runs it without, as before.
// CFG 16384 (kSaNoSlice, debug variant 54 with the shipped A12 form; session 47): a timing probe
// with wrong results: no activation slice in shared memory (no copy, no wait for it, no row sums,
// no rearrangement, no block barrier). Why: ncu put 4.8% of the 32-row product's stall samples at
// the barrier after the copy, every block of the one wave waiting for its slice at once (H100,
// csrc/PERF_NOTES.md); this bounds what copying the slice in parts behind the first units could
// gain before anything is built. Session 47 (H100): 17 / 24 / 32 rows of 8192x28672 64.3-64.7 /
// 65.8-66.2 / 67.5 us against the shipped 66.9-67.2 / 69.1-69.2 / 73.4-73.5, 4096x28672 8-9% less.
// (Since session 48 it also leaves out the parts' mbarriers and the row sums.)
// Debug variant 55 (session 47) copied the slice and waited for it without the passes over it
// (a probe); with 54 it said the copy, not the passes, costs most (csrc/PERF_NOTES.md).
// The slice in parts (session 48): thread 0 copies the slice in up to 8 parts of whole chunks, each
// one bulk copy (TMA) counted on an mbarrier of its own, and a warp waits for a part only before
// the first unit whose k rows are in it; the prep (prep_frag) wrote the activations in the form's
// layout (wgmma's core matrices for the wgmma forms: gemv_f16_acts, sa_form) and MUL1's chunk sums,
// of which each thread loads one at the start and adds it into the row sums after its first unit,
// on one more mbarrier that only a flush of the slice's first k row waits for. Below sm_90 the
// block copies the whole slice by cp.async and waits for it. Why: every block of the one wave
// waited for its whole slice at once (ncu: 4.8% of the 32-row product's stall samples at that
// barrier; no slice at all, debug variant 54, bounds it at ~3 us of ~71 at 32 rows of
// 8192x28672), and a thread can only sum and rearrange what it loads itself.
// Before it (session 47; every form in session 48's first A/B): each thread loaded its 16-byte
// chunks into registers, stored them in the form's layout and summed its rows, one barrier after
// (against the three passes before that, copy, row sums, rearrangement, each behind a barrier, 57
// of 68 pairs faster on an H100, the two-tile wgmma form by 6-8%). The parts against it (H100s,
// bench/session48.sh, both builds in one call): `parts` (two passes, K = 4 MUL1 at five shapes and
// K = 2 3INST) at 17..32 rows faster in 30 of 34 pairs, by 1.6% on average (-5.3% to +1.6%), at
// 9..16 rows (the synchronous two-group form) slower by 0.7% on average (-3.9% to +5.2%); decode
// at batch 32 / 24 / 16 / 12 7,376 / 6,021 / 4,166 / 3,362 tok/s against 7,409 / 6,021 / 4,149 /
// 3,377; `final` (three passes, 8192x28672, 4096x28672, 28672x8192) at 17..32 rows faster in 20 of
// 27 (by 1.1% on average; 32 rows of 8192x28672 +1.4%, +0.5%, -3.2%), at 9..16 rows slower in 26 of
// 27 (by 2.0% on average, up to 7.0% at 12 rows of 28672x8192). Shipped everywhere regardless, one
// mechanism: the two-group form's loss is below what it gains on the per-warp kernel (session 39:
// 12-21% at 12 / 16 rows of the shapes it serves).
// Debug forms 57-60 (session 48, timed in session 49 on an H100 and removed): the synchronous
// forms' parts filled by every thread's cp.async (57), the parts the teams start in copied first
// (58), half the slice copied (59, a probe) and the block barrier after the PDL wait (60). None
// closed the 9..16-row gap: 57 and 58 were up to 3% slower, 60 within +-2% with no direction. The
// slice costs at most 1.4-5.1% at 17..32 rows (54), and half its bytes (59) took up to ~2% off on
// 8192x28672 and little on 4096x28672, so sharing a slice between a cluster's blocks (TMA
// multicast) could gain at most ~2% on the largest layers (csrc/PERF_NOTES.md, session 49).
// CFG 524288 (kSaWide, debug variant 61, session 49): blocks of 16 warps, one to an SM, whose
// slices are twice as deep (128 KB of fragments: 128 k rows at four row groups, 256 at two).
// Why: the split-k tail. Every team flushes a column group's sums into the workspace once per k
// slice it covers, and a flush also falls wherever a team's range ends inside a column group: at
// 32 rows of 8192x28672 8 slices x 112 wgmma column units plus 528 team ends, ~1,420 flushes of
// 32 x 256 sums; with 4 slices ~980. ncu put 10.5% of the 32-row product's stall samples on the
// flushes (session 47, H100), and no tail at all measured ~6 us of ~73 (session 38). The same
// warps an SM and registers a thread (launch bounds 512 x 1 against 256 x 2). Measured (H100,
// bench/session49.sh, three passes against the shipped blocks in the same process): 1.2-2.4%
// faster at 17..32 rows of 8192x28672 and 0.1-2.0% of 28672x8192, slower elsewhere (9..16 rows of
// those 0.9-4.0%, 4096x28672 up to 5.0%, 4096x14336 and 14336x4096 at 17..32 rows 1.7-8.0%);
// decode at batch 12 / 16 / 24 / 32 0.3-2.7% slower. Not shipped; every shipped form in wide blocks passed the whole
// GPU suite (an A/B build, since removed).
// Debug variants 62 and 63 (sessions 49-50, removed): the two-tile wgmma form (80 registers a
// thread) three blocks to an SM, 6 warps a scheduler instead of 4, with three-stage rings and
// slices cut to a third of the SM (48 k rows), without and with A12. Why: the four-tile wgmma loop
// issues on ~60% of its cycles (35.5 instructions a tile by nvdisasm; csrc/PERF_NOTES.md, session
// 49), and more warps might hide more of a tile's dependent chain. Measured (H100, session 50,
// three passes against shipped in the same process): 8-21% slower at 17..32 rows of 8192x28672,
// 4096x28672 and 28672x8192, 1-5% slower on 4096x14336, 1-3% faster only on 14336x4096; decode at
// batch 17 / 24 / 32 4-10% slower. More warps do not pay for two tiles a unit and twice the k
// slices.
// CFG 1048576 (kSaRotate, debug variant 70; 71 with kSaWide; session 53): slice s starts its unit
// list s / nsl of the way along its segment's column units and wraps (ranges and flush counts
// unchanged: the shift is whole column units). Why: block bi of every slice covers the same units,
// and all blocks run at once at the same pace, so the nsl teams that hold a column unit's partial
// sums flush them into the same workspace words at about the same time (8 slices at 8192 inputs,
// 28 at 28672), and every team's last flush falls at the kernel's end. Session 28 put the
// workspace atomics at ~4-8 us of 32 rows, rising with the slices more than with the flushes; a
// vector flush with a quarter of the requests measured slower (session 29), so the requests'
// number is not the cost. Rotated, the slices' concurrent flushes land on different columns.
// Measured (H100, session 54, two passes): no faster (32 rows of 8192x28672 70.1-70.3 us against
// 70.6-70.7; 28672x8192 the same; 4096x28672 2% slower), decode at batch 16 / 32 within 1%, ncu's
// elapsed and SM active cycles the same: same-address flushes are not the cost.
// Timing probes of the wgmma form (wrong results; session 53): kSaNoTail (debug variant 68: no
// flush at all, the bound of any flush change) and kSaNoLastFlush (69: no flush of each team's
// last column unit, the burst at the kernel's end). Measured (H100, session 54, 32 rows): 68 took
// 8192x28672 from 70.6-70.7 us to 64.2-66.3, 28672x8192 from 73.4-75.6 to 65.6-67.1, 4096x28672
// from 41.7 to 39.2; 69 to 67.8-69.5, 71.7 and 39.1 (on the last, the last flush is all of it).
// CFG 4194304 (kSaStamp, debug variants 72 / 73 with the shipped / rotated four-group forms;
// session 53): each team's lane 0 of its first warp writes when its block started, when its first
// unit was done, when its last flush began and when it ended (%globaltimer, ns), with its SM, k
// slice, block index (in its slice and in the grid), units and flush count, into the buffer
// set_sa_stamp_buffer names (passed as
// `counters`, which split products do not use; nothing is written without one). Why: session 47's
// ncu had the SMs active on only 92% of the 32-row product's elapsed cycles though every block
// has the same units; bench/sa_stamps.py says which blocks end early, and whether their slices,
// flush counts or SMs explain it.
// Debug variants 74 / 75 (session 54, removed; the code is in 70caf20): each slice's blocks
// interleaved over the grid and the grid's first `SMs` blocks (placed first) given 1.25-1.75 times
// the units, since on each SM the block placed first ends ~13.5 us before the other (stamps). A
// loss, 6-26% slower on an H100: which block an SM favours is decided at run time, and the SMs
// where the weights missed straggled (csrc/PERF_NOTES.md, session 54).
// CFG 16777216 (kSaTwin, debug variants 78 / 79, the latter with stamps; session 54): the grid's
// blocks two to a block of 16 warps, one an SM: warps 8 h .. 8 h + 7 of block b work as block 2 b
// + h would (its slice, units, shared memory and barriers of its own). Why: of an SM's two
// blocks the one placed first ends first on every SM (session 54's stamps), ~13.5 us before the
// other, whose teams then run alone at half the warps; a block's warps start together, and a
// block's two teams ended within 1.8 us of each other on average.
// CFG 33554432 (kSaSteal, debug variant 80; session 55): units claimed at run time, so that a team
// whose block the SM favours takes work from the others of its k slice (their blocks hold the same
// activations) instead of leaving its SM's other block to end alone. Each team keeps its range in
// a word (next unit, end) of a zeroed buffer passed as `counters` (sa_claim_words): it takes its
// own next unit by an atomic add to the low half, NS - 1 ahead of the MMAs (the ring's depth),
// and, its range done, units from the end of other teams' ranges by a compare-and-swap on the high
// half; each unit is claimed once, whatever the order. A team's sums of one column group add up
// over any of its k rows, so it flushes where the next unit's group differs. Each team zeroes its
// word at its end (every unit of it claimed by then); a word is set after the PDL wait, when the
// product before has ended.
constexpr int kSaAffine = 4, kSaNoTail = 8, kSaTwoRows = 16, kSaA12 = 64, kSaTcSum = 128,
              kSaTwoTiles = 512, kSaSkipEmpty = 1024, kSaInFinish = 2048, kSaWgmma = 4096, kSaProducts = 8192,
              kSaNoSlice = 16384, kSaWide = 524288, kSaRotate = 1048576, kSaNoLastFlush = 2097152,
              kSaStamp = 4194304, kSaTwin = 16777216, kSaSteal = 33554432;
constexpr int kSaStealVictims = 8;  // kSaSteal: blocks whose ranges a team tries once its own is done
constexpr int kSaStampWords = 8;  // uint64 words a team's stamps take (kSaStamp)
__device__ __forceinline__ uint64_t sa_globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
template <int K, int NG, int CFG = 0>
struct SaShape {
    static constexpr int C = CFG & 3;                           // the shape part of CFG
    // tiles per unit: 16 * NG * CT accumulators
    static constexpr int CT = CFG & kSaTwoTiles ? 2 : NG == 4 || C >= 2 ? 4 : 8;
    static constexpr int KR = C % 2 ? 1 : (NG == 4 && K <= 4 && !(CFG & kSaTwoRows) ? 4 : 2);  // k rows per unit
    // warps a block, and blocks an SM the grid is sized for; kSaTwin: those blocks (warps and
    // blocks here) two to a launched block of HALVES x WARPS warps, one an SM
    static constexpr int WARPS = CFG & kSaWide ? 2 * kGvWarps : kGvWarps;
    static constexpr int BLOCKS_PER_SM = CFG & kSaWide ? 1 : 2;
    static constexpr int HALVES = CFG & kSaTwin ? 2 : 1;
    static_assert(BLOCKS_PER_SM % HALVES == 0, "kSaTwin: whole launched blocks an SM (not with kSaWide)");
    // warps a team (a warpgroup in the wgmma form, else one warp), and teams a block
    static constexpr int GW = CFG & kSaWgmma ? 4 : 1;
    static constexpr int TEAMS = WARPS / GW;
    static constexpr int TW = 8 * K;                            // trellis words per tile
    static constexpr int SW = KR * CT * TW;                     // ring stage: one unit's trellis
    static constexpr int BROW = NG * 64;                        // fragment words per k row (prep_frag)
    static constexpr int KS = 16384 * (WARPS / kGvWarps) / BROW;  // k rows per slice: 64 KB of fragments at most (wide: 128)
    static constexpr int NS_RAW = 1536 / SW;                    // ~6 KB of trellis in flight per warp
    static constexpr int NS = NS_RAW < 3 ? 3 : (NS_RAW > 8 ? 8 : NS_RAW);
    static constexpr int RING_WORDS = WARPS * NS * SW;
    // the slice's parts, each on an mbarrier of its own (whole 128-input chunks: 8 k rows or a
    // power-of-two multiple)
    static constexpr int PARTS = 8 * (WARPS / kGvWarps);
    // after the ring: the slice's row sums (MUL1, raw decode; 32 words), the parts' mbarriers and
    // the row sums' one
    // and kSaSteal: a team's claim state (8 words, CLAIM_SLOTS on)
    static constexpr int CLAIM_SLOTS = 32 + 2 * (PARTS + 1);
    static constexpr int EXTRA_WORDS = CLAIM_SLOTS + (CFG & kSaSteal ? 8 * TEAMS : 0);
    // kSaTwin: where the second half's shared memory starts (after a slice of KS k rows, the
    // ring and the extra words, rounded to 512 bytes so that its slice and mbarriers stay aligned;
    // a compile-time stride keeps the halves' addresses in uniform registers)
    static constexpr int HALF_WORDS = (KS * BROW + RING_WORDS + EXTRA_WORDS + 127) / 128 * 128;
};

// Where each block of the grid works (host-computed, see sa_grid).
struct SaGrid {
    int ks = 0;                 // k rows of the largest slice (its shared memory)
    int nsl = 1;                // k slices, of tk / nsl rows each (rounded either way to whole units)
    int nseg = 1;               // segments of a grouped product
    int seg_grp[5] = {};        // first column group of segment s; seg_grp[nseg] = all groups
    int seg_blocks[4] = {};     // blocks per slice of segment s
};

template <int K, int CB, int NG, int CFG>
__global__ void __launch_bounds__(SaShape<K, NG, CFG>::HALVES * SaShape<K, NG, CFG>::WARPS * 32,
                                  SaShape<K, NG, CFG>::BLOCKS_PER_SM / SaShape<K, NG, CFG>::HALVES)
exl3_gemv_sa_kernel(const uint32_t* __restrict__ xb, const float* __restrict__ csum, const uint32_t* __restrict__ trellis,
                    float* __restrict__ z, int m, int in, int out, half* __restrict__ y, int ldy,
                    const half* __restrict__ svh, const half* __restrict__ bias, int* __restrict__ counters,
                    int early_trigger, int finish_rows, const __grid_constant__ SaGrid grid) {
    using S = SaShape<K, NG, CFG>;
    constexpr int CT = S::CT, KR = S::KR, TW = S::TW, SW = S::SW, NS = S::NS, BROW = S::BROW;
    // MUL1 decodes to 1024 + t (decode_pair_mul1_raw) without the affine step per weight pair (4
    // HFMA2 per tile): the flush applies k_inv to each sum, and the warp holding a column group's
    // first k row of the slice adds k_bias times the slice's row sums of x (computed once per block
    // from the prep's chunk sums), as the one-group per-warp kernel does with its MMA row sums. On an H100
    // (session 27): 8192x28672 and 28672x8192 at 17 and 32 rows 6% faster, 14336x4096 2-4%,
    // 4096x14336 and 4096x28672 at 24 rows 3%, at 32 rows +-3% (csrc/PERF_NOTES.md).
    constexpr bool RAW = CB == CB_MUL1 && !(CFG & kSaAffine);
    constexpr bool kInFinish = (CFG & kSaInFinish) != 0;  // finish_rows > 0 possible (unsplit)
    constexpr bool kTcSum = (CFG & kSaTcSum) && K == 4 && CB == CB_MUL1;
    constexpr bool kPx = (CFG & kSaProducts) && K == 4 && RAW && !kTcSum;
    constexpr bool WG = (CFG & kSaWgmma) != 0;
    static_assert(!WG || (NG == 4 && KR % 2 == 0 && !kInFinish), "wgmma form: four row groups, A alternates by k row");
    // A unit's column groups: a warpgroup's 4 adjacent ones with wgmma (warp wi the group 4 G + wi
    // of unit G), else the warp's one. Its team (warpgroup or warp) owns a range of units.
    constexpr int kThreads = S::WARPS * 32;
    constexpr int GW = S::GW, kTeams = S::TEAMS;
    const int ks = grid.ks;
    extern __shared__ __align__(16) uint32_t sa_smem[];

    const int lane = threadIdx.x & 31;
    const Mul1SumSelect tc_select(lane);
    // With wgmma the warp index comes from lane 0, so that ptxas knows it and all derived from it to
    // be warp-uniform and keeps the descriptors in uniform registers (bench/wgmma_probe.cu).
    const int block_warp = WG ? __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0) : (int)threadIdx.x >> 5;
    // kSaTwin: this warp's half of the block works as grid block vblock, as its warp `warp`, thread
    // tid (derived from the warp index, so uniform where it is)
    constexpr bool kTwin = S::HALVES > 1;
    const int half = kTwin ? block_warp / S::WARPS : 0;
    const int warp = kTwin ? block_warp % S::WARPS : block_warp;
    const unsigned tid = kTwin ? threadIdx.x - (unsigned)(half * kThreads) : threadIdx.x;
    const int vblock = kTwin ? S::HALVES * (int)blockIdx.x + half : (int)blockIdx.x;
    const int wi = warp % GW, team = warp / GW;
    const int tk = in >> 4;
    const int tn = out >> 4;

    // This block's segment, k slice and range of units.
    int bx = vblock, seg = 0;
    while (seg + 1 < grid.nseg && bx >= grid.nsl * grid.seg_blocks[seg]) bx -= grid.nsl * grid.seg_blocks[seg++];
    const int nb = grid.seg_blocks[seg];
    const bool live = !kTwin || bx < grid.nsl * nb;  // kSaTwin: an odd grid's last half has no block
    const int slice = bx / nb, bi = bx - slice * nb;
    // k rows [r0, r0 + nr), whole 128-input chunks (the prep's sums are a chunk's), in units of KR
    // rows: unit row ur covers k rows r0 + KR ur ..
    const int r0 = 8 * (int)((long)(tk / 8) * slice / grid.nsl);
    const int nr = live ? 8 * (int)((long)(tk / 8) * (slice + 1) / grid.nsl) - r0 : 0;
    const int nru = nr / KR;
    const int g_first = grid.seg_grp[seg];
    const long units = (long)(grid.seg_grp[seg + 1] - g_first) / GW * nru;
    // kSaRotate: the slice's column units (n_cu in its segment) start at `rot` and wrap at g_wrap
    // (a unit's column group is g_first + GW ((u / nru + rot) mod n_cu) + wi)
    constexpr bool kRot = (CFG & kSaRotate) != 0;
    const int n_cu = kRot ? (grid.seg_grp[seg + 1] - g_first) / GW : 0;
    const int rot = kRot ? (int)((long)n_cu * slice / grid.nsl) : 0;
    const int g_wrap = g_first + GW * n_cu;
    const long b0 = units * bi / nb, b1 = units * (bi + 1) / nb;
    auto team_first = [&](int t) { return b0 + (b1 - b0) * t / kTeams; };  // team t's units [first(t), first(t + 1))
    const long u0 = team_first(team), u1 = team_first(team + 1);
    const int n_units = (int)(u1 - u0);
    constexpr bool kStamp = (CFG & kSaStamp) != 0;
    constexpr bool kSteal = (CFG & kSaSteal) != 0;
    static_assert(!kSteal || !(kStamp || kInFinish || kRot || kTwin), "kSaSteal: the split shipped forms");
    uint64_t stamp[4] = {};  // kSaStamp: block start, first unit done, last flush begun, team end
    int n_flushes = 0;
    if constexpr (kStamp) stamp[0] = sa_globaltimer();

    const int acts = half * S::HALF_WORDS;  // the slice's fragments: nr * BROW words
    const int ring = acts + ks * BROW + warp * NS * SW;
    float* row_sums = reinterpret_cast<float*>(sa_smem + acts + ks * BROW + S::RING_WORDS);  // [32], RAW
    const uint32_t ring_sa = static_cast<uint32_t>(__cvta_generic_to_shared(sa_smem + ring));
    const uint32_t acts_sa = static_cast<uint32_t>(__cvta_generic_to_shared(sa_smem + acts));
    const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(sa_smem + acts + ks * BROW + S::RING_WORDS + 32));

    // The slice in parts of 8 << part_shift k rows (at most PARTS), each copied in bulk by thread 0
    // and counted on its mbarrier; the row sums on one more (kSumsBar), which every thread
    // arrives at once it has stored its share, after its first unit: a flush of the slice's first k
    // row (grp_row0) waits for it. Below sm_90 (no bulk copies) the whole block copies the slice,
    // sums the rows and waits for all of it.
    constexpr bool kSlice = !(CFG & kSaNoSlice);
    constexpr bool kParts = kSlice && kBulkCopies;
    int part_shift = 3, n_parts;
    while ((n_parts = (nr + (1 << part_shift) - 1) >> part_shift) > S::PARTS) ++part_shift;
    uint32_t waited = kParts ? 0u : ~0u;  // parts (and the row sums) this warp has waited for
    auto wait_bar = [&](int j) {
        if (!(waited >> j & 1u)) {
            mbar_wait(bars + 8 * j, 0);
            waited |= 1u << j;
        }
    };
    auto wait_part = [&](int row) { wait_bar(row >> part_shift); };  // the part holding k row `row` of the slice
    constexpr int kSumsBar = S::PARTS;
    if constexpr (kParts) {
        if (tid == 0) {
            for (int j = 0; j < n_parts; ++j) mbar_init(bars + 8 * j, 1);
            if (RAW) mbar_init(bars + 8 * kSumsBar, kThreads);
            mbar_init_fence();
        }
        __syncthreads();
    }
    // RAW: this thread's share of the slice's row sums, the prep's sum of one chunk of one row
    // ([segment, row, in / 128]): a row's nr / 8 chunks over kPerRow adjacent threads of a warp.
    constexpr int kPerRow = kThreads / (NG * 8);
    static_assert(kPerRow <= 32, "a row's sum is a warp's shuffle");
    float sum_share = 0.f;
    auto publish_row_sums = [&]() {
        if constexpr (RAW && kSlice) {
#pragma unroll
            for (int o = kPerRow / 2; o > 0; o >>= 1) sum_share += __shfl_xor_sync(0xffffffffu, sum_share, o);
            if (tid % kPerRow == 0) row_sums[tid / kPerRow] = sum_share;
            if constexpr (kParts) mbar_arrive(bars + 8 * kSumsBar);
        }
    };

    // Producer: (column group, k row) of the next unit to fetch and its lane's source chunk.
    constexpr int kChunks = CT * TW / 4;  // 16-byte chunks of trellis per k row of a unit
    const size_t row_step = (size_t)tn * TW;
    auto first_grp = [&]() {
        int cu = (int)(u0 / nru);
        if constexpr (kRot) cu = cu + rot >= n_cu ? cu + rot - n_cu : cu + rot;
        return g_first + GW * cu + wi;
    };
    int p_grp = first_grp();
    int p_row = r0 + KR * (int)(u0 % nru);
    int p_slot = 0;
    const uint32_t* p_src = trellis + (size_t)p_row * row_step + (size_t)p_grp * CT * TW + lane * 4;
    auto copy_unit = [&]() {  // the unit at p_src into ring stage p_slot
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
            const uint32_t dst = ring_sa + (uint32_t)(p_slot * SW + kr * CT * TW + lane * 4) * 4u;
#pragma unroll
            for (int c0 = 0; c0 < kChunks; c0 += 32) {
                if (kChunks % 32 == 0 || c0 + lane < kChunks) gv_cp16(dst + c0 * 16, p_src + kr * row_step + c0 * 4);
            }
        }
        p_slot = p_slot + 1 == NS ? 0 : p_slot + 1;
    };
    auto issue = [&](int s) {
        if (s < n_units) {
            copy_unit();
            p_src += KR * row_step;
            if ((p_row += KR) == r0 + nr) {
                p_row = r0;
                p_grp += GW;
                if (kRot && p_grp >= g_wrap) p_grp -= GW * n_cu;
                p_src = trellis + (size_t)r0 * row_step + (size_t)p_grp * CT * TW + lane * 4;
            }
        }
        cp_async_commit();
    };
    // kSaSteal: unit u of the slice (of any of its teams' ranges), from its index.
    auto issue_unit = [&](const int u) {
        const int cu = u / nru;
        p_src = trellis + (size_t)(r0 + KR * (u - cu * nru)) * row_step + (size_t)(g_first + GW * cu + wi) * CT * TW + lane * 4;
        copy_unit();
        cp_async_commit();
    };

    // Prologue: the trellis (a weight) first, then, once the prep before this kernel is done,
    // the slice's activations (prep_frag wrote them in this form's layout) and row sums.
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) issue(s);
    if (early_trigger == 1) pdl_launch_dependents();
    pdl_wait_primary();
    if constexpr (kSlice) {
        const uint32_t* src = xb + ((size_t)seg * tk + r0) * BROW;
        if constexpr (kParts) {
            if (tid == 0) {
                for (int j = 0; j < n_parts; ++j) {
                    const int row = j << part_shift, rows = min(1 << part_shift, nr - row);
                    const uint32_t bytes = (uint32_t)(rows * BROW * 4);
                    mbar_arrive_expect(bars + 8 * j, bytes);
                    bulk_load(acts_sa + (uint32_t)(row * BROW * 4), src + (size_t)row * BROW, bytes, bars + 8 * j);
                }
            }
        } else {
            for (int w = 4 * (int)tid; w < nr * BROW; w += 4 * kThreads) gv_cp16(acts_sa + w * 4, src + w);
            cp_async_commit();
        }
        if constexpr (RAW) {  // (loaded now, summed and stored after the first unit)
            const int row = tid / kPerRow, c = tid % kPerRow;
            if (row < m && c < nr / 8) sum_share = __ldcg(csum + ((size_t)seg * m + row) * (in >> 7) + r0 / 8 + c);
        }
        if constexpr (!kParts) {
            publish_row_sums();
            cp_async_wait<0>();
            __syncthreads();
        }
    }
    // Thread 0 waits for every part before it leaves: a block must not end under its copies.
    auto wait_all_parts = [&]() {
        if (kParts && tid == 0)
            for (int j = 0; j < n_parts; ++j) wait_bar(j);
    };
    if (n_units <= 0) {
        if constexpr (kParts) publish_row_sums();
        wait_all_parts();
        return;
    }

    // kSaSteal: claims by lane 0 of the team's first warp: its own range's next unit while it has
    // one, then units from the end of the ranges of the same team in the slice's next blocks (at
    // most kSaStealVictims of them). A word's low half is the next unit, its high half the end.
    // The team's state is in shared memory (the main loop's registers hold its sums): two
    // alternating results, the victim step (0: its own range), its own word (derivable from
    // vblock, but kept here: derived in the loop, the 4-tile wgmma form's spills rose from 24 to
    // 32 bytes, ptxas), the slice's first word, its block's index and the slice's block count.
    volatile int* const claim_state =
        reinterpret_cast<volatile int*>(sa_smem + acts + ks * BROW + S::RING_WORDS + S::CLAIM_SLOTS) + 8 * team;
    auto claim_one = [&]() -> int {
        unsigned* const words = reinterpret_cast<unsigned*>(counters);
        int v = claim_state[2];
        if (v == 0) {
            const unsigned old = atomicAdd(words + claim_state[3], 1u);
            if ((old & 0xffffu) < (old >> 16)) return (int)(old & 0xffffu);
            v = 1;
        }
        const int first = claim_state[4], b = claim_state[5], n = claim_state[6];
        for (; v <= min(n - 1, kSaStealVictims); ++v) {
            unsigned* const w = words + first + (b + v < n ? b + v : b + v - n) * kTeams + team;
            unsigned old = __ldcg(w);
            for (int t = 0; t < 4 && (old & 0xffffu) < (old >> 16); ++t) {
                const unsigned seen = atomicCAS(w, old, old - 0x10000u);
                if (seen == old) {
                    claim_state[2] = v;
                    return (int)(old >> 16) - 1;
                }
                old = seen;
            }
        }
        claim_state[2] = v;
        return -1;
    };
    // The team's next unit, the same in all its warps (a wgmma team's through its result words,
    // behind a barrier of the team's warps: named barrier 1 + team).
    auto team_claim = [&](const int s) -> int {
        int u = -1;
        if (wi == 0 && lane == 0) u = claim_one();
        if constexpr (GW == 1) {
            return __shfl_sync(0xffffffffu, u, 0);
        } else {
            static_assert(!kSteal || kTeams == 2, "kSaSteal: two wgmma teams a block");
            if (wi == 0 && lane == 0) claim_state[s & 1] = u;
            __syncwarp();  // (bar.sync is warp-aligned)
            if (team == 0) asm volatile("bar.sync 1, %0;" ::"n"(GW * 32) : "memory");
            else asm volatile("bar.sync 2, %0;" ::"n"(GW * 32) : "memory");
            return claim_state[s & 1];
        }
    };
    if constexpr (kSteal) {  // the team's range less the prologue's units (after the PDL wait: the product before may steal until it ends)
        if (wi == 0 && lane == 0) {
            const int own = vblock * kTeams + team;
            claim_state[2] = 0;
            claim_state[3] = own;
            claim_state[4] = (vblock - bi) * kTeams;
            claim_state[5] = bi;
            claim_state[6] = nb;
            atomicExch(reinterpret_cast<unsigned*>(counters) + own, (unsigned)u1 << 16 | (unsigned)(u0 + min(NS - 1, n_units)));
        }
        __syncwarp();
    }

    int wa, wb, wc, shift;
    lane_words<K>(lane, wa, wb, wc, shift);
    bool has_b[NG];  // the lane's B column (row lane / 4 of each group of 8) is a real row
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) has_b[gr] = gr * 8 + (lane >> 2) < m;
    const int live_groups = (CFG & kSaSkipEmpty) ? (m + 7) >> 3 : NG;  // MMAs for these groups only

    int c_grp = first_grp();
    int c_row = r0 + KR * (int)(u0 % nru);
    bool grp_row0 = c_row == r0;  // this warp does the slice's first k row of column group c_grp
    int c_slot = 0;
    int seg_units = 0;  // k rows of the current column group done by this warp
    float acc[NG][CT][4];
    uint32_t a_wg[2][CT][4];  // wgmma: the decoded tiles of even and odd k rows (one set in flight)
    // wgmma: 0 while the sums hold a flushed column group's, so that the next k row's wgmmas
    // overwrite them. Zeroing them instead is an ordinary write, which ptxas orders after every
    // wgmma in flight (a wait it injects, even where the write is predicated off).
    int wg_scale = 1;
    auto zero_acc = [&]() {
#pragma unroll
        for (int gr = 0; gr < NG; ++gr)
#pragma unroll
            for (int ct = 0; ct < CT; ++ct)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[gr][ct][q] = 0.f;
    };
    // The version-3 completion protocol: count this warp's k rows of the 128-column block; the
    // warp that completes it applies the output transform, after its main loop (deferred).
    GvBlockList deferred;
    auto finish_block = [&](uint2 sv, uint2 bv) {
        const int blk = (c_grp * CT) >> 3;
        if (!gv_count_block(counters, blk, seg_units, tk * (8 / CT), lane)) return;
        if (finish_rows == 1 || !deferred.add(blk))
            gv_finish_block<false>(z, y, ldy, sv, bv, bias != nullptr, m, out, blk, lane, in, nullptr);
        if (lane == 0) counters[blk] = 0;
    };

    zero_acc();
    // kSaSteal: the units of the ring stages in flight, oldest first (-1: none; the prologue's are
    // the first of the team's own range), whether claims may still succeed, whether this thread
    // has published its row sums, and whether the open sums hold their group's slice row 0
    int q[kSteal ? NS : 1];
#pragma unroll
    for (int i = 0; i < (kSteal ? NS : 1); ++i) q[i] = i < NS - 1 && i < n_units ? (int)u0 + i : -1;
    bool more = true, published = false, acc_row0 = false;
    for (int s = 0; kSteal || s < n_units; ++s) {
        cp_async_wait<NS - 2>();
        __syncwarp();
        int next = -1;  // kSaSteal: the next unit this warp will do, where one is in flight
        if constexpr (kSteal) {
            const int un = more ? team_claim(s) : -1;
            more = un >= 0;
            if (more) issue_unit(un);
            else cp_async_commit();
            q[NS - 1] = un;
            const int cur = q[0];
#pragma unroll
            for (int i = 0; i + 1 < NS; ++i) {
                q[i] = q[i + 1];
                if (next < 0) next = q[i];
            }
            if (cur < 0) {
                if (!more && next < 0) break;
                continue;
            }
            const int cu = cur / nru;
            c_grp = g_first + GW * cu + wi;
            c_row = r0 + KR * (cur - cu * nru);
        } else {
            issue(s + NS - 1);
        }
        const int stage = ring + c_slot * SW;
        c_slot = c_slot + 1 == NS ? 0 : c_slot + 1;
        if constexpr (WG) {
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) {
                uint32_t(&av)[CT][4] = a_wg[kr & 1];
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    uint32_t v[4];
                    gv_decode_f16<K, CB, RAW, (CFG & kSaA12) != 0, kTcSum, kPx>(sa_smem, stage + (kr * CT + ct) * TW,
                                                                                 wa, wb, wc, shift, v, tc_select);
                    av[ct][0] = v[0];  // m16n8k16's A order (mma_16816's arguments)
                    av[ct][1] = v[2];
                    av[ct][2] = v[1];
                    av[ct][3] = v[3];
                }
                if (kr == 0) wait_part(c_row - r0);  // (a unit's k rows are in one part)
                const uint64_t desc = wg_smem_desc(acts_sa + (uint32_t)((c_row + kr - r0) * BROW * 4), 128, 256);
                wg_fence();
#pragma unroll
                for (int ct = 0; ct < CT; ++ct)
                    wgmma_rs_n32(acc[0][ct], acc[1][ct], acc[2][ct], acc[3][ct], av[ct], desc, kr == 0 ? wg_scale : 1);
                wg_commit();
                wg_wait<1>();  // the previous k row's: its A registers are this loop's next
            }
            wg_scale = 1;
        } else {
            wait_part(c_row - r0);
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) {
                const int ab = acts + (c_row + kr - r0) * BROW + lane * 2;
                uint2 b[NG];
#pragma unroll
                for (int gr = 0; gr < NG; ++gr)
                    b[gr] = has_b[gr] ? *reinterpret_cast<const uint2*>(sa_smem + ab + gr * 64) : make_uint2(0u, 0u);
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    uint32_t v[4];
                    gv_decode_f16<K, CB, RAW, (CFG & kSaA12) != 0, kTcSum, kPx>(sa_smem, stage + (kr * CT + ct) * TW,
                                                                                 wa, wb, wc, shift, v, tc_select);
#pragma unroll
                    for (int gr = 0; gr < NG; ++gr)
                        if (gr < live_groups) mma_16816(acc[gr][ct], v[0], v[2], v[1], v[3], b[gr].x, b[gr].y);
                }
            }
        }
        if (kParts && (kSteal ? !published : s == 0)) publish_row_sums();  // (before a flush that may wait for them)
        if constexpr (kSteal) {
            published = true;
            acc_row0 |= c_row == r0;
        }
        if (kStamp && s == 0) stamp[1] = sa_globaltimer();
        seg_units += KR;
        // kSaSteal: a column group's sums add up over any of its k rows, so they are flushed where
        // the next unit's group differs, or where no next unit is known yet
        const bool last = kSteal ? next < 0 && !more : s + 1 == n_units;
        if (kSteal ? next < 0 || g_first + GW * (next / nru) + wi != c_grp : (c_row += KR) == r0 + nr || last) {
            if constexpr (kSteal) grp_row0 = acc_row0;
            if constexpr (WG) wg_wait<0>();  // the sums are final
            if (last && early_trigger == 2) pdl_launch_dependents();
            if constexpr (kStamp) {
                ++n_flushes;
                if (last) stamp[2] = sa_globaltimer();
            }
            uint2 sv = make_uint2(0u, 0u), bv = make_uint2(0u, 0u);
            if ((CFG & kSaNoTail) || ((CFG & kSaNoLastFlush) && last)) {  // probes: keep the sums alive without the tail
                float t = 0.f;
#pragma unroll
                for (int gr = 0; gr < NG; ++gr)
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct) t += acc[gr][ct][0] + acc[gr][ct][3];
                if (t == 1.25e-37f) z[lane] = t;
            } else {
                // finish_rows 0: gv_finish_kernel transforms the output after this kernel (no count).
                if (kInFinish && y && finish_rows) gv_block_weights(svh, bias, (c_grp * CT) >> 3, lane, sv, bv);
                if constexpr (RAW) {
                    // D rows 2 cq and 2 cq + 1 of each group (gv_flush_f16's sacc[gr][q & 1]).
                    float sacc[NG][4];
                    if (grp_row0) wait_bar(kSumsBar);
#pragma unroll
                    for (int gr = 0; gr < NG; ++gr) {
                        const int row = gr * 8 + 2 * (lane & 3);
                        sacc[gr][0] = grp_row0 ? row_sums[row] : 0.f;
                        sacc[gr][1] = grp_row0 ? row_sums[row + 1] : 0.f;
                        sacc[gr][2] = sacc[gr][3] = 0.f;
                    }
                    gv_flush_f16<NG, CT, true>(z, acc, c_grp, m, out, lane, sacc);
                } else {
                    gv_flush_f16<NG, CT>(z, acc, c_grp, m, out, lane);
                }
                if (kInFinish && y && finish_rows) finish_block(sv, bv);
            }
            if constexpr (kSteal) {
                if constexpr (WG) wg_scale = 0; else zero_acc();
                acc_row0 = false;
            } else if (!last) {
                if constexpr (WG) wg_scale = 0; else zero_acc();
                grp_row0 = true;
                c_row = r0;
                c_grp += GW;
                if (kRot && c_grp >= g_wrap) c_grp -= GW * n_cu;
                seg_units = 0;
            }
        }
    }
    if constexpr (kSteal) {
        if (wi == 0 && lane == 0) atomicExch(reinterpret_cast<unsigned*>(counters) + vblock * kTeams + team, 0u);  // (every unit of it claimed)
    }
    if constexpr (kInFinish) deferred.drain([&](int blk) { gv_finish_block_rows8(z, y, ldy, svh, bias, m, out, blk, lane); });
    if constexpr (WG) wg_wait<0>();  // (the last unit's flush waited already; ptxas cannot tell)
    cp_async_wait<0>();
    if constexpr (kStamp) {
        if (counters && wi == 0 && lane == 0) {
            uint32_t smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            uint64_t* out_stamps = reinterpret_cast<uint64_t*>(counters) + ((size_t)vblock * kTeams + team) * kSaStampWords;
            out_stamps[0] = 1ull << 63 | (uint64_t)(n_flushes & 0xfff) << 40 | (uint64_t)(bi & 0xffff) << 24 |
                            (uint64_t)(slice & 0xfff) << 12 | (smid & 0xfff);
            stamp[3] = sa_globaltimer();
#pragma unroll
            for (int j = 0; j < 4; ++j) out_stamps[1 + j] = stamp[j];
            out_stamps[5] = (uint64_t)vblock;
            out_stamps[6] = (uint64_t)n_units;
        }
    }
    wait_all_parts();
}

}  // namespace trellis
