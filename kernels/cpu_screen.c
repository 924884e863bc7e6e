/* Exact greedy tokens through an int8 screen of the LM head (kernels/greedy_screen.py).
 *
 * Greedy decoding needs each row's argmax over the vocabulary, not its logits. The screen computes every logit
 * approximately from an int8 copy of the LM head (a quarter of the fp32 bytes, and more multiply-adds per
 * instruction than fp32 FMAs) together with a rigorous bound on its error, keeps the tokens whose upper bound
 * reaches the best lower bound, and recomputes only those in fp32, each as tw_gemm computes it (one FMA chain over k
 * in order). The token is then the argmax of tw_gemm's logits bit for bit, the first index on ties, whatever the
 * weights and inputs; the screen only decides how many tokens are recomputed.
 *
 * The bound. Row x (K floats) is quantised as x = sx qx + dx with integers |qx| <= X_MAX, weight row v as
 * w = sv qw + dw with |qw| <= 127. Then x.w = sx sv (qx.qw) + sx (qx.dw) + (dx.w), and qx.qw is exact in int32,
 * so by Cauchy-Schwarz
 *   |x.w - sx sv qx.qw| <= sx |qx| |dw| + |dx| |w|      (|.|: 2-norms),
 * and tw_gemm's fp32 chain is within gamma_K |x| |w| of x.w (K roundings, gamma_K = K u / (1 - K u)). The
 * screen's own float arithmetic (a few roundings per term) is covered by a relative margin of 2^-12 on the bound
 * and by 2^-20 |y| for the rounding of the approximate logit y itself. (The 2-norms give a bound about 30% tighter than
 * max-norm times 1-norm on Gaussian-like rows: fewer tokens to recompute.)
 *
 * Layout. The int8 weight is packed in panels of SCR_NR columns, [K4][SCR_NR][4] bytes per panel (K4 = K / 4
 * rounded up, zero-padded): one k-quad of a column is 4 bytes, multiplied with 4 bytes of x held unsigned as
 * qx + X_OFF (the X_OFF * sum(qw) this adds is taken off per column). Two builds:
 * - AVX-512 VNNI: 16 int32 lanes, VPDPBUSD (64 multiply-adds per instruction), x in [-127, 127].
 * - AVX2: 8 lanes, VPMADDUBSW + VPMADDWD (32 per two instructions). VPMADDUBSW saturates pairs of products at 16
 *   bits, so x keeps 7 bits (qx in [-63, 63], unsigned at most 127: a pair is at most 2 * 127 * 127 = 32258); the
 *   coarser x makes the bound about twice as wide.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SCREEN 64 /* vector bytes */
#define X_MAX 127
#define SCR_MAXR 8
#elif defined(__AVX2__) && defined(__FMA__)
#define SCREEN 32
#define X_MAX 63
#define SCR_MAXR 4
#else
#define SCREEN 0
#endif

#define SCR_PREFETCH 32768 /* bytes ahead in the weight stream (into L2), as tw_gemm */
#define SCR_BATCH 8        /* candidates recomputed together: independent FMA chains */
#define SCR_ROW_ALIGN 64   /* bytes: quantised rows and per-row float arrays start on cache lines */
#define SCR_MARGIN (1.0 + 0x1p-12) /* the rounding of the bound's own terms (folded into its coefficients) */
#define SCR_YREL (0x1p-20f * (float)SCR_MARGIN) /* the rounding of the approximate logit, relative to it */

#if SCREEN
#define SVL (SCREEN / 4)  /* lanes */
#define SCR_NR (2 * SVL)  /* columns per panel: two vectors of int32 accumulators */
#define X_OFF (X_MAX + 1) /* x as unsigned bytes: qx + X_OFF in [1, 2 X_MAX + 1] */
typedef float svec __attribute__((vector_size(SCREEN), aligned(4)));
typedef int32_t sivec __attribute__((vector_size(SCREEN), aligned(4)));

/* acc + per lane (column) the sum of 4 products of x's unsigned bytes xb with the column's signed bytes w. */
static inline sivec dot4(sivec acc, sivec xb, sivec w) {
#if SCREEN == 64
    return (sivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)xb, (__m512i)w);
#else
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)xb, (__m256i)w); /* exact: see X_MAX */
    return acc + (sivec)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

static inline svec vmax(svec a, svec b) {
#if SCREEN == 64
    return (svec)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return (svec)_mm256_max_ps((__m256)a, (__m256)b);
#endif
}

