/* Exact greedy tokens through an int8 screen of the LM head (AVX-512 VNNI builds; kernels/greedy_screen.py).
 *
 * Greedy decoding needs each row's argmax over the vocabulary, not its logits. The screen computes every logit
 * approximately from an int8 copy of the LM head (a quarter of the fp32 bytes; one VNNI instruction does 64 int8
 * multiply-adds where an FMA does 16 in fp32) together with a rigorous bound on its error, keeps the tokens whose
 * upper bound reaches the best lower bound, and recomputes only those in fp32, each as tw_gemm computes it (one FMA
 * chain over k in order). The token is then the argmax of tw_gemm's logits bit for bit, the first index on ties,
 * whatever the weights and inputs; the screen only decides how many tokens are recomputed.
 *
 * The bound. Row x (K floats) is quantised as x = sx qx + dx with integers qx in [-127, 127], weight row v as
 * w = sv qw + dw. Then x.w = sx sv (qx.qw) + sx (qx.dw) + (dx.w), and qx.qw is exact in int32, so by
 * Cauchy-Schwarz
 *   |x.w - sx sv qx.qw| <= sx |qx| |dw| + |dx| |w|      (|.|: 2-norms),
 * and tw_gemm's fp32 chain is within gamma_K |x| |w| of x.w (K roundings, gamma_K = K u / (1 - K u)). The
 * screen's own float arithmetic (a few roundings per term) is covered by a relative margin on the bound and by
 * 2^-20 |y| for the rounding of the approximate logit y itself. (The 2-norms give a bound about 30% tighter than
 * max-norm times 1-norm on Gaussian-like rows: fewer tokens to recompute.)
 *
 * Layout. The int8 weight is packed in panels of SCR_NR columns, [K4][SCR_NR][4] bytes per panel (K4 = K / 4
 * rounded up, zero-padded): one k-quad of a column is the 4 bytes VNNI multiplies with 4 bytes of x (as unsigned
 * qx + 128; the 128 * sum(qw) it adds is taken off per column).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SCREEN 1
#else
#define SCREEN 0
#endif

#define SCR_NR 32 /* columns per panel: two vectors of int32 accumulators */
#define SCR_MAXR 8
#define SCR_PREFETCH 32768 /* bytes ahead in the weight stream (into L2), as tw_gemm */
#define SCR_BATCH 8        /* candidates recomputed together: independent FMA chains */
#define SCR_ROW_ALIGN 64   /* bytes: quantised rows and per-row float arrays start on cache lines */
#define SCR_YREL 0x1p-20f  /* the rounding of the approximate logit, relative to it */
#define SCR_MARGIN (1.0f + 0x1p-12f) /* the rounding of the bound's own terms */

int tw_screen_available(void) { return SCREEN; }

int tw_screen_panel_width(void) { return SCR_NR; }

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* Bytes of scratch tw_screen_argmax needs for M rows of K features, N columns, num_threads threads. */
int64_t tw_screen_scratch_bytes(int64_t M, int64_t K, int64_t N, int num_threads) {
    const int64_t rows = round_up(M, 16);
    return rows * round_up(K, SCR_ROW_ALIGN)           /* quantised rows */
           + 3 * rows * 4                             /* sx, bound coefficients a and b */
           + M * round_up(N, SCR_NR) * 4              /* upper bounds */
           + (int64_t)num_threads * rows * (64 + 4);  /* per thread: running max vectors, their maxima */
}

#if SCREEN
/* Quantise each row: xq = qx + 128 (zero-padded to Kp bytes), sx, and the bound's coefficients a = sx |qx|,
 * b = |dx| + (gamma_K + 2^-22) |x| (the 2^-22: the rounding of dx as computed here), rounded up. Returns -1, or the
 * first row that cannot be screened: a value that is not finite, or products that could overflow. */
static int64_t quantise_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t Kp, float w2max,
                             uint8_t* xq, float* sx, float* a, float* b) {
    const double u = 0x1p-24, gamma = K * u / (1.0 - K * u);
    for (int64_t m = 0; m < M; m++) {
        const float* r = x + m * ldx;
        float amax = 0.0f;
        double ss = 0.0;
        int finite = 1;
        for (int64_t k = 0; k < K; k++) {
            const float v = fabsf(r[k]);
            finite &= v <= FLT_MAX; /* false for inf and NaN */
            amax = v > amax ? v : amax;
            ss += (double)v * v;
        }
        const double norm = sqrt(ss);
        if (!finite || norm * w2max > 0x1p100) return m;
        const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int64_t qq = 0;
        double dd = 0.0;
        uint8_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            long v = lrintf(r[k] * inv);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[k] = (uint8_t)(v + 128);
            qq += v * v;
            const double d = r[k] - s * (float)v;
            dd += d * d;
        }
        memset(q + K, 128, (size_t)(Kp - K));
        sx[m] = s;
        a[m] = (float)((double)s * sqrt((double)qq) * (1.0 + 0x1p-20));
        b[m] = (float)((sqrt(dd) + (gamma + 0x1p-22) * norm) * (1.0 + 0x1p-20));
    }
    return -1;
}

