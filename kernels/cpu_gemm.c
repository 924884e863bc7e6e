/* fp32 GEMM for small row counts on x86 CPUs: C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * Built by kernels/cpu_gemm.py with -O3 -march=native -fopenmp. GCC vector extensions give one source for both
 * ISAs: with AVX-512 a `vec` is one zmm register (16 floats), with AVX2 one ymm (8 floats).
 *
 * W is packed once into panels of NR = 2 vectors of output columns: panel p holds columns [p*NR, p*NR + NR) as
 * [K][NR], zero-padded past N, so a panel streams as one contiguous run. A register tile is MR <= MAXR rows x NR
 * columns: 2 * MR accumulators (16 of 32 zmm registers with AVX-512, 12 of 16 ymm with AVX2), each k step loads two
 * vectors of W and broadcasts MR scalars of A. Every output element is one fp32 FMA chain over k in order, so a
 * row's result does not depend on the batch it came in (M) or its place in it.
 *
 * Decode-sized GEMMs (a few rows) read every weight byte once per step from DRAM; what limits them is how many
 * bytes are in flight, not FLOPs. The hardware prefetcher ramps up on a single stream too slowly for that, so the
 * k loop prefetches PREFETCH_BYTES ahead in the panel (one row block) or, when several row blocks share a panel
 * (their later passes hit cache), spreads the prefetch of the next panel over those passes. Prefetches go to L2
 * (prefetcht1), which tracks more misses in flight than L1: 32 KiB ahead into L2 took 8-15% off engine decode steps
 * at batch 4-8 against 8 KiB into L1 (3% at batch 32).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VB 64
#define MAXR 8
#else
#define VB 32
#define MAXR 6
#endif
#define VL (VB / 4)
#define NR (2 * VL)
#define PREFETCH_BYTES 32768
#define PREFETCH_LOCALITY 2 /* __builtin_prefetch: 2 = prefetcht1, into L2 */

typedef float vec __attribute__((vector_size(VB), aligned(4))); /* aligned(4): loads need no 64-byte alignment */

/* Bytes per vector when the build has fused multiply-add on 256- or 512-bit vectors; 0: not worth using. */
int tw_vector_bytes(void) {
#if defined(__FMA__) && (defined(__AVX2__) || defined(__AVX512F__))
    return VB;
#else
    return 0;
#endif
}

int tw_panel_width(void) { return NR; }

static inline __attribute__((always_inline)) void tile(const int MR, const float* A, int64_t lda, const float* B,
                                                       int64_t K, float* C, int64_t ldc, int64_t ncols,
                                                       const float* bias, const float* pf, int64_t pf_stride) {
    vec c0[MAXR], c1[MAXR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = (vec){0};
    for (int64_t k = 0; k < K; k++) {
        vec b0 = *(const vec*)(B + k * NR), b1 = *(const vec*)(B + k * NR + VL);
        __builtin_prefetch(pf + k * pf_stride, 0, PREFETCH_LOCALITY);
        if (pf_stride == NR && VB == 64) /* a 512-bit panel row is 2 cache lines */
            __builtin_prefetch(pf + k * pf_stride + 16, 0, PREFETCH_LOCALITY);
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            float a = A[i * lda + k];
            c0[i] += a * b0;
            c1[i] += a * b1;
        }
    }
    float t[NR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        memcpy(t, &c0[i], VB);
        memcpy(t + VL, &c1[i], VB);
        if (bias)
            for (int j = 0; j < NR; j++) t[j] += j < ncols ? bias[j] : 0.0f;
        memcpy(C + i * ldc, t, (size_t)ncols * sizeof(float));
    }
}

static void row_block(int mr, const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc,
                      int64_t ncols, const float* bias, const float* pf, int64_t pf_stride) {
    switch (mr) { /* a constant MR per case: the tile's loops unroll and its accumulators stay in registers */
        case 1: tile(1, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 2: tile(2, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 3: tile(3, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 4: tile(4, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 5: tile(5, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 6: tile(6, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
#if MAXR > 6
        case 7: tile(7, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
        case 8: tile(8, A, lda, B, K, C, ldc, ncols, bias, pf, pf_stride); break;
#endif
    }
}

/* C = A @ W^T (+ bias). A: [M, K] with row stride lda; Bp: W packed as [ceil(N / NR), K, NR]; C: [M, N] with row
 * stride ldc; bias: [N] or NULL. Panels are split over num_threads OpenMP threads (torch's own runtime). */
void tw_gemm(const float* A, int64_t M, int64_t K, int64_t lda, const float* Bp, int64_t N, float* C, int64_t ldc,
             const float* bias, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR, blocks = (M + MAXR - 1) / MAXR;
    const int64_t ahead = PREFETCH_BYTES / (NR * (int64_t)sizeof(float));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
        const float* panel = Bp + p * K * NR;
        const float* next = p + 1 < panels ? panel + K * NR : panel;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t m = b * MAXR;
            const int mr = M - m < MAXR ? (int)(M - m) : MAXR;
            /* one block streams its own panel `ahead` rows ahead; several take 1/blocks of the next panel each */
            const float* pf = blocks == 1 ? panel + ahead * NR : next + b * K * NR / blocks;
            const int64_t pf_stride = blocks == 1 ? NR : (NR + blocks - 1) / blocks;
            row_block(mr, A + m * lda, lda, panel, K, C + m * ldc + p * NR, ldc, ncols, bias ? bias + p * NR : 0, pf,
                      pf_stride);
        }
    }
}

