/* y = x @ w.T with int8 activations and integer dot products (the "int8" numerics mode).
 *
 * Activations: each token's row is quantized in blocks of 32, with A = 127 (8 bits, llama.cpp's Q8_0
 * activations: numerics "int8") or A = 32767 (16 bits: numerics "int16"):
 *   dx = max|x| / A, xq = rint(x * (1 / dx)) in [-A, A] (dx = 0 gives 0)
 * 8 bits: stored as unsigned bytes xu = xq + 128 (vpdpbusd multiplies unsigned by signed bytes).
 * 16 bits: split xq = 256 * hi + lo (lo = xq & 255 unsigned, hi = xq >> 8 in [-128, 127]); the
 * bytes xu = hi + 128 and lo each go through the same int8 products, I = 256 * I_hi + I_lo.
 *
 * Weights: a format's to_q8w (ggml_types.h, one column of the type table) rewrites a row's blocks as
 *   w[k] = s[g] * q[k] + m[g]        q int8, one scale s and offset m per group g of G = 32 or 16 weights
 * which is the format's own dequantization formula regrouped (Q4_0: q = nibble - 8, s = d; Q4_K:
 * q = nibble, s = d * sc, m = -dmin * mn; ...): no weight is re-quantized. ratchet_pack_q8 lays a
 * weight out once (at its first int8 use) in panels of 16 output rows, the 16 rows' 4-byte runs
 * side by side (the VNNI layout: one 64-byte vector = 4 weights of 16 rows), with per row and group
 * the correction -128 * sum(q), s and m.
 *
 * Output row n, token t, per group g (I exact in int32, starting from the correction):
 *   I = sum_{k in g} xu[k] q[n, k] - 128 sum_{k in g} q[n, k] = sum_{k in g} xq[k] q[n, k]
 *   acc = fma(float(I), s[n, g] * dx[t, g], acc);  acc = fma(m[n, g], dx[t, g] * sum_{k in g} xq[k], acc)
 * in increasing g: one scalar sequence per output (16 outputs are the 16 lanes of a vector; nothing
 * is reduced across lanes). The sequence does not depend on how many tokens share the call, the
 * tiling or the thread count, so a row's result is bit-identical alone or among any number of rows
 * (batch-invariant), per build.
 */
#include <math.h>
#include <stdlib.h>

#include "ggml_types.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define QA 32 /* activation block */
#define PN 16 /* output rows per panel (vector lanes) */
#define TT 8  /* tokens per register tile */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_ISA "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define INT8_ISA "avxvnni"
#else
#define INT8_ISA "scalar"
#endif

const char *ratchet_int8_isa(void) { return INT8_ISA; }

/* ------------------------------------------------------------ activations */

/* One token's row x[K] (K % 32 == 0) -> xu[K] (xq + 128, or hi + 128), xlo[K] (16 bits: lo),
 * d32[K / 32] (dx per block), sum16[K / 16] (sum of xq per 16: the offset term's activation side). */
static void quantize_row(const float *x, int K, int bits, uint8_t *xu, uint8_t *xlo, float *d32, int32_t *sum16) {
    const float A = bits == 16 ? 32767.0f : 127.0f;
    for (int b = 0; b < K / QA; b++) {
        const float *xb = x + b * QA;
        float amax = 0.0f;
        for (int j = 0; j < QA; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / A, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < QA; j++) {
            int v = (int)rintf(xb[j] * id);
            v = v > (int)A ? (int)A : v < -(int)A ? -(int)A : v;
            if (bits == 16) {
                xu[b * QA + j] = (uint8_t)((v >> 8) + 128); /* arithmetic shift: floor(v / 256) */
                xlo[b * QA + j] = (uint8_t)(v & 0xFF);
            } else {
                xu[b * QA + j] = (uint8_t)(v + 128);
            }
            sum[j / 16] += v;
        }
        d32[b] = d;
        sum16[2 * b] = sum[0];
        sum16[2 * b + 1] = sum[1];
    }
}

