// Plain C++ interface of the Trellis CUDA kernels. Nothing here includes torch, so the kernels
// compile (and can be syntax-checked) with a bare nvcc; csrc/bindings.cpp adapts torch tensors.
// Every launcher returns a cudaError_t (cudaSuccess or the launch error).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace trellis {

// An attribute of the current device, queried once per device (0 where it cannot be queried):
// launchers that choose a path, a grid or shared memory by it ask on every launch.
template <cudaDeviceAttr A>
inline int current_device_attr() {
    static int v[64] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
    if (!v[dev] && cudaDeviceGetAttribute(&v[dev], A, dev) != cudaSuccess) return 0;
    return v[dev];
}

// Rows of x handled by one pass of the fused product; larger m loops over row chunks.
constexpr int kMaxFusedRows = 32;

// A product's output left open: its split-k sums z (fp32, row stride ld), before the output
// transform (had128 / sqrt(128), svh, bias) that the kernel reading it applies as it reads
// (prep_frag), so the product needs no completion count and no output stage of its own. The
// reader's product zeroes z after its programmatic-dependent wait (MmArgs::zero_after).
struct OpenSums {
    const float* z = nullptr;  // nullptr: not open
    int ld = 0;
    const half* svh = nullptr;
    const half* bias = nullptr;  // optional
};

// A norm before a normed input's residual add: x becomes rms_norm(x) * w (eps) first. Gemma's
// post-attention / post-feedforward norm, then the next pre-norm, in one prep instead of a norm
// kernel and a prep (version 3 prep_frag only, with a residual). w == nullptr: none.
struct PreNorm {
    const half* w = nullptr;
    float eps = 0.f;
};

// A normed product input, rms_norm(x (+ residual)) * w over the whole row (see prep_frag), after
// `pre` where that has a weight.
struct PrepNorm {
    const half* w = nullptr;
    const half* residual = nullptr;
    half* residual_out = nullptr;
    float eps = 0.f;
    PreNorm pre;
};

// Decode chain (version 3, m = 1): the warp that finishes a 128-column block of this product's
// output also writes that block's part of the next product's MUL1 integer input (the int8
// passes, steps and chunk sums prep_frag would write), so no prep kernel runs between the two.
// mode 1 (normed): the next input is rms_norm(y + res) * norm_w. A block cannot know the row's
//   1 / rms, so it writes the chunks of (y + res) * norm_w (the int8 passes are scale-invariant)
//   and its sum of squares to part[block]; the next product's output stage applies 1 / rms
//   (MmArgs::in_part). y + res goes to res_out (the residual stream).
// mode 2 (gated): this product is a gated MLP's grouped gate/up (out = 2n, up from column n) and
//   the next input is act(gate) * up: the second of a chunk's two blocks to finish writes it
//   (pairs: int32 [n / 128], zero on entry and left zero).
struct ChainOut {
    int mode = 0;  // 0: none
    uint32_t* xb = nullptr;   // the next product's xb, scales, csum (prep_frag's layout, ng = 1)
    float2* scales = nullptr;
    float* csum = nullptr;
    const half* suh = nullptr;  // the next product's input signs [nseg, n]
    int nseg = 1;
    int n = 0;  // the next product's in
    const half* norm_w = nullptr;  // mode 1
    const half* res = nullptr;     // mode 1, optional
    half* res_out = nullptr;       // mode 1, optional
    float* part = nullptr;         // mode 1: [n / 128]
    int* pairs = nullptr;          // mode 2
    int act = 0;                   // mode 2: 0 SiLU, 1 GELU tanh, 2 GELU erf
};

