/* y = x @ w.T with integer activations and integer dot products (the "int8" / "int16" numerics modes).
 *
 * Activations: each token's row is quantized on its own, in blocks of 32, with A = 127 (8 bits,
 * llama.cpp's Q8_0 activations: numerics "int8") or A = 32639 (16 bits: numerics "int16"):
 *   dx = max|x| / A, xq = rint(x * (1 / dx)) in [-A, A] (dx = 0 gives 0)
 * 8 bits: the signed bytes xq. 16 bits: xq = 256 * hi + lo with both halves signed bytes
 * (lo = xq's low byte read as int8, hi = (xq - lo) / 256 in [-127, 127]: why A is 32639, not
 * 32767); each half goes through the same int8 products, I = 256 * I_hi + I_lo.
 *
 * Weights: a format's to_q8w (ggml_types.h, one column of the type table) rewrites a row's blocks as
 *   w[k] = s[g] * q[k] + m[g],  s[g] = D * c[g],  m[g] = D_m * c_m[g]
 * q int8; per group g of G = 32 or 16 weights a scale and an offset, each the product of the
 * block's fp16 factor (D = d, D_m = -dmin or the block's min) and a small integer multiplier (a
 * K-quant's 6-bit sub-scale; 1 for the 32-weight formats): the format's own dequantization formula
 * regrouped (Q4_0: q = nibble - 8, s = d; Q4_K: q = nibble, s = d * sc, m = -dmin * mn; ...), so no
 * weight is re-quantized. At its first integer-mode use a weight is packed once (ratchet_q8_plan,
 * ratchet_pack_q8) in panels of 16 output rows: the values made unsigned, u = q + z with z = 0 or
 * the power of two >= -min(q), laid out in the VNNI order (one 64-byte vector = 4 consecutive
 * weights of each of the 16 rows) in vb bits per value: 4 (two per byte; the kernel splits the
 * nibbles in registers: Q4_0, Q4_1, Q4_K, Q2_K, Q3_K), 5 or 6 (nibbles plus a plane of the high bit
 * or two: Q5_*, Q6_K), else 8 (bytes: Q8_0); G is 32 unless a row of the panel changes its
 * multipliers within 32 weights (Q6_K, Q3_K, Q2_K: G = 16); beside the values, per row, one fp16 D
 * (and D_m) per super-group of SB weights (256 for the K-quants: the span over which d stays) and an
 * int8 c (and c_m) per group, none where every multiplier is 1 (a "unit" panel: the 32-weight
 * formats, s = D, also saving the multiply per group). Every choice is read from the values, per
 * panel, never from the format's name. Bytes per weight: Q4_K 0.58 (file 0.56), Q6_K 0.82 (0.82), Q8_0 1.09 (1.06).
 *
 * Output row n, token t, per group g (I exact in int32; unsigned weight bytes times signed
 * activation bytes is exactly what vpdpbusd multiplies; the zero point comes off as z * sum xq):
 *   I = sum_{k in g} u[n, k] xq[k] - z sum_{k in g} xq[k];  acc = fma(float(I), s[n, g] * dx[t, g], acc);
 *   acc = fma(m[n, g], dx[t, g] * sum_{k in g} xq[k], acc)
 * in increasing g (except groups of 16 with 8-bit activations and no offsets, Q6_K and Q3_K: the two
 * groups of an activation block are summed in integers first, J = c[g0] I[g0] + c[g1] I[g1], then
 * as = fma(float(J), dx, as) and per super-group acc = fma(as, D, acc): PAIRED in matmul_int8_panel.h),
 * one scalar sequence per output (16 outputs are the 16 lanes of a vector;
 * nothing is reduced across lanes). Tiles: a group's weight vectors are loaded (and unpacked) once
 * and used for every token of a tile, each token with its own accumulator: up to TR (8) tokens with
 * the accumulators in registers (panel_tile), on AVX-512 up to TT (15) with the tokens streamed through
 * the weights (panel_stream; merge_rest below says when). The sequence per output does not depend on
 * how many tokens share the call, the tiling or the thread count, so a row's result is bit-identical
 * alone or among any number of rows (batch-invariant), and every build gives the AVX-512 build's bits.
 */
#include <math.h>
#include <stdlib.h>

#include "ggml_types.h"
#include "matmul_int8_panel.h"
#include "silu.h"

#ifdef _OPENMP
#include <omp.h>
#else /* a compiler without OpenMP: the parallel loops run on the calling thread */
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define QA 32 /* activation block */
#define A8 127
#define A16 32639

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_ISA "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_ISA "avx2" /* vpmaddubsw + vpmaddwd (AVX-VNNI machines take this path too) */
#define PAIRS16 1 /* 16-bit activations reach the kernel as int16 pairs (prep_tile_blocks) */
#else
#define INT8_ISA "scalar"
#endif

const char *ratchet_int8_isa(void) { return INT8_ISA; }

/* ------------------------------------------------------------ activations */

#if defined(__AVX512F__)
/* Lane j of the result = the max (float) or sum (int32) of v[j]'s 16 lanes, for 16 vectors at once: a
 * tree of in-register shuffles, each level halving the vectors (3 shuffles + 1 op per pair), then one
 * permutation: 2.9 ops a vector where _mm512_reduce_* took ~8 with a serial dependency. Max is exact in
 * any order and int32 sums are exact: the same values as the per-block reductions. */
#define HREDUCE16(NAME, T, OP, TOPS, FROMPS)                                                                           \
    static inline __attribute__((always_inline)) T NAME(const T v[16]) {                                              \
        __m512 w[8], x[4], y[2];                                                                                      \
        for (int i = 0; i < 8; i++) {                                                                                 \
            const __m512 a = TOPS(v[2 * i]), b = TOPS(v[2 * i + 1]);                                                  \
            w[i] = TOPS(OP(FROMPS(_mm512_shuffle_f32x4(a, b, 0x44)), FROMPS(_mm512_shuffle_f32x4(a, b, 0xEE))));      \
        }                                                                                                             \
        for (int i = 0; i < 4; i++)                                                                                   \
            x[i] = TOPS(OP(FROMPS(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88)),                               \
                           FROMPS(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD))));                             \
        for (int i = 0; i < 2; i++)                                                                                   \
            y[i] = TOPS(OP(FROMPS(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0))),               \
                           FROMPS(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)))));             \
        const T z = OP(FROMPS(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0))),                               \
                       FROMPS(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1))));                              \
        /* element 4k + m of z reduced v[4m + k] */                                                                   \
        return FROMPS(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), \
                                            TOPS(z)));                                                                \
    }