/* exported for tests: the activation blocks as the kernel sees them (xlo only for 16 bits) */
void ratchet_quantize_q8(const float *x, int M, int K, int bits, uint8_t *xu, uint8_t *xlo, float *d32,
                         int32_t *sum16) {
    for (int t = 0; t < M; t++)
        quantize_row(x + (long)t * K, K, bits, xu + (long)t * K, bits == 16 ? xlo + (long)t * K : NULL,
                     d32 + (long)t * (K / 32), sum16 + (long)t * (K / 16));
}

/* ------------------------------------------------------------ weights: to_q8w per format */

#define QK 32
#define QK_K 256

static inline void fill(float *p, int n, float v) {
    for (int i = 0; i < n; i++) p[i] = v;
}

void q8w_q4_0(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    (void)m16;
    for (int64_t b = 0; b < n; b++, src += 18, q += QK, s4 += QK / 4) {
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((src[2 + j] & 0x0F) - 8);
            q[j + 16] = (int8_t)((src[2 + j] >> 4) - 8);
        }
        fill(s4, QK / 4, load_fp16(src));
    }
}

void q8w_q4_1(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 20, q += QK, s4 += QK / 4, m16 += 2) {
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(src[4 + j] & 0x0F);
            q[j + 16] = (int8_t)(src[4 + j] >> 4);
        }
        fill(s4, QK / 4, load_fp16(src));
        fill(m16, 2, load_fp16(src + 2));
    }
}

static inline void q5_values(const uint8_t *qs, uint32_t qh, int off, int8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4)) - off);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - off);
    }
}

void q8w_q5_0(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    (void)m16;
    for (int64_t b = 0; b < n; b++, src += 22, q += QK, s4 += QK / 4) {
        uint32_t qh;
        memcpy(&qh, src + 2, 4);
        q5_values(src + 6, qh, 16, q);
        fill(s4, QK / 4, load_fp16(src));
    }
}

void q8w_q5_1(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 24, q += QK, s4 += QK / 4, m16 += 2) {
        uint32_t qh;
        memcpy(&qh, src + 4, 4);
        q5_values(src + 8, qh, 0, q);
        fill(s4, QK / 4, load_fp16(src));
        fill(m16, 2, load_fp16(src + 2));
    }
}

void q8w_q8_0(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    (void)m16;
    for (int64_t b = 0; b < n; b++, src += 34, q += QK, s4 += QK / 4) {
        memcpy(q, src + 2, QK);
        fill(s4, QK / 4, load_fp16(src));
    }
}

