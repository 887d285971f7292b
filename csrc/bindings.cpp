// Torch bindings for the Trellis kernels: shape/dtype checks and stream plumbing only; the
// kernels themselves live behind the plain interface in kernels.h.
#include <cmath>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "kernels.h"

namespace {

// Codebook ids as in csrc/exl3_decode.cuh (kept torch-free, so not included here).
constexpr int64_t kCodebookMul1 = 2;

#define CHECK_CUDA_OK(expr)                                                             \
    do {                                                                                \
        cudaError_t err_ = (expr);                                                      \
        TORCH_CHECK(err_ == cudaSuccess, "trellis kernel failed: ", cudaGetErrorString(err_)); \
    } while (0)

const half* hptr(const torch::Tensor& t) { return reinterpret_cast<const half*>(t.data_ptr()); }
half* hptr_mut(torch::Tensor& t) { return reinterpret_cast<half*>(t.data_ptr()); }
const half* opt_hptr(const c10::optional<torch::Tensor>& t) {
    return t.has_value() ? reinterpret_cast<const half*>(t->data_ptr()) : nullptr;
}

void check_half_vec(const c10::optional<torch::Tensor>& t, int64_t n, const char* name) {
    if (!t.has_value()) return;
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kHalf && t->is_contiguous() &&
                    t->numel() == n,
                name, " must be a contiguous fp16 CUDA vector of length ", n);
}

void check_trellis(const torch::Tensor& trellis) {
    TORCH_CHECK(trellis.is_cuda() && trellis.scalar_type() == torch::kShort && trellis.dim() == 3 &&
                    trellis.is_contiguous(),
                "trellis must be a contiguous int16 CUDA tensor [in/16, out/16, 16*K]");
    TORCH_CHECK(trellis.size(2) % 16 == 0 && trellis.size(2) / 16 >= 1 && trellis.size(2) / 16 <= 8,
                "trellis last dim must be 16*K with K in 1..8");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0,
                "trellis must be 16-byte aligned");
}

// The norm arguments of the fused rows [r0, ...): the residual pointers move with x.
trellis::PrepNorm chunk_norm(trellis::PrepNorm n, int64_t offset) {
    if (n.residual) {
        n.residual += offset;
        n.residual_out += offset;
    }
    return n;
}

void check_f32(const torch::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == n,
                name, " must be a contiguous fp32 CUDA tensor of ", n, " elements");
}

// The int8 input of a decode product (1..4 rows, one fragment group) that another kernel writes:
// xb [nseg, in/16, 1, 32, 4] int32, scales [nseg, rows, in/128, 2] and csum [nseg, rows, in/128] fp32.
void check_prepared(const torch::Tensor& xb, const torch::Tensor& scales, const torch::Tensor& csum, int64_t nseg,
                    int64_t in, int64_t rows) {
    TORCH_CHECK(xb.is_cuda() && xb.scalar_type() == torch::kInt && xb.is_contiguous() &&
                    xb.numel() == nseg * (in / 16) * 32 * 4,
                "prepared xb must be a contiguous int32 CUDA tensor [segments, in/16, 1, 32, 4]");
    check_f32(scales, nseg * rows * (in / 128) * 2, "prepared scales");
    check_f32(csum, nseg * rows * (in / 128), "prepared csum");
}

// The decode chain's output (trellis::ChainOut) from its tensors. mode 1: [xb, scales, csum,
// suh, part, norm_w] and optionally [res, res_out]; mode 2: [xb, scales, csum, suh, pairs]. n is
// the next product's in: this product's out (mode 1) or half of it (mode 2); rows this product's.
trellis::ChainOut chain_out(std::vector<torch::Tensor>& t, int64_t mode, int64_t act, int64_t out,
                            const std::vector<int64_t>& seg_cols, int64_t rows) {
    trellis::ChainOut c;
    TORCH_CHECK(mode == 1 || mode == 2, "chain mode must be 1 (normed) or 2 (gated)");
    TORCH_CHECK(mode == 1 ? (t.size() == 6 || t.size() == 8) : t.size() == 5,
                "chain: mode 1 takes [xb, scales, csum, suh, part, norm_w (, res, res_out)], mode 2 "
                "[xb, scales, csum, suh, pairs]");
    const int64_t n = mode == 1 ? out : out / 2;
    TORCH_CHECK(mode == 1 || (seg_cols.size() == 1 && seg_cols[0] == n),
                "a gated chain needs a gate/up product of two equal halves");
    TORCH_CHECK(t[3].is_cuda() && t[3].scalar_type() == torch::kHalf && t[3].is_contiguous() &&
                    t[3].numel() % n == 0 && t[3].numel() / n >= 1 && t[3].numel() / n <= 4,
                "chain suh must be the next product's input signs [segments, n]");
    c.mode = (int)mode;
    c.n = (int)n;
    c.nseg = (int)(t[3].numel() / n);
    check_prepared(t[0], t[1], t[2], c.nseg, n, rows);
    c.xb = reinterpret_cast<uint32_t*>(t[0].data_ptr());
    c.scales = reinterpret_cast<float2*>(t[1].data_ptr());
    c.csum = t[2].data_ptr<float>();
    c.suh = hptr(t[3]);
    if (mode == 1) {
        check_f32(t[4], rows * (n / 128), "chain part");
        check_half_vec(t[5], n, "chain norm weight");
        c.part = t[4].data_ptr<float>();
        c.norm_w = hptr(t[5]);
        if (t.size() == 8) {
            check_half_vec(t[6], rows * n, "chain residual");
            check_half_vec(t[7], rows * n, "chain residual_out");
            c.res = hptr(t[6]);
            c.res_out = hptr_mut(t[7]);
        }
    } else {
        TORCH_CHECK(t[4].is_cuda() && t[4].scalar_type() == torch::kInt && t[4].is_contiguous() &&
                        t[4].numel() >= n / 128,
                    "chain pairs must be a zeroed int32 CUDA tensor of at least n/128 entries");
        TORCH_CHECK(act >= 0 && act <= 2, "act must be 0 (SiLU), 1 (GELU tanh) or 2 (GELU erf)");
        c.pairs = t[4].data_ptr<int>();
        c.act = (int)act;
    }
    return c;
}

bool chain_fits(int64_t in, int64_t out, int64_t K, int64_t rows) {
    trellis::MmArgs a;
    a.m = (int)rows;
    a.in = (int)in;
    a.out = (int)out;
    a.K = (int)K;
    a.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    return trellis::gemv_chain_fits(a);
}

// The open-sums view of an fp32 matrix (x or up of a product whose input is the open output of
// the product before it): rows [m, in] at row stride ld, 16-byte aligned, with that product's
// svh and (optional: an empty tensor) bias over the same columns.
trellis::OpenSums open_sums(const torch::Tensor& z, const torch::Tensor& svh, const torch::Tensor& bias, int64_t m,
                            int64_t in, const char* name) {
    TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat && z.dim() == 2 && z.size(0) == m &&
                    z.size(1) == in && z.stride(1) == 1 && z.stride(0) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(z.data_ptr()) % 16 == 0,
                name, " (open sums) must be an fp32 CUDA matrix [m, in] with 16-byte aligned rows");
    check_half_vec(svh, in, "open sums svh");
    trellis::OpenSums o;
    o.z = z.data_ptr<float>();
    o.ld = (int)z.stride(0);
    o.svh = hptr(svh);
    if (bias.numel()) {
        check_half_vec(bias, in, "open sums bias");
        o.bias = hptr(bias);
    }
    return o;
}