#define PS_ID(v) (v)
HREDUCE16(hmax16_ps, __m512, _mm512_max_ps, PS_ID, PS_ID)
HREDUCE16(hsum16_epi32, __m512i, _mm512_add_epi32, _mm512_castsi512_ps, _mm512_castps_si512)

/* quantize_row's 32-blocks b0..b0+15 at once (same values): the 16 amax in one vector, one vector division
 * for their dx and another for 1 / dx, the sums of xq per 16 by hsum16_epi32 */
static inline void quantize_16blocks(const float *x, int bits, int8_t *xh, int8_t *xl, float *d32, int32_t *sum16) {
    const int A = bits == 16 ? A16 : A8;
    __m512 mx[16];
    for (int j = 0; j < 16; j++)
        mx[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j * QA)), _mm512_abs_ps(_mm512_loadu_ps(x + j * QA + 16)));
    const __m512 d = _mm512_div_ps(hmax16_ps(mx), _mm512_set1_ps((float)A));
    const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), d);
    float ids[16];
    _mm512_storeu_ps(d32, d);
    _mm512_storeu_ps(ids, id);
    for (int s = 0; s < 2; s++) { /* 8 blocks: 16 vectors of xq, then their 16 sums */
        __m512i q[16];
        for (int j = 0; j < 8; j++) {
            const int b = 8 * s + j;
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + b * QA + 16 * h), _mm512_set1_ps(ids[b])));
                v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-A)), _mm512_set1_epi32(A));
                q[2 * j + h] = v;
                if (bits == 16) {
                    const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
                    _mm_storeu_si128((__m128i *)(xl + b * QA + 16 * h), _mm512_cvtepi32_epi8(lo));
                    v = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
                }
                _mm_storeu_si128((__m128i *)(xh + b * QA + 16 * h), _mm512_cvtepi32_epi8(v));
            }
        }
        _mm512_storeu_si512(sum16 + 16 * s, hsum16_epi32(q));
    }
}
#endif

/* One token's row x[K] (K % 32 == 0) -> xh[K] (8 bits: xq; 16 bits: hi), xl[K] (16 bits: lo),
 * d32[K / 32] (dx per block), sum16[K / 16] (sum of xq per 16: the offset term's activation side). */
static void quantize_row(const float *x, int K, int bits, int8_t *xh, int8_t *xl, float *d32, int32_t *sum16) {
    const int A = bits == 16 ? A16 : A8;
    int b0 = 0;
#if defined(__AVX512F__) /* 16 blocks at a time (the per-block loop below for the rest: the same values) */
    for (; b0 + 16 <= K / QA; b0 += 16)
        quantize_16blocks(x + b0 * QA, bits, xh + b0 * QA, bits == 16 ? xl + b0 * QA : NULL, d32 + b0, sum16 + 2 * b0);
#endif
    for (int b = b0; b < K / QA; b++) {
        const float *xb = x + b * QA;
        float amax = 0.0f;
#if defined(__AVX512F__)
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)),
                                                  _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
#elif defined(__AVX2__) /* max is exact in any order: the portable loop's value */
        const __m256 sgn = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_andnot_ps(sgn, _mm256_loadu_ps(xb));
        for (int j = 8; j < QA; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sgn, _mm256_loadu_ps(xb + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
        for (int j = 0; j < QA; j++) amax = fmaxf(amax, fabsf(xb[j]));
#endif
        const float d = amax / (float)A, id = d > 0.0f ? 1.0f / d : 0.0f;
        d32[b] = d;
#if defined(__AVX512F__) /* cvtps_epi32 rounds to nearest even, as rintf in the default mode */
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), _mm512_set1_ps(id)));
            v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-A)), _mm512_set1_epi32(A));
            sum16[2 * b + h] = _mm512_reduce_add_epi32(v);
            if (bits == 16) {
                const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
                _mm_storeu_si128((__m128i *)(xl + b * QA + 16 * h), _mm512_cvtepi32_epi8(lo));
                v = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
            }
            _mm_storeu_si128((__m128i *)(xh + b * QA + 16 * h), _mm512_cvtepi32_epi8(v));
        }
#else
        int32_t vq[QA];
#if defined(__AVX2__) /* cvtps_epi32 rounds to nearest even, as rintf */
        for (int j = 0; j < QA; j += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), _mm256_set1_ps(id)));
            _mm256_storeu_si256((__m256i *)(vq + j),
                                _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(-A)), _mm256_set1_epi32(A)));
        }
#else
        for (int j = 0; j < QA; j++) {
            const int v = (int)rintf(xb[j] * id);
            vq[j] = v > A ? A : v < -A ? -A : v;
        }
#endif
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < QA; j++) {
            int v = vq[j];
            sum[j / 16] += v;
            if (bits == 16) {
                const int lo = (int)(int8_t)(uint8_t)(v & 0xFF);
                xl[b * QA + j] = (int8_t)lo;
                v = (v - lo) / 256;
            }
            xh[b * QA + j] = (int8_t)v;
        }
        sum16[2 * b] = sum[0];
        sum16[2 * b + 1] = sum[1];
#endif
    }
}

/* exported for tests: the activation blocks as the kernel sees them (xl only for 16 bits) */
void ratchet_quantize_q8(const float *x, int M, int K, int bits, int8_t *xh, int8_t *xl, float *d32,
                         int32_t *sum16) {
    for (int t = 0; t < M; t++)
        quantize_row(x + (long)t * K, K, bits, xh + (long)t * K, bits == 16 ? xl + (long)t * K : NULL,
                     d32 + (long)t * (K / 32), sum16 + (long)t * (K / 16));
}

/* ------------------------------------------------------------ weights: to_q8w per format */

#define QK 32
#define QK_K 256

static inline void fill8(int8_t *p, int n, int v) {
    for (int i = 0; i < n; i++) p[i] = (int8_t)v;
}

/* formats with one scale (and offset) per block of 32: d, dm are the block's own fp16 numbers, c = 1 */
static inline void unit_factors(const uint8_t *d, const uint8_t *m, float *db, float *dmb, int8_t *c16, int8_t *cm16) {
    *db = load_fp16(d);
    *dmb = m ? load_fp16(m) : 0.0f;
    fill8(c16, QK / 16, 1);
    fill8(cm16, QK / 16, m ? 1 : 0);
}

