// Which execution pipe an SM runs VABSDIFF4 and HFMA2 on, measured by throughput alone and beside
// IMAD, IDP4A, LOP3 and PRMT.
//
// Why: MUL1's decode spends one IMAD (state x multiplier) and one IDP4A (the byte sum) a weight,
// and both run on the half-rate FMA-heavy pipe, which with the ALU pipe holds the block-shared
// product's issue (csrc/PERF_NOTES.md, session 50). `vabsdiff4.u32.u32.u32.add x, 0, c` is the
// same byte sum plus c in one instruction (VABSDIFF4.U8.ACC in SASS). If it runs on a pipe other
// than those two, some byte sums could move there and the decode would stop sharing one pipe. The
// same question for HFMA2, which could pack a MUL1 pair (two byte sums into one fp16 pair) in
// place of the PRMT on the ALU pipe.
//
// Method: one block of 32 warps (8 a scheduler) per SM, each thread advancing 16 independent
// dependency chains of one or two kinds of instruction (inline PTX, so nothing folds), timed by
// the SM clock. A pipe's rate shows as warp instructions an SM cycle (4 for a full-rate pipe, 2
// for a half-rate one). Two kinds on different pipes mixed 8 + 8 approach the sum of their rates
// (at most 4, one issue a scheduler a cycle); two kinds on one pipe stay at that pipe's rate.
// One JSON line per case.
// Session 51 (H100, warp instructions an SM cycle): IMAD, IDP4A, VABSDIFF4, LOP3, PRMT, SHF alone
// 1.98-2.00 each (half rate); IMAD + IDP4A 2.00 (one pipe), IMAD + LOP3 3.88 (two pipes);
// VABSDIFF4 beside LOP3 1.87 and PRMT 1.99 (the ALU pipe), beside IMAD 2.68 and IDP4A 2.73 (it
// takes some FMA-heavy time too). So VABSDIFF4 is an ALU op, not a free pipe. Also HFMA2: plain
// 3.60 alone (ptxas sends half of them to the MMA pipe as HFMA2.MMA); with an operand swizzle
// (.H0_H0, what a MUL1 pair pack would need) 1.99 alone, 2.01 beside IMAD, 2.00 beside IDP4A (the
// FMA-heavy pipe), 3.13 beside LOP3 or PRMT. So a pack by HFMA2 would move the PRMT's load from
// the ALU pipe onto the FMA-heavy pipe, the busier of the two in the block-shared product.
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/pipe_probe.cu -o /tmp/pipe_probe && /tmp/pipe_probe
#include <cuda_runtime.h>

#include <cstdio>

namespace {

enum Op { kImad, kIdp4a, kVabs4, kLop3, kPrmt, kShf, kHfma2, kHfma2Lo };
const char* op_name(int op) {
    switch (op) {
        case kImad: return "IMAD";
        case kIdp4a: return "IDP4A";
        case kVabs4: return "VABSDIFF4";
        case kLop3: return "LOP3";
        case kPrmt: return "PRMT";
        case kShf: return "SHF";
        case kHfma2: return "HFMA2";
        default: return "HFMA2_H0H0";
    }
}

template <int OP>
__device__ __forceinline__ void step(unsigned& x, unsigned y, unsigned z) {
    if constexpr (OP == kImad) {
        asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(y), "r"(z));
    } else if constexpr (OP == kIdp4a) {
        asm volatile("dp4a.u32.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(y), "r"(z));
    } else if constexpr (OP == kVabs4) {
        asm volatile("vabsdiff4.u32.u32.u32.add %0, %0, %1, %2;" : "+r"(x) : "r"(y), "r"(z));
    } else if constexpr (OP == kLop3) {
        asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(x) : "r"(y), "r"(z));
    } else if constexpr (OP == kPrmt) {
        asm volatile("prmt.b32 %0, %0, %1, 0x6521;" : "+r"(x) : "r"(y));
    } else if constexpr (OP == kShf) {
        asm volatile("shf.l.wrap.b32 %0, %0, %1, 5;" : "+r"(x) : "r"(y));
    } else if constexpr (OP == kHfma2) {
        asm volatile("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(x) : "r"(y), "r"(z));
    } else {
        // The pack a MUL1 fp16 pair could take: x.lo in both halves (an operand swizzle in SASS)
        // times (0, 1) plus z, so that lo = z.lo and hi = x.lo + z.hi.
        asm volatile("{.reg .b16 l, h; mov.b32 {l, h}, %0; mov.b32 %0, {l, l};"
                     " fma.rn.f16x2 %0, %0, %1, %2;}" : "+r"(x) : "r"(y), "r"(z));
    }
}

constexpr int kChains = 16;
constexpr int kUnroll = 8;

// The first `NA` chains take OP_A, the rest OP_B; the chains interleave in program order so the
// scheduler always has both kinds ready.
template <int OP_A, int OP_B, int NA>
__global__ void __launch_bounds__(1024, 1) probe(unsigned* out, long long* cycles, int iters,
                                                  unsigned y, unsigned z) {
    unsigned x[kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c) x[c] = threadIdx.x * 7919u + c;
    __syncthreads();
    long long t0 = clock64();
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int c = 0; c < kChains; ++c) {
                if ((c * NA) % kChains < NA)
                    step<OP_A>(x[c], y + c, z);
                else
                    step<OP_B>(x[c], y + c, z);
            }
        }
    }
    __syncthreads();
    long long t1 = clock64();
    unsigned acc = 0;