// Inputs of the fused product for one chunk of m <= kMaxFusedRows rows.
struct MmArgs {
    const half* xh = nullptr;       // fp16 path: had128(x * suh), [m, in], row stride ldxh
    int ldxh = 0;
    const uint32_t* sq = nullptr;   // MUL1 integer path (m <= 8): splatted int8 passes [2m, ldsq]
    int ldsq = 0;
    const float2* scales = nullptr; // [m, in/128] (step of pass 1, step of pass 2)
    const float* csum = nullptr;    // [m, in/128] sum of xh over each 128-chunk (integer path; fp16: gemv_f16_acts)
    const uint32_t* xb = nullptr;   // version 3: activations in MMA fragment order (prep_frag)
    bool acts_wgmma = false;        // fp16 path: xb in wgmma's layout (gemv_f16_acts)
    int version = 3;                // 3: persistent-warp kernel (exl3_gemv.cuh), 2: exl3_mm.cuh
    // Version 3 with y set: the kernel also applies the output transform (had128, svh, bias),
    // writes y [m, out] (row stride ldy) and leaves z and counters zeroed. counters: int32
    // [out/128], zero on entry.
    half* y = nullptr;
    int ldy = 0;
    const half* svh = nullptr;
    const half* bias = nullptr;
    int* counters = nullptr;
    const uint32_t* trellis = nullptr;  // [in/16, out/16, 16K] int16 as uint32 words
    float* z = nullptr;             // [m, out] fp32, zero on entry; partial sums are added
    int m = 0, in = 0, out = 0, K = 0, codebook = 0, ksplit = 0, num_sms = 0;
    // Version 3: launch with programmatic dependent launch (sm_90+), so the product's blocks start
    // and fetch trellis while the prep kernel before it still runs.
    bool pdl = false;
    // Version 3 under pdl: when the kernel after this one may launch (see set_early_trigger):
    // 0 when the product ends, 1 at its start, 2 when each warp leaves its main loop.
    int early_trigger = 0;
    // Version 3, grouped product: the trellis is several linears concatenated along the columns;
    // segment s + 1 starts at column seg_cols[s] (unused entries stay past any column) and has
    // its own activations in xb (and, on the I8 path, its own scales and chunk sums).
    int seg_cols[3] = {0x7fffffff, 0x7fffffff, 0x7fffffff};
    // Version 3, MUL1 integer path, m = 1 (see gemv_self_prep): the product preps its own input
    // from x (with up / norm as prep_frag takes them) and suh ([segments, in]); xb, scales and
    // csum are then unused and no prep kernel runs before it.
    bool self_prep = false;
    const half* x = nullptr;
    int ldx = 0;
    const half* up = nullptr;
    int ldu = 0;
    int act = 0;
    PrepNorm norm;
    const half* suh = nullptr;
    // Version 3 with y: the output stage prepares the next product's input (see ChainOut).
    ChainOut next;
    // Version 3 with y, m = 1: the input (xb, scales, csum) was written by the previous product's
    // output stage in mode 1, without the norm's 1 / rms: in_part holds the sums of squares of its
    // in / 128 blocks and this product's output stage scales by rsqrt(sum / in + in_eps).
    const float* in_part = nullptr;
    float in_eps = 0.f;
    // Version 3, per-warp kernel: zero_n floats at zero_after (the open sums this product's prep
    // read, see OpenSums) are zeroed after the kernel's programmatic-dependent wait, when that
    // prep has finished reading them.
    float* zero_after = nullptr;
    int zero_n = 0;
};

// xh = fp16(had128(fp16(x * suh)) / sqrt(128)) for rows of x; with sq non-null also the two int8
// passes of xh per 128-chunk, their steps and the chunk sums (inputs of the MUL1 path).
cudaError_t prep_x(const half* x, int ldx, const half* suh, half* xh, uint32_t* sq, int ldsq,
                   float2* scales, float* csum, int rows, int in, cudaStream_t stream);

// Version-3 activation prep: xh = had128(x * suh) written in MMA fragment order into xb. With
// scales/csum non-null (MUL1 integer path, rows <= 8): two int8 passes of xh per 128-chunk, each
// value repeated in 4 bytes, fragment groups of 4 rows (ng = 1 or 2), plus the steps and chunk
// sums; otherwise fp16 fragments in groups of 8 rows (ng = 1, 2 or 4), with csum non-null the
// chunk sums too, and with wgmma_layout (ng = 4) each group's words in wgmma's core-matrix order
// (gemv_f16_acts says which a product wants).
// nseg > 1 (grouped product): suh is [nseg, in] and segment s writes its own xb (and scales,
// csum) series right after segment s - 1's, in one launch.
// up != nullptr: the input is act(x) * up (act 0 SiLU, 1 GELU tanh, 2 GELU erf), rounded as
// gated_act rounds it: a gated MLP's down projection without the separate activation launch.
// norm.w != nullptr: the input is rms_norm(x (+ norm.residual)) * norm.w over the whole row of
// `in` values (x and residual row-major with stride ldx); x + residual goes to norm.residual_out.
// norm.pre.w != nullptr: x is rms_norm(x) * norm.pre.w first (PreNorm), both row statistics the
// block's; needs norm.w and norm.residual, and neither up nor open sums.
// xo.z / uo.z != nullptr: x / up is the open output of the product before (OpenSums) and x / up
// is not read; the residual then has row stride `in`.
cudaError_t prep_frag(const half* x, int ldx, const half* suh, uint32_t* xb, float2* scales,
                      float* csum, int rows, int in, int ng, int nseg, cudaStream_t stream,
                      const half* up = nullptr, int ldu = 0, int act = 0,
                      const PrepNorm& norm = PrepNorm{}, const OpenSums& xo = OpenSums{},
                      const OpenSums& uo = OpenSums{}, bool wgmma_layout = false);