void q8w_q4_0(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 18, q += QK, c16 += 2, cm16 += 2) {
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((src[2 + j] & 0x0F) - 8);
            q[j + 16] = (int8_t)((src[2 + j] >> 4) - 8);
        }
        unit_factors(src, NULL, d + b, dm + b, c16, cm16);
    }
}

void q8w_q4_1(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 20, q += QK, c16 += 2, cm16 += 2) {
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(src[4 + j] & 0x0F);
            q[j + 16] = (int8_t)(src[4 + j] >> 4);
        }
        unit_factors(src, src + 2, d + b, dm + b, c16, cm16);
    }
}

static inline void q5_values(const uint8_t *qs, uint32_t qh, int off, int8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4)) - off);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - off);
    }
}

void q8w_q5_0(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 22, q += QK, c16 += 2, cm16 += 2) {
        uint32_t qh;
        memcpy(&qh, src + 2, 4);
        q5_values(src + 6, qh, 16, q);
        unit_factors(src, NULL, d + b, dm + b, c16, cm16);
    }
}

void q8w_q5_1(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 24, q += QK, c16 += 2, cm16 += 2) {
        uint32_t qh;
        memcpy(&qh, src + 4, 4);
        q5_values(src + 8, qh, 0, q);
        unit_factors(src, src + 2, d + b, dm + b, c16, cm16);
    }
}

void q8w_q8_0(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 34, q += QK, c16 += 2, cm16 += 2) {
        memcpy(q, src + 2, QK);
        unit_factors(src, NULL, d + b, dm + b, c16, cm16);
    }
}

