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
#include <omp.h>
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

/* One vector load / store at any float address. Not memcpy: GCC expands that into 256-bit halves through the stack,
 * and the full-width reload of two half-width stores stalls store forwarding (it made attention 2x slower). */
static inline vec vload(const float* p) { return *(const vec*)p; }
static inline void vstore(float* p, vec v) { *(vec*)p = v; }

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
    if (ncols == NR) { /* a whole panel: two vector stores per row */
        const vec b0 = bias ? vload(bias) : (vec){0}, b1 = bias ? vload(bias + VL) : (vec){0};
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            vstore(C + i * ldc, bias ? c0[i] + b0 : c0[i]);
            vstore(C + i * ldc + VL, bias ? c1[i] + b1 : c1[i]);
        }
        return;
    }
    float t[NR]; /* the last panel, cut short at N */
    for (int i = 0; i < MR; i++) {
        vstore(t, c0[i]);
        vstore(t + VL, c1[i]);
        for (int j = 0; j < ncols; j++) C[i * ldc + j] = bias ? t[j] + bias[j] : t[j];
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
            if (p + 1 < panels) /* the next panel's output lines, owned before its tile stores to them */
                for (int i = 0; i < mr; i++)
                    for (int l = 0; l < NR; l += 16) __builtin_prefetch(C + (m + i) * ldc + (p + 1) * NR + l, 1, 3);
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
            const vec v = vload(h + j);
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

typedef int32_t ivec __attribute__((vector_size(VB), aligned(4)));

/* e^x lane-wise for x <= 0 (softmax's scores minus their max), Cephes' expf scheme: x = n ln2 + r with |r| <=
 * ln2/2, a degree-7 polynomial for e^r, 2^n put into the exponent bits. Within 2 ulp of expf; below -87.3 (where
 * e^x leaves the normal range) it returns e^-87.3 ~ 1e-38, which no softmax over at least one e^0 term can tell
 * from 0. */
static inline vec vexp_nonpos(vec x) {
    const vec lo = (vec){0} - 87.3f, magic = (vec){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const ivec under = x < lo;
    x = (vec)(((ivec)x & ~under) | ((ivec)lo & under));
    const vec n = (x * 1.44269504088896341f + magic) - magic;
    const vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
    return p * (vec)e;
}

/* Sum of a vector's lanes as a tree of halves (vector adds, then the last four lanes): attention's dot products,
 * where the order of the sum is free (SDPA has its own). */
static inline float hsum_tree(vec v) {
    typedef float half __attribute__((vector_size(VB / 2), aligned(4)));
    typedef float quarter __attribute__((vector_size(16), aligned(4)));
    union { vec v; half h[2]; } a = {v};
    union { half h; quarter q[VB / 32]; } b = {a.h[0] + a.h[1]};
#if VB == 64
    const quarter c = b.q[0] + b.q[1];
#else
    const quarter c = b.q[0];
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

#define ATTN_AHEAD 16 /* tokens: the K or V row read that many tokens later is prefetched (blocks are scattered) */

/* A walk over a sequence's cache slots in position order, without a division per token: block-table index and
 * offset of the current position, and of the position ATTN_AHEAD later (prefetched). */
typedef struct {
    int64_t b, o, ab, ao;
} slot_walk;

static inline slot_walk walk_start(int64_t bs) { return (slot_walk){0, 0, ATTN_AHEAD / bs, ATTN_AHEAD % bs}; }

static inline void walk_next(slot_walk* w, int64_t bs) {
    if (++w->o == bs) w->o = 0, w->b++;
    if (++w->ao == bs) w->ao = 0, w->ab++;
}

static inline void prefetch_row(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 2);
}

/* One decode sequence's attention (see tw_decode_attention) over L cached positions with block-table row bt:
 * q [H][D] rows ldh apart, out [H][D]; sc [H][max_len] scores, acc [H][D], inv [H] scratch. Inlined with D a
 * constant (64, 128) where the caller can: the loops over D unroll and the G query heads of a KV head reuse its
 * key and value vectors from registers. */
static inline __attribute__((always_inline)) void decode_one(const int64_t D, const float* qs, int64_t ldh, int64_t L,
                                                             const int32_t* bt, int64_t bs, const float* kc,
                                                             const float* vc, int64_t Hkv, int64_t G, float scale,
                                                             float* o, float* sc, float* acc, float* inv,
                                                             int64_t max_len) {
    const int64_t dv = D - D % VL, token = Hkv * D;
    slot_walk w = walk_start(bs);
    for (int64_t j = 0; j < L; j++, walk_next(&w, bs)) { /* scores, keys in memory order */
        const float* kj = kc + (bt[w.b] * bs + w.o) * token;
        if (j + ATTN_AHEAD < L) prefetch_row(kc + (bt[w.ab] * bs + w.ao) * token, token);
        for (int64_t h = 0; h < Hkv; h++) {
            const float* k = kj + h * D;
            for (int64_t g = 0; g < G; g++) {
                const int64_t i = h * G + g;
                const float* qi = qs + i * ldh;
                vec a = (vec){0};
                for (int64_t d = 0; d < dv; d += VL) a += vload(qi + d) * vload(k + d);
                float x = hsum_tree(a);
                for (int64_t d = dv; d < D; d++) x += qi[d] * k[d];
                sc[i * max_len + j] = x * scale;
            }
        }
    }
    const int64_t H = Hkv * G;
    for (int64_t i = 0; i < H; i++) { /* softmax numerators in place */
        float* si = sc + i * max_len;
        float mx = si[0], sum = 0.0f;
        for (int64_t j = 1; j < L; j++) mx = si[j] > mx ? si[j] : mx;
        int64_t j = 0;
        for (; j + VL <= L; j += VL) {
            const vec x = vexp_nonpos(vload(si + j) - mx);
            vstore(si + j, x);
            sum += hsum_tree(x);
        }
        if (j < L) {
            float t[VL];
            for (int64_t l = 0; l < VL; l++) t[l] = j + l < L ? si[j + l] - mx : 0.0f;
            vstore(t, vexp_nonpos(vload(t)));
            for (int64_t l = 0; j + l < L; l++) sum += (si[j + l] = t[l]);
        }
        inv[i] = 1.0f / sum;
    }
    for (int64_t e = 0; e < H * D; e++) acc[e] = 0.0f;
    w = walk_start(bs);
    for (int64_t j = 0; j < L; j++, walk_next(&w, bs)) { /* weighted sum of values, in memory order */
        const float* vj = vc + (bt[w.b] * bs + w.o) * token;
        if (j + ATTN_AHEAD < L) prefetch_row(vc + (bt[w.ab] * bs + w.ao) * token, token);
        for (int64_t h = 0; h < Hkv; h++) {
            const float* v = vj + h * D;
            for (int64_t g = 0; g < G; g++) {
                const int64_t i = h * G + g;
                const float p = sc[i * max_len + j];
                float* a = acc + i * D;
                for (int64_t d = 0; d < dv; d += VL) vstore(a + d, vload(a + d) + p * vload(v + d));
                for (int64_t d = dv; d < D; d++) a[d] += p * v[d];
            }
        }
    }
    for (int64_t i = 0; i < H; i++)
        for (int64_t d = 0; d < D; d++) o[i * D + d] = acc[i * D + d] * inv[i];
}

/* Decode attention straight from the paged KV cache: for every sequence s with exactly one query token (row
 * qsl[s]; sequences with more are skipped: they are prefill chunks), softmax(q k^T * scale) v over its lens[s]
 * cached positions, whose slots come from block-table row s (width W). Query head i reads KV head i / (H / Hkv),
 * as Llama's GQA. q [T, H, D] with token and head strides ldt, ldh; caches [num_blocks, bs, Hkv, D]; out [T, H, D]
 * contiguous (only decode rows written). One sequence at a time, keys and values read once each in memory order
 * (all heads of a token together); fp32 throughout, dot products and the weighted sum of v vectorised over D, exp
 * is vexp_nonpos. The caller's scratch holds threads x H x (max_len + D + 1) floats.
 * Returns -1, or the first decode sequence whose length or block ids are out of range (then nothing is written). */
int64_t tw_decode_attention(const float* q, int64_t ldt, int64_t ldh, int64_t S, const int32_t* qsl,
                            const int32_t* lens, const int32_t* tables, int64_t W, const float* kc, const float* vc,
                            int64_t num_blocks, int64_t bs, int64_t Hkv, int64_t H, int64_t D, float scale,
                            float* out, float* scratch, int64_t max_len, int num_threads) {
    for (int64_t s = 0; s < S; s++) {
        if (qsl[s + 1] - qsl[s] != 1) continue;
        const int64_t L = lens[s];
        if (L < 1 || L > max_len || L > W * bs) return s;
        for (int64_t b = 0; b < (L + bs - 1) / bs; b++)
            if (tables[s * W + b] < 0 || tables[s * W + b] >= num_blocks) return s;
    }
    const int64_t G = H / Hkv;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && S >= 2)
    for (int64_t s = 0; s < S; s++) {
        if (qsl[s + 1] - qsl[s] != 1) continue;
        float* sc = scratch + (int64_t)omp_get_thread_num() * H * (max_len + D + 1); /* scores [H][L] */
        float *acc = sc + H * max_len, *inv = acc + H * D;                           /* [H][D], [H] */
        const float* qs = q + qsl[s] * ldt;
        float* o = out + qsl[s] * H * D;
        const int32_t* bt = tables + s * W;
        if (D == 64) /* the common head sizes, unrolled */
            decode_one(64, qs, ldh, lens[s], bt, bs, kc, vc, Hkv, G, scale, o, sc, acc, inv, max_len);
        else if (D == 128)
            decode_one(128, qs, ldh, lens[s], bt, bs, kc, vc, Hkv, G, scale, o, sc, acc, inv, max_len);
        else
            decode_one(D, qs, ldh, lens[s], bt, bs, kc, vc, Hkv, G, scale, o, sc, acc, inv, max_len);
    }
    return -1;
}

/* Index of each row's first maximum, as torch's max(dim=-1).indices: x [rows, n] with row stride ld; a row with
 * a NaN gets its first NaN's index (torch propagates NaN as the maximum). Greedy sampling over the vocabulary. */
void tw_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * ld;
        float best = row[0];
        int64_t at = 0, j = 0;
        if (n >= VL) { /* per lane: its largest value and where it first came (strict >: the earliest wins) */
            vec vbest = vload(row), nan = (vec){0};
            ivec lane, where;
            for (int l = 0; l < VL; l++) lane[l] = l;
            where = lane;
            for (j = VL; j + VL <= n; j += VL) {
                const vec v = vload(row + j);
                const ivec more = v > vbest;
                vbest = (vec)(((ivec)v & more) | ((ivec)vbest & ~more));
                where = (((int32_t)j + lane) & more) | (where & ~more);
                nan = (vec)((ivec)nan | (v != v));
            }
            best = vbest[0];
            at = where[0];
            for (int l = 1; l < VL; l++)
                if (vbest[l] > best || (vbest[l] == best && where[l] < at)) best = vbest[l], at = where[l];
            int any_nan = 0;
            for (int l = 0; l < VL; l++) any_nan |= ((ivec)nan)[l] != 0 || vbest[l] != vbest[l];
            if (any_nan) j = 0, best = row[0], at = 0; /* rare: the scalar scan below finds the first NaN */
        }
        for (int64_t i = j ? j : 1; i < n && best == best; i++)
            if (row[i] > best || row[i] != row[i]) best = row[i], at = i;
        out[r] = at;
    }
}