/* Bit l set where a[l] >= b[l]. */
static inline uint32_t ge_mask(svec a, svec b) {
#if SCREEN == 64
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GE_OQ);
#else
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GE_OQ));
#endif
}

static inline svec sload(const float* p) { return *(const svec*)p; }
static inline sivec siload(const void* p) { return *(const sivec*)p; }
static inline svec splat(float x) { return (svec){0} + x; }
static inline svec blend(sivec m, svec a, svec b) { return (svec)(((sivec)a & m) | ((sivec)b & ~m)); }
#else
#define SCR_NR 1
#endif

int tw_screen_available(void) { return SCREEN != 0; }

int tw_screen_panel_width(void) { return SCR_NR; }

/* The largest |qx| of the build (127, or 63 with AVX2); 0 without a screen. */
int tw_screen_x_max(void) {
#if SCREEN
    return X_MAX;
#else
    return 0;
#endif
}

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
/* Quantise each row: xq = qx + X_OFF (padded to Kp bytes with X_OFF, i.e. qx = 0), sx, and the bound's coefficients
 * a = sx |qx|, b = |dx| + (gamma_K + 2^-22) |x| (the 2^-22: the rounding of dx as computed here), rounded up and
 * times SCR_MARGIN.
 * Returns -1, or the first row that cannot be screened: a value that is not finite, or products that could
 * overflow. */
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
        const float s = amax / (float)X_MAX, inv = amax > 0.0f ? (float)X_MAX / amax : 0.0f;
        int64_t qq = 0;
        double dd = 0.0;
        uint8_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            long v = lrintf(r[k] * inv);
            v = v > X_MAX ? X_MAX : v < -X_MAX ? -X_MAX : v;
            q[k] = (uint8_t)(v + X_OFF);
            qq += v * v;
            const double d = r[k] - s * (float)v;
            dd += d * d;
        }
        memset(q + K, X_OFF, (size_t)(Kp - K));
        sx[m] = s;
        a[m] = (float)((double)s * sqrt((double)qq) * (1.0 + 0x1p-20) * SCR_MARGIN);
        b[m] = (float)((sqrt(dd) + (gamma + 0x1p-22) * norm) * (1.0 + 0x1p-20) * SCR_MARGIN);
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
    float* hi; /* upper bounds, row stride ldh (padded past N: whole vectors are stored) */
    int64_t ldh;
    svec* lomax; /* per row: the running maximum of lower bounds, per lane */
} screen_job;

/* One register tile: MR rows x SCR_NR columns of int32 dot products over the panel, then per column the
 * approximate logit y, its bound e, the upper bound y + e stored to hi and the lower bound y - e folded into the
 * row's running maximum (columns past N left out). */
static inline __attribute__((always_inline)) void screen_tile(const int MR, const screen_job* j) {
    sivec c[SCR_MAXR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = (sivec){0};
    const int8_t *panel = j->panel, *pf = j->pf;
    const int64_t step = j->pf_step, row = 4 * SCR_NR;
    for (int64_t k = 0; k < j->K4; k++) {
        const sivec w0 = siload(panel + k * row), w1 = siload(panel + k * row + SCREEN);
        __builtin_prefetch(pf + k * step, 0, 2);
        if (step == row && row > 64) __builtin_prefetch(pf + k * step + 64, 0, 2);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, j->xq + i * j->Kp + 4 * k, 4);
            const sivec xb = (sivec){0} + quad;
            c[i][0] = dot4(c[i][0], xb, w0);
            c[i][1] = dot4(c[i][1], xb, w1);
        }
    }
    sivec lane;
    for (int l = 0; l < SVL; l++) lane[l] = l;
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* unrolled: c[i][h] stays in registers */
        const sivec valid = lane < (sivec){0} + (int32_t)(j->ncols - SVL * h);
        const svec s = sload(j->ws + SVL * h), dwv = sload(j->dw + SVL * h), w2v = sload(j->w2 + SVL * h);
        const sivec off = siload(j->wsum + SVL * h) * X_OFF;
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const svec y = __builtin_convertvector(c[i][h] - off, svec) * s * j->sx[i];
            const svec e = j->a[i] * dwv + j->b[i] * w2v + (svec)((sivec)y & 0x7fffffff) * SCR_YREL;
            svec lo = y - e;
            if (j->ncols < SCR_NR) lo = blend(valid, lo, splat(-INFINITY)); /* the last panel: columns past N */
            j->lomax[i] = vmax(lo, j->lomax[i]);
            *(svec*)(j->hi + i * j->ldh + SVL * h) = y + e;
        }
    }
}