// y = had(z(x)) for x [m, in] fp16. workspace: fp32, >= min(m, 32) * out elements, all zero on
// entry (and left zero). int8_mode: 1 lets MUL1 layers with m <= 8 use the integer path.
// seg_cols (grouped product, version 3 with counters): the trellis is up to four linears
// concatenated along the columns, linear s + 1 starting at column seg_cols[s]; suh is then
// [linears, in] and svh, bias, y span all of them.
// Decode chains (m = 1, or 2..4 with split finish 5; version 3 with counters; csrc/kernels.h
// ChainOut): `prepared` = [xb,
// scales, csum] (and [part] when they lack the norm's 1 / rms, applied with eps) is this product's
// int8 input, written by the previous product's output stage, so no prep runs; x then only gives
// m. `chain` (with chain_mode, chain_act) makes this product's output stage write the next one's.
// Open sums (kernels.h OpenSums; version 3, m <= 8): x (and up) may be fp32, the open output of the
// product before, with open_post = [svh_x, bias_x (, svh_up, bias_up)] (an empty tensor for no
// bias); zero_after is then the fp32 region holding those sums, which this product zeroes once its
// prep has read them. open_out: the product applies no output transform and returns its sums, a
// [m, out] fp32 view of the workspace that stays non-zero until a reader's product zeroes it.
torch::Tensor exl3_gemm(torch::Tensor x, torch::Tensor suh, torch::Tensor svh, torch::Tensor trellis,
                        c10::optional<torch::Tensor> bias, int64_t codebook,
                        torch::Tensor workspace, int64_t ksplit, int64_t int8_mode,
                        int64_t version, c10::optional<torch::Tensor> counters,
                        std::vector<int64_t> seg_cols, c10::optional<torch::Tensor> up,
                        int64_t act, c10::optional<torch::Tensor> norm_w, double eps,
                        c10::optional<torch::Tensor> residual,
                        c10::optional<torch::Tensor> residual_out, std::vector<torch::Tensor> prepared,
                        std::vector<torch::Tensor> chain, int64_t chain_mode, int64_t chain_act,
                        std::vector<torch::Tensor> open_post, c10::optional<torch::Tensor> zero_after,
                        bool open_out, c10::optional<torch::Tensor> pre_norm_w, double pre_eps) {
    check_trellis(trellis);
    const c10::cuda::CUDAGuard guard(x.device());
    const bool open_in = x.scalar_type() == torch::kFloat;
    TORCH_CHECK(x.is_cuda() && (open_in || x.scalar_type() == torch::kHalf) && x.dim() == 2 && x.stride(1) == 1,
                "x must be an fp16 (or open-sums fp32) CUDA matrix with unit column stride");
    const int64_t m = x.size(0), in = trellis.size(0) * 16, out = trellis.size(1) * 16;
    TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " columns, the layer takes ", in);
    TORCH_CHECK(in % 128 == 0 && out % 128 == 0, "fused EXL3 product needs dims that are multiples of 128");
    TORCH_CHECK(x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
                "x rows must be 8-byte aligned");
    trellis::OpenSums xo, uo;
    if (open_in || open_out) {
        TORCH_CHECK(version == 3 && m <= 8 && prepared.empty() && chain.empty(),
                    "open sums take the version-3 product at m <= 8, without decode chains");
    }
    if (open_in) {
        TORCH_CHECK(open_post.size() == (up.has_value() ? 4u : 2u), "open sums need their svh and bias (open_post)");
        TORCH_CHECK(zero_after.has_value() && zero_after->is_cuda() && zero_after->scalar_type() == torch::kFloat &&
                        zero_after->is_contiguous() && zero_after->numel() % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(zero_after->data_ptr()) % 16 == 0,
                    "open sums need the fp32 region that holds them (zero_after), 16-byte aligned");
        TORCH_CHECK(zero_after->numel() < (1LL << 31), "open sums region too large");
        xo = open_sums(x, open_post[0], open_post[1], m, in, "x");
        if (up.has_value()) uo = open_sums(*up, open_post[2], open_post[3], m, in, "up");
    } else {
        TORCH_CHECK(open_post.empty() && !zero_after.has_value(), "open_post and zero_after go with open-sums input");
    }
    const int nseg = (int)seg_cols.size() + 1;
    TORCH_CHECK(nseg <= 4, "a grouped product takes at most four linears");
    for (size_t s = 0; s < seg_cols.size(); ++s)
        TORCH_CHECK(seg_cols[s] % 128 == 0 && seg_cols[s] > (s ? seg_cols[s - 1] : 0) && seg_cols[s] < out,
                    "grouped product: segment starts must be increasing multiples of 128 inside the output");
    TORCH_CHECK(nseg == 1 || (version == 3 && (counters.has_value() || open_out)),
                "grouped product needs the version-3 kernel with its fused output stage");
    if (up.has_value()) {  // x is a gate, the input act(x) * up (a gated MLP's down projection)
        TORCH_CHECK(version == 3 && nseg == 1, "a gated input needs the version-3 single product");
        TORCH_CHECK(up->is_cuda() && up->scalar_type() == x.scalar_type() && up->dim() == 2 &&
                        up->size(0) == m && up->size(1) == in && up->stride(1) == 1 &&
                        up->stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(up->data_ptr()) % 8 == 0,
                    "up must be a CUDA matrix of x's dtype shaped like x with 8-byte aligned rows");
        TORCH_CHECK(act >= 0 && act <= 2, "act must be 0 (SiLU), 1 (GELU tanh) or 2 (GELU erf)");
    }
    trellis::PrepNorm norm;
    if (norm_w.has_value()) {  // the input is rms_norm(x (+ residual)) * norm_w (q/k/v, gate/up)
        TORCH_CHECK(version == 3 && !up.has_value() && (x.is_contiguous() || open_in),
                    "a normed input needs the version-3 product and a contiguous x");
        check_half_vec(norm_w, in, "norm weight");
        norm.w = hptr(*norm_w);
        norm.eps = (float)eps;
        if (residual.has_value()) {
            TORCH_CHECK(residual_out.has_value(), "a residual needs residual_out");
            for (const auto* t : {&*residual, &*residual_out})
                TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kHalf && t->is_contiguous() &&
                                t->size(0) == m && t->numel() == m * in,
                            "residual and residual_out must be contiguous fp16 CUDA tensors shaped like x");
            norm.residual = hptr(*residual);
            norm.residual_out = hptr_mut(*residual_out);
        }
        if (pre_norm_w.has_value()) {  // x is rms_norm(x) * pre_norm_w first (Gemma's post-norms)
            TORCH_CHECK(residual.has_value() && !open_in && prepared.empty(),
                        "a norm before the normed input needs a residual, and neither open sums nor a prepared input");
            check_half_vec(*pre_norm_w, in, "pre-norm weight");
            norm.pre = trellis::PreNorm{hptr(*pre_norm_w), (float)pre_eps};
        }
    } else {
        TORCH_CHECK(!pre_norm_w.has_value(), "a pre-norm weight goes with norm_w");
    }
    check_half_vec(suh, in * nseg, "suh");
    check_half_vec(svh, out, "svh");
    check_half_vec(bias, out, "bias");
    TORCH_CHECK(workspace.is_cuda() && workspace.scalar_type() == torch::kFloat &&
                    workspace.is_contiguous() &&
                    workspace.numel() >= std::min<int64_t>(m, trellis::kMaxFusedRows) * out,
                "workspace too small");
    auto y = torch::empty({open_out ? 0 : m, out}, x.options().dtype(torch::kHalf));
    if (m == 0) return open_out ? workspace.narrow(0, 0, 0).view({0, out}) : y;
    auto stream = at::cuda::getCurrentCUDAStream();
    const int chunk = (int)std::min<int64_t>(m, trellis::kMaxFusedRows);
    const bool use_i8 = int8_mode != 0 && codebook == kCodebookMul1 && m <= 8;
    trellis::MmArgs a;
    a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
    a.z = workspace.data_ptr<float>();
    a.in = (int)in;
    a.out = (int)out;
    a.K = (int)(trellis.size(2) / 16);
    a.codebook = (int)codebook;
    a.ksplit = (int)ksplit;
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    a.num_sms = props->multiProcessorCount;
    a.pdl = trellis::pdl_setting() && props->major >= 9;
    a.early_trigger = trellis::early_trigger_setting();
    a.version = version == 2 ? 2 : 3;
    const bool fused_out = a.version == 3 && counters.has_value() && !open_out;
    if (open_in) {
        a.zero_after = zero_after->data_ptr<float>();
        a.zero_n = (int)zero_after->numel();
    }
    if (fused_out) {
        TORCH_CHECK(counters->is_cuda() && counters->scalar_type() == torch::kInt &&
                        counters->is_contiguous() && counters->numel() >= out / 128,
                    "counters must be a zeroed int32 CUDA tensor of at least out/128 entries");
        a.counters = counters->data_ptr<int>();
        a.svh = hptr(svh);
        a.bias = opt_hptr(bias);
        a.ldy = (int)out;
    }
    for (size_t s = 0; s < seg_cols.size(); ++s) a.seg_cols[s] = (int)seg_cols[s];
    a.m = (int)chunk;
    if (!chain.empty() || !prepared.empty()) {
        TORCH_CHECK(fused_out && use_i8 && (m == 1 || (m <= 4 && trellis::gemv_split_finish_setting() >= 5)),
                    "decode chains take one row (2..4 with split finish 5) on the version-3 MUL1 integer-path "
                    "product with counters");
        if (!chain.empty()) {
            a.next = chain_out(chain, chain_mode, chain_act, out, seg_cols, m);
            TORCH_CHECK(trellis::gemv_chain_fits(a), "this product's shape (or a debug variant) cannot write a chain output");
        }
    }
    if (!prepared.empty()) {
        TORCH_CHECK(use_i8 && !up.has_value() && !norm_w.has_value() && (prepared.size() == 3 || prepared.size() == 4),
                    "a prepared input is [xb, scales, csum (, part)] of a MUL1 integer-path product, without up or norm");
        check_prepared(prepared[0], prepared[1], prepared[2], nseg, in, m);
        a.xb = reinterpret_cast<const uint32_t*>(prepared[0].data_ptr());
        a.scales = reinterpret_cast<const float2*>(prepared[1].data_ptr());
        a.csum = prepared[2].data_ptr<float>();
        if (prepared.size() == 4) {
            check_f32(prepared[3], m * (in / 128), "prepared part");
            a.in_part = prepared[3].data_ptr<float>();
            a.in_eps = (float)eps;
        }
        a.y = hptr_mut(y);
        CHECK_CUDA_OK(trellis::exl3_mm_partial(a, stream));
        return y;
    }
    if (fused_out && use_i8 && m == 1 && !a.next.mode && !open_in && !norm.pre.w && trellis::gemv_self_prep(a)) {  // decode: no prep kernel
        a.self_prep = true;
        a.x = hptr(x);
        a.ldx = (int)x.stride(0);
        if (up.has_value()) {
            a.up = hptr(*up);
            a.ldu = (int)up->stride(0);
            a.act = (int)act;
        }
        a.norm = norm;
        a.suh = hptr(suh);
        a.y = hptr_mut(y);
        CHECK_CUDA_OK(trellis::exl3_mm_partial(a, stream));
        return y;
    }
    torch::Tensor xh, xb, sq, scales, csum;
    auto chunk_sums = [&]() {  // [segment, row, in / 128]: the integer path's, or the fp16 path's where asked
        if (!csum.defined()) csum = torch::empty({nseg, chunk, in / 128}, x.options().dtype(torch::kFloat));
        return csum.data_ptr<float>();
    };
    if (use_i8) {
        scales = torch::empty({nseg, chunk, in / 128, 2}, x.options().dtype(torch::kFloat));
        a.scales = reinterpret_cast<const float2*>(scales.data_ptr());
        a.csum = chunk_sums();
    }
    if (a.version == 3) {
        // Fragment-ordered activations: I8 4 words per lane per group, F16 2 words.
        const int ng = trellis::gemv_groups(chunk, use_i8);
        xb = torch::empty({nseg, in / 16, ng, 32, use_i8 ? 4 : 2}, x.options().dtype(torch::kInt));
        a.xb = reinterpret_cast<const uint32_t*>(xb.data_ptr());
    } else {
        xh = torch::empty({chunk, in}, x.options());
        a.xh = hptr(xh);
        a.ldxh = (int)in;
        if (use_i8) {
            sq = torch::empty({2 * chunk, in}, x.options().dtype(torch::kInt));
            a.sq = reinterpret_cast<const uint32_t*>(sq.data_ptr());
            a.ldsq = (int)in;
        }
    }
    for (int64_t r0 = 0; r0 < m; r0 += trellis::kMaxFusedRows) {
        const int rows = (int)std::min<int64_t>(trellis::kMaxFusedRows, m - r0);
        a.m = rows;
        const half* xr = open_in ? nullptr : hptr(x) + r0 * x.stride(0);
        float2* sc = use_i8 ? reinterpret_cast<float2*>(scales.data_ptr()) : nullptr;
        float* cs = use_i8 ? chunk_sums() : nullptr;
        if (fused_out) a.y = hptr_mut(y) + r0 * out;
        if (a.version == 3 && !use_i8) {  // the fp16 path: what its product's form wants from the prep
            const int acts = trellis::gemv_f16_acts(a);
            a.acts_wgmma = acts & trellis::kActsWgmma;
            if (acts & trellis::kActsChunkSums) cs = chunk_sums();
            a.csum = cs;
        }
        if (a.version == 3) {
            CHECK_CUDA_OK(trellis::prep_frag(xr, (int)x.stride(0), hptr(suh),
                                             reinterpret_cast<uint32_t*>(xb.data_ptr()), sc, cs, rows,
                                             (int)in, trellis::gemv_groups(rows, use_i8), nseg, stream,
                                             up.has_value() && !open_in ? hptr(*up) + r0 * up->stride(0) : nullptr,
                                             up.has_value() ? (int)up->stride(0) : 0, (int)act,
                                             chunk_norm(norm, r0 * in), xo, uo, a.acts_wgmma));
        } else {
            CHECK_CUDA_OK(trellis::prep_x(xr, (int)x.stride(0), hptr(suh), hptr_mut(xh),
                                          use_i8 ? reinterpret_cast<uint32_t*>(sq.data_ptr()) : nullptr,
                                          (int)in, sc, cs, rows, (int)in, stream));
        }
        CHECK_CUDA_OK(trellis::exl3_mm_partial(a, stream));
        if (open_out) return workspace.narrow(0, 0, m * out).view({m, out});
        if (!fused_out)
            CHECK_CUDA_OK(trellis::had128_f32(a.z, (int)out, hptr_mut(y) + r0 * out, (int)out, hptr(svh),
                                          opt_hptr(bias), rows, (int)out, true, stream));
    }
    return y;
}