/* What one register tile reads and writes: MR rows from row m, one panel's SCR_NR columns. */
typedef struct {
    const uint8_t* xq;     /* quantised rows, Kp bytes apart */
    int64_t Kp, K4;
    const float *sx, *a, *b; /* the rows' scales and bound coefficients */
    const int8_t *panel, *pf; /* the panel, and where its k loop prefetches (pf_step bytes per k-quad) */
    int64_t pf_step, ncols;   /* ncols: the panel's columns before N */
    const float *ws, *dw, *w2; /* the columns' scales and the 2-norms of dw and w */
    const int32_t* wsum;
    float* hi; /* upper bounds, row stride ldh */
    int64_t ldh;
    __m512* lomax; /* per row: the running maximum of lower bounds, per lane */
} screen_job;

/* One register tile: MR rows x SCR_NR columns of int32 dot products over the panel, then per column the
 * approximate logit y, its bound e, the upper bound y + e stored to hi and the lower bound y - e folded into the
 * row's running maximum. */
static inline __attribute__((always_inline)) void screen_tile(const int MR, const screen_job* j) {
    __m512i c0[SCR_MAXR], c1[SCR_MAXR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = _mm512_setzero_si512();
    const int8_t *panel = j->panel, *pf = j->pf;
    const int64_t step = j->pf_step;
    for (int64_t k = 0; k < j->K4; k++) {
        const __m512i w0 = _mm512_loadu_si512(panel + k * 4 * SCR_NR);
        const __m512i w1 = _mm512_loadu_si512(panel + k * 4 * SCR_NR + 64);
        _mm_prefetch((const char*)(pf + k * step), _MM_HINT_T1);
        if (step == 4 * SCR_NR) _mm_prefetch((const char*)(pf + k * step + 64), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, j->xq + i * j->Kp + 4 * k, 4);
            const __m512i xb = _mm512_set1_epi32(quad);
            c0[i] = _mm512_dpbusd_epi32(c0[i], xb, w0);
            c1[i] = _mm512_dpbusd_epi32(c1[i], xb, w1);
        }
    }
    for (int h = 0; h < 2; h++) {
        const int64_t left = j->ncols - 16 * h;
        if (left <= 0) break;
        const __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 s = _mm512_loadu_ps(j->ws + 16 * h), dwv = _mm512_loadu_ps(j->dw + 16 * h);
        const __m512 w2v = _mm512_loadu_ps(j->w2 + 16 * h);
        const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(j->wsum + 16 * h), 7); /* 128 sum(qw) */
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512i dot = _mm512_sub_epi32(h ? c1[i] : c0[i], off);
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), s), _mm512_set1_ps(j->sx[i]));
            __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(j->a[i]), dwv, _mm512_mul_ps(_mm512_set1_ps(j->b[i]), w2v));
            e = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_abs_ps(y), _mm512_set1_ps(SCR_YREL), e),
                              _mm512_set1_ps(SCR_MARGIN));
            j->lomax[i] = _mm512_mask_max_ps(j->lomax[i], valid, j->lomax[i], _mm512_sub_ps(y, e));
            _mm512_mask_storeu_ps(j->hi + i * j->ldh + 16 * h, valid, _mm512_add_ps(y, e));
        }
    }
}

static void screen_rows(int mr, const screen_job* j) {
    switch (mr) { /* a constant MR per case: the accumulators stay in registers */
        case 1: screen_tile(1, j); break;
        case 2: screen_tile(2, j); break;
        case 3: screen_tile(3, j); break;
        case 4: screen_tile(4, j); break;
        case 5: screen_tile(5, j); break;
        case 6: screen_tile(6, j); break;
        case 7: screen_tile(7, j); break;
        case 8: screen_tile(8, j); break;
    }
}

/* The fp32 logits of n <= SCR_BATCH candidate columns (idx, ascending), each one FMA chain over k in order from +0:
 * tw_gemm's arithmetic for one output element, so the same bits. The chains run side by side (independent FMAs);
 * unused slots repeat the last candidate. Keeps the first maximum in (best, at). */
static void pick(const float* x, int64_t K, const float* W, int64_t ldw, const int32_t* idx, int n, float* best,
                 int64_t* at) {
    float acc[SCR_BATCH];
    const float* rows[SCR_BATCH];
    for (int j = 0; j < SCR_BATCH; j++) acc[j] = 0.0f, rows[j] = W + (int64_t)idx[j < n ? j : n - 1] * ldw;
    for (int64_t k = 0; k < K; k++)
#pragma GCC unroll 8
        for (int j = 0; j < SCR_BATCH; j++) acc[j] = fmaf(x[k], rows[j][k], acc[j]);
    for (int j = 0; j < n; j++)
        if (*at < 0 || acc[j] > *best) *best = acc[j], *at = idx[j];
}
#endif