void q8w_q2_k(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 84, q += QK_K, s4 += QK_K / 4, m16 += 16) {
        const uint8_t *sc = src, *qs = src + 16;
        const float d = load_fp16(src + 80), dmin = load_fp16(src + 82);
        for (int i = 0; i < QK_K; i++) q[i] = (int8_t)((qs[(i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3);
        for (int sb = 0; sb < 16; sb++) {
            fill(s4 + 4 * sb, 4, d * (float)(sc[sb] & 0x0F));
            m16[sb] = -(dmin * (float)(sc[sb] >> 4));
        }
    }
}

void q8w_q3_k(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    (void)m16;
    for (int64_t b = 0; b < n; b++, src += 110, q += QK_K, s4 += QK_K / 4) {
        const uint8_t *hmask = src, *qs = src + 32, *scales = src + 96;
        const float d = load_fp16(src + 108);
        for (int sb = 0; sb < 16; sb++) {
            int lo = (sb < 8 ? scales[sb] : scales[sb - 8] >> 4) & 0x0F;
            int hi = (scales[8 + sb % 4] >> (2 * (sb / 4))) & 3;
            fill(s4 + 4 * sb, 4, d * (float)((lo | (hi << 4)) - 32));
        }
        for (int i = 0; i < QK_K; i++) {
            int l = i % 32;
            int ql = (qs[(i / 128) * 32 + l] >> (2 * ((i % 128) / 32))) & 3;
            int qh = ((hmask[l] >> (i / 32)) & 1) ^ 1;
            q[i] = (int8_t)(ql - (qh << 2));
        }
    }
}

static inline void k4_sm(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

static inline void k4_factors(const uint8_t *src, float *s4, float *m16) {
    const float d = load_fp16(src), dmin = load_fp16(src + 2);
    uint8_t sc[8], mn[8];
    k4_sm(src + 4, sc, mn);
    for (int sb = 0; sb < 8; sb++) {
        fill(s4 + 8 * sb, 8, d * (float)sc[sb]);
        fill(m16 + 2 * sb, 2, -(dmin * (float)mn[sb]));
    }
}

void q8w_q4_k(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 144, q += QK_K, s4 += QK_K / 4, m16 += 16) {
        const uint8_t *qs = src + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[c * 64 + l] = (int8_t)(qs[c * 32 + l] & 0x0F);
                q[c * 64 + 32 + l] = (int8_t)(qs[c * 32 + l] >> 4);
            }
        k4_factors(src, s4, m16);
    }
}

void q8w_q5_k(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 176, q += QK_K, s4 += QK_K / 4, m16 += 16) {
        const uint8_t *qh = src + 16, *qs = src + 48;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[c * 64 + l] = (int8_t)((qs[c * 32 + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
                q[c * 64 + 32 + l] = (int8_t)((qs[c * 32 + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
        k4_factors(src, s4, m16);
    }
}

void q8w_q6_k(const uint8_t *src, int8_t *q, float *s4, float *m16, int64_t n) {
    (void)m16;
    for (int64_t b = 0; b < n; b++, src += 210, q += QK_K, s4 += QK_K / 4) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *scales = (const int8_t *)(src + 192);
        const float d = load_fp16(src + 208);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 128; j++) {
                int lo = (ql[h * 64 + j % 64] >> (4 * (j / 64))) & 0x0F;
                int hi = (qh[h * 32 + j % 32] >> (2 * (j / 32))) & 3;
                q[h * 128 + j] = (int8_t)((lo | (hi << 4)) - 32);
            }
        for (int sb = 0; sb < 16; sb++) fill(s4 + 4 * sb, 4, d * (float)scales[sb]);
    }
}

/* ------------------------------------------------------------ packing (once per weight) */

typedef struct {
    int32_t type;
    int32_t rows;
    const uint8_t *data;
    int64_t row_bytes;
    const int32_t *rowmap;
} part_q8_t; /* same layout as part_t in matmul.c */

/* Weight rows of parts (N = sum of rows) -> panels of 16 rows (the last padded with zero rows):
 *   Q    [NP/16][K/G][G/4][16][4] int8     CORR, S, M [NP/16][K/G][16] (M only if Mo != NULL) */
void ratchet_pack_q8(const part_q8_t *parts, int nparts, int K, int G, int8_t *Q, int32_t *CORR, float *S,
                     float *Mo, int threads) {
    int N = 0;
    for (int i = 0; i < nparts; i++) N += parts[i].rows;
    const int NPAN = (N + PN - 1) / PN, NG = K / G;
#pragma omp parallel num_threads(threads)
    {
        int8_t *q = malloc((size_t)K);
        float *s4 = malloc(sizeof(float) * (size_t)(K / 4)), *m16 = calloc((size_t)(K / 16), sizeof(float));
#pragma omp for schedule(static)
        for (int p = 0; p < NPAN; p++) {
            for (int r = 0; r < PN; r++) {
                int row = p * PN + r, pi = 0;
                if (row < N) {
                    while (row >= parts[pi].rows) row -= parts[pi++].rows;
                    const part_q8_t *pt = &parts[pi];
                    const ggml_type_t *ty = &RATCHET_TYPES[pt->type];
                    long stored = pt->rowmap ? pt->rowmap[row] : row;
                    for (int g = 0; g < K / 16; g++) m16[g] = 0.0f;
                    ty->to_q8w(pt->data + stored * pt->row_bytes, q, s4, m16, K / ty->blck);
                } else {
                    memset(q, 0, (size_t)K);
                    for (int l = 0; l < K / 4; l++) s4[l] = 0.0f;
                    for (int g = 0; g < K / 16; g++) m16[g] = 0.0f;
                }
                for (int g = 0; g < NG; g++) {
                    const long pg = (long)p * NG + g;
                    int32_t sum = 0;
                    for (int c = 0; c < G / 4; c++)
                        for (int j = 0; j < 4; j++) {
                            const int8_t v = q[g * G + 4 * c + j];
                            Q[((pg * (G / 4) + c) * PN + r) * 4 + j] = v;
                            sum += v;
                        }
                    CORR[pg * PN + r] = -128 * sum;
                    S[pg * PN + r] = s4[g * G / 4];
                    if (Mo) Mo[pg * PN + r] = m16[g * G / 16];
                }
            }
        }
        free(q);
        free(s4);
        free(m16);
    }
}

/* ------------------------------------------------------------ the matmul */

typedef struct {
    const uint8_t *xu;  /* [K] */
    const uint8_t *xlo; /* [K] (16 bits) or NULL */
    const float *dx;   /* [K / G] */
    const float *xs;   /* [K / G]: dx * sum of the group's xq */
} xrow_t;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline __attribute__((always_inline)) void panel_tile(const int8_t *Q, const int32_t *CORR, const float *S,
                                                             const float *Mo, const xrow_t *xs, int NG, int G,
                                                             float *y, int N, int nvalid, const int tt) {
    __m512 acc[TT];
    for (int t = 0; t < tt; t++) acc[t] = _mm512_setzero_ps();
    const int C = G / 4;
    for (int g = 0; g < NG; g++) {
        const __m512i *qv = (const __m512i *)(Q + (long)g * C * 64);
        const __m512i corr = _mm512_loadu_si512(CORR + g * PN);
        const __m512 sv = _mm512_loadu_ps(S + g * PN);
        for (int t = 0; t < tt; t++) {
            const int32_t *xw = (const int32_t *)(xs[t].xu + (long)g * G);
            __m512i I = corr, J = _mm512_setzero_si512(); /* two chains (integer sums: order-free) */
            for (int c = 0; c < C; c += 2) {
                I = _mm512_dpbusd_epi32(I, _mm512_set1_epi32(xw[c]), _mm512_loadu_si512(qv + c));
                J = _mm512_dpbusd_epi32(J, _mm512_set1_epi32(xw[c + 1]), _mm512_loadu_si512(qv + c + 1));
            }
            I = _mm512_add_epi32(I, J);
            if (xs[t].xlo) { /* 16 bits: I = 256 * I_hi + I_lo */
                const int32_t *xl = (const int32_t *)(xs[t].xlo + (long)g * G);
                __m512i L0 = _mm512_setzero_si512(), L1 = _mm512_setzero_si512();
                for (int c = 0; c < C; c += 2) {
                    L0 = _mm512_dpbusd_epi32(L0, _mm512_set1_epi32(xl[c]), _mm512_loadu_si512(qv + c));
                    L1 = _mm512_dpbusd_epi32(L1, _mm512_set1_epi32(xl[c + 1]), _mm512_loadu_si512(qv + c + 1));
                }
                I = _mm512_add_epi32(_mm512_slli_epi32(I, 8), _mm512_add_epi32(L0, L1));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sv, _mm512_set1_ps(xs[t].dx[g])), acc[t]);
            if (Mo) acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(Mo + g * PN), _mm512_set1_ps(xs[t].xs[g]), acc[t]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    for (int t = 0; t < tt; t++) _mm512_mask_storeu_ps(y + (long)t * N, mask, acc[t]);
}
#else
/* portable C (and the AVX-VNNI build, which the compiler vectorizes): the same sequence per lane */
static inline void panel_tile(const int8_t *Q, const int32_t *CORR, const float *S, const float *Mo,
                              const xrow_t *xs, int NG, int G, float *y, int N, int nvalid, const int tt) {
    float acc[TT][PN];
    for (int t = 0; t < tt; t++)
        for (int l = 0; l < PN; l++) acc[t][l] = 0.0f;
    const int C = G / 4;
    for (int g = 0; g < NG; g++) {
        const int8_t *qg = Q + (long)g * C * 64;
        for (int t = 0; t < tt; t++) {
            const uint8_t *xw = xs[t].xu + (long)g * G;
            int32_t I[PN];
            for (int l = 0; l < PN; l++) I[l] = CORR[g * PN + l];
            for (int c = 0; c < C; c++)
                for (int l = 0; l < PN; l++)
                    for (int j = 0; j < 4; j++) I[l] += (int32_t)xw[4 * c + j] * (int32_t)qg[(c * PN + l) * 4 + j];
            if (xs[t].xlo) { /* 16 bits: I = 256 * I_hi + I_lo */
                const uint8_t *xl = xs[t].xlo + (long)g * G;
                for (int l = 0; l < PN; l++) {
                    int32_t lo = 0;
                    for (int c = 0; c < C; c++)
                        for (int j = 0; j < 4; j++) lo += (int32_t)xl[4 * c + j] * (int32_t)qg[(c * PN + l) * 4 + j];
                    I[l] = I[l] * 256 + lo;
                }
            }
            const float dx = xs[t].dx[g];
            for (int l = 0; l < PN; l++) {
                acc[t][l] = fmaf((float)I[l], S[g * PN + l] * dx, acc[t][l]);
                if (Mo) acc[t][l] = fmaf(Mo[g * PN + l], xs[t].xs[g], acc[t][l]);
            }
        }
    }
    for (int t = 0; t < tt; t++)
        for (int l = 0; l < nvalid; l++) y[(long)t * N + l] = acc[t][l];
}
#endif

static void panel_any(const int8_t *Q, const int32_t *CORR, const float *S, const float *Mo, const xrow_t *xs,
                      int NG, int G, float *y, int N, int nvalid, int tt) {
    switch (tt) { /* literal tile sizes: the accumulators live in registers */
    case 1: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 1); break;
    case 2: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 2); break;
    case 3: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 3); break;
    case 4: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 4); break;
    case 5: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 5); break;
    case 6: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 6); break;
    case 7: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, 7); break;
    default: panel_tile(Q, CORR, S, Mo, xs, NG, G, y, N, nvalid, TT); break;
    }
}