torch::Tensor exl3_reconstruct(torch::Tensor trellis, int64_t codebook) {
    check_trellis(trellis);
    const c10::cuda::CUDAGuard guard(trellis.device());
    const int64_t in = trellis.size(0) * 16, out = trellis.size(1) * 16;
    TORCH_CHECK(out % 128 == 0, "reconstruct kernel needs out % 128 == 0");
    auto w = torch::empty({in, out}, trellis.options().dtype(torch::kHalf));
    CHECK_CUDA_OK(trellis::exl3_reconstruct(reinterpret_cast<const uint32_t*>(trellis.data_ptr()),
                                            hptr_mut(w), (int)in, (int)out,
                                            (int)(trellis.size(2) / 16), (int)codebook,
                                            at::cuda::getCurrentCUDAStream()));
    return w;
}

// Blockwise 128-point Hadamard over the last dim (normalized), with optional fp16 pre-scale
// (fp16 input only), post-scale and bias. Output fp16.
torch::Tensor had128(torch::Tensor x, c10::optional<torch::Tensor> pre,
                     c10::optional<torch::Tensor> post, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "had128: x must be a contiguous CUDA tensor");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = x.size(-1);
    TORCH_CHECK(n % 128 == 0, "had128: last dim must be a multiple of 128");
    const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
    check_half_vec(pre, n, "pre");
    check_half_vec(post, n, "post");
    check_half_vec(bias, n, "bias");
    auto y = torch::empty(x.sizes(), x.options().dtype(torch::kHalf));
    if (rows == 0) return y;
    auto stream = at::cuda::getCurrentCUDAStream();
    if (x.scalar_type() == torch::kFloat) {
        TORCH_CHECK(!pre.has_value(), "had128: pre-scale is for fp16 input");
        CHECK_CUDA_OK(trellis::had128_f32(x.data_ptr<float>(), (int)n, hptr_mut(y), (int)n,
                                          opt_hptr(post), opt_hptr(bias), (int)rows, (int)n, false,
                                          stream));
    } else {
        TORCH_CHECK(x.scalar_type() == torch::kHalf, "had128: x must be fp16 or fp32");
        CHECK_CUDA_OK(trellis::had128_f16(hptr(x), (int)n, hptr_mut(y), (int)n, opt_hptr(pre),
                                          opt_hptr(post), opt_hptr(bias), (int)rows, (int)n, stream));
    }
    return y;
}

