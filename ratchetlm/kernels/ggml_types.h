/* GGUF tensor types: one table row per format (ggml's type-traits idea).
 *
 * A row says how many weights a block holds, how many bytes it takes and how to dequantize it
 * (to_float, bit-identical to gguf-py's numpy `dequantize`). The matmul driver (matmul.c) looks the
 * row up and never names a format; a new format is a new row. The int8 mode's column (to_q8w) rewrites a
 * format's blocks as int8 values with per-block fp16 factors and per-16 integer multipliers, in
 * matmul_int8.c.
 */
#ifndef RATCHET_GGML_TYPES_H
#define RATCHET_GGML_TYPES_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* n_blocks consecutive blocks at src -> n_blocks * blck floats at dst */
typedef void (*to_float_fn)(const uint8_t *src, float *dst, int64_t n_blocks);
/* n_blocks blocks -> the int8 mode's form w[k] = d[b] * c16[k / 16] * q[k] + dm[b] * cm16[k / 16], b = k / blck
 * (matmul_int8.c): d, dm the block's fp16 scale and offset factors, c16, cm16 small integer multipliers */
typedef void (*to_q8w_fn)(const uint8_t *src, int8_t *q, float *d, float *dm, int8_t *c16, int8_t *cm16,
                          int64_t n_blocks);

/* the few-token matmul straight from registers (matmul.c, AVX-512 and AVX2 builds): rr stored rows (their
 * blocks at rows[r]) times tt tokens of x [tt, K], into y (stride N) */
typedef void (*few_fn)(const uint8_t *const *rows, const float *x, int K, float *y, int N, int rr, int tt);

typedef struct {
    const char *name; /* GGML name, e.g. "Q4_K" (the Python side matches rows by it) */
    int ggml_id;      /* GGMLQuantizationType value in the file */
    int blck;         /* weights per block */
    int bytes;        /* bytes per block */
    to_float_fn to_float;
    to_q8w_fn to_q8w; /* NULL: the int8 mode multiplies this format in fp32 (F32 / F16 / BF16) */
    int q8_offsets;   /* to_q8w writes offsets (formats with a min / offset term) */
    few_fn few;       /* NULL: few tokens go through the scratch buffer like many (matmul.c) */
} ggml_type_t;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define FEW(name) few_##name
void few_f32(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_f16(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_bf16(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q4_0(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q4_1(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q5_0(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q5_1(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q8_0(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q4_k(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q5_k(const uint8_t *const *, const float *, int, float *, int, int, int);
void few_q6_k(const uint8_t *const *, const float *, int, float *, int, int, int);
#else
#define FEW(name) NULL
#endif

void q8w_q4_0(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q4_1(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q5_0(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q5_1(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q8_0(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q2_k(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q3_k(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q4_k(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q5_k(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);
void q8w_q6_k(const uint8_t *, int8_t *, float *, float *, int8_t *, int8_t *, int64_t);

extern const ggml_type_t RATCHET_TYPES[];
extern const int RATCHET_NUM_TYPES;

/* IEEE half -> float, exact (what numpy's astype(float32) does); handles subnormals, inf, nan */
static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, like the portable conversion */
#else
    return fp16_to_fp32(h);
#endif
}

#if defined(__AVX2__)
/* Q4_K / Q5_K: a block's 8 sub-block factors d * scale -> ds and dmin * min -> dm (one vector multiply
 * each: the same values as gguf-py's scalar d * sc); the 6-bit scales and mins packed in 12 bytes are
 * unpacked four at a time in 32-bit words. (units_avx512.h and units_avx2.h) */
static inline void k4_sub_factors(const uint8_t *blk, float ds[8], float dm[8]) {
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4); /* mins 4..7 */
    const uint32_t mins_lo = u[1] & m6;                    /* mins 0..3 */
    u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);        /* scales 4..7 */
    u[0] &= m6;                                            /* scales 0..3 */
    u[2] = mins_lo;
    __m128i bytes = _mm_loadu_si128((const __m128i *)u); /* scales 0..7, mins 0..7 */
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(load_fp16(blk)), sc));
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(load_fp16(blk + 2)), mn));
}
#endif
#endif
