// How fast a grid of per-warp cp.async rings, shaped like the one-row product's (exl3_gemv.cuh,
// CFG 10: 2 blocks of 8 warps per SM, a unit of 32 tiles = 4 KB, two ring stages), reads the
// 117 MB trellis of 8192x28672 at K = 4 in different address orders, with and without a
// stand-in for the decode's work between a stage's arrival and the next fetch.
//
// Why: on an H100 the one-row product streams ~2.5 TB/s whether it decodes or not (timing probes,
// csrc/PERF_NOTES.md sessions 34-35), while dense fp16 of the same shape streams ~3.05 TB/s. This
// separates the read order and the ring from everything else: if an order reaches the fp16 rate
// here, the trellis can be stored in that order when a model loads.
//
// Standalone (no torch; the products' own cp.async helpers from csrc/exl3_mm.cuh):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc bench/stream_probe.cu -o /tmp/stream_probe
//   /tmp/stream_probe [reps [delay ...]]
// One JSON line per case: order, stages, delay (dependent IMADs a lane per unit), us per read of
// the whole trellis, GB/s; a plain LDG read and a device copy before them, the LDG read again after.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3_mm.cuh"  // gv_cp16, cp_async_commit, cp_async_wait, kGvWarps: the product's ring

namespace {

using trellis::cp_async_commit;
using trellis::cp_async_wait;
using trellis::gv_cp16;
constexpr int kWarps = trellis::kGvWarps;  // warps per block
constexpr int kUnitBytes = 4096;   // 32 tiles of 128 bytes (K = 4)
constexpr int kIn = 8192, kOut = 28672;
constexpr int kTk = kIn / 16, kTn = kOut / 16;           // 512 k rows of 1,792 tiles
constexpr long kRowBytes = (long)kTn * 128;               // 229,376 bytes from one k row to the next
constexpr long kTotal = (long)kTk * kRowBytes;            // 117,440,512
constexpr long kUnits = kTotal / kUnitBytes;              // 28,672

// Read orders: where unit u's four 1 KB pieces are (piece p = 0..3), and which units a warp takes.
enum Order : int {
    kShipped = 0,     // (column group of 8 tiles, 4 k rows) units, group-major, contiguous ranges a warp
    kRowOf32 = 1,     // one k row of 32 tiles (4 KB contiguous) a unit, group-major ranges
    kWarpStream = 2,  // each warp's range one contiguous stream (the product's timing probe 3)
    kStepMajor = 3,   // unit-contiguous, stored so that step t of every warp is one contiguous span
    kRowMajor = 4,    // the shipped units, but ranges taken k-row-unit-major (a warp crosses groups)
};

__device__ __forceinline__ long piece_addr(int order, long u, int p) {
    switch (order) {
        case kShipped: {
            const long rows_kr = kTk / 4, grp = u / rows_kr, ur = u - grp * rows_kr;
            return (ur * 4 + p) * kRowBytes + grp * 1024;
        }
        case kRowOf32: {
            const long grp = u / kTk, row = u - grp * kTk;
            return row * kRowBytes + grp * 4096 + p * 1024;
        }
        case kRowMajor: {
            const long groups = kTn / 8, ur = u / groups, grp = u - ur * groups;
            return (ur * 4 + p) * kRowBytes + grp * 1024;
        }
        default:  // kWarpStream, kStepMajor: unit-contiguous
            return u * kUnitBytes + p * 1024;
    }
}

template <int NS>
__global__ void __launch_bounds__(kWarps * 32, 2) ring_read(const uint8_t* __restrict__ src, int order, int delay,
                                                             uint32_t* __restrict__ sink) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long nwarps = (long)gridDim.x * kWarps, gw = (long)blockIdx.x * kWarps + warp;
    // Units this warp takes, in its order: contiguous ranges, or every nwarps-th (step-major).
    const bool strided = order == kStepMajor;
    const long u0 = strided ? gw : kUnits * gw / nwarps;
    const long u1 = strided ? kUnits : kUnits * (gw + 1) / nwarps;
    const long du = strided ? nwarps : 1;
    const int n = (int)((u1 - u0 + du - 1) / du);
    uint8_t* ring = smem + warp * NS * kUnitBytes;
    const uint32_t ring_sa = (uint32_t)__cvta_generic_to_shared(ring);
    auto issue = [&](int s) {
        if (s < n) {
            const long u = u0 + s * du;
            const uint32_t dst = ring_sa + (s % NS) * kUnitBytes + lane * 16;
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const uint8_t* base = src + piece_addr(order, u, p) + lane * 16;
                gv_cp16(dst + p * 1024, base);
                gv_cp16(dst + p * 1024 + 512, base + 512);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) issue(s);
    uint32_t acc = lane;
    for (int s = 0; s < n; ++s) {
        cp_async_wait<NS - 2>();
        __syncwarp();
        issue(s + NS - 1);
        const uint4* st = reinterpret_cast<const uint4*>(ring + (s % NS) * kUnitBytes);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const uint4 v = st[c * 32 + lane];
            acc ^= v.x + v.y + v.z + v.w;
        }
        for (int i = 0; i < delay; ++i) acc = acc * 0x83DCD12Du + (uint32_t)i;
        __syncwarp();
    }
    if (acc == 0x12345678u) sink[gw] = acc;  // keeps the reads; never true in practice
}

