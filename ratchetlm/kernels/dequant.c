/* Dequantizers for every supported GGUF format, and the type table that names them.
 *
 * Each format has a portable C version that transcribes gguf-py's numpy `dequantize_blocks` float
 * operation by float operation (same operands, same order, no fused multiply-add: the library is
 * built with -ffp-contract=off), so its output is bit-identical to gguf-py. The AVX-512 / AVX2
 * versions of the common formats do the same operations on vectors, built from the register-level
 * units of units_avx512.h / units_avx2.h (which the few-token matmul also uses): on AVX-512 the
 * 4/5-bit formats compute the block's 16 or 32 possible weights once (the same operations on
 * q = 0..15 / 0..31) and pick each weight from that table with a permute; on AVX2 they widen the
 * integer values and scale them.
 *
 * Block layouts (bytes, little-endian; fp16 scales):
 *   Q4_0 d, qs[16]           w[j] = d * (nib - 8)          nib: low nibble of qs[j] for j < 16,
 *   Q4_1 d, m, qs[16]        w[j] = d * nib + m            high nibble of qs[j - 16] above
 *   Q5_0 d, qh[4], qs[16]    w[j] = d * (q5 - 16)          q5 = nib | bit j of qh << 4
 *   Q5_1 d, m, qh[4], qs[16] w[j] = d * q5 + m
 *   Q8_0 d, qs[32] int8      w[j] = q * d
 *   Q2_K scales[16], qs[64], d, dmin                      (256 weights, 16 sub-blocks of 16)
 *   Q3_K hmask[32], qs[64], scales[12], d                 (256 weights, 16 sub-blocks of 16)
 *   Q4_K d, dmin, scales[12], qs[128]                      (256 weights, 8 sub-blocks of 32)
 *   Q5_K d, dmin, scales[12], qh[32], qs[128]             (256 weights, 8 sub-blocks of 32)
 *   Q6_K ql[128], qh[64], scales[16] int8, d              (256 weights, 16 sub-blocks of 16)
 */
#include "ggml_types.h"

#define QK 32
#define QK_K 256

/* ------------------------------------------------------------ portable C (the reference) */

static void f32_c(const uint8_t *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void f16_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = load_fp16(src + 2 * i);
}

static void bf16_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(dst + i, &bits, 4);
    }
}

static void q4_0_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 18, dst += QK) {
        const float d = load_fp16(src);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((src[2 + j] & 0x0F) - 8);
            dst[j + 16] = d * (float)((src[2 + j] >> 4) - 8);
        }
    }
}