// had128(gated_act(gate, up, act), pre): gate and up [rows, n] with unit column stride (column
// slices of one gate/up output are fine), pre [n]. Output contiguous fp16. With svh_gate and
// svh_up ([n] each; biases optional), gate and up are sums before the gate/up product's output
// transform: had128(z, None, svh, bias) of each is taken first, with the same bits.
torch::Tensor gated_had128(torch::Tensor gate, torch::Tensor up, int64_t act, torch::Tensor pre,
                           c10::optional<torch::Tensor> svh_gate, c10::optional<torch::Tensor> svh_up,
                           c10::optional<torch::Tensor> bias_gate, c10::optional<torch::Tensor> bias_up) {
    TORCH_CHECK(gate.is_cuda() && up.device() == gate.device() && gate.scalar_type() == torch::kHalf &&
                    up.scalar_type() == torch::kHalf,
                "gated_had128: fp16 tensors on one CUDA device");
    TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "gated_had128: gate and up must be the same 2-d shape");
    TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1, "gated_had128: last dim must be contiguous");
    TORCH_CHECK(gate.stride(0) % 4 == 0 && up.stride(0) % 4 == 0 && (uintptr_t)gate.data_ptr() % 8 == 0 &&
                    (uintptr_t)up.data_ptr() % 8 == 0,
                "gated_had128: rows must be 8-byte aligned");
    const c10::cuda::CUDAGuard guard(gate.device());
    const int64_t n = gate.size(1);
    TORCH_CHECK(n % 128 == 0, "gated_had128: last dim must be a multiple of 128");
    check_half_vec(pre, n, "pre");
    TORCH_CHECK(svh_gate.has_value() == svh_up.has_value(), "gated_had128: svh_gate and svh_up go together");
    TORCH_CHECK(svh_gate.has_value() || (!bias_gate.has_value() && !bias_up.has_value()),
                "gated_had128: a bias needs the output scales");
    for (const auto* v : {&svh_gate, &svh_up, &bias_gate, &bias_up}) check_half_vec(*v, n, "output scale or bias");
    auto y = torch::empty({gate.size(0), n}, gate.options());
    if (gate.size(0) > 0) {
        CHECK_CUDA_OK(trellis::gated_had128(hptr(gate), (int)gate.stride(0), hptr(up), (int)up.stride(0), (int)act,
                                            hptr(pre), hptr_mut(y), (int)n, (int)gate.size(0), (int)n,
                                            opt_hptr(svh_gate), opt_hptr(svh_up), opt_hptr(bias_gate),
                                            opt_hptr(bias_up), at::cuda::getCurrentCUDAStream()));
    }
    return y;
}

std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps,
                                    c10::optional<torch::Tensor> residual) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kHalf && x.is_contiguous(),
                "rms_norm: x must be contiguous fp16 CUDA");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = x.size(-1);
    const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
    check_half_vec(w, n, "weight");
    auto y = torch::empty_like(x);
    torch::Tensor res_out;
    if (residual.has_value()) {
        TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                        residual->scalar_type() == torch::kHalf,
                    "rms_norm: residual must match x");
        res_out = torch::empty_like(x);
    }
    if (rows > 0) {
        CHECK_CUDA_OK(trellis::rms_norm(hptr(x), opt_hptr(residual), hptr(w), hptr_mut(y),
                                        residual.has_value() ? hptr_mut(res_out) : nullptr,
                                        (int)rows, (int)n, (float)eps,
                                        at::cuda::getCurrentCUDAStream()));
    }
    if (residual.has_value()) return {y, res_out};
    return {y};
}

// [out [nm, rows, n], x + residual (with a residual)]: out[i] = had128(rms_norm(x (+ residual)) * w,
// pre[i]) for the nm rows of pre, the inputs of a grouped product's members at prefill, with the
// bits of rms_norm and then had128.
std::vector<torch::Tensor> norm_had128(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual,
                                       torch::Tensor pre) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kHalf && x.is_contiguous(),
                "norm_had128: x must be contiguous fp16 CUDA");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = x.size(-1);
    const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(n % 128 == 0, "norm_had128: last dim must be a multiple of 128");
    check_half_vec(w, n, "weight");
    TORCH_CHECK(pre.is_cuda() && pre.device() == x.device() && pre.scalar_type() == torch::kHalf && pre.dim() == 2 &&
                    pre.size(1) == n && pre.size(0) >= 1 && pre.is_contiguous(),
                "norm_had128: pre must be contiguous fp16 [members, n] on x's device");
    torch::Tensor res_out;
    if (residual.has_value()) {
        TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                        residual->scalar_type() == torch::kHalf && residual->device() == x.device(),
                    "norm_had128: residual must match x");
        res_out = torch::empty_like(x);
    }
    auto out = torch::empty({pre.size(0), rows, n}, x.options());
    if (rows > 0) {
        auto inv = torch::empty({rows}, x.options().dtype(torch::kFloat));
        CHECK_CUDA_OK(trellis::norm_had128(hptr(x), opt_hptr(residual), residual.has_value() ? hptr_mut(res_out) : nullptr,
                                           hptr(w), (float)eps, inv.data_ptr<float>(), hptr(pre), (int)pre.size(0),
                                           hptr_mut(out), (int)rows, (int)n, at::cuda::getCurrentCUDAStream()));
    }
    if (residual.has_value()) return {out, res_out};
    return {out};
}