// The plain read: every thread streams 16-byte loads, four in flight, grid-stride.
__global__ void __launch_bounds__(256) ldg_read(const uint4* __restrict__ src, long n, uint32_t* __restrict__ sink) {
    uint32_t acc = 0;
    const long stride = (long)gridDim.x * blockDim.x;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __ldcs(src + i + j * stride);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= v[j].x + v[j].y + v[j].z + v[j].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x + v.y + v.z + v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        fprintf(stderr, "stream_probe: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

template <typename F>
float time_us(F&& launch, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) launch();
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) launch();
    cudaEventRecord(b);
    check(cudaEventSynchronize(b), "timing");
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1000.f / reps;
}

template <int NS>
void run_ring(const uint8_t* src, uint32_t* sink, int sms, int order, int delay, int reps) {
    const int smem = kWarps * NS * kUnitBytes;
    check(cudaFuncSetAttribute(ring_read<NS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
    const float us = time_us([&] { ring_read<NS><<<sms * 2, kWarps * 32, smem>>>(src, order, delay, sink); }, reps);
    check(cudaGetLastError(), "ring_read");
    static const char* names[] = {"shipped", "row_of_32", "warp_stream", "step_major", "row_major"};
    printf("{\"case\": \"ring\", \"order\": \"%s\", \"stages\": %d, \"delay\": %d, \"us\": %.2f, \"GBps\": %.0f}\n",
           names[order], NS, delay, us, kTotal / (us * 1e3));
}

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 30;
    int dev = 0, sms = 0;
    check(cudaGetDevice(&dev), "device");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "sm count");
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, dev), "props");
    printf("{\"device\": \"%s\", \"sms\": %d, \"bytes\": %ld}\n", prop.name, sms, kTotal);
    uint8_t *src = nullptr, *dst = nullptr;
    uint32_t* sink = nullptr;
    check(cudaMalloc(&src, kTotal), "malloc");
    check(cudaMalloc(&dst, kTotal), "malloc");
    check(cudaMalloc(&sink, 1 << 20), "malloc");
    check(cudaMemset(src, 0x5a, kTotal), "memset");
    const float ldg = time_us([&] { ldg_read<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(src), kTotal / 16, sink); }, reps);
    printf("{\"case\": \"ldg\", \"us\": %.2f, \"GBps\": %.0f}\n", ldg, kTotal / (ldg * 1e3));
    const float cp = time_us([&] { cudaMemcpyAsync(dst, src, kTotal, cudaMemcpyDeviceToDevice); }, reps);
    printf("{\"case\": \"copy\", \"us\": %.2f, \"GBps_read\": %.0f}\n", cp, kTotal / (cp * 1e3));
    // The stand-in decode: `delay` dependent IMADs a lane per unit after the stage arrives (argv[2..];
    // 0, 100, 200 and 400 by default). At 800 a warp's unit took ~7 us on an H100, longer than the
    // product's ~3.5, so the read rate no longer bounded the time.
    std::vector<int> delays;
    for (int i = 2; i < argc; ++i) delays.push_back(atoi(argv[i]));
    if (delays.empty()) delays = {0, 100, 200, 400};
    for (int delay : delays) {
        for (int order = 0; order <= 4; ++order) {
            run_ring<2>(src, sink, sms, order, delay, reps);
            run_ring<3>(src, sink, sms, order, delay, reps);
        }
    }
    const float ldg2 = time_us([&] { ldg_read<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(src), kTotal / 16, sink); }, reps);
    printf("{\"case\": \"ldg\", \"us\": %.2f, \"GBps\": %.0f}\n", ldg2, kTotal / (ldg2 * 1e3));
    return 0;
}
