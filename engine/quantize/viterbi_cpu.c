/* CPU tail-biting Viterbi for EXL3 tiles (same algorithm as viterbi.py, fused into one loop
 * per step so the 65536 state costs stay in cache). Built on first use by viterbi_native.py with
 * the system C compiler; -ffp-contract=off keeps the arithmetic identical in the forward pass
 * and the traceback, so the chosen path is deterministic.
 *
 * Layout: state s = k*N + e, N = 2^(16-K); the predecessor edge of s is s >> K.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#define STEPS 256

/* One trellis step: cur[e] = min over k of prev[k*M + (e >> K)] + (lut[k*N + e] - wp)^2, with
 * M = N >> K. Looping over (k, m = e >> K, low bits of e) makes the predecessor cost a scalar
 * for each run of 2^K states, so the innermost loop is a plain vectorizable stream. A fixed
 * run length (NK) lets the compiler vectorize even for small K. */
#define DEFINE_STEP(NAME, NK_EXPR)                                                             \
    static void NAME(const float *prev, float *cur, const float *lut, float wp, int K) {       \
        const int nk = (NK_EXPR);                                                              \
        const int N = 1 << (16 - K);                                                           \
        const int M = N >> K;                                                                  \
        for (int k = 0; k < nk; k++) {                                                         \
            const float *l = lut + (size_t)k * N;                                              \
            const float *pk = prev + (size_t)k * M;                                            \
            for (int m = 0; m < M; m++) {                                                      \
                const float c = pk[m];                                                         \
                float *cu = cur + (size_t)m * nk;                                              \
                const float *ll = l + (size_t)m * nk;                                          \
                if (k == 0) {                                                                  \
                    for (int j = 0; j < nk; j++) { float d = ll[j] - wp; cu[j] = c + d * d; }  \
                } else {                                                                       \
                    for (int j = 0; j < nk; j++) {                                             \
                        float d = ll[j] - wp;                                                  \
                        float v = c + d * d;                                                   \
                        cu[j] = v < cu[j] ? v : cu[j];                                         \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_STEP(step_k1, 2)
DEFINE_STEP(step_k2, 4)
DEFINE_STEP(step_k3, 8)
DEFINE_STEP(step_any, 1 << K)

/* costs[p*N + e] = best cost of a path ending in edge e after step p. */
static void forward(const float *w, int T, int K, const float *lut, const float *start,
                    float *costs) {
    const int N = 1 << (16 - K);
    const float *prev = start;
    for (int p = 0; p < T; p++) {
        float *cur = costs + (size_t)p * N;
        switch (K) {
            case 1: step_k1(prev, cur, lut, w[p], K); break;
            case 2: step_k2(prev, cur, lut, w[p], K); break;
            case 3: step_k3(prev, cur, lut, w[p], K); break;
            default: step_any(prev, cur, lut, w[p], K); break;
        }
        prev = cur;
    }
}

static void traceback(const float *w, int T, int K, const float *lut, const float *start,
                      const float *costs, int end_edge, int32_t *states) {
    const int N = 1 << (16 - K);
    const int nk = 1 << K;
    int e = end_edge;
    for (int p = T - 1; p >= 0; p--) {
        const float *prev = p > 0 ? costs + (size_t)(p - 1) * N : start;
        const float wp = w[p];
        float best = INFINITY;
        int best_s = e; /* k = 0 */
        for (int k = 0; k < nk; k++) {
            int s = k * N + e;
            float d = lut[s] - wp;
            float v = prev[s >> K] + d * d;
            if (v < best) { best = v; best_s = s; }
        }
        states[p] = best_s;
        e = best_s >> K;
    }
}

static int argmin(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] < x[b]) b = i;
    return b;
}

/* Encode one tile: targets[256] (stream order) -> states[256]. */
static void encode_tile(const float *targets, int K, const float *lut, int warmup, int lookahead,
                        int32_t *states, float *costs, float *rep, float *start, float *wbuf,
                        int32_t *path) {
    const int N = 1 << (16 - K);
    const int lead = STEPS - warmup;  /* pass A starts here with a free start */
    const int TA = warmup + lookahead;
    /* pass A: free start at step 256-warmup, through 255, then `lookahead` steps past the wrap */
    for (int i = 0; i < warmup; i++) wbuf[i] = targets[lead + i];
    for (int i = 0; i < lookahead; i++) wbuf[warmup + i] = targets[i];
    for (int e = 0; e < N; e++) start[e] = 0.0f;
    forward(wbuf, TA, K, lut, start, costs);
    int end = argmin(costs + (size_t)(TA - 1) * N, N);
    traceback(wbuf, TA, K, lut, start, costs, end, path);
    int e_star = path[warmup - 1] & (N - 1); /* edge after step 255 = edge entering step 0 */
    /* pass B: closed cycle through e_star */
    for (int e = 0; e < N; e++) start[e] = INFINITY;
    start[e_star] = 0.0f;
    forward(targets, STEPS, K, lut, start, costs);
    traceback(targets, STEPS, K, lut, start, costs, e_star, states);
}

/* Returns 0 on success, -1 if memory ran out. */
int trellis_viterbi_encode(const float *targets, int64_t n_tiles, int K, const float *lut,
                           int warmup, int lookahead, int32_t *states, int n_threads) {
    const int N = 1 << (16 - K);
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float *costs = malloc(sizeof(float) * (size_t)STEPS * N);
        float *rep = malloc(sizeof(float) * 65536);
        float *start = malloc(sizeof(float) * N);
        float *wbuf = malloc(sizeof(float) * STEPS);
        int32_t *path = malloc(sizeof(int32_t) * STEPS);
        int ok = costs && rep && start && wbuf && path;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_tiles; t++) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            encode_tile(targets + t * STEPS, K, lut, warmup, lookahead, states + t * STEPS,
                        costs, rep, start, wbuf, path);
        }
        free(costs); free(rep); free(start); free(wbuf); free(path);
    }
    return failed ? -1 : 0;
}
