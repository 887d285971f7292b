// Where the block scheduler puts a grid of 2 x SMs blocks when an SM could hold three: evenly
// (two on every SM) or packed (three on some, none on others).
//
// Why: the products' grids are sized for two blocks of 8 warps per SM (csrc/exl3_mm.cuh,
// gv_blocks). Kernels at 80 registers with shared memory under ~75 KB fit three. The two-group
// kernel without its output stage is such a kernel and ran 1.4x slower than with it (96
// registers, two blocks), about the 1.5x that packing 264 blocks three to an SM on 88 of 132 SMs
// would give (csrc/PERF_NOTES.md, session 41). This probe asks the scheduler directly, without
// the product: each block records its SM (%smid) and stays resident for a while, so the whole
// grid is placed before any block leaves.
//
// Cases (one JSON line each): shared memory per block that lets three blocks fit (64 KB, the
// two-group ring) or two (the padding of TRELLIS_GV_BLOCK_CAP=1, 76,928 bytes); launched alone,
// or as a programmatic dependent of a short kernel that holds a quarter of the SMs (as a product
// follows its prep kernel).
// Session 42 (H100): alone, two to an SM; as a dependent, three on 66 SMs, two on 33 and none on 33
// (as many as the short kernel's blocks). So products pad their shared memory to two blocks
// (gemv_block_cap).
//
// Second part ("small" lines, written in session 42): a small dependent grid (4, 6 and 14 blocks of
// 8 warps, the chain finish kernels' grids at batch 1 of Llama-3.1-8B, and 32) after a kernel that
// fills every SM and leaves them at staggered times, as a decode product does before its finish
// kernel; unpadded, and padded so that one block fits an SM ("one_per_sm").
// Session 43 (H100): unpadded they stack up to four deep (6 blocks on 2-3 SMs, 14 on 5, 32 on 8-9);
// padded, one to an SM. Padding the finish kernels so (TRELLIS_FINISH_SPREAD, since removed) left
// decode and the finish kernels' time unchanged.
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/occupancy_probe.cu -o /tmp/occupancy_probe
//   /tmp/occupancy_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

namespace {

__device__ __forceinline__ unsigned sm_id() {
    unsigned id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Stands in for a product: records its SM, then stays resident for `hold_ns`.
// Its dynamic shared memory only sizes the launch: the small cases ask for none, so it is not
// touched (session 43: writing its first word there was an illegal access).
__global__ void __launch_bounds__(256, 2) placed(unsigned* sm_of_block, unsigned long long hold_ns) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) sm_of_block[blockIdx.x] = sm_id();
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < hold_ns) {
    }
}

// Stands in for a prep kernel: lets its dependent launch at once, then holds its SMs.
__global__ void prep_like(unsigned long long hold_ns) {
    asm volatile("griddepcontrol.launch_dependents;");
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < hold_ns) {
    }
}

// Stands in for a decode product before its finish kernel: fills an SM's thread slots (two blocks
// of 1,024 threads), lets its dependent launch at once, and leaves at a time staggered by block.
__global__ void __launch_bounds__(1024, 2) full_like(unsigned long long hold_ns) {
    asm volatile("griddepcontrol.launch_dependents;");
    const unsigned long long t0 = now_ns(), hold = hold_ns + (blockIdx.x % 16) * 1500ull;
    while (now_ns() - t0 < hold) {
    }
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::printf("{\"error\": \"%s: %s\"}\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

// Launches `placed` (`grid` blocks of 256 threads, `smem` bytes each; a programmatic dependent of
// the kernel before it where `pdl`) and returns how many of its blocks each SM took.
std::map<unsigned, int> placement(int grid, size_t smem, bool pdl, unsigned long long hold_ns, unsigned* d_sm) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check(cudaLaunchKernelEx(&cfg, placed, d_sm, hold_ns), "launch");
    check(cudaDeviceSynchronize(), "run");
    std::vector<unsigned> sm_of_block(grid);
    check(cudaMemcpy(sm_of_block.data(), d_sm, grid * sizeof(unsigned), cudaMemcpyDeviceToHost), "copy");
    std::map<unsigned, int> per_sm;  // SM ids need not be 0..sms-1
    for (unsigned s : sm_of_block) per_sm[s]++;
    return per_sm;
}

void run_case(int sms, size_t smem, bool after_prep, unsigned* d_sm) {
    const int grid = 2 * sms;
    check(cudaFuncSetAttribute(placed, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), "smem attribute");
    int fit = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, placed, 256, smem), "occupancy");
    if (after_prep) prep_like<<<std::max(1, sms / 4), 256>>>(20000);
    const std::map<unsigned, int> per_sm = placement(grid, smem, after_prep, 50000ull, d_sm);
    int hist[5] = {sms - (int)per_sm.size(), 0, 0, 0, 0}, most = 0;
    for (const auto& kv : per_sm) {
        hist[std::min(kv.second, 4)]++;
        most = std::max(most, kv.second);
    }
    std::printf("{\"smem\": %zu, \"blocks_fit_per_sm\": %d, \"after_prep\": %s, \"grid\": %d, \"sms\": %d, "
                "\"sms_used\": %d, \"most_per_sm\": %d, \"sms_with_0_1_2_3_4plus\": [%d, %d, %d, %d, %d]}\n",
                smem, fit, after_prep ? "true" : "false", grid, sms, (int)per_sm.size(), most, hist[0], hist[1],
                hist[2], hist[3], hist[4]);
}

// A small dependent grid (`grid` blocks of 256 threads) after full_like; smem 0 or enough that one
// block fits an SM.
void run_small_case(int sms, int grid, size_t smem, unsigned* d_sm) {
    check(cudaFuncSetAttribute(placed, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), "smem attribute");
    full_like<<<2 * sms, 1024>>>(30000);
    const std::map<unsigned, int> per_sm = placement(grid, smem, true, 20000ull, d_sm);
    int most = 0;
    for (const auto& kv : per_sm) most = std::max(most, kv.second);
    std::printf("{\"small\": true, \"grid\": %d, \"one_per_sm\": %s, \"smem\": %zu, \"sms_used\": %d, "
                "\"most_per_sm\": %d}\n",
                grid, smem ? "true" : "false", smem, (int)per_sm.size(), most);
}

}  // namespace

int main() {
    int dev = 0, sms = 0;
    check(cudaGetDevice(&dev), "device");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
    unsigned* d_sm = nullptr;
    check(cudaMalloc(&d_sm, 4 * sms * sizeof(unsigned)), "malloc");
    for (int rep = 0; rep < 2; ++rep)
        for (bool after_prep : {false, true})
            for (size_t smem : {size_t(64 * 1024), size_t(76928)}) run_case(sms, smem, after_prep, d_sm);
    int per_sm = 0, reserved = 0;
    check(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), "smem per SM");
    check(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev), "reserved smem");
    const size_t one_per_sm = ((size_t)per_sm / 2 - reserved + 1 + 127) / 128 * 128;
    for (int rep = 0; rep < 2; ++rep)
        for (int grid : {4, 6, 14, 32})
            for (size_t smem : {size_t(0), one_per_sm}) run_small_case(sms, grid, smem, d_sm);
    cudaFree(d_sm);
    return 0;
}