// Groups of B columns the version-3 kernel uses for m rows (the xb layout depends on it).
inline int gemv_groups(int m, bool int8) {
    if (int8) return m <= 4 ? 1 : 2;
    return m <= 8 ? 1 : (m <= 16 ? 2 : 4);
}

// z += had128(x * suh) @ What (before the output Hadamard). in, out multiples of 128.
cudaError_t exl3_mm_partial(const MmArgs& args, cudaStream_t stream);

// What the fp16 path's version-3 product described by `a` (m, in, out, K, codebook, seg_cols,
// num_sms, and the debug variant) wants from its prep (prep_frag): kActsChunkSums, the chunk sums
// of xh in csum (the block-shared kernel's MUL1 constant term), kActsWgmma, xb in wgmma's layout
// (MmArgs::acts_wgmma; the block-shared kernel's wgmma forms). The dispatch refuses a product
// whose flags differ from its own choice.
constexpr int kActsChunkSums = 1, kActsWgmma = 2;
int gemv_f16_acts(const MmArgs& a);

// y[rows, n] = fp16(fp16(had128(in) / sqrt(128)) * post) + bias, where `in` is fp32 (z of the
// product) or fp16 (optionally scaled first by `pre` with an fp16 multiply). pre/post/bias may be
// null. zero_input: write zeros back over `in` (fp32 only) so a workspace stays zeroed.
cudaError_t had128_f32(float* in, int ld_in, half* out, int ld_out, const half* post,
                       const half* bias, int rows, int n, bool zero_input, cudaStream_t stream);
cudaError_t had128_f16(const half* in, int ld_in, half* out, int ld_out, const half* pre,
                       const half* post, const half* bias, int rows, int n, cudaStream_t stream);
// Whether fp16 Hadamards run in 64-row tiles in shared memory (default) or a warp per 128-block
// (the form before session 17, now with 4 blocks per warp; a benchmark baseline). The same bits
// either way.
void set_had_tiles(bool enabled);
// Whether the plain and gated tile Hadamards (had128_f16, gated_had128) loop over tiles with the
// next one's loads in flight (on by default) or take one tile per block (the same bits).
void set_had_pipeline(bool enabled);
// out[rows, n] = had128_f16 of act(gate) * up (gated_act's rounding) with pre: a gated MLP's down
// projection input at prefill, without the gated product going through memory. With svh_gate and
// svh_up (biases optional), gate and up are the gate/up product's sums before its output
// transform, which is applied first exactly as had128_f16(z, post = svh, bias) would.
cudaError_t gated_had128(const half* gate, int ld_gate, const half* up, int ld_up, int act, const half* pre,
                         half* out, int ld_out, int rows, int n, const half* svh_gate, const half* svh_up,
                         const half* bias_gate, const half* bias_up, cudaStream_t stream);

// Timing probe for benchmarks: 0 normal, 1 = product without decode, 2 = decode without MMA.
void set_mm_debug_variant(int variant);