void q8w_q2_k(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 84, q += QK_K, c16 += 16, cm16 += 16) {
        const uint8_t *sc = src, *qs = src + 16;
        d[b] = load_fp16(src + 80);
        dm[b] = -load_fp16(src + 82);
        for (int i = 0; i < QK_K; i++) q[i] = (int8_t)((qs[(i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3);
        for (int sb = 0; sb < 16; sb++) {
            c16[sb] = (int8_t)(sc[sb] & 0x0F);
            cm16[sb] = (int8_t)(sc[sb] >> 4);
        }
    }
}

void q8w_q3_k(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 110, q += QK_K, c16 += 16, cm16 += 16) {
        const uint8_t *hmask = src, *qs = src + 32, *scales = src + 96;
        d[b] = load_fp16(src + 108);
        dm[b] = 0.0f;
        for (int sb = 0; sb < 16; sb++) {
            int lo = (sb < 8 ? scales[sb] : scales[sb - 8] >> 4) & 0x0F;
            int hi = (scales[8 + sb % 4] >> (2 * (sb / 4))) & 3;
            c16[sb] = (int8_t)((lo | (hi << 4)) - 32);
            cm16[sb] = 0;
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

/* Q4_K / Q5_K: s = d * sc (6 bits), m = -dmin * mn (6 bits), one of each per 32 weights */
static inline void k4_factors(const uint8_t *src, float *d, float *dm, int8_t *c16, int8_t *cm16) {
    *d = load_fp16(src);
    *dm = -load_fp16(src + 2);
    uint8_t sc[8], mn[8];
    k4_sm(src + 4, sc, mn);
    for (int sb = 0; sb < 8; sb++) {
        fill8(c16 + 2 * sb, 2, sc[sb]);
        fill8(cm16 + 2 * sb, 2, mn[sb]);
    }
}

void q8w_q4_k(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 144, q += QK_K, c16 += 16, cm16 += 16) {
        const uint8_t *qs = src + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[c * 64 + l] = (int8_t)(qs[c * 32 + l] & 0x0F);
                q[c * 64 + 32 + l] = (int8_t)(qs[c * 32 + l] >> 4);
            }
        k4_factors(src, d + b, dm + b, c16, cm16);
    }
}

void q8w_q5_k(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 176, q += QK_K, c16 += 16, cm16 += 16) {
        const uint8_t *qh = src + 16, *qs = src + 48;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[c * 64 + l] = (int8_t)((qs[c * 32 + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
                q[c * 64 + 32 + l] = (int8_t)((qs[c * 32 + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
        k4_factors(src, d + b, dm + b, c16, cm16);
    }
}

void q8w_q6_k(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 210, q += QK_K, c16 += 16, cm16 += 16) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *scales = (const int8_t *)(src + 192);
        d[b] = load_fp16(src + 208);
        dm[b] = 0.0f;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 128; j++) {
                int lo = (ql[h * 64 + j % 64] >> (4 * (j / 64))) & 0x0F;
                int hi = (qh[h * 32 + j % 32] >> (2 * (j / 32))) & 3;
                q[h * 128 + j] = (int8_t)((lo | (hi << 4)) - 32);
            }
        memcpy(c16, scales, 16);
        fill8(cm16, 16, 0);
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

typedef struct {
    int32_t vb;    /* bits per stored value: 4 (nibbles), 5 or 6 (nibbles + a 1- or 2-bit plane), 8 (bytes) */
    int32_t G;     /* weights per group (one scale multiplier c, one offset multiplier): 32 or 16 */
    int32_t z;     /* zero point: 0 or a power of two (u = q + z for every weight of the panel) */
    int32_t has_m; /* 1: the groups have offsets (D_m and c_m beside D and c) */
    int32_t SB;    /* weights per super-group (one fp16 D and D_m per row): 256, 128, 64 or 32 */
    int32_t unit;  /* 1: every multiplier is 1 (the 32-weight formats): per group only D (and D_m), s = D */
    int64_t qoff;  /* byte offset of the panel's weights in Q */
    int64_t soff;  /* byte offset of its factors in SM */
} q8panel_t;

/* A row's integer form, per 32 or 16 weights: w[k] = d32[k / 32] * c16[k / 16] * q[k] + dm32[k / 32] * cm16[k / 16]
 * (to_q8w's per-block d, dm repeated for each 32 weights of the block). Scratch for one row. */
typedef struct {
    int8_t *q, *c16, *cm16;
    float *d32, *dm32, *db, *dmb;
} rowq8_t;

static rowq8_t row_alloc(int K) {
    rowq8_t r = {malloc((size_t)K), malloc((size_t)K / 16), malloc((size_t)K / 16), malloc(sizeof(float) * (size_t)K / 32),
                 malloc(sizeof(float) * (size_t)K / 32), malloc(sizeof(float) * (size_t)K / 32),
                 malloc(sizeof(float) * (size_t)K / 32)};
    return r;
}

static void row_free(rowq8_t *r) {
    free(r->q);
    free(r->c16);
    free(r->cm16);
    free(r->d32);
    free(r->dm32);
    free(r->db);
    free(r->dmb);
}

/* to_q8w of output row `row` (N rows over the parts; beyond N a zero row) */
static void row_q8w(const part_q8_t *parts, int N, int row, int K, rowq8_t *r) {
    if (row >= N) {
        memset(r->q, 0, (size_t)K);
        memset(r->c16, 1, (size_t)K / 16); /* s = 0 * 1: a zero row that keeps a unit panel unit */
        memset(r->cm16, 1, (size_t)K / 16);
        for (int b = 0; b < K / 32; b++) r->d32[b] = r->dm32[b] = 0.0f;
        return;
    }
    int pi = 0;
    while (row >= parts[pi].rows) row -= parts[pi++].rows;
    const part_q8_t *pt = &parts[pi];
    const ggml_type_t *ty = &RATCHET_TYPES[pt->type];
    const long stored = pt->rowmap ? pt->rowmap[row] : row;
    ty->to_q8w(pt->data + stored * pt->row_bytes, r->q, r->db, r->dmb, r->c16, r->cm16, K / ty->blck);
    for (int b = 0; b < K / 32; b++) {
        r->d32[b] = r->db[b * 32 / ty->blck];
        r->dm32[b] = r->dmb[b * 32 / ty->blck];
    }
}

static int total_rows(const part_q8_t *parts, int nparts) {
    int N = 0;
    for (int i = 0; i < nparts; i++) N += parts[i].rows;
    return N;
}

/* f as IEEE half bits, if f is exactly a half (every GGUF integer format's d and dmin are) */
static int fp16_exact(float f, uint16_t *h) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
    const int e = (int)((b >> 23) & 0xFF), E = e - 127;
    const uint32_t m = b & 0x7FFFFF;
    if (e == 0 && m == 0) {
        *h = sign;
        return 1;
    }
    if (e == 0xFF) { /* inf / nan: kept (the weights are what the file says) */
        *h = (uint16_t)(sign | 0x7C00 | (m >> 13) | (m && !(m >> 13)));
        return 1;
    }
    if (E > 15 || E < -24) return 0;
    if (E >= -14) {
        *h = (uint16_t)(sign | ((E + 15) << 10) | (m >> 13));
        return !(m & 0x1FFF);
    }
    const uint32_t full = m | 0x800000;
    const int rs = -(E + 1); /* a subnormal half: value = mant * 2^-24 */
    *h = (uint16_t)(sign | (full >> rs));
    return !(full & ((1u << rs) - 1));
}

/* Decide each panel's layout from its values: G (32 unless a row changes its multipliers within
 * 32 weights), SB (the longest span, up to 256, over which every row keeps its d and dm), z (0, or
 * the smallest power of two >= -min q: u = q + z <= 255 as q <= 127), the bits per value (vb),
 * offsets (any dm * cm != 0); and its offsets in Q and SM. Returns the sizes of Q and SM (bytes) in
 * sizes[0], sizes[1] (sizes[0] = -1: a d or dm that is not an fp16 value), the zero point in sizes[2]. */
void ratchet_q8_plan(const part_q8_t *parts, int nparts, int K, q8panel_t *panels, int64_t *sizes, int threads) {
    const int N = total_rows(parts, nparts), NPAN = (N + PN - 1) / PN;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        rowq8_t rq = row_alloc(K);
#pragma omp for schedule(static)
        for (int p = 0; p < NPAN; p++) {
            int g32 = 1, lo = 0, hi = 0, has_m = 0, SB = 256, c1 = 1, cm1 = 1;
            while (K % SB) SB /= 2;
            for (int r = 0; r < PN; r++) {
                row_q8w(parts, N, p * PN + r, K, &rq);
                for (int g = 0; g < K / 32 && g32; g++)
                    g32 &= rq.c16[2 * g + 1] == rq.c16[2 * g] && rq.cm16[2 * g + 1] == rq.cm16[2 * g];
                for (int k = 0; k < K; k++) {
                    lo = rq.q[k] < lo ? rq.q[k] : lo;
                    hi = rq.q[k] > hi ? rq.q[k] : hi;
                }
                for (int b = 0; b < K / 32; b++) {
                    uint16_t h;
                    bad |= !fp16_exact(rq.d32[b], &h) || !fp16_exact(rq.dm32[b], &h);
                    while (SB > 32 && (rq.d32[b] != rq.d32[b / (SB / 32) * (SB / 32)] ||
                                       rq.dm32[b] != rq.dm32[b / (SB / 32) * (SB / 32)]))
                        SB /= 2;
                }
                for (int g = 0; g < K / 16; g++) {
                    has_m |= rq.dm32[g / 2] * (float)rq.cm16[g] != 0.0f;
                    c1 &= rq.c16[g] == 1;
                    cm1 &= rq.cm16[g] == 1;
                }
            }
            /* unit: no multipliers stored (vb, z: the range for now) */
            panels[p] = (q8panel_t){hi, g32 ? 32 : 16, lo, has_m, SB, g32 && c1 && (cm1 || !has_m), 0, 0};
        }
        row_free(&rq);
    }
    /* one zero point for the weight (the kernel subtracts z * sum xq, precomputed per call): the
     * smallest power of two >= -min q; panels without negative values keep z = 0 */
    int lo = 0;
    for (int p = 0; p < NPAN; p++) lo = panels[p].z < lo ? panels[p].z : lo;
    int zw = 0;
    if (lo < 0)
        for (zw = 1; zw < -lo; zw *= 2) {
        }
    for (int p = 0; p < NPAN; p++) {
        const int z = panels[p].z < 0 ? zw : 0;
        const int umax = panels[p].vb + z; /* u in [0, umax] */
        panels[p].vb = umax <= 15 ? 4 : umax <= 31 && panels[p].G == 32 ? 5 : umax <= 63 ? 6 : 8;
        panels[p].z = z;
        panels[p].unit &= panels[p].vb != 6; /* (no kernel variant for 6-bit unit panels) */
        if (panels[p].unit) panels[p].SB = panels[p].G;
    }
    int64_t qo = 0, so = 0;
    for (int p = 0; p < NPAN; p++) {
        panels[p].qoff = qo;
        panels[p].soff = so;
        qo += (int64_t)K * PN * panels[p].vb / 8;
        so += (int64_t)(K / panels[p].SB) * (1 + panels[p].has_m) * (2 + (panels[p].unit ? 0 : panels[p].SB / panels[p].G)) * PN;
    }
    sizes[0] = bad ? -1 : qo;
    sizes[1] = so;
    sizes[2] = zw;
}

/* One row r's G values of a group into the group's bytes, u = q + z, in the VNNI order: item (c, r, j)
 * = weight 4 c + j of row r, c < C = G / 4, i.e. vector c holds 4 consecutive weights of each of the
 * 16 rows. vb = 8: the C vectors as bytes. vb = 4, 5, 6: C / 2 vectors of nibbles (vector c < C / 2
 * holds item c in its low and item c + C / 2 in its high nibble), then for vb = 6 C / 4 vectors whose
 * bits 2j..2j+1 are bits 4..5 of item 4p + j (p the plane vector), for vb = 5 one vector whose bit j
 * is bit 4 of item j. */
static void plane_pack(const int8_t *qg, int z, int G, int vb, int r, uint8_t *dst) {
    const int C = G / 4;
    for (int c = 0; c < C; c++)
        for (int j = 0; j < 4; j++) {
            const int u = qg[4 * c + j] + z, i = (r * 4 + j);  /* byte i of a vector */
            if (vb == 8) {
                dst[c * 64 + i] = (uint8_t)u;
                continue;
            }
            uint8_t *nb = dst + (c % (C / 2)) * 64 + i;
            *nb = (uint8_t)(c < C / 2 ? (*nb & 0xF0) | (u & 0x0F) : (*nb & 0x0F) | ((u & 0x0F) << 4));
            uint8_t *pl = dst + C / 2 * 64;
            if (vb == 6) {
                uint8_t *b = pl + (c / 4) * 64 + i;
                *b = (uint8_t)((*b & ~(3 << (2 * (c % 4)))) | (((u >> 4) & 3) << (2 * (c % 4))));
            } else if (vb == 5) {
                pl[i] = (uint8_t)((pl[i] & ~(1 << c)) | (((u >> 4) & 1) << c));
            }
        }
}

/* Write each panel as planned: Q (u = q + z in the VNNI order, see plane_pack) and SM, per
 * super-group of SB weights: D[16] (fp16), D_m[16] if the panel has offsets, then per group c[16]
 * (int8) and c_m[16]: the scale s = D * c and the offset m = D_m * c_m of each row. */
void ratchet_pack_q8(const part_q8_t *parts, int nparts, int K, const q8panel_t *panels, uint8_t *Q, uint8_t *SM,
                     int threads) {
    const int N = total_rows(parts, nparts), NPAN = (N + PN - 1) / PN;
#pragma omp parallel num_threads(threads)
    {
        rowq8_t rq = row_alloc(K);
#pragma omp for schedule(static)
        for (int p = 0; p < NPAN; p++) {
            const q8panel_t *pn = &panels[p];
            const int G = pn->G, NG = K / G, vb = pn->vb, z = pn->z, hm = pn->has_m;
            const int GPS = pn->SB / G, SBB = (1 + hm) * (2 + (pn->unit ? 0 : GPS)) * PN; /* bytes per super-group */
            uint8_t *qp = Q + pn->qoff, *sp = SM + pn->soff;
            for (int r = 0; r < PN; r++) {
                row_q8w(parts, N, p * PN + r, K, &rq);
                for (int g = 0; g < NG; g++) {
                    uint8_t *sbp = sp + (long)(g / GPS) * SBB;
                    if (g % GPS == 0) {
                        uint16_t h;
                        fp16_exact(rq.d32[g * G / 32], &h);
                        memcpy(sbp + 2 * r, &h, 2);
                        if (hm) {
                            fp16_exact(rq.dm32[g * G / 32], &h);
                            memcpy(sbp + 2 * PN + 2 * r, &h, 2);
                        }
                    }
                    int8_t *cp = (int8_t *)sbp + (1 + hm) * 2 * PN + (g % GPS) * (1 + hm) * PN;
                    if (!pn->unit) cp[r] = rq.c16[g * G / 16];
                    if (!pn->unit && hm) cp[PN + r] = rq.cm16[g * G / 16];
                    plane_pack(rq.q + g * G, z, G, vb, r, qp + (long)g * G * PN * vb / 8);
                }
            }
        }
        row_free(&rq);
    }
}

/* ------------------------------------------------------------ the matmul */

/* one panel times one tile, by the panel's stored-value width (matmul_int8_panel.h) */
static void panel_any(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int vb, int b16,
                      int has_m, int unit, int SB, float *y, int N, int nvalid, int tt) {
    switch (vb) {
    case 4: ratchet_panel_vb4(Q, SM, z, xs, K, G, b16, has_m, unit, SB, y, N, nvalid, tt); break;
    case 5: ratchet_panel_vb5(Q, SM, z, xs, K, G, b16, has_m, unit, SB, y, N, nvalid, tt); break;
    case 6: ratchet_panel_vb6(Q, SM, z, xs, K, G, b16, has_m, unit, SB, y, N, nvalid, tt); break;
    case 13:
    case 14: ratchet_panel_unpacked(Q, SM, z, xs, K, G, vb, b16, has_m, unit, SB, y, N, nvalid, tt); break;
    default: ratchet_panel_vb8(Q, SM, z, xs, K, G, b16, has_m, unit, SB, y, N, nvalid, tt); break;
    }
}

/* A panel of 5- or 6-bit values (Q, the layout of plane_pack) rewritten as bytes (dst, G * PN bytes a group:
 * the layout of vb 8, values < 2^vb) for the vb + 8 kernels (13, 14). A call of many tiles (a prefill: 64 tiles of 8
 * for 512 tokens) otherwise splits nibbles and merges planes again for every tile: on AVX-512 about a fifth
 * of the Q6_K panel kernel's cycles (perf, 1B Q6_K prefill, one thread, 2026-11-28), on AVX2 more (3-4
 * tokens a pass). GCC vector extensions: one zmm a vector on AVX-512, two ymm on AVX2, the shifts constants. */
typedef uint8_t u8x64 __attribute__((vector_size(64), aligned(1))); /* 64 bytes: one zmm, two ymm, or scalar code */
/* G, vb literals at every call (unpack_panel): the shifts are constants, the loops unrolled */
static inline __attribute__((always_inline)) void unpack_groups(const uint8_t *Q, int K, const int G, const int vb,
                                                                const uint8_t off, uint8_t *dst) {
    const int C = G / 4;
    for (int g = 0; g < K / G; g++) {
        const uint8_t *qg = Q + (long)g * VBYTES(G, vb), *pl = qg + C / 2 * 64;
        uint8_t *o = dst + (long)g * G * PN;
        #pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const u8x64 nb = *(const u8x64 *)(qg + (c % (C / 2)) * 64);
            const u8x64 n = c >= C / 2 ? nb >> 4 : nb & 0x0F;
            const u8x64 p = *(const u8x64 *)(vb == 6 ? pl + (c / 4) * 64 : pl);
            const u8x64 h = vb == 6 ? ((p >> (2 * (c % 4))) & 3) << 4 : ((p >> c) & 1) << 4;
            *(u8x64 *)(o + c * 64) = (n | h) - off; /* (off: u - 32 as a signed byte, mod 256) */
        }
    }
}

#if defined(PAIRS16)
/* A paired panel's multipliers (PAIRED, matmul_int8_panel.h) as the AVX2 kernel reads them, made once per
 * unpacked panel (UNPACK_MUL_BYTES there) instead of once per block and pass of 4 tokens (that was ~6% of the
 * unpacked Q6_K kernel's samples, AVX2, 512 rows): per group and half the 8 rows' (c, c) pairs, then per 32-block
 * and half the rows' constant -128 (c0 Q0 + c1 Q1), Q the sum of a group's 16 signed values (W: the panel
 * unpacked as u - 32). In vectors: the scalar loop this replaced took ~0.4 instructions a weight, beside the
 * products' ~7 of a 64-row MLP call. The other builds read c from SM. */
static void unpack_multipliers(const uint8_t *SMp, const uint8_t *W, int K, int SB, int16_t *dst) {
    const int GPS = SB / 16, SBB = (2 + GPS) * PN, NG = K / 16;
    int32_t *kc = (int32_t *)(dst + (long)NG * 2 * 16);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int b = 0; b < NG / 2; b++) {
        __m256i k[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int gi = 0; gi < 2; gi++) {
            const int g = 2 * b + gi;
            const int8_t *cp = (const int8_t *)SMp + (long)(g / GPS) * SBB + 2 * PN + (g % GPS) * PN;
            const uint8_t *wg = W + (long)g * 16 * PN; /* the group's 4 vectors of 64 bytes (16 rows x 4 values) */
            for (int h = 0; h < 2; h++) {
                const __m128i cb = _mm_loadl_epi64((const __m128i *)(cp + 8 * h));
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(cb, cb)); /* (c, c) per row */
                _mm256_storeu_si256((__m256i *)(dst + ((long)g * 2 + h) * 16), sc);
                __m256i q = _mm256_setzero_si256(); /* per row two int16 sums of 8 values (|.| <= 256) */
                for (int c = 0; c < 4; c++)
                    q = _mm256_add_epi16(q, _mm256_maddubs_epi16(ones, _mm256_loadu_si256((const __m256i *)(wg + c * 64 + 32 * h))));
                k[h] = _mm256_add_epi32(k[h], _mm256_madd_epi16(q, sc)); /* c Q per row */
            }
        }
        for (int h = 0; h < 2; h++) /* |c0 Q0 + c1 Q1| <= 2 * 128 * 512: times -128 within int32 */
            _mm256_storeu_si256((__m256i *)(kc + ((long)b * 2 + h) * 8), _mm256_mullo_epi32(k[h], _mm256_set1_epi32(-128)));
    }
}
#endif

/* off: 32 where the AVX2 kernel takes the values signed (its unpacked paired panels), else 0 */
static void unpack_panel(const uint8_t *Q, int K, int G, int vb, int off, uint8_t *dst) {
    if (vb == 6 && G == 16 && off)
        unpack_groups(Q, K, 16, 6, 32, dst);
    else if (vb == 6 && G == 16)
        unpack_groups(Q, K, 16, 6, 0, dst);
    else if (vb == 6)
        unpack_groups(Q, K, 32, 6, 0, dst);
    else
        unpack_groups(Q, K, 32, 5, 0, dst);
}

/* Calls of UNPACK_ROWS+ rows (prefill, long verifies) go over each thread's panels in blocks of about
 * PANEL_BLOCK bytes of unpacked weights (half of this CPU's 1 MB L2) (5- and 6-bit panels unpacked once per block for the vb 13 / 14 kernels: the same
 * integer sums and float steps, so the same bits at any tile count): every tile's activations are then
 * read once per block of panels instead of once per panel (a 512-token prefill's tiles of K = 8192 are
 * 4.5 MB, more than the L2, re-read for every 16 rows of output), and the block's weights stay in L2. */
#define UNPACK_ROWS 25 /* 4+ tiles of 8 (2 tiles of 8: 1.17x the time, one thread, 2048 x 8192 Q5_K, Q6_K) */
#define PANEL_BLOCK (512 * 1024) /* 128 KB: 1.08-1.16x the time, 1 MB 1.02-1.26x (AVX-512, 512 rows, one thread) */

/* A tile's activation items, token-interleaved (word [i][t] is token t's i-th item; the xtile_t fields
 * in order): xh [K / 4], xl [K / 4] (16 bits) or xu [K / 4] (8 bits, AVX2 build: xq + 128), then per 32-block d,
 * sx32, zq16 (2), zq32, sx16 (2), sp32 */
#if defined(PAIRS16)
#define XU_WORDS 1 /* the AVX2 signed-weight kernel's unsigned activations (matmul_int8_panel.h, panel_pass) */
#else
#define XU_WORDS 0
#endif
static long x_words(int K, int bits) { return (long)K / 4 * (bits == 16 || XU_WORDS ? 2 : 1); }
static long tile_words(int K, int bits) { return x_words(K, bits) + (long)(K / 32) * 8; }

static xtile_t tile_view(int32_t *dst, int K, int bits, int tt) {
    const long NB = K / 32;
    int32_t *rest = dst + x_words(K, bits) * tt, *second = dst + (long)K / 4 * tt;
    return (xtile_t){dst, bits == 16 ? second : NULL, (const float *)rest, rest + 4 * NB * tt,
                     rest + 2 * NB * tt, (const float *)(rest + NB * tt), (const float *)(rest + 5 * NB * tt),
                     rest + 7 * NB * tt, bits == 8 && XU_WORDS ? second : NULL};
}

/* Blocks [b0, b1) of the tile's tt tokens quantized (quantize_row) and written straight into the tile's
 * layout at dst, so a tile's preparation splits over threads by blocks. Token t's values are x + t xs
 * [K], or with `gated` silu(g) * u of its fused gate/up row x + t xs [2 K] (SwiGLU: the down
 * projection's input is made here, the bits of ratchet_silu_mul's). Each token's items depend on its
 * own values only: who prepares which blocks changes no value. */

/* exported for tests: the down projection's input as ratchet_mm_q8w_swiglu makes it, act [M, K] from gu [M, 2 K] */
void ratchet_swiglu_act(const float *gu, int M, int K, float *act) {
    for (int r = 0; r < M; r++) silu_mul_n(gu + 2L * r * K, gu + 2L * r * K + K, K, act + (long)r * K);
}

#define PREP_CHUNK 64 /* blocks per quantize_row call (its outputs on the stack) */
static void prep_tile_blocks(const float *x, long xs, int gated, int K, int bits, int zw, int32_t *dst, int tt,
                             int b0, int b1) {
    const int NB = K / 32;
    const long xl_off = (long)K / 4 * tt, rest_off = x_words(K, bits) * tt;
    int32_t xh[PREP_CHUNK * 8], xl[PREP_CHUNK * 8], q16[PREP_CHUNK * 2];
    float d[PREP_CHUNK], act[gated ? PREP_CHUNK * QA : 1];
    for (int c0 = b0; c0 < b1; c0 += PREP_CHUNK) {
        const int nb = MIN(PREP_CHUNK, b1 - c0);
        for (int t = 0; t < tt; t++) {
            const float *src = x + (long)t * xs + (long)c0 * QA;
            if (gated) {
                silu_mul_n(src, src + K, nb * QA, act); /* silu_mul1's bits, 16 or 8 at a time (silu.h) */
                src = act;
            }
            quantize_row(src, nb * QA, bits, (int8_t *)xh, bits == 16 ? (int8_t *)xl : NULL, d, q16);
            int32_t *wh = dst + (long)c0 * 8 * tt + t;
#if defined(PAIRS16)
            if (bits == 16) { /* the AVX2 kernel's form: items 4i, 4i + 2 and 4i + 1, 4i + 3 as int16 pairs */
                const int8_t *h8 = (const int8_t *)xh, *l8 = (const int8_t *)xl;
                for (int i = 0; i < nb * 8; i++) {
                    uint16_t v[4];
                    for (int j = 0; j < 4; j++) v[j] = (uint16_t)(256 * h8[4 * i + j] + l8[4 * i + j]);
                    wh[(long)i * tt] = (int32_t)(v[0] | (uint32_t)v[2] << 16);
                    wh[xl_off + (long)i * tt] = (int32_t)(v[1] | (uint32_t)v[3] << 16);
                }
            } else
#endif
            {
                for (int i = 0; i < nb * 8; i++) wh[(long)i * tt] = xh[i];
                if (bits == 8 && XU_WORDS) /* xq + 128 per byte, as unsigned bytes (xq ^ 0x80) */
                    for (int i = 0; i < nb * 8; i++) wh[xl_off + (long)i * tt] = (int32_t)((uint32_t)xh[i] ^ 0x80808080u);
                if (bits == 16)
                    for (int i = 0; i < nb * 8; i++) wh[xl_off + (long)i * tt] = xl[i];
            }
            int32_t *rest = dst + rest_off + t;
            float *d32 = (float *)rest, *sx32 = (float *)(rest + (long)NB * tt), *sx16 = (float *)(rest + 5L * NB * tt);
            int32_t *zq16 = rest + 2L * NB * tt, *zq32 = rest + 4L * NB * tt, *sp32 = rest + 7L * NB * tt;
            for (int j = 0; j < nb; j++) {
                const long b = c0 + j;
                const int32_t s0 = q16[2 * j], s1 = q16[2 * j + 1];
                d32[b * tt] = d[j];
                sx32[b * tt] = d[j] * (float)(s0 + s1);
                sx16[2 * b * tt] = d[j] * (float)s0;
                sx16[(2 * b + 1) * tt] = d[j] * (float)s1;
                zq32[b * tt] = -zw * (s0 + s1); /* |sum xq| <= 32 * 32639: exact in int32 for zw <= 128 */
                zq16[2 * b * tt] = -zw * s0;
                zq16[(2 * b + 1) * tt] = -zw * s1;
                sp32[b * tt] = (int32_t)(((uint32_t)s0 & 0xFFFF) | (uint32_t)s1 << 16); /* 8 bits: |s| <= 16 * 127, int16 (paired panels) */
            }
        }
    }
}

/* Tiles of TR tokens (register tiles, panel_tile), the last one holding the rest; on AVX-512 (TT 15 > TR 8) a rest
 * of r = M % TR in 1..TR - 1 tokens joins the last full tile instead, one streamed tile of TR + r (panel_stream),
 * where its activation items stay small, (TR + r) x K <= TILE_KT (any rest at K = 576, SmolLM2-135M; 1-4 at
 * K = 1536, 1 at K = 2048), and not where 5- and 6-bit panels are unpacked first (UNPACK_ROWS). A rest tile paid
 * the per-group work (weight loads and unpacking, scales) for its few tokens: one token cost ~2 of a full tile's
 * tokens (1.8-2.3x, docs/benchmarks.md, *Streamed tiles*). Measured (kernel, one thread, weights in cache, 2026-11-29; the default model's shapes, Q4_1 and
 * the Q8_0 head), against tiles of 8 and the rest: 9-12 rows 0.91-0.97x the time, 13-15 0.96-0.99x, 17 0.93-0.98x;
 * 16 tokens streamed (0.98x) or 24 as 12 + 12 (1.04-1.05x, the streamed tile's accumulators live in L1) did not
 * pay, nor 9 as 5 + 4 register tiles (1.03-1.14x: the 8-token tile is the most efficient one), nor a 16-token
 * tile at K = 1536 (~33 KB of activation items beside the panel: 1.03-1.08x). Other builds: TR + rest. Which tile
 * a token lands in changes no value. */
#define TILE_KT (12 * 1536)
static int merge_rest(int M, int K, int blocked) {
    return TT > TR && !blocked && M > TR && M % TR != 0 && (long)(TR + M % TR) * K <= TILE_KT;
}

/* Tokens from which one tile's preparation is split over the threads (by blocks, one more barrier):
 * at one token its ~0.5 us (K = 576) costs less than the barrier and the other thread's wake-up */
#define PREP_SPLIT_MIN 2

/* y [M, N] = x [M, K] @ w.T, activations of `bits` (8 or 16), w packed by ratchet_pack_q8 with zero
 * point zw (ratchet_q8_plan's sizes[2]). Each tile (merge_rest) is prepared (quantized, interleaved)
 * by one thread, or, when the call is one tile of PREP_SPLIT_MIN+ tokens (decode at a batch, short
 * verifies), by every thread, a range of blocks each; a one-token call is prepared by the calling
 * thread before the team starts. Who prepares a token changes no value. */
static void mm_q8(const float *x, long xs, int gated, int M, int K, int bits, int zw, const q8panel_t *panels,
                  const uint8_t *Q, const uint8_t *SM, float *y, int N, int threads) {
    if (M <= 0 || N <= 0) return;
    const int NPAN = (N + PN - 1) / PN, NB = K / 32;
    int blocked = 0; /* the 5- and 6-bit weights only (the other widths measured no gain) */
    for (int p = 0; p < NPAN && M >= UNPACK_ROWS; p++) blocked |= panels[p].vb == 5 || panels[p].vb == 6;
    /* NT tiles: tile ti holds tokens t0[ti] .. t0[ti + 1] - 1, TR each but the last (merge_rest) */
    const int NT = (M + TR - 1) / TR - merge_rest(M, K, blocked);
    const long per = tile_words(K, bits); /* words per token */
    int32_t *til = malloc(sizeof(int32_t) * (size_t)M * per);
    xtile_t *tiles = malloc(sizeof(xtile_t) * (size_t)NT);
    int *t0 = malloc(sizeof(int) * (size_t)(NT + 1));
    for (int ti = 0; ti <= NT; ti++) t0[ti] = ti < NT ? ti * TR : M;
    for (int ti = 0; ti < NT; ti++) tiles[ti] = tile_view(til + (long)t0[ti] * per, K, bits, t0[ti + 1] - t0[ti]);
    const int split = NT == 1 && M >= PREP_SPLIT_MIN && threads > 1;
    if (NT == 1 && !split) prep_tile_blocks(x, xs, gated, K, bits, zw, til, M, 0, NB);
#pragma omp parallel num_threads(threads)
    {
        if (split) {
            const int nth = omp_get_num_threads(), id = omp_get_thread_num();
            prep_tile_blocks(x, xs, gated, K, bits, zw, til, M, (int)((long)NB * id / nth),
                             (int)((long)NB * (id + 1) / nth));
#pragma omp barrier
        } else if (NT > 1) {
#pragma omp for schedule(static)
            for (int ti = 0; ti < NT; ti++) /* each token quantized on its own: nothing depends on M */
                prep_tile_blocks(x + t0[ti] * xs, xs, gated, K, bits, zw, til + (long)t0[ti] * per,
                                 t0[ti + 1] - t0[ti], 0, NB);
        }
        if (!blocked) {
#pragma omp for schedule(static)
            for (int p = 0; p < NPAN; p++) {
                const q8panel_t *pn = &panels[p];
                for (int ti = 0; ti < NT; ti++)
                    panel_any(Q + pn->qoff, SM + pn->soff, pn->z, &tiles[ti], K, pn->G, pn->vb, bits == 16, pn->has_m,
                              pn->unit, pn->SB, y + (long)t0[ti] * N + p * PN, N, MIN(PN, N - p * PN),
                              t0[ti + 1] - t0[ti]);
            }
        } else { /* this thread's panels (the static schedule's share) in blocks of PB, the tiles inside */
            const int nth = omp_get_num_threads(), id = omp_get_thread_num();
            const int p0 = (int)((long)NPAN * id / nth), p1 = (int)((long)NPAN * (id + 1) / nth);
            const int PB = MIN(NPAN, (int)(PANEL_BLOCK / ((long)K * PN)) > 0 ? (int)(PANEL_BLOCK / ((long)K * PN)) : 1);
            const long UPS = (long)K * PN + UNPACK_MUL_BYTES(K); /* bytes per unpacked panel */
            uint8_t *ub = aligned_alloc(64, (size_t)(PB * UPS)); /* the block's unpacked panels */
            for (int b0 = p0; b0 < p1; b0 += PB) {
                const int b1 = MIN(p1, b0 + PB);
                for (int p = b0; p < b1; p++)
                    if (panels[p].vb == 5 || panels[p].vb == 6) {
#if defined(PAIRS16) /* (only the AVX2 kernel takes them signed, and reads the multipliers' layout) */
                        const int sw = PAIRED(panels[p].G, bits == 16, panels[p].has_m);
#else
                        const int sw = 0;
#endif
                        unpack_panel(Q + panels[p].qoff, K, panels[p].G, panels[p].vb, sw, ub + (long)(p - b0) * UPS);
#if defined(PAIRS16)
                        if (sw)
                            unpack_multipliers(SM + panels[p].soff, ub + (long)(p - b0) * UPS, K, panels[p].SB,
                                               (int16_t *)(ub + (long)(p - b0) * UPS + (long)K * PN));
#endif
                    }
                for (int ti = 0; ti < NT; ti++)
                    for (int p = b0; p < b1; p++) {
                        const q8panel_t *pn = &panels[p];
                        const int unp = pn->vb == 5 || pn->vb == 6;
                        panel_any(unp ? ub + (long)(p - b0) * UPS : Q + pn->qoff, SM + pn->soff, pn->z, &tiles[ti],
                                  K, pn->G, unp ? pn->vb + 8 : pn->vb, bits == 16, pn->has_m, pn->unit, pn->SB,
                                  y + (long)t0[ti] * N + p * PN, N, MIN(PN, N - p * PN), t0[ti + 1] - t0[ti]);
                    }
            }
            free(ub);
        }
    }
    free(til);
    free(tiles);
    free(t0);
}

/* the entry point: the weight's arguments in one struct (kernels/__init__.py Q8Weight, built once per
 * weight), so a call from Python converts 5 arguments, not 11 */
typedef struct {
    int32_t K, bits, zw, N;
    const q8panel_t *panels;
    const uint8_t *Q, *SM;
} q8weight_t;

void ratchet_mm_q8w(const float *x, int M, const q8weight_t *w, float *y, int threads) {
    mm_q8(x, w->K, 0, M, w->K, w->bits, w->zw, w->panels, w->Q, w->SM, y, w->N, threads);
}

/* y [M, N] = (silu(gu[:, :K]) * gu[:, K:]) @ w.T for gu [M, 2 K] (SwiGLU's gate/up output): the same
 * values as ratchet_silu_mul then ratchet_mm_q8w, without the activation's own pass and buffer (the
 * decode chain's MLP; chain.c) */
void ratchet_mm_q8w_swiglu(const float *gu, int M, const q8weight_t *w, float *y, int threads) {
    mm_q8(gu, 2L * w->K, 1, M, w->K, w->bits, w->zw, w->panels, w->Q, w->SM, y, w->N, threads);
}
