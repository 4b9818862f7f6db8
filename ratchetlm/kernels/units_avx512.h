/* AVX-512 dequantization in registers: a block's 32-weight unit j as two 16-lane vectors in k order
 * (weights 32j .. 32j + 15 and 32j + 16 .. 32j + 31 of the block).
 *
 * Each format has a `prep` (per block: its scales, or the table of its 16 / 32 possible weights) and
 * a `unit`. They do gguf-py's float operations (dequant.c says which), so the vectors are bit-identical
 * to gguf-py's `dequantize`. Two users: to_float (dequant.c) stores them; the few-token matmul
 * (matmul.c) multiplies them straight from registers. Both therefore multiply the same weights by
 * construction, and tests check both against gguf-py.
 *
 * F16 / BF16 / F32 have 1-weight blocks; here a "block" of them is 32 weights (the matmul only
 * takes this path when K is a multiple of 32).
 */
#ifndef RATCHET_UNITS_AVX512_H
#define RATCHET_UNITS_AVX512_H
#if defined(__AVX512F__)
#include "ggml_types.h"

typedef __m512 unit_vec_t;
#define UNIT_VECS 2 /* vectors per 32-weight unit */
#define UNIT(NAME, b, st, j, v) NAME##_unit(b, st, j, &(v)[0], &(v)[1])
#define UNIT_STORE(p, v) _mm512_storeu_ps(p, v)

#define IOTA16 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LOAD16B(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))

static inline uint32_t unit_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 32-weight blocks: the block's possible weights as a table, picked by a permute */
typedef struct {
    __m512 t0, t1;
} tab_t;

/* 16 bytes of nibbles: low nibbles -> weights 0..15 (table lo), high -> 16..31 (table hi) */
static inline void nib_unit(const uint8_t *qs, __m512 lo, __m512 hi, __m512 *v0, __m512 *v1) {
    __m512i v = LOAD16B(qs);
    *v0 = _mm512_permutexvar_ps(v, lo); /* permutexvar reads index bits 0..3 */
    *v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), hi);
}

/* Q4_0: w = d * (nib - 8) */
static inline void q4_0_prep(const uint8_t *b, tab_t *s) {
    s->t0 = _mm512_mul_ps(_mm512_set1_ps(load_fp16(b)), _mm512_sub_ps(IOTA16, _mm512_set1_ps(8.0f)));
}
static inline void q4_0_unit(const uint8_t *b, const tab_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)j;
    nib_unit(b + 2, s->t0, s->t0, v0, v1);
}

/* Q4_1: w = d * nib + m */
static inline void q4_1_prep(const uint8_t *b, tab_t *s) {
    s->t0 = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(load_fp16(b)), IOTA16), _mm512_set1_ps(load_fp16(b + 2)));
}
static inline void q4_1_unit(const uint8_t *b, const tab_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)j;
    nib_unit(b + 4, s->t0, s->t0, v0, v1);
}

/* 5-bit: nibble | (qh bit << 4) indexes 32 entries (t0: q < 16, t1: q >= 16) */
static inline void q5_unit(const uint8_t *qs, uint32_t qh, const tab_t *s, __m512 *v0, __m512 *v1) {
    const __m512i low4 = _mm512_set1_epi32(0x0F), b4 = _mm512_set1_epi32(0x10);
    __m512i v = LOAD16B(qs);
    __m512i lo = _mm512_and_si512(v, low4);
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, b4);
    __m512i sh = _mm512_srli_epi32(v, 4);
    __m512i hi = _mm512_mask_or_epi32(sh, (__mmask16)(qh >> 16), sh, b4);
    *v0 = _mm512_permutex2var_ps(s->t0, lo, s->t1);
    *v1 = _mm512_permutex2var_ps(s->t0, hi, s->t1);
}

/* Q5_0: w = d * (q5 - 16) */
static inline void q5_0_prep(const uint8_t *b, tab_t *s) {
    __m512 vd = _mm512_set1_ps(load_fp16(b));
    s->t0 = _mm512_mul_ps(vd, _mm512_sub_ps(IOTA16, _mm512_set1_ps(16.0f)));
    s->t1 = _mm512_mul_ps(vd, IOTA16);
}
static inline void q5_0_unit(const uint8_t *b, const tab_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)j;
    q5_unit(b + 6, unit_u32(b + 2), s, v0, v1);
}

/* Q5_1: w = d * q5 + m */
static inline void q5_1_prep(const uint8_t *b, tab_t *s) {
    __m512 vd = _mm512_set1_ps(load_fp16(b)), vm = _mm512_set1_ps(load_fp16(b + 2));
    s->t0 = _mm512_add_ps(_mm512_mul_ps(vd, IOTA16), vm);
    s->t1 = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_add_ps(IOTA16, _mm512_set1_ps(16.0f))), vm);
}
static inline void q5_1_unit(const uint8_t *b, const tab_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)j;
    q5_unit(b + 8, unit_u32(b + 4), s, v0, v1);
}

/* Q8_0: w = q * d */
static inline void q8_0_prep(const uint8_t *b, tab_t *s) { s->t0 = _mm512_set1_ps(load_fp16(b)); }
static inline void q8_0_unit(const uint8_t *b, const tab_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)j;
    *v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), s->t0);
    *v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), s->t0);
}