static void screen_rows(int mr, const screen_job* j) {
    switch (mr) { /* a constant MR per case: the accumulators stay in registers */
        case 1: screen_tile(1, j); break;
        case 2: screen_tile(2, j); break;
        case 3: screen_tile(3, j); break;
        case 4: screen_tile(4, j); break;
#if SCR_MAXR > 4
        case 5: screen_tile(5, j); break;
        case 6: screen_tile(6, j); break;
        case 7: screen_tile(7, j); break;
        case 8: screen_tile(8, j); break;
#endif
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
 * [ceil(N / SCR_NR) * SCR_NR], zero past N; w2max the largest w2). out[m]: the argmax over n of tw_gemm's
 * (x W^T)[m, n], first on ties; ncand[m] (if not NULL): how many columns were recomputed in fp32. Returns -1, or
 * the first row it cannot screen (nothing is written then): a non-finite value, or one so large that the products
 * could overflow. */
int64_t tw_screen_argmax(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* Wq, const float* ws,
                         const int32_t* wsum, const float* dw, const float* w2, float w2max, int64_t N,
                         const float* W, int64_t ldw, int64_t* out, int32_t* ncand, void* scratch, int num_threads) {
#if SCREEN
    const int64_t rows = round_up(M, 16), Kp = round_up(K, SCR_ROW_ALIGN), K4 = (K + 3) / 4;
    const int64_t Npad = round_up(N, SCR_NR), panels = Npad / SCR_NR, blocks = (M + SCR_MAXR - 1) / SCR_MAXR;
    uint8_t* xq = (uint8_t*)scratch;
    float* sx = (float*)(xq + rows * Kp);
    float *a = sx + rows, *b = a + rows, *hi = b + rows;
    svec* lomax_all = (svec*)(hi + M * Npad); /* 64-byte aligned: every term above is a multiple of 64 */
    float* tmax = (float*)((char*)lomax_all + (int64_t)num_threads * rows * 64);
    const int64_t bad = quantise_rows(x, M, K, ldx, Kp, w2max, xq, sx, a, b);
    if (bad >= 0) return bad;
    const int64_t panel_bytes = K4 * 4 * SCR_NR;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int t = omp_get_thread_num();
        svec* lomax = lomax_all + (int64_t)t * rows;
        for (int64_t m = 0; m < M; m++) lomax[m] = splat(-INFINITY);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int8_t* panel = Wq + p * panel_bytes;
            const int8_t* next = p + 1 < panels ? panel + panel_bytes : panel;
            const int64_t ncols = N - p * SCR_NR < SCR_NR ? N - p * SCR_NR : SCR_NR;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t m = blk * SCR_MAXR;
                const int mr = M - m < SCR_MAXR ? (int)(M - m) : SCR_MAXR;
                /* one block streams its own panel ahead; several take 1/blocks of the next panel each */
                const int8_t* pf = blocks == 1 ? panel + SCR_PREFETCH : next + blk * panel_bytes / blocks;
                const int64_t pf_step = blocks == 1 ? 4 * SCR_NR : (4 * SCR_NR + blocks - 1) / blocks;
                const int64_t c = p * SCR_NR;
                const screen_job job = {xq + m * Kp, Kp, K4, sx + m, a + m, b + m, panel, pf, pf_step, ncols,
                                        ws + c, dw + c, w2 + c, wsum + c, hi + m * Npad + c, Npad, lomax + m};
                screen_rows(mr, &job);
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float mx = -INFINITY;
            for (int l = 0; l < SVL; l++) mx = lomax[m][l] > mx ? lomax[m][l] : mx;
            tmax[t * rows + m] = mx;
        }
    } /* implicit barrier: every thread's maxima are in */

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && M > 1)
    for (int64_t m = 0; m < M; m++) {
        float lo = -INFINITY;
        for (int t = 0; t < num_threads; t++) lo = tmax[t * rows + m] > lo ? tmax[t * rows + m] : lo;
        const float* h = hi + m * Npad;
        const float* xr = x + m * ldx;
        const svec lov = splat(lo);
        int32_t idx[SCR_BATCH];
        float best = -INFINITY;
        int64_t at = -1;
        int32_t count = 0;
        int n = 0;
        for (int64_t v0 = 0; v0 < N; v0 += SVL) {
            uint32_t hits = ge_mask(sload(h + v0), lov);
            if (N - v0 < SVL) hits &= (1u << (N - v0)) - 1; /* the padding past N */
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