static void q4_1_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 20, dst += QK) {
        const float d = load_fp16(src), m = load_fp16(src + 2);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)(src[4 + j] & 0x0F) + m;
            dst[j + 16] = d * (float)(src[4 + j] >> 4) + m;
        }
    }
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void q5_0_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 22, dst += QK) {
        const float d = load_fp16(src);
        const uint32_t qh = load_u32(src + 2);
        for (int j = 0; j < 16; j++) {
            int lo = (src[6 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            int hi = (src[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            dst[j] = d * (float)(lo - 16);
            dst[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void q5_1_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 24, dst += QK) {
        const float d = load_fp16(src), m = load_fp16(src + 2);
        const uint32_t qh = load_u32(src + 4);
        for (int j = 0; j < 16; j++) {
            int lo = (src[8 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            int hi = (src[8 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            dst[j] = d * (float)lo + m;
            dst[j + 16] = d * (float)hi + m;
        }
    }
}

static void q8_0_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 34, dst += QK) {
        const float d = load_fp16(src);
        for (int j = 0; j < 32; j++) dst[j] = (float)(int8_t)src[2 + j] * d;
    }
}

static void q2_k_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 84, dst += QK_K) {
        const uint8_t *sc = src, *qs = src + 16;
        const float d = load_fp16(src + 80), dmin = load_fp16(src + 82);
        for (int i = 0; i < QK_K; i++) {
            int h = i / 128, s = (i % 128) / 32, l = i % 32, sb = i / 16;
            float q = (float)((qs[h * 32 + l] >> (2 * s)) & 3);
            float dl = d * (float)(sc[sb] & 0x0F), ml = dmin * (float)(sc[sb] >> 4);
            dst[i] = dl * q - ml;
        }
    }
}

static void q3_k_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 110, dst += QK_K) {
        const uint8_t *hmask = src, *qs = src + 32, *scales = src + 96;
        const float d = load_fp16(src + 108);
        float dl[16];
        for (int i = 0; i < 16; i++) {
            int lo = (i < 8 ? scales[i] : scales[i - 8] >> 4) & 0x0F;
            int hi = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
            dl[i] = d * (float)((lo | (hi << 4)) - 32);
        }
        for (int i = 0; i < QK_K; i++) {
            int h = i / 128, s = (i % 128) / 32, l = i % 32;
            int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
            int qh = ((hmask[l] >> (i / 32)) & 1) ^ 1; /* the offset is applied when the mask bit is 0 */
            dst[i] = dl[i / 16] * (float)(ql - (qh << 2));
        }
    }
}

/* 6-bit sub-block scales and mins of Q4_K / Q5_K (12 bytes -> 8 + 8) */
static inline void k4_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

static void q4_k_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 144, dst += QK_K) {
        const float d = load_fp16(src), dmin = load_fp16(src + 2);
        uint8_t sc[8], mn[8];
        k4_scale_min(src + 4, sc, mn);
        const uint8_t *qs = src + 16;
        for (int i = 0; i < QK_K; i++) {
            int c = i / 64, s = (i % 64) / 32, l = i % 32, sb = i / 32;
            float q = (float)((qs[c * 32 + l] >> (4 * s)) & 0x0F);
            dst[i] = (d * (float)sc[sb]) * q - dmin * (float)mn[sb];
        }
    }
}

static void q5_k_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 176, dst += QK_K) {
        const float d = load_fp16(src), dmin = load_fp16(src + 2);
        uint8_t sc[8], mn[8];
        k4_scale_min(src + 4, sc, mn);
        const uint8_t *qh = src + 16, *qs = src + 48;
        for (int i = 0; i < QK_K; i++) {
            int c = i / 64, s = (i % 64) / 32, l = i % 32, sb = i / 32;
            int q = ((qs[c * 32 + l] >> (4 * s)) & 0x0F) | (((qh[l] >> sb) & 1) << 4);
            dst[i] = (d * (float)sc[sb]) * (float)q - dmin * (float)mn[sb];
        }
    }
}

static void q6_k_c(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n; b++, src += 210, dst += QK_K) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *scales = (const int8_t *)(src + 192);
        const float d = load_fp16(src + 208);
        for (int i = 0; i < QK_K; i++) {
            int h = i / 128, j = i % 128;
            int lo = (ql[h * 64 + j % 64] >> (4 * (j / 64))) & 0x0F;
            int hi = (qh[h * 32 + j % 32] >> (2 * (j / 32))) & 3;
            dst[i] = (d * (float)scales[i / 16]) * (float)((lo | (hi << 4)) - 32);
        }
    }
}

/* ------------------------------------------------------------ AVX-512 */
#if defined(__AVX512F__)
#include "units_avx512.h"

static void f16_avx512(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
    f16_c(src + 2 * i, dst + i, n - i);
}

static void bf16_avx512(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
    bf16_c(src + 2 * i, dst + i, n - i);
}

#define F16_FN f16_avx512
#define BF16_FN bf16_avx512

/* ------------------------------------------------------------ AVX2 (+FMA, F16C) */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "units_avx2.h"

static void f16_avx2(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    f16_c(src + 2 * i, dst + i, n - i);
}

static void bf16_avx2(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    bf16_c(src + 2 * i, dst + i, n - i);
}

#define F16_FN f16_avx2
#define BF16_FN bf16_avx2

#else
#define F16_FN f16_c
#define BF16_FN bf16_c
#endif

#if defined(UNIT_VECS)
/* the quantized formats on AVX-512 / AVX2: each block's units (units_avx512.h / units_avx2.h), stored */
#define UNITS_TO_FLOAT(NAME, BLCK, BYTES, STATE)                                                   \
    static void NAME##_units(const uint8_t *src, float *dst, int64_t n) {                          \
        for (int64_t b = 0; b < n; b++, src += BYTES, dst += BLCK) {                               \
            STATE st;                                                                              \
            NAME##_prep(src, &st);                                                                 \
            for (int j = 0; j < BLCK / 32; j++) {                                                  \
                unit_vec_t v[UNIT_VECS];                                                           \
                UNIT(NAME, src, &st, j, v);                                                        \
                for (int i = 0; i < UNIT_VECS; i++) UNIT_STORE(dst + 32 * j + 32 / UNIT_VECS * i, v[i]); \
            }                                                                                      \
        }                                                                                          \
    }
