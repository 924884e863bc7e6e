/* Native CPU kernels, built by kernels/cpu_native.py with -O3 -march=native -fopenmp: an fp32 GEMM for small row
 * counts (tw_gemm) and two of a layer's token-wise ops (tw_rms_norm, tw_rope). GCC vector extensions give one
 * source for both ISAs: with AVX-512 a `vec` is one zmm register (16 floats), with AVX2 one ymm (8 floats). Every
 * output row is computed on its own in a fixed order, so a row's bits never depend on the batch it came in.
 *
 * GEMM: C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N]).
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
#include <math.h>
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


/* Horizontal sum of a vector's lanes, in lane order. */
static inline float hsum(vec v) {
    float t[VL], s = 0.0f;
    memcpy(t, &v, VB);
    for (int j = 0; j < VL; j++) s += t[j];
    return s;
}

/* RMSNorm with the pre-norm residual add of Llama blocks, numerics as HF LlamaRMSNorm in fp32: h = x (+ r), rounded;
 * out = (h * (1 / sqrt(mean(h^2) + eps))) * w, two rounded products. Only the sum of squares differs from torch's:
 * VL lane-wise partial sums, then the lanes in order. With r, new_r gets h. Row strides in elements. */
void tw_rms_norm(const float* x, int64_t ldx, const float* r, int64_t ldr, const float* w, float* out,
                 float* new_r, int64_t rows, int64_t d, float eps, int num_threads) {
    const int64_t dv = d - d % VL;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows >= 64)
    for (int64_t i = 0; i < rows; i++) {
        const float* h = x + i * ldx;
        if (r) { /* h = x + r, kept as the new residual stream and normalised from there */
            float* n = new_r + i * d;
            for (int64_t j = 0; j < d; j++) n[j] = h[j] + r[i * ldr + j];
            h = n;
        }
        vec acc = (vec){0};
        for (int64_t j = 0; j < dv; j += VL) {
            vec v;
            memcpy(&v, h + j, VB);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (int64_t j = dv; j < d; j++) ss += h[j] * h[j];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        float* o = out + i * d;
        for (int64_t j = 0; j < d; j++) {
            const float t = h[j] * inv;
            o[j] = t * w[j];
        }
    }
}

/* Rotary embedding, rotate-half convention, of T tokens x heads rows of head_dim D (token stride ldt, head stride
 * ldh, in elements) into out [T, heads, D]: with c, s row pos[t] of cos_sin [max_pos, D] (cos then sin, D/2 each),
 * out = x1 c - x2 s | x2 c + x1 s, each product rounded as torch rounds it (no contraction into FMAs), so the
 * result is rope_torch's bit for bit. Returns -1, or the first token whose position is outside the table (then
 * nothing is written). */
__attribute__((optimize("fp-contract=off"))) int64_t tw_rope(const float* x, int64_t ldt, int64_t ldh, int64_t T,
                                                              int64_t heads, int64_t D, const int64_t* pos,
                                                              const float* cos_sin, int64_t max_pos, float* out,
                                                              int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return t;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos_sin + pos[t] * D;
        const float* s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            const float* x1 = x + t * ldt + h * ldh;
            const float* x2 = x1 + half;
            float* o = out + (t * heads + h) * D;
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j] * c[j], b = x2[j] * s[j], e = x2[j] * c[j], f = x1[j] * s[j];
                o[j] = a - b;
                o[j + half] = e + f;
            }
        }
    }
    return -1;
}
