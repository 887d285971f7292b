// Trellis tile decode shared by the EXL3 product and reconstruct kernels.
//
// One 16x16 tile is 256 trellis steps stored as 8*K little-endian uint32 words (format spec
// section 3). Lane t of a warp decodes steps 8t..8t+7, which by the fragment order of spec 3.4
// are exactly its registers of an mma.m16n8k16 operand. The lane's symbols are the K stream
// bytes starting at byte t*K; its 8 states also need the 2 bytes before (window L = 16, wrapping
// around the tile: tail-biting). Those K+2 bytes always fit in 3 consecutive words, so a lane
// reads 3 words, funnel-shifts them once so that its window starts at bit 95 of a 96-bit value,
// and from then on every state sits at a compile-time bit offset.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace trellis {

// Codebook ids as in the format (quantization_config codebook names 3inst/mcg/mul1).
enum Codebook : int { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

// Word index (within the tile) of the first of the 3 words lane t needs, and the shift that
// puts its window at the top.
template <int K>
__device__ __forceinline__ void lane_window(int lane, int& w0, int& shift) {
    const int tile_bytes = 32 * K;
    int b = lane * K - 2;
    if (b < 0) b += tile_bytes;
    w0 = b >> 2;
    shift = (b & 3) * 8;
}

template <int K>
__device__ __forceinline__ int wrap_word(int w) {
    return w >= 8 * K ? w - 8 * K : w;
}

// The lane's three words of every tile (wa, wb, wc: lane_window's first word and the two after
// it, wrapped) and the shift of its window: the per-lane constants of a kernel's tile decodes.
template <int K>
__device__ __forceinline__ void lane_words(int lane, int& wa, int& wb, int& wc, int& shift) {
    lane_window<K>(lane, wa, shift);
    wb = wrap_word<K>(wa + 1);
    wc = wrap_word<K>(wa + 2);
}

// 16-bit state whose window starts Q bits below the top of the 96-bit value (h0:h1:h2).
template <int Q>
__device__ __forceinline__ uint32_t state_at(uint32_t h0, uint32_t h1, uint32_t h2) {
    if constexpr (Q + 16 <= 32) {
        return (h0 >> (16 - Q)) & 0xffffu;
    } else if constexpr (Q < 32) {
        return __funnelshift_r(h1, h0, 48 - Q) & 0xffffu;
    } else if constexpr (Q + 16 <= 64) {
        return (h1 >> (48 - Q)) & 0xffffu;
    } else if constexpr (Q < 64) {
        return __funnelshift_r(h2, h1, 80 - Q) & 0xffffu;
    } else {
        return (h2 >> (80 - Q)) & 0xffffu;
    }
}

__device__ __forceinline__ uint32_t as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }

// MUL1 without its affine step: half2(1024 + t0, 1024 + t1), t the byte sums of s * 0x83DCD12D
// (0x6400 + t is the fp16 of 1024 + t, exactly). value = k_inv * (1024 + t) + k_bias; a product
// can apply that once per output (k_inv * sum(x h) + k_bias * sum(x)) instead of once per pair.
// mul1_raw_pair: the same from the two products x = s * 0x83DCD12D, where a kernel has them already
// (lane_products_k4 makes them with one mask fewer).
__device__ __forceinline__ uint32_t mul1_raw_pair(uint32_t x0, uint32_t x1) {
    const uint32_t t0 = __dp4a(x0, 0x01010101u, 0x6400u);
    const uint32_t t1 = __dp4a(x1, 0x01010101u, 0x6400u);
    return __byte_perm(t0, t1, 0x5410);
}
__device__ __forceinline__ uint32_t decode_pair_mul1_raw(uint32_t s0, uint32_t s1) {
    return mul1_raw_pair(s0 * 0x83DCD12Du, s1 * 0x83DCD12Du);
}

// Two states -> half2(value(s0), value(s1)); bit-exact with the reference codebooks (spec 2).
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
    if constexpr (CB == CB_MUL1) {
        const half2 k_inv = as_h2(0x1EEE1EEEu);
        const half2 k_bias = as_h2(0xC931C931u);
        return as_u32(__hfma2(as_h2(decode_pair_mul1_raw(s0, s1)), k_inv, k_bias));
    } else {
        uint32_t x0, x1;
        if constexpr (CB == CB_3INST) {
            x0 = s0 * 89226354u + 64248484u;
            x1 = s1 * 89226354u + 64248484u;
        } else {
            x0 = s0 * 0xCBAC1FEDu;
            x1 = s1 * 0xCBAC1FEDu;
        }
        x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        uint32_t lo = __byte_perm(x0, x1, 0x5410);
        uint32_t hi = __byte_perm(x0, x1, 0x7632);
        return as_u32(__hadd2(as_h2(lo), as_h2(hi)));
    }
}

// Decode lane's 8 steps from its 3 raw words. Output v[q] = half2 of steps (2q, 2q+1).
template <int K, int CB>
__device__ __forceinline__ void decode_lane(uint32_t w0, uint32_t w1, uint32_t w2, int shift,
                                            uint32_t v[4]) {
    uint32_t h0 = __funnelshift_l(w1, w0, shift);
    uint32_t h1 = __funnelshift_l(w2, w1, shift);
    uint32_t h2 = w2 << shift;
    // State of step j starts (j+1)*K bits below the window top.
    v[0] = decode_pair<CB>(state_at<1 * K>(h0, h1, h2), state_at<2 * K>(h0, h1, h2));
    v[1] = decode_pair<CB>(state_at<3 * K>(h0, h1, h2), state_at<4 * K>(h0, h1, h2));
    v[2] = decode_pair<CB>(state_at<5 * K>(h0, h1, h2), state_at<6 * K>(h0, h1, h2));
    v[3] = decode_pair<CB>(state_at<7 * K>(h0, h1, h2), state_at<8 * K>(h0, h1, h2));
}

}  // namespace trellis