UNITS_TO_FLOAT(q4_0, QK, 18, tab_t)
UNITS_TO_FLOAT(q4_1, QK, 20, tab_t)
UNITS_TO_FLOAT(q5_0, QK, 22, tab_t)
UNITS_TO_FLOAT(q5_1, QK, 24, tab_t)
UNITS_TO_FLOAT(q8_0, QK, 34, tab_t)
UNITS_TO_FLOAT(q4_k, QK_K, 144, kstate_t)
UNITS_TO_FLOAT(q5_k, QK_K, 176, kstate_t)
UNITS_TO_FLOAT(q6_k, QK_K, 210, kstate_t)
#define Q4_0_FN q4_0_units
#define Q4_1_FN q4_1_units
#define Q5_0_FN q5_0_units
#define Q5_1_FN q5_1_units
#define Q8_0_FN q8_0_units
#define Q4_K_FN q4_k_units
#define Q5_K_FN q5_k_units
#define Q6_K_FN q6_k_units
#else
#define Q4_0_FN q4_0_c
#define Q4_1_FN q4_1_c
#define Q5_0_FN q5_0_c
#define Q5_1_FN q5_1_c
#define Q8_0_FN q8_0_c
#define Q4_K_FN q4_k_c
#define Q5_K_FN q5_k_c
#define Q6_K_FN q6_k_c
#endif

/* ------------------------------------------------------------ the table */
/* name, GGMLQuantizationType, weights per block, bytes per block, dequantize, int8-mode form, has offsets,
 * few-token matmul */
const ggml_type_t RATCHET_TYPES[] = {
    {"F32", 0, 1, 4, f32_c, NULL, 0, FEW(f32)},
    {"F16", 1, 1, 2, F16_FN, NULL, 0, FEW(f16)},
    {"BF16", 30, 1, 2, BF16_FN, NULL, 0, FEW(bf16)},
    {"Q4_0", 2, QK, 18, Q4_0_FN, q8w_q4_0, 0, FEW(q4_0)},
    {"Q4_1", 3, QK, 20, Q4_1_FN, q8w_q4_1, 1, FEW(q4_1)},
    {"Q5_0", 6, QK, 22, Q5_0_FN, q8w_q5_0, 0, FEW(q5_0)},
    {"Q5_1", 7, QK, 24, Q5_1_FN, q8w_q5_1, 1, FEW(q5_1)},
    {"Q8_0", 8, QK, 34, Q8_0_FN, q8w_q8_0, 0, FEW(q8_0)},
    {"Q2_K", 10, QK_K, 84, q2_k_c, q8w_q2_k, 1, NULL}, /* portable C only: rare formats, correct and slower */
    {"Q3_K", 11, QK_K, 110, q3_k_c, q8w_q3_k, 0, NULL},
    {"Q4_K", 12, QK_K, 144, Q4_K_FN, q8w_q4_k, 1, FEW(q4_k)},
    {"Q5_K", 13, QK_K, 176, Q5_K_FN, q8w_q5_k, 1, FEW(q5_k)},
    {"Q6_K", 14, QK_K, 210, Q6_K_FN, q8w_q6_k, 0, FEW(q6_k)},
};
const int RATCHET_NUM_TYPES = sizeof(RATCHET_TYPES) / sizeof(RATCHET_TYPES[0]);

/* ------------------------------------------------------------ exports for Python */
int ratchet_num_types(void) { return RATCHET_NUM_TYPES; }
const char *ratchet_type_name(int t) { return RATCHET_TYPES[t].name; }
int ratchet_type_ggml_id(int t) { return RATCHET_TYPES[t].ggml_id; }
int ratchet_type_blck(int t) { return RATCHET_TYPES[t].blck; }
int ratchet_type_bytes(int t) { return RATCHET_TYPES[t].bytes; }

/* n_blocks blocks of type t -> floats (tests compare this with gguf-py) */
void ratchet_to_float(int t, const uint8_t *src, float *dst, int64_t n_blocks) { RATCHET_TYPES[t].to_float(src, dst, n_blocks); }
int ratchet_type_has_q8(int t) { return RATCHET_TYPES[t].to_q8w != NULL; }

/* n_blocks blocks of type t -> the int8 mode's (q, d, dm, c16, cm16) form (tests rebuild the weights from it) */
void ratchet_to_q8w(int t, const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16,
                    int64_t n_blocks) {
    RATCHET_TYPES[t].to_q8w(src, q, d, dm, c16, cm16, n_blocks);
}