// kc, vc [batch, hk, slots, d] (last dim contiguous, same strides), v [batch, T, hk, d] with
// heads contiguous, pos int64 [1] on the device: also store k (rotated) and v at slot pos + t.
void rope_qk(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
             c10::optional<torch::Tensor> v, c10::optional<torch::Tensor> kc,
             c10::optional<torch::Tensor> vc, c10::optional<torch::Tensor> pos) {
    for (const auto* t : {&q, &k, &cos, &sin})
        TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kHalf, "rope_qk: fp16 CUDA tensors");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                    q.size(3) == k.size(3), "rope_qk: q, k must be [batch, T, heads, d] alike");
    const int64_t d = q.size(3), T = q.size(1);
    for (const auto* t : {&q, &k})
        TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == d, "rope_qk: heads must be contiguous");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * d && sin.numel() == T * d,
                "rope_qk: cos, sin must be contiguous [T, d]");
    trellis::KvStore st;
    if (kc.has_value()) {
        TORCH_CHECK(v.has_value() && vc.has_value() && pos.has_value(), "rope_qk: a KV store needs v, kc, vc and pos");
        TORCH_CHECK(v->scalar_type() == torch::kHalf && kc->scalar_type() == torch::kHalf &&
                        vc->scalar_type() == torch::kHalf && v->is_cuda() && kc->is_cuda() && vc->is_cuda(),
                    "rope_qk: v and the caches must be fp16 CUDA tensors");
        TORCH_CHECK(v->sizes() == k.sizes() && v->stride(3) == 1 && v->stride(2) == d,
                    "rope_qk: v must be shaped like k, heads contiguous");
        TORCH_CHECK(kc->dim() == 4 && kc->sizes() == vc->sizes() && kc->strides() == vc->strides() &&
                        kc->size(0) == k.size(0) && kc->size(1) == k.size(2) && kc->size(3) == d &&
                        kc->stride(3) == 1 && kc->size(2) >= T,
                    "rope_qk: caches must be [batch, kv heads, slots, d] alike, last dim contiguous");
        TORCH_CHECK(pos->is_cuda() && pos->scalar_type() == torch::kLong && pos->numel() == 1,
                    "rope_qk: pos must be an int64 CUDA tensor of one element");
        st.kc = hptr_mut(*kc);
        st.vc = hptr_mut(*vc);
        st.v = hptr(*v);
        st.pos = pos->data_ptr<int64_t>();
        st.c_batch = (long)kc->stride(0);
        st.c_head = (long)kc->stride(1);
        st.c_tok = (long)kc->stride(2);
        st.v_batch = (long)v->stride(0);
        st.v_tok = (long)v->stride(1);
        st.slots = (long)kc->size(2);
    }
    if (q.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(q.device());
    CHECK_CUDA_OK(trellis::rope_qk(hptr_mut(q), hptr_mut(k), hptr(cos), hptr(sin), (int)q.size(0), (int)T,
                                   (int)q.size(2), (int)k.size(2), (int)d, (long)q.stride(0), (long)q.stride(1),
                                   (long)k.stride(0), (long)k.stride(1), st, at::cuda::getCurrentCUDAStream()));
}

// Row-wise argmax of x [rows, n] (fp32 or fp16, last dim contiguous) -> int64 [rows]; scratch:
// int64, at least 2 * rows, zero (left zero).
torch::Tensor argmax_rows(torch::Tensor x, torch::Tensor scratch) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 &&
                    (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kHalf),
                "argmax_rows: a 2-d fp32 or fp16 CUDA tensor, last dim contiguous");
    TORCH_CHECK(x.size(1) > 0 && x.size(1) < (1L << 31) && x.size(0) < 65536, "argmax_rows: unsupported shape");
    TORCH_CHECK(scratch.is_cuda() && scratch.scalar_type() == torch::kLong && scratch.is_contiguous() &&
                    scratch.numel() >= 2 * x.size(0) && scratch.device() == x.device(),
                "argmax_rows: scratch must be int64 on x's device with 2 words per row");
    const c10::cuda::CUDAGuard guard(x.device());
    auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
    if (x.size(0) > 0) {
        CHECK_CUDA_OK(trellis::argmax_rows(x.data_ptr(), x.scalar_type() == torch::kFloat, (long)x.stride(0),
                                           (int)x.size(0), (int)x.size(1), scratch.data_ptr(),
                                           out.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()));
    }
    return out;
}

// The sampler's draw among the top tokens (trellis::sample_top): vals fp32 [look] sorted down, ids
// int64 [look], top and z fp32 0-dim, u float64 0-dim, all on one CUDA device -> int64 [3].
torch::Tensor sample_top(torch::Tensor vals, torch::Tensor ids, torch::Tensor top, c10::optional<torch::Tensor> z,
                         double top_p, double min_p, torch::Tensor u) {
    TORCH_CHECK(vals.is_cuda() && vals.dim() == 1 && vals.is_contiguous() && vals.scalar_type() == torch::kFloat,
                "sample_top: vals must be a contiguous fp32 CUDA vector");
    const int64_t look = vals.numel();
    TORCH_CHECK(look >= 1 && look <= 1024, "sample_top: 1 to 1024 tokens");
    TORCH_CHECK(ids.device() == vals.device() && ids.scalar_type() == torch::kLong && ids.numel() == look &&
                    ids.is_contiguous(), "sample_top: ids must be int64 [look] on vals' device");
    TORCH_CHECK(top.device() == vals.device() && top.scalar_type() == torch::kFloat && top.numel() == 1,
                "sample_top: top must be one fp32 on vals' device");
    TORCH_CHECK(u.device() == vals.device() && u.scalar_type() == torch::kDouble && u.numel() == 1,
                "sample_top: u must be one float64 on vals' device");
    if (z.has_value())
        TORCH_CHECK(z->device() == vals.device() && z->scalar_type() == torch::kFloat && z->numel() == 1,
                    "sample_top: z must be one fp32 on vals' device");
    const c10::cuda::CUDAGuard guard(vals.device());
    auto out = torch::empty({3}, ids.options());
    CHECK_CUDA_OK(trellis::sample_top(vals.data_ptr<float>(), ids.data_ptr<int64_t>(), (int)look,
                                      top.data_ptr<float>(), z.has_value() ? z->data_ptr<float>() : nullptr,
                                      (float)top_p, min_p > 0, min_p > 0 ? (float)std::log(min_p) : 0.f,
                                      u.data_ptr<double>(), out.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()));
    return out;
}

// The k (1..64) largest of a contiguous fp32 CUDA vector, largest first, ties to the lower index
// (trellis::topk_small) -> (values fp32 [k], indices int64 [k]).
std::vector<torch::Tensor> topk_small(torch::Tensor x, int64_t k) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 1 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
                "topk_small: x must be a contiguous fp32 CUDA vector");
    const int64_t n = x.numel();
    TORCH_CHECK(trellis::topk_small_serves(n, (int)k), "topk_small: needs 1 <= k <= 64, k <= n and ceil(n / 2,048) * k <= 8,192");
    const c10::cuda::CUDAGuard guard(x.device());
    auto scratch = torch::empty({(int64_t)trellis::topk_small_scratch_words((int)n, (int)k)}, x.options().dtype(torch::kLong));
    auto vals = torch::empty({k}, x.options());
    auto ids = torch::empty({k}, x.options().dtype(torch::kLong));
    CHECK_CUDA_OK(trellis::topk_small(x.data_ptr<float>(), (int)n, (int)k, scratch.data_ptr(), vals.data_ptr<float>(),
                                      ids.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()));
    return {vals, ids};
}

torch::Tensor gated_act(torch::Tensor gate, torch::Tensor up, int64_t act) {
    TORCH_CHECK(gate.is_cuda() && gate.scalar_type() == torch::kHalf && up.scalar_type() == torch::kHalf,
                "gated_act: fp16 CUDA tensors");
    TORCH_CHECK(gate.sizes() == up.sizes(), "gated_act: gate and up differ in shape");
    const c10::cuda::CUDAGuard guard(gate.device());
    const int64_t n = gate.size(-1);
    auto g2 = gate.reshape({-1, n});
    auto u2 = up.reshape({-1, n});
    TORCH_CHECK(g2.stride(1) == 1 && u2.stride(1) == 1, "gated_act: last dim must be contiguous");
    auto y = torch::empty(gate.sizes(), gate.options());
    if (g2.size(0) > 0 && n > 0) {
        CHECK_CUDA_OK(trellis::gated_act(hptr(g2), hptr(u2), hptr_mut(y), (int)g2.size(0), (int)n,
                                         (int)g2.stride(0), (int)u2.stride(0), (int)act,
                                         at::cuda::getCurrentCUDAStream()));
    }
    return y;
}