// Programmatic dependent launch of the version-3 product (on by default where the GPU has it);
// off gives benchmarks a same-run baseline.
void set_pdl(bool enabled);
bool pdl_setting();
// Fewest units per warp in the version-3 launcher (default 8; benchmarks sweep it).
void set_gemv_min_units(int units);
// Whether a product grid the min-units cap leaves short of two blocks per SM takes every resident
// block: 0 never, 1 (default) where it has more blocks than SMs, 2 always.
void set_gemv_grid_fill(int mode);
// Whether products (per-warp and block-shared kernels) pad their shared memory to hold an SM at
// the blocks their grid is sized for (exl3_mm.cuh, gemv_block_cap): 1 (default) yes, 0 no.
void set_gemv_block_cap(int on);
void set_gemv_two_row_units(int units);
void set_gemv_four_row_units(int units);  // 0: never four k rows per unit
// When products and decode attention let the kernel after them launch (PDL). Mode 1, at their
// start: measured on the H200 it cost 1-4% of decode speed (the next product's trellis prefetch
// then competes with the running one for DRAM; csrc/PERF_NOTES.md, session 5). Mode 2 (products
// only, the default): a warp triggers when it leaves its main loop, so the next kernel launches
// during the product's tail (atomics, output stage), not while it streams; +2-3% decode
// (session 6). Mode 0: when they end.
void set_early_trigger(int mode);
int early_trigger_setting();
// Decode attention's merge of its splits' partials: one pass with a running max (default), or the
// max first and then the sums (false: as before session 15; a benchmark knob).
void set_attn_merge_online(bool enabled);
bool attn_merge_online_setting();
// Timing probe (wrong results): prep_frag launches nothing. Benchmarks only.
void set_prep_skip(bool enabled);
// Whether a decode product (m = 1, MUL1 integer path) preps its own input instead of a prep
// kernel running before it (default off: measured slower, csrc/PERF_NOTES.md, session 6).
void set_self_prep(bool enabled);
// Which fp16-path products take the kernel with block-shared activations (exl3_gemv_sa.cuh):
// 0 none, 1 (default) where it measured faster (17..32 rows of large layers), 2 all.
void set_gemv_shared_acts(int mode);
// Which products' output transform runs as a kernel of its own after them instead of in the warp
// that completes each 128-column block: 0 none, 1 the block-shared kernel's, 2 also the per-warp
// kernel's at 9..32 rows, 3 also its fp16-path products of 1..8 rows, 4 also the integer path's,
// 5 (default) also a decode chain's product, whose chain output the finish kernel then writes
// (exl3_mm.cuh, gemv_split_finish).
void set_gemv_split_finish(int mode);
int gemv_split_finish_setting();  // the setting in force (decode chains of 2..4 rows need 5)
// Whether that chain finish kernel reads its inputs from earlier kernels before its PDL wait
// (default on; exl3_mm.cuh, finish_early_reads).
void set_finish_early_reads(bool enabled);
// How the block-shared kernel cuts its grid (exl3_gemv_sa.cuh, sa_grid): 1 (default) as few k
// slices as shared memory allows and never more blocks than fit at once; 0 the rule before
// session 28 (about 8 column groups per block), a benchmark baseline.
void set_gemv_sa_grid(int rule);
void set_gemv_sa_tiles(int rule);
void set_sa_stamp_buffer(int64_t ptr, int64_t slots);
// Whether block-shared products of 17..32 rows at K <= 4 take Hopper's warpgroup MMA on a device
// of compute capability 9.0: 1 (default) yes, 0 no (a benchmark baseline).
void set_gemv_wgmma(int mode);
// Rows of its workspace the warp that finishes a 128-column block reads per round trip: 8
// (default), or 1 (row by row, the earlier order; a benchmark baseline).
void set_gemv_finish_rows(int rows);
// Where a version-3 product takes a ring smaller than the shipped one (exl3_gemv_geom.cuh): 3
// (default) wherever two shipped blocks do not fit on an SM (RTX: 100 KB per SM; A100: 164 KB;
// never on an H200), 0 only where the shipped block cannot launch (more shared memory than a block
// may have: K = 8 on the integer path of an RTX 30/40/50 GPU), 1 on every GPU (a test knob), 2
// never (as before).
void set_gemv_compact(int mode);
// Below how many units per resident warp a product that would take CFG 0 takes the compact ring
// on any GPU (default 16; 0: never; exl3_gemv_geom.cuh, gemv_lean_units).
void set_gemv_lean_units(int units);
// The most groups of rows (8 fp16 rows, 4 integer rows each) a product may have for that rule (default 1).
void set_gemv_lean_groups(int groups);
// Whether this build has the products' debug variant `variant` (all of them with
// TRELLIS_DEBUG_VARIANTS; else those that take shipped kernels: exl3_gemv_geom.cuh,
// debug_variant_built, the one list).
bool debug_variant_in_build(int variant);
// The configuration (CFG) a version-3 product of this shape takes on the per-warp kernel (not the
// block-shared one, exl3_gemv_sa.cuh) and its block's shared memory, on this GPU (per_block 0) or
// on one with the given limits (what cudaDevAttrMaxSharedMemoryPerBlockOptin, ...PerMultiprocessor
// and ReservedSharedMemoryPerBlock say); returns how many of its blocks fit on an SM there (at
// most 2, what the grid is sized for; 0: it cannot launch).
int gemv_plan(int K, bool int8, int rows, bool self_prep, bool chain, int in, int out, int num_sms, int per_block,
               int per_sm, int reserved, int& cfg, int& smem_bytes);