/* SiLU-and-mul, Llama's SwiGLU gate: out[t, j] = silu(g) * u with g = x[t, j], u = x[t, F + j], for x [T, 2F] (row
 * stride ldx) and out [T, F] contiguous. silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (vexp_nonpos; expf
 * for the columns past the last whole vector): 1 / (1 + e) for g >= 0, e / (1 + e) below. Within a few ulp of
 * torch's silu; a column's result depends only on F, never on T or the thread count. */
void tw_silu_and_mul(const float* x, int64_t ldx, int64_t T, int64_t F, float* out, int num_threads) {
    const int64_t fv = F - F % VL;
    const ivec sign = (ivec){0} + (int32_t)0x80000000;
    const vec one = (vec){0} + 1.0f;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + F;
        float* o = out + t * F;
        for (int64_t j = 0; j < fv; j += VL) {
            const vec gv = vload(g + j);
            const vec e = vexp_nonpos((vec)((ivec)gv | sign)); /* exp(-|g|) */
            const ivec pos = gv >= 0.0f;
            const vec num = (vec)(((ivec)one & pos) | ((ivec)e & ~pos));
            vstore(o + j, gv * (num / (one + e)) * vload(u + j));
        }
        for (int64_t j = fv; j < F; j++) {
            const float e = expf(-fabsf(g[j]));
            o[j] = g[j] * ((g[j] >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[j];
        }
    }
}

/* Scatter this step's k, v [T, row] (row = Hkv * D contiguous floats; token strides ldk, ldv) into the caches,
 * viewed as [num_slots, row], at slots[t]; a slot of -1 is skipped (padding). Returns -1, or the first token whose
 * slot is outside [-1, num_slots) (then nothing is written). */
int64_t tw_store_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t T, int64_t row,
                    const int64_t* slots, int64_t num_slots, float* kc, float* vc) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return t;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(kc + slots[t] * row, k + t * ldk, (size_t)row * sizeof(float));
        memcpy(vc + slots[t] * row, v + t * ldv, (size_t)row * sizeof(float));
    }
    return -1;
}