// Gemma 2's prefill probabilities in place (trellis::capped_softmax): scores [..., t, S] fp16,
// contiguous, holding scale / softcap times q.k, the chunk's queries q0 .. q0 + t - 1; mask bool
// [T or 1, S] (True = may attend; rows of the whole prefill's T queries) or none.
void capped_softmax_(torch::Tensor scores, double softcap, c10::optional<torch::Tensor> mask, int64_t q0) {
    TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == torch::kHalf && scores.is_contiguous() && scores.dim() >= 2,
                "capped_softmax_: scores must be a contiguous fp16 CUDA tensor [..., t, S]");
    const c10::cuda::CUDAGuard guard(scores.device());  // the row limit is the scores' device's
    const int64_t S = scores.size(-1), t = scores.size(-2);
    TORCH_CHECK(S >= 1 && t >= 1 && S <= trellis::capped_softmax_max_len(),
                "capped_softmax_: rows of 1 to ", trellis::capped_softmax_max_len(), " scores");
    TORCH_CHECK(softcap > 0.0 && std::isfinite(softcap), "capped_softmax_: softcap must be finite and > 0");
    const uint8_t* m = nullptr;
    long ld = 0;
    if (mask.has_value()) {
        TORCH_CHECK(mask->is_cuda() && mask->scalar_type() == torch::kBool && mask->dim() == 2 && mask->size(1) == S &&
                        mask->stride(1) == 1 && (mask->size(0) == 1 || q0 + t <= mask->size(0)) && q0 >= 0,
                    "capped_softmax_: mask must be bool [T or 1, S] with a row for every query, last dim contiguous");
        m = reinterpret_cast<const uint8_t*>(mask->data_ptr());
        ld = mask->size(0) == 1 ? 0 : (long)mask->stride(0);
    }
    CHECK_CUDA_OK(trellis::capped_softmax(hptr_mut(scores), (long)(scores.numel() / S), (int)S, (float)softcap, m, ld,
                                          (int)t, (int)q0, at::cuda::getCurrentCUDAStream()));
}

// Whether decode_attention over this cache span k, v [B, Hkv, S, D] can write a chain output
// (its `next`) for one sequence: head dim 128, or 256 where the tensor-core walk takes it.
bool decode_attention_chain_serves(torch::Tensor k, torch::Tensor v) {
    if (k.dim() != 4 || !k.is_cuda() || k.sizes() != v.sizes() || k.strides() != v.strides()) return false;
    const c10::cuda::CUDAGuard guard(k.device());
    trellis::DecodeAttnArgs a;
    a.k = hptr(k), a.v = hptr(v), a.S = (int)k.size(2), a.D = (int)k.size(3);
    a.kv_b = (long)k.stride(0), a.kv_h = (long)k.stride(1), a.kv_t = (long)k.stride(2);
    return trellis::decode_attention_chains(a);
}

// One-token decode attention: q [B, H, 1, D], k, v [B, Hkv, S, D] (last dim contiguous, the same
// strides), mask additive fp16 [1 or B, S] or none; softcap: Gemma 2's score cap (0: none);
// counters (int32, zero, left zero) are the caller's persistent scratch. Returns out [B, H, 1, D].
// next (decode chain into o_proj, B = 1, D = 128, or 256 on the tensor-core walk): [xb, scales,
// csum, suh] of o_proj's input (check_prepared's shapes with in = H * D), written from the output
// as o_proj's prep would. window (> 0, with rope): the layer's sliding window, whose slots are
// all the kernel walks (DecodeAttnArgs::window); 0: the whole span.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               c10::optional<torch::Tensor> mask, double scale, double softcap, torch::Tensor counters,
                               std::vector<torch::Tensor> next, std::vector<torch::Tensor> rope,
                               double head_norm_eps, int64_t window) {
    for (const auto* t : {&q, &k, &v})
        TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kHalf && t->dim() == 4 && t->stride(3) == 1,
                    "decode_attention: q, k, v must be 4-d fp16 CUDA tensors, last dim contiguous");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
    TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per sequence");
    TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.size(0) == B && k.size(3) == D,
                "decode_attention: k, v must be [B, Hkv, S, D] with the same strides");
    TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && S > 0, "decode_attention: query heads must be a multiple of kv heads");
    TORCH_CHECK(D == 64 || D == 128 || D == 256, "decode_attention: head dim must be 64, 128 or 256");
    const int64_t dl = D / 32;  // halves per lane: vector loads need that alignment
    auto aligned = [&](const torch::Tensor& t) {
        return reinterpret_cast<uintptr_t>(t.data_ptr()) % (dl * 2) == 0 && t.stride(0) % dl == 0 &&
               t.stride(1) % dl == 0 && (t.size(2) == 1 || t.stride(2) % dl == 0);
    };
    TORCH_CHECK(aligned(q) && aligned(k) && aligned(v), "decode_attention: rows must be aligned to D/32 halves");
    trellis::DecodeAttnArgs a;
    if (mask.has_value()) {
        TORCH_CHECK(mask->is_cuda() && mask->scalar_type() == torch::kHalf && mask->dim() == 2 &&
                        (mask->size(0) == 1 || mask->size(0) == B) && mask->size(1) == S && mask->stride(1) == 1,
                    "decode_attention: mask must be additive fp16 [1 or B, S], last dim contiguous");
        a.mask = hptr(*mask);
        a.mask_b = mask->size(0) == 1 ? 0 : (long)mask->stride(0);
    }
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty({B, H, 1, D}, q.options());
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    a.B = (int)B, a.Hkv = (int)Hkv, a.G = (int)(H / Hkv), a.S = (int)S, a.D = (int)D;
    a.q = hptr(q), a.q_b = (long)q.stride(0), a.q_h = (long)q.stride(1);
    a.k = hptr(k), a.v = hptr(v);
    a.kv_b = (long)k.stride(0), a.kv_h = (long)k.stride(1), a.kv_t = (long)k.stride(2);
    TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0 (0: none)");
    // A sliding window's span (with the fused RoPE, whose pos the kernel finds the window by).
    a.window = rope.empty() || window >= S ? 0 : (int)window;
    const int slots = a.window > 0 ? a.window : a.S;
    a.n_split = trellis::decode_attention_splits(a.B, a.Hkv, a.G, slots, sms, trellis::decode_attention_mma_keys(a));
    TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == torch::kInt &&
                    counters.numel() >= trellis::decode_attention_counters(a.B, a.Hkv, a.G),
                "decode_attention: too few counters");
    // The splits' partial results: written before they are read, so no zeroing.
    torch::Tensor ws;
    const size_t ws_floats = trellis::decode_attention_ws_floats(a.B, a.Hkv, a.G, a.D, a.n_split);
    if (ws_floats > 0) ws = torch::empty({(int64_t)ws_floats}, q.options().dtype(torch::kFloat));
    a.out = hptr_mut(out), a.o_b = (long)(H * D), a.o_h = (long)D;
    a.ws = ws_floats > 0 ? ws.data_ptr<float>() : nullptr, a.counters = counters.data_ptr<int32_t>();
    a.scale = (float)scale;
    TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "decode_attention: softcap must be finite and >= 0 (0: none)");
    a.softcap = (float)softcap;
    a.early_trigger = trellis::early_trigger_setting() == 1;
    a.merge_online = trellis::attn_merge_online_setting();
    if (!next.empty()) {
        TORCH_CHECK(next.size() == 4 && B == 1 && trellis::decode_attention_chains(a),
                    "decode_attention: a chain output is [xb, scales, csum, suh] for one sequence of head dim 128, or 256 "
                    "on the tensor-core walk (decode_attention_chain_serves)");
        check_prepared(next[0], next[1], next[2], 1, H * D, 1);
        check_half_vec(next[3], H * D, "decode_attention: o_proj suh");
        a.next_xb = reinterpret_cast<uint32_t*>(next[0].data_ptr());
        a.next_scales = reinterpret_cast<float2*>(next[1].data_ptr());
        a.next_csum = next[2].data_ptr<float>();
        a.next_suh = hptr(next[3]);
    }
    if (!rope.empty()) {
        // [new_k, new_v, cos, sin, pos (, q_norm, k_norm)]: q is unrotated; the kernel rotates it
        // and new_k (each head normed first, with the norm weights), and writes the token's k and
        // v into k, v (the cache's span) at slot *pos.
        TORCH_CHECK(rope.size() == 5 || rope.size() == 7,
                    "decode_attention: rope is [new_k, new_v, cos, sin, pos] or that and [q_norm, k_norm]");
        const auto &nk = rope[0], &nv = rope[1], &pos = rope[4];
        for (const auto* t : {&nk, &nv})
            TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kHalf && t->dim() == 4 && t->size(0) == B &&
                            t->size(1) == 1 && t->size(2) == Hkv && t->size(3) == D && t->stride(3) == 1 &&
                            reinterpret_cast<uintptr_t>(t->data_ptr()) % (dl * 2) == 0 && t->stride(0) % dl == 0 &&
                            t->stride(2) % dl == 0,
                        "decode_attention: new_k, new_v must be fp16 [B, 1, Hkv, D], rows aligned to D/32 halves");
        TORCH_CHECK(nk.strides() == nv.strides(), "decode_attention: new_k, new_v must have the same strides");
        check_half_vec(rope[2], D, "decode_attention: cos");
        check_half_vec(rope[3], D, "decode_attention: sin");
        TORCH_CHECK(pos.is_cuda() && pos.scalar_type() == torch::kLong && pos.numel() == 1,
                    "decode_attention: pos must be an int64 CUDA tensor of one element");
        a.new_k = hptr(nk), a.new_v = hptr(nv);
        a.nk_b = (long)nk.stride(0), a.nk_h = (long)nk.stride(2);
        a.cos = hptr(rope[2]), a.sin = hptr(rope[3]);
        a.pos = pos.data_ptr<int64_t>();
        if (rope.size() == 7) {
            TORCH_CHECK((D == 128 || D == 256) && softcap == 0.0,
                        "decode_attention: q/k norms take head dims 128 and 256, without a soft cap");
            check_half_vec(rope[5], D, "decode_attention: q_norm");
            check_half_vec(rope[6], D, "decode_attention: k_norm");
            TORCH_CHECK(head_norm_eps >= 0.0 && std::isfinite(head_norm_eps), "decode_attention: norm eps must be finite and >= 0");
            a.q_norm = hptr(rope[5]), a.k_norm = hptr(rope[6]);
            a.head_norm_eps = (float)head_norm_eps;
        }
    }
    CHECK_CUDA_OK(trellis::decode_attention(a, at::cuda::getCurrentCUDAStream()));
    return out;
}