// The block-shared product's grid for a plain (one-segment) product on this GPU: its blocks, and
// its k slices and the rows of the largest (exl3_gemv_sa.cuh, sa_grid).
int gemv_sa_plan(int K, int rows, int in, int out, int num_sms, int& slices, int& slice_rows);
// Whether the product described by `a` (m, in, out, K, num_sms, int8 path) takes its own prep:
// the setting is on, no debug variant is set, m = 1 on the integer path, and every warp's k rows
// fit its chunk slots.
bool gemv_self_prep(const MmArgs& a);

// Whether the product described by `a` can write a chain output (ChainOut): no debug variant, and
// one row where no warp finishes more column blocks than the kernel keeps for their chain output,
// or 2..4 rows with gemv_split_finish 5 (the finish kernel writes them).
bool gemv_chain_fits(const MmArgs& a);

// Dense inner weight What [in, out] fp16, bit-exact with the format's reference decode.
cudaError_t exl3_reconstruct(const uint32_t* trellis, half* out, int in, int n_out, int K,
                             int codebook, cudaStream_t stream);

// Gemma 2's prefill attention probabilities in place (capped_softmax.cu): each row of S fp16
// scores s becomes softmax over the row of fp16(fp16(tanh(s)) * softcap), -inf where the mask
// (uint8, 1 = may attend; row q0 + r % q_rows of rows mask_ld apart, 0: one row for all; nullptr:
// none) hides a key. The scores hold already scale / softcap times q.k. S at most
// capped_softmax_max_len() (the row stays in one block's shared memory).
int capped_softmax_max_len();
cudaError_t capped_softmax(half* scores, long rows, int S, float softcap, const uint8_t* mask, long mask_ld,
                           int q_rows, int q0, cudaStream_t stream);

// RMSNorm over the last dim: y = w * fp16(x * rsqrt(mean(x^2) + eps)); if residual is non-null,
// x is first replaced by fp16(x + residual) and that sum is written to residual_out.
cudaError_t rms_norm(const half* x, const half* residual, const half* w, half* y,
                     half* residual_out, int rows, int n, float eps, cudaStream_t stream);
// A grouped product's transformed inputs at prefill: out[i] (member i of nm, [rows, n] each,
// contiguous) = had128_f16 of rms_norm(x (+ residual)) * w with pre-scale pre[i] ([nm, n]), with the
// bits of rms_norm followed by had128_f16. inv: rows floats of scratch. residual_out as rms_norm's.
// Where the tile kernels are off or a pointer is not 16-byte aligned it runs rms_norm and then
// had128_f16 per member (the same bits).
cudaError_t norm_had128(const half* x, const half* residual, half* residual_out, const half* w, float eps,
                        float* inv, const half* pre, int nm, half* out, int rows, int n, cudaStream_t stream);

// out[r] = the first index of row r's largest value (NaN above all, as torch.argmax), x [rows, n]
// fp32 (f32) or fp16 with row stride ld; scratch: 2 * rows zeroed 64-bit words, left zero.
cudaError_t argmax_rows(const void* x, bool f32, long ld, int rows, int n, void* scratch, int64_t* out,
                        cudaStream_t stream);

// The sampler's draw among the `look` (<= 1024) most likely tokens (vals sorted down, their ids):
// out = (token, widen, bad) as engine/generate/sampling.py's choose() defines them. z: the sum of
// exp(logit - vals[0]) over the vocabulary when vals is not the whole distribution, else null;
// top: the logits' max; u: the draw's uniform (all device pointers).
cudaError_t sample_top(const float* vals, const int64_t* ids, int look, const float* top, const float* z,
                       float top_p, bool min_on, float log_min_p, const double* u, int64_t* out, cudaStream_t stream);