/* F32 / F16 / BF16, 32 weights a "block" */
typedef struct {
    int unused;
} none_t;
static inline void f32_prep(const uint8_t *b, none_t *s) { (void)b, (void)s; }
static inline void f32_unit(const uint8_t *b, const none_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)s, (void)j;
    *v0 = _mm512_loadu_ps((const float *)b);
    *v1 = _mm512_loadu_ps((const float *)b + 16);
}
#define f16_prep f32_prep
static inline void f16_unit(const uint8_t *b, const none_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)s, (void)j;
    *v0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    *v1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
}
#define bf16_prep f32_prep
static inline void bf16_unit(const uint8_t *b, const none_t *s, int j, __m512 *v0, __m512 *v1) {
    (void)s, (void)j;
    *v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16));
    *v1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32))), 16));
}

/* K-quants (256 weights): the sub-block factors d * scale (ds) and dmin * min (dm), one vector
 * multiply each (the same values as gguf-py's scalar d * sc) */
typedef struct {
    float ds[16], dm[8];
    __m512i h0, h1; /* Q5_K: the qh bytes for l = 0..15, 16..31 */
} kstate_t;

/* Q4_K: w = (d * sc) * q - dmin * m; sub-block 2c: low nibbles of qs[32c .. 32c + 31], 2c + 1: high */
static inline void q4_k_prep(const uint8_t *b, kstate_t *s) { k4_sub_factors(b, s->ds, s->dm); }
static inline void q4_k_unit(const uint8_t *b, const kstate_t *s, int j, __m512 *v0, __m512 *v1) {
    const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s->ds[j]), IOTA16), _mm512_set1_ps(s->dm[j]));
    const uint8_t *qs = b + 16 + 32 * (j / 2);
    __m512i lo = LOAD16B(qs), hi = LOAD16B(qs + 16);
    if (j & 1) {
        lo = _mm512_srli_epi32(lo, 4);
        hi = _mm512_srli_epi32(hi, 4);
    }
    *v0 = _mm512_permutexvar_ps(lo, t);
    *v1 = _mm512_permutexvar_ps(hi, t);
}

/* Q5_K: as Q4_K with a fifth bit: bit j of qh[l] */
static inline void q5_k_prep(const uint8_t *b, kstate_t *s) {
    k4_sub_factors(b, s->ds, s->dm);
    s->h0 = LOAD16B(b + 16);
    s->h1 = LOAD16B(b + 32);
}
static inline void q5_k_unit(const uint8_t *b, const kstate_t *s, int j, __m512 *v0, __m512 *v1) {
    const __m512i low4 = _mm512_set1_epi32(0x0F), b4 = _mm512_set1_epi32(0x10), bit = _mm512_set1_epi32(1 << j);
    const __m512 vd = _mm512_set1_ps(s->ds[j]), vm = _mm512_set1_ps(s->dm[j]);
    const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(vd, IOTA16), vm);
    const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(vd, _mm512_add_ps(IOTA16, _mm512_set1_ps(16.0f))), vm);
    const uint8_t *qs = b + 48 + 32 * (j / 2);
    __m512i lo = LOAD16B(qs), hi = LOAD16B(qs + 16);
    if (j & 1) {
        lo = _mm512_srli_epi32(lo, 4);
        hi = _mm512_srli_epi32(hi, 4);
    } else {
        lo = _mm512_and_si512(lo, low4);
        hi = _mm512_and_si512(hi, low4);
    }
    lo = _mm512_mask_or_epi32(lo, _mm512_test_epi32_mask(s->h0, bit), lo, b4);
    hi = _mm512_mask_or_epi32(hi, _mm512_test_epi32_mask(s->h1, bit), hi, b4);
    *v0 = _mm512_permutex2var_ps(t0, lo, t1);
    *v1 = _mm512_permutex2var_ps(t0, hi, t1);
}

/* Q6_K: w = (d * scale) * (q6 - 32), 16 sub-blocks of 16. Weights 128h + 32p + l (p = 0..3, l < 32):
 * low 4 bits from ql[64h + 32(p % 2) + l] (low nibble for p < 2, high for p >= 2), top 2 bits
 * from qh[32h + l] >> 2p. Unit j covers h = j / 4, p = j % 4. */
static inline void q6_k_prep(const uint8_t *b, kstate_t *s) {
    _mm512_storeu_ps(s->ds, _mm512_mul_ps(_mm512_set1_ps(load_fp16(b + 208)),
                                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))));
}
static inline void q6_k_unit(const uint8_t *b, const kstate_t *s, int j, __m512 *v0, __m512 *v1) {
    const int h = j / 4, p = j % 4;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    __m256i lb = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (p % 2)));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    if (p >= 2) lb = _mm256_srli_epi16(lb, 4);
    __m256i hi2 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * p)), m3);
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_slli_epi16(hi2, 4)), off);
    *v0 = _mm512_mul_ps(_mm512_set1_ps(s->ds[2 * j]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    *v1 = _mm512_mul_ps(_mm512_set1_ps(s->ds[2 * j + 1]),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
}

#endif
#endif