// Trellis states int32 [n, 256] for targets fp32 [n, 256] (stream order, already fp16-rounded by
// the caller): the tail-biting Viterbi of engine/quantize/viterbi.py. lut: the codebook's 65536
// fp16 values (engine.formats.exl3.codebook_lut).
torch::Tensor viterbi_encode(torch::Tensor targets, int64_t K, torch::Tensor lut, int64_t warmup,
                             int64_t lookahead) {
    TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kFloat && targets.dim() == 2 &&
                    targets.size(1) == 256 && targets.is_contiguous(),
                "viterbi_encode: targets must be a contiguous fp32 CUDA tensor [n, 256]");
    TORCH_CHECK(lut.is_cuda() && lut.scalar_type() == torch::kHalf && lut.is_contiguous() &&
                    lut.numel() == 65536 && lut.device() == targets.device(),
                "viterbi_encode: lut must be 65536 contiguous fp16 values on the targets' device");
    TORCH_CHECK(K >= 1 && K <= 8, "viterbi_encode: K must be 1..8");
    TORCH_CHECK(warmup >= 1 && warmup <= 256 && lookahead >= 0 && lookahead <= 256,
                "viterbi_encode: warmup must be 1..256 and lookahead 0..256");
    const c10::cuda::CUDAGuard guard(targets.device());
    const int64_t n = targets.size(0);
    TORCH_CHECK(n <= INT32_MAX, "viterbi_encode: too many tiles");
    auto states = torch::empty({n, 256}, targets.options().dtype(torch::kInt));
    if (n == 0) return states;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int blocks = (int)std::min<int64_t>(n, sms);  // one 512-thread block fills an SM
    auto scratch = torch::empty({(int64_t)trellis::viterbi_scratch_bytes((int)K, (int)lookahead, blocks)},
                                targets.options().dtype(torch::kByte));
    CHECK_CUDA_OK(trellis::viterbi_encode(targets.data_ptr<float>(), (int)n, (int)K, hptr(lut),
                                          (int)warmup, (int)lookahead, states.data_ptr<int32_t>(),
                                          scratch.data_ptr(), blocks, at::cuda::getCurrentCUDAStream()));
    return states;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("exl3_gemm", &exl3_gemm, "fused EXL3 product for small batches", py::arg("x"), py::arg("suh"), py::arg("svh"),
          py::arg("trellis"), py::arg("bias"), py::arg("codebook"), py::arg("workspace"), py::arg("ksplit"),
          py::arg("int8_mode"), py::arg("version"), py::arg("counters"), py::arg("seg_cols"), py::arg("up"),
          py::arg("act"), py::arg("norm_w"), py::arg("eps"), py::arg("residual"), py::arg("residual_out"),
          py::arg("prepared"), py::arg("chain"), py::arg("chain_mode"), py::arg("chain_act"), py::arg("open_post"),
          py::arg("zero_after"), py::arg("open_out"), py::arg("pre_norm_w") = py::none(), py::arg("pre_eps") = 0.0);
    m.def("capped_softmax_", &capped_softmax_, "Gemma 2's prefill attention probabilities in place, in one pass");
    m.def("capped_softmax_max_len", &trellis::capped_softmax_max_len, "the longest score row capped_softmax_ takes");
    m.def("decode_attention_chain_serves", &decode_attention_chain_serves,
          "whether decode attention over this cache span can write o_proj's input (head dim 128, or 256 on the tensor-core walk)");
    m.def("chain_fits", &chain_fits, "whether a product of this shape and rows (1..4) can write a decode chain output",
          py::arg("in_features"), py::arg("out_features"), py::arg("K"), py::arg("rows") = 1);
    m.def("set_mm_debug_variant", &trellis::set_mm_debug_variant, "timing probe (0 = normal)");
    m.def("set_pdl", &trellis::set_pdl, "programmatic dependent launch of the product (default on)");
    m.def("set_gemv_min_units", &trellis::set_gemv_min_units, "fewest units per warp of the product (default 8)");
    m.def("set_gemv_grid_fill", &trellis::set_gemv_grid_fill,
          "every resident block for a product grid the min-units cap leaves short: 0 never, 1 (default) where it "
          "has more blocks than SMs, 2 always");
    m.def("set_gemv_block_cap", &trellis::set_gemv_block_cap,
          "products pad their shared memory so an SM holds no more blocks than their grid is sized for (default 1: yes)");
    m.def("set_gemv_four_row_units", &trellis::set_gemv_four_row_units,
          "k-row quads per resident warp from which a product takes four k rows per unit (0: never)");
    m.def("set_gemv_two_row_units", &trellis::set_gemv_two_row_units,
          "k-row pairs per resident warp from which a product takes two k rows per unit (default 6)");
    m.def("set_early_trigger", &trellis::set_early_trigger, "when the kernel after a product or decode attention may launch: 0 at their end, 1 at their start, 2 (products, the default) at their tail");
    m.def("set_attn_one_load_splits", &trellis::set_attn_one_load_splits,
          "decode attention takes one load of 16 keys per warp while that needs at most this many splits (default 10; 0: never)");
    m.def("set_attn_mma_slots", &trellis::set_attn_mma_slots,
          "decode attention (D = 64 or 128) walks its keys on the tensor cores from spans of this many slots (default 1: all; 0: never)");
    m.def("set_attn_mma_d256", &trellis::set_attn_mma_d256,
          "decode attention at head dim 256 walks its keys on the tensor cores too (default on)");
    m.def("set_attn_mma_stages", &trellis::set_attn_mma_stages,
          "the tensor-core walk's ring stages per warp: 0 (default) the most that fit, up to 3; 2 or 3 where they fit");
    m.def("set_attn_mma_one_split", &trellis::set_attn_mma_one_split,
          "the tensor-core walk takes one split for spans of at most this many slots (default 256; 0: never)");
    m.def("set_attn_merge_online", &trellis::set_attn_merge_online,
          "decode attention merges its splits in one pass with a running max (default) or max first, then sums");
    m.def("set_self_prep", &trellis::set_self_prep, "decode products (m = 1, integer path) prep their own input (default off)");
    m.def("set_gemv_shared_acts", &trellis::set_gemv_shared_acts,
          "fp16-path products with block-shared activations: 0 none, 1 17..32 rows of large layers, 2 all, 3 as 1 and 9..16 rows of the largest layers (at least 4096 x 28672 weights; default)");
    m.def("set_gemv_split_finish", &trellis::set_gemv_split_finish,
          "products whose output transform runs as a kernel of its own after them: 0 none, 1 the block-shared kernel's, 2 also the per-warp kernel's at 9..32 rows, 3 also its fp16-path products of 1..8 rows, 4 also the integer path's, 5 also decode chains' products (the kernel writes the chain output; default)");
    m.def("split_finish_setting", &trellis::gemv_split_finish_setting, "the split-finish setting in force (set_gemv_split_finish)");
    m.def("set_finish_early_reads", &trellis::set_finish_early_reads,
          "the decode chains' finish kernel reads the input's row sums and the residual before its PDL wait (default) or after it");
    m.def("set_gemv_sa_grid", &trellis::set_gemv_sa_grid,
          "the block-shared product's grid: 1 fewest k slices, never more blocks than fit at once (default); 0 the rule before session 28");
    m.def("set_gemv_sa_tiles", &trellis::set_gemv_sa_tiles,
          "the block-shared product: 1 two tiles per unit at 25..32 rows of layers under 4096 x 18432 weights, K <= 4 (default); 0 four tiles everywhere; 2 two tiles everywhere (benchmarks)");
    m.def("set_sa_stamp_buffer", &trellis::set_sa_stamp_buffer,
          "debug variants 72 / 73 / 76 / 79: a device buffer (address, teams) of 8 int64 a team for the block-shared product's stamps; 0 slots: none");
    m.def("set_gemv_wgmma", &trellis::set_gemv_wgmma,
          "block-shared products of 17..32 rows at K <= 4 on Hopper's warpgroup MMA where the device has it: 1 (default) yes, 0 no");
    m.def("debug_variant_built", &trellis::debug_variant_in_build,
          "whether this build has this debug variant of the products (all with TRELLIS_DEBUG_VARIANTS=1)");
    m.def("set_gemv_compact", &trellis::set_gemv_compact,
          "products on a ring that fits two blocks in 100 KB per SM: 3 where two shipped blocks do not fit on an SM (default), 0 where the shipped block cannot launch, 1 always, 2 never");
    m.def("set_gemv_lean_units", &trellis::set_gemv_lean_units,
          "products that would take one k row per unit with fewer units than this per resident warp take the compact ring (default 16; 0: never)");
    m.def("set_gemv_lean_groups", &trellis::set_gemv_lean_groups,
          "the most groups of rows (8 fp16 rows, 4 integer rows each) a product may have for the lean rule (default 1)");
    m.def("gemv_plan",
          [](int64_t K, bool int8, int64_t rows, bool self_prep, bool chain, int64_t in, int64_t out, int64_t num_sms,
             int64_t per_block, int64_t per_sm, int64_t reserved) {
              int cfg = 0, smem = 0;
              const int blocks = trellis::gemv_plan((int)K, int8, (int)rows, self_prep, chain, (int)in, (int)out, (int)num_sms,
                                                 (int)per_block, (int)per_sm, (int)reserved, cfg, smem);
              return std::make_tuple(cfg, smem, blocks);
          },
          "(CFG, shared memory bytes, blocks per SM) of a version-3 product on this GPU (per_block 0) or one with these limits",
          py::arg("K"), py::arg("int8"), py::arg("rows"), py::arg("self_prep"), py::arg("chain"), py::arg("in_features"),
          py::arg("out_features"), py::arg("num_sms"), py::arg("per_block") = 0, py::arg("per_sm") = 0,
          py::arg("reserved") = 0);
    m.def("gemv_sa_plan",
          [](int64_t K, int64_t rows, int64_t in, int64_t out, int64_t num_sms) {
              int slices = 0, slice_rows = 0;
              const int blocks = trellis::gemv_sa_plan((int)K, (int)rows, (int)in, (int)out, (int)num_sms, slices, slice_rows);
              return std::make_tuple(blocks, slices, slice_rows);
          },
          "(blocks, k slices, rows of the largest slice) of the block-shared product's grid on this GPU",
          py::arg("K"), py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("num_sms"));
    m.def("set_gemv_finish_rows", &trellis::set_gemv_finish_rows,
          "workspace rows a finishing warp reads per round trip: 8 (default) or 1 (row by row, a baseline)");
    m.def("set_prep_skip", &trellis::set_prep_skip, "timing probe: the activation prep launches nothing (wrong results)");
    m.def("exl3_reconstruct", &exl3_reconstruct, "dense inner weight What");
    m.def("had128", &had128, "blockwise 128-point Hadamard with scales");
    m.def("set_had_tiles", &trellis::set_had_tiles, "fp16 Hadamards in 64-row tiles (default) or a warp per block");
    m.def("set_had_pipeline", &trellis::set_had_pipeline, "the plain and gated tile Hadamards looping with the next loads in flight (default) or one tile per block");
    m.def("gated_had128", &gated_had128, "had128(act(gate) * up, pre): a gated MLP's down projection input at prefill",
          py::arg("gate"), py::arg("up"), py::arg("act"), py::arg("pre"), py::arg("svh_gate") = py::none(),
          py::arg("svh_up") = py::none(), py::arg("bias_gate") = py::none(), py::arg("bias_up") = py::none());
    m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add");
    m.def("norm_had128", &norm_had128, "a grouped product's member inputs at prefill: had128 of RMSNorm under each pre-scale");
    m.def("gated_act", &gated_act, "act(gate) * up");
    m.def("sample_top", &sample_top, "the sampler's draw among the top tokens (one block)");
    m.def("topk_small", &topk_small, "the k (<= 64) largest of an fp32 vector, largest first, ties to the lower index");
    m.def("topk_small_serves", &trellis::topk_small_serves, "whether topk_small takes k of n values");
    m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (NaN largest)");
    m.def("rope_qk", &rope_qk, "rotate-half RoPE on q and k in place");
    m.def("decode_attention", &decode_attention, "one-token decode attention over a KV cache");
    m.def("viterbi_encode", &viterbi_encode, "tail-biting Viterbi trellis encoder (quantizer)");
}