// The k (1..64) largest of x [n] fp32, by value (NaN largest) then lower index: vals fp32 [k] and
// ids int64 [k], largest first. scratch: topk_small_scratch_words(n, k) 64-bit words. Refuses
// (cudaErrorInvalidValue) k > 64, n < k and more than 8,192 / k blocks of 2,048 logits.
cudaError_t topk_small(const float* x, int n, int k, void* scratch, float* vals, int64_t* ids, cudaStream_t stream);
int topk_small_scratch_words(int n, int k);
// Whether topk_small takes k of n (the limits above, in one place for the host and Python).
bool topk_small_serves(long n, int k);

// Gated MLP glue: y = act(gate) * up, act 0 = SiLU, 1 = GELU (tanh approximation), 2 = GELU (erf).
cudaError_t gated_act(const half* gate, const half* up, half* y, int rows, int n, int ld_gate,
                      int ld_up, int act, cudaStream_t stream);

// Where rope_qk also stores this step's k (rotated) and v: caches [batch, hk, slots, d] with
// element strides c_batch, c_head, c_tok (c_dim 1), token t written at slot *pos + t; v is
// [batch, T, hk, d] like k (heads contiguous). kc == nullptr: no store.
struct KvStore {
    half* kc = nullptr;
    half* vc = nullptr;
    const half* v = nullptr;
    const int64_t* pos = nullptr;
    long c_batch = 0, c_head = 0, c_tok = 0, v_batch = 0, v_tok = 0;
    long slots = 0;  // a slot past the end is not written
};

// RoPE (rotate-half) on q [batch, T, hq, d] and k [batch, T, hk, d] in place, heads contiguous
// within a token; cos, sin [T, d]. Strides in elements. With store.kc set, the rotated k and v
// also go into the KV cache in the same launch.
cudaError_t rope_qk(half* q, half* k, const half* cos, const half* sin, int batch, int T, int hq,
                    int hk, int d, long q_batch, long q_tok, long k_batch, long k_tok,
                    const KvStore& store, cudaStream_t stream);