/* y [M, N] = x [M, K] @ w.T, activations of `bits` (8 or 16), w packed by ratchet_pack_q8 with
 * group size G (16 or 32) */
void ratchet_mm_q8(const float *x, int M, int K, int bits, int G, const int8_t *Q, const int32_t *CORR, const float *S,
                   const float *Mo, float *y, int N, int threads) {
    if (M <= 0 || N <= 0) return;
    const int NG = K / G, NPAN = (N + PN - 1) / PN;
    uint8_t *xu = malloc((size_t)M * K), *xlo = bits == 16 ? malloc((size_t)M * K) : NULL;
    float *d32 = malloc(sizeof(float) * (size_t)M * (K / 32)), *dxg = malloc(sizeof(float) * (size_t)M * NG);
    float *xsg = malloc(sizeof(float) * (size_t)M * NG);
    int32_t *sum16 = malloc(sizeof(int32_t) * (size_t)M * (K / 16));
    xrow_t *xr = malloc(sizeof(xrow_t) * (size_t)M);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < M; t++) { /* each token quantized on its own: nothing depends on M */
            float *d = d32 + (long)t * (K / 32), *dg = dxg + (long)t * NG, *sg = xsg + (long)t * NG;
            int32_t *s16 = sum16 + (long)t * (K / 16);
            uint8_t *lo = xlo ? xlo + (long)t * K : NULL;
            quantize_row(x + (long)t * K, K, bits, xu + (long)t * K, lo, d, s16);
            for (int g = 0; g < NG; g++) {
                dg[g] = d[g * G / 32];
                sg[g] = dg[g] * (float)(G == 32 ? s16[2 * g] + s16[2 * g + 1] : s16[g]);
            }
            xr[t] = (xrow_t){xu + (long)t * K, lo, dg, sg};
        }
#pragma omp for schedule(static)
        for (int p = 0; p < NPAN; p++) {
            const long pg = (long)p * NG;
            const int nvalid = MIN(PN, N - p * PN);
            for (int t0 = 0; t0 < M; t0 += TT)
                panel_any(Q + pg * G * PN, CORR + pg * PN, S + pg * PN, Mo ? Mo + pg * PN : NULL, xr + t0, NG, G,
                          y + (long)t0 * N + p * PN, N, nvalid, MIN(TT, M - t0));
        }
    }
    free(xu);
    free(xlo);
    free(d32);
    free(dxg);
    free(xsg);
    free(sum16);
    free(xr);
}