#pragma unroll
    for (int c = 0; c < kChains; ++c) acc ^= x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int OP_A, int OP_B, int NA>
void run(int sms, unsigned* out, long long* cycles, long long* host_cycles) {
    const int iters = 2048;
    probe<OP_A, OP_B, NA><<<sms, 1024>>>(out, cycles, iters / 8, 0x01010101u, 0x6400u);  // warm
    probe<OP_A, OP_B, NA><<<sms, 1024>>>(out, cycles, iters, 0x01010101u, 0x6400u);
    cudaMemcpy(host_cycles, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        std::printf("{\"error\": \"%s\"}\n", cudaGetErrorString(err));
        return;
    }
    long long worst = 0;
    double mean = 0;
    for (int b = 0; b < sms; ++b) {
        worst = host_cycles[b] > worst ? host_cycles[b] : worst;
        mean += host_cycles[b];
    }
    mean /= sms;
    const double warp_instr = 32.0 * iters * kUnroll * kChains;  // a block's, i.e. an SM's
    std::printf("{\"a\": \"%s\", \"b\": \"%s\", \"chains_a\": %d, \"chains_b\": %d, "
                "\"warp_instr_per_sm_cycle\": %.3f, \"worst_block\": %.3f}\n",
                op_name(OP_A), op_name(OP_B), NA, kChains - NA, warp_instr / mean,
                warp_instr / worst);
}

}  // namespace

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    std::printf("{\"device\": \"%s\", \"sms\": %d}\n", prop.name, sms);
    unsigned* out;
    long long* cycles;
    cudaMalloc(&out, sms * 1024 * sizeof(unsigned));
    cudaMalloc(&cycles, sms * sizeof(long long));
    long long host_cycles[1024];
    // Each kind alone.
    run<kImad, kImad, 16>(sms, out, cycles, host_cycles);
    run<kIdp4a, kIdp4a, 16>(sms, out, cycles, host_cycles);
    run<kVabs4, kVabs4, 16>(sms, out, cycles, host_cycles);
    run<kLop3, kLop3, 16>(sms, out, cycles, host_cycles);
    run<kPrmt, kPrmt, 16>(sms, out, cycles, host_cycles);
    run<kShf, kShf, 16>(sms, out, cycles, host_cycles);
    run<kHfma2, kHfma2, 16>(sms, out, cycles, host_cycles);
    run<kHfma2Lo, kHfma2Lo, 16>(sms, out, cycles, host_cycles);
    // Pairs, 8 + 8: known same pipe (IMAD + IDP4A), known different (IMAD + LOP3), then VABSDIFF4
    // beside each.
    run<kImad, kIdp4a, 8>(sms, out, cycles, host_cycles);
    run<kImad, kLop3, 8>(sms, out, cycles, host_cycles);
    run<kImad, kVabs4, 8>(sms, out, cycles, host_cycles);
    run<kIdp4a, kVabs4, 8>(sms, out, cycles, host_cycles);
    run<kLop3, kVabs4, 8>(sms, out, cycles, host_cycles);
    run<kPrmt, kVabs4, 8>(sms, out, cycles, host_cycles);
    // HFMA2 (a candidate for the pair pack that PRMT does today) beside each integer pipe.
    run<kImad, kHfma2, 8>(sms, out, cycles, host_cycles);
    run<kLop3, kHfma2, 8>(sms, out, cycles, host_cycles);
    run<kImad, kHfma2Lo, 8>(sms, out, cycles, host_cycles);
    run<kIdp4a, kHfma2Lo, 8>(sms, out, cycles, host_cycles);
    run<kLop3, kHfma2Lo, 8>(sms, out, cycles, host_cycles);
    run<kPrmt, kHfma2Lo, 8>(sms, out, cycles, host_cycles);
    // The decode's mix: IMAD and a byte sum, 8 + 8, with the byte sum by each instruction.
    run<kImad, kVabs4, 4>(sms, out, cycles, host_cycles);
    run<kImad, kVabs4, 12>(sms, out, cycles, host_cycles);
    cudaFree(out);
    cudaFree(cycles);
    return 0;
}