// One-token decode attention (csrc/decode_attention.cu): q [B, H, 1, D] against k, v [B, Hkv, S, D]
// (any strides with the last dim contiguous; k and v share them), H = Hkv * G, softmax over
// scale * q.k + mask (additive [B or 1, S], 0 / -inf; null: none), out [B, H, 1, D]. Strides in
// elements. With n_split > 1 the blocks of a (batch, kv head) merge through ws
// (decode_attention_ws_floats) and counters (decode_attention_counters of them, zero between
// calls; the kernel leaves them zero).
struct DecodeAttnArgs {
    const half* q = nullptr;
    long q_b = 0, q_h = 0;
    const half* k = nullptr;
    const half* v = nullptr;
    long kv_b = 0, kv_h = 0, kv_t = 0;
    const half* mask = nullptr;
    long mask_b = 0;
    half* out = nullptr;
    long o_b = 0, o_h = 0;
    float* ws = nullptr;
    int* counters = nullptr;
    int B = 0, Hkv = 0, G = 0, S = 0, D = 0, n_split = 1;
    float scale = 1.f;
    // Gemma 2's soft cap: each score s (scale included) becomes softcap * tanh(s / softcap)
    // before the mask and the softmax; 0: none.
    float softcap = 0.f;
    // See set_early_trigger (mode 1). Under the default mode 2 attention triggers at its end: at its
    // start or after its walks, o_proj's early fetch made batch-1 decode 2.3% slower on an H200
    // (csrc/PERF_NOTES.md, sessions 13 and 43).
    bool early_trigger = false;
    // Several splits: their partials merge in one pass with a running max (false: the max first,
    // then the sums, as before session 15; set_attn_merge_online).
    bool merge_online = true;
    // Decode chain into o_proj (B = 1, D = 128 or 256; see ChainOut): the output's head h is
    // o_proj's input chunk h (D = 256: chunks 2h and 2h + 1), so the kernel also writes o_proj's
    // int8 input (prep_frag's layout, one fragment group) with o_proj's input signs next_suh
    // [H * D]; no prep kernel runs for it.
    uint32_t* next_xb = nullptr;
    float2* next_scales = nullptr;
    float* next_csum = nullptr;
    const half* next_suh = nullptr;
    // RoPE and the KV-cache write of the step's token, done here instead of by rope_qk before
    // (one kernel boundary less per layer): q is then the unrotated projection; new_k, new_v the
    // token's rows [B, Hkv, D] (strides nk_b, nk_h, alike); cos, sin [D]; *pos the token's slot
    // in k and v (the cache, read and written through the same pointers), which the span holds.
    const half* new_k = nullptr;
    const half* new_v = nullptr;
    long nk_b = 0, nk_h = 0;
    const half* cos = nullptr;
    const half* sin = nullptr;
    const int64_t* pos = nullptr;
    // With pos, Qwen3's and Gemma 3's RMSNorm over each q head and the token's k head (weights
    // [D], one eps) before the RoPE, as rms_norm_kernel computes it, to the bit; null: none.
    // Head dims 128 and 256 only, and never with softcap (no model has both).
    const half* q_norm = nullptr;
    const half* k_norm = nullptr;
    float head_norm_eps = 0.f;
    // With pos, a sliding-window layer's window (> 0: the token sees slots pos - window < j <=
    // pos): the splits then cover only the window's slots of the span, not all S (the mask still
    // hides the slots past pos while the window has not filled); n_split counts splits of
    // min(S, window) slots. 0: the whole span.
    int window = 0;
};
// mma_keys: the tensor-core key walk serves the call with steps of this many keys
// (decode_attention_mma_keys), one block per SM; 0: the scalar walk.
int decode_attention_splits(int batch, int kv_heads, int groups, int slots, int sms, int mma_keys = 0);
// The ring stages of the tensor-core key walk for a call, 0 where the scalar walk serves it: the
// walk takes D = 64 or 128 (and 256 with set_attn_mma_d256), 16-byte aligned rows, a span of at
// least set_attn_mma_slots() slots (default 1: all; 0 never), and a GPU that fits two stages or
// more in a block's shared memory.
int decode_attention_mma_stages(const DecodeAttnArgs& a);
// Whether the kernel that serves a call can write a chain output into o_proj (DecodeAttnArgs::
// next_xb): head dim 128, or 256 on the tensor-core walk.
bool decode_attention_chains(const DecodeAttnArgs& a);
// Keys per step of the walk that serves a call: 16, 8 at head dim 256, 0 for the scalar walk.
int decode_attention_mma_keys(const DecodeAttnArgs& a);
void set_attn_mma_slots(int slots);
// Whether head dim 256 (Gemma) takes the tensor-core walk (default on: faster in Gemma 2 decode,
// session 24; the scalar walk otherwise).
void set_attn_mma_d256(bool enabled);
// The tensor-core walk's ring stages: 0 (default) the most that fit, up to 3; 2 or 3 where they fit.
void set_attn_mma_stages(int stages);
// The tensor-core walk takes one split (no merge) for spans of at most this many slots (default
// 256: two steps of 16 keys per warp; 0 never).
void set_attn_mma_one_split(int slots);
// Short caches take a split per 16 keys per warp (one load) while that is at most `splits` splits
// (default 10); 0: about 32 keys per warp always (before session 16).
void set_attn_one_load_splits(int splits);
int decode_attention_counters(int batch, int kv_heads, int groups);
size_t decode_attention_ws_floats(int batch, int kv_heads, int groups, int head_dim, int n_split);
cudaError_t decode_attention(const DecodeAttnArgs& args, cudaStream_t stream);

// Tail-biting Viterbi encoder (spec 5.6, same result as engine/quantize/viterbi.py): targets fp32
// [n, 256] in stream order, lut the codebook's 65536 fp16 values, states int32 [n, 256]. `blocks`
// persistent blocks (at most one per SM fits) share `scratch` of viterbi_scratch_bytes bytes.
size_t viterbi_scratch_bytes(int K, int lookahead, int blocks);
cudaError_t viterbi_encode(const float* targets, int n, int K, const half* lut, int warmup,
                           int lookahead, int32_t* states, void* scratch, int blocks,
                           cudaStream_t stream);

}  // namespace trellis