/* Greedy tokens of x [M, K] (row stride ldx) under W [N, K] (row stride ldw, fp32), screened through the int8
 * panels Wq with per-column scale ws, sum of int8 weights wsum and 2-norms |dw| dw and |w| w2 (each
 * [ceil(N / SCR_NR) * SCR_NR], zero past N; w2max the largest w2). out[m]: the argmax over n of tw_gemm's (x W^T)[m, n], first on
 * ties; ncand[m] (if not NULL): how many columns were recomputed in fp32. Returns -1, or the first row it cannot
 * screen (nothing is written then): a non-finite value, or one so large that the products could overflow. */
int64_t tw_screen_argmax(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* Wq, const float* ws,
                         const int32_t* wsum, const float* dw, const float* w2, float w2max, int64_t N,
                         const float* W, int64_t ldw, int64_t* out, int32_t* ncand, void* scratch, int num_threads) {
#if SCREEN
    const int64_t rows = round_up(M, 16), Kp = round_up(K, SCR_ROW_ALIGN), K4 = (K + 3) / 4;
    const int64_t Npad = round_up(N, SCR_NR), panels = Npad / SCR_NR, blocks = (M + SCR_MAXR - 1) / SCR_MAXR;
    uint8_t* xq = (uint8_t*)scratch;
    float* sx = (float*)(xq + rows * Kp);
    float *a = sx + rows, *b = a + rows, *hi = b + rows;
    __m512* lomax_all = (__m512*)(hi + M * Npad); /* 64-byte aligned: every term above is a multiple of 64 */
    float* tmax = (float*)(lomax_all + (int64_t)num_threads * rows);
    const int64_t bad = quantise_rows(x, M, K, ldx, Kp, w2max, xq, sx, a, b);
    if (bad >= 0) return bad;
    const int64_t panel_bytes = K4 * 4 * SCR_NR, ahead = SCR_PREFETCH;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int t = omp_get_thread_num();
        __m512* lomax = lomax_all + (int64_t)t * rows;
        for (int64_t m = 0; m < M; m++) lomax[m] = _mm512_set1_ps(-INFINITY);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int8_t* panel = Wq + p * panel_bytes;
            const int8_t* next = p + 1 < panels ? panel + panel_bytes : panel;
            const int64_t ncols = N - p * SCR_NR < SCR_NR ? N - p * SCR_NR : SCR_NR;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t m = blk * SCR_MAXR;
                const int mr = M - m < SCR_MAXR ? (int)(M - m) : SCR_MAXR;
                /* one block streams its own panel ahead; several take 1/blocks of the next panel each */
                const int8_t* pf = blocks == 1 ? panel + ahead : next + blk * panel_bytes / blocks;
                const int64_t pf_step = blocks == 1 ? 4 * SCR_NR : (4 * SCR_NR + blocks - 1) / blocks;
                const int64_t c = p * SCR_NR;
                const screen_job job = {xq + m * Kp, Kp, K4, sx + m, a + m, b + m, panel, pf, pf_step, ncols,
                                        ws + c, dw + c, w2 + c, wsum + c, hi + m * Npad + c, Npad, lomax + m};
                screen_rows(mr, &job);
            }
        }
        for (int64_t m = 0; m < M; m++) tmax[t * rows + m] = _mm512_reduce_max_ps(lomax[m]);
    } /* implicit barrier: every thread's maxima are in */

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && M > 1)
    for (int64_t m = 0; m < M; m++) {
        float lo = -INFINITY;
        for (int t = 0; t < num_threads; t++) lo = tmax[t * rows + m] > lo ? tmax[t * rows + m] : lo;
        const float* h = hi + m * Npad;
        const float* xr = x + m * ldx;
        const __m512 lov = _mm512_set1_ps(lo);
        int32_t idx[SCR_BATCH];
        float best = -INFINITY;
        int64_t at = -1;
        int32_t count = 0;
        int n = 0;
        for (int64_t v0 = 0; v0 < N; v0 += 16) {
            const int64_t left = N - v0;
            const __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            uint32_t hits = _mm512_mask_cmp_ps_mask(valid, _mm512_loadu_ps(h + v0), lov, _CMP_GE_OQ);
            while (hits) {
                idx[n++] = (int32_t)(v0 + __builtin_ctz(hits));
                hits &= hits - 1;
                if (n == SCR_BATCH) pick(xr, K, W, ldw, idx, n, &best, &at), count += n, n = 0;
            }
        }
        if (n) pick(xr, K, W, ldw, idx, n, &best, &at), count += n;
        out[m] = at;
        if (ncand) ncand[m] = count;
    }
    return -1;
#else
    (void)x, (void)M, (void)K, (void)ldx, (void)Wq, (void)ws, (void)wsum, (void)dw, (void)w2, (void)w2max, (void)N;
    (void)W, (void)ldw, (void)out, (void)ncand, (void)scratch, (void)num_threads;
    return 0;
#endif
}
