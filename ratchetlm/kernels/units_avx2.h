/* AVX2 (+ FMA, F16C) dequantization in registers: units_avx512.h's scheme on 8-lane vectors. A
 * block's 32-weight unit j is four vectors v[0..3] in k order (weights 32j + 8i .. 32j + 8i + 7), from
 * the same float operations as gguf-py's `dequantize` (dequant.c's portable functions say which), so
 * they are its bits. Two users: to_float (dequant.c) stores them; the few-token matmul (matmul.c)
 * multiplies them straight from registers.
 *
 * Where the AVX-512 units pick a block's weights from a 16- or 32-entry table with one permute (AVX2
 * permutes 8 lanes), these widen the integer values and scale them: the same products and sums per
 * weight, so the same values.
 */
#ifndef RATCHET_UNITS_AVX2_H
#define RATCHET_UNITS_AVX2_H
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include "ggml_types.h"

typedef __m256 unit_vec_t;
#define UNIT_VECS 4 /* vectors per 32-weight unit */
#define UNIT(NAME, b, st, j, v) NAME##_unit(b, st, j, v)
#define UNIT_STORE(p, v) _mm256_storeu_ps(p, v)

#define I32x8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))) /* 8 bytes, zero-extended */
#define F32x8(v) _mm256_cvtepi32_ps(v)

/* 16 bytes of nibbles as integers: low nibbles -> q[0..1] (weights 0..15), high -> q[2..3] (16..31) */
static inline void nib_ints(const uint8_t *qs, __m256i q[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F), raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    q[0] = _mm256_cvtepu8_epi32(lo);
    q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi);
    q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

/* bit (first + 8i + lane) of qh as 16 (the fifth bit of a 5-bit weight), for the four vectors */
static inline __m256i bit4_of(uint32_t qh, int first, int i) {
    const __m256i shift = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first + 8 * i));
    return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)qh), shift), _mm256_set1_epi32(1)), 4);
}

/* 32-weight blocks: the block's factors */
typedef struct {
    __m256 d, m;
} tab_t;

/* Q4_0: w = d * (nib - 8) */
static inline void q4_0_prep(const uint8_t *b, tab_t *s) { s->d = _mm256_set1_ps(load_fp16(b)); }
static inline void q4_0_unit(const uint8_t *b, const tab_t *s, int j, __m256 v[4]) {
    (void)j;
    __m256i q[4];
    nib_ints(b + 2, q);
    for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(s->d, F32x8(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
}

/* Q4_1: w = d * nib + m */
static inline void q4_1_prep(const uint8_t *b, tab_t *s) {
    s->d = _mm256_set1_ps(load_fp16(b));
    s->m = _mm256_set1_ps(load_fp16(b + 2));
}
static inline void q4_1_unit(const uint8_t *b, const tab_t *s, int j, __m256 v[4]) {
    (void)j;
    __m256i q[4];
    nib_ints(b + 4, q);
    for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(s->d, F32x8(q[i])), s->m);
}

/* 5-bit: nibble | (bit k of qh) << 4 for weight k */
static inline void q5_ints(const uint8_t *qs, uint32_t qh, __m256i q[4]) {
    nib_ints(qs, q);
    for (int i = 0; i < 4; i++) q[i] = _mm256_or_si256(q[i], bit4_of(qh, 0, i));
}

/* Q5_0: w = d * (q5 - 16) */
#define q5_0_prep q4_0_prep
static inline void q5_0_unit(const uint8_t *b, const tab_t *s, int j, __m256 v[4]) {
    (void)j;
    __m256i q[4];
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    q5_ints(b + 6, qh, q);
    for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(s->d, F32x8(_mm256_sub_epi32(q[i], _mm256_set1_epi32(16))));
}

/* Q5_1: w = d * q5 + m */
#define q5_1_prep q4_1_prep
static inline void q5_1_unit(const uint8_t *b, const tab_t *s, int j, __m256 v[4]) {
    (void)j;
    __m256i q[4];
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    q5_ints(b + 8, qh, q);
    for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(s->d, F32x8(q[i])), s->m);
}

/* Q8_0: w = q * d */
#define q8_0_prep q4_0_prep
static inline void q8_0_unit(const uint8_t *b, const tab_t *s, int j, __m256 v[4]) {
    (void)j;
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_mul_ps(F32x8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))), s->d);
}

/* F32 / F16 / BF16, 32 weights a "block" */
typedef struct {
    int unused;
} none_t;
static inline void f32_prep(const uint8_t *b, none_t *s) { (void)b, (void)s; }
static inline void f32_unit(const uint8_t *b, const none_t *s, int j, __m256 v[4]) {
    (void)s, (void)j;
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps((const float *)b + 8 * i);
}
#define f16_prep f32_prep
static inline void f16_unit(const uint8_t *b, const none_t *s, int j, __m256 v[4]) {
    (void)s, (void)j;
    for (int i = 0; i < 4; i++) v[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * i)));
}
#define bf16_prep f32_prep
static inline void bf16_unit(const uint8_t *b, const none_t *s, int j, __m256 v[4]) {
    (void)s, (void)j;
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * i))), 16));
}

/* K-quants (256 weights): the sub-block factors d * scale (ds) and dmin * min (dm) */
typedef struct {
    float ds[16], dm[8];
} kstate_t;

/* Q4_K / Q5_K sub-block j's 4-bit values: low nibbles of qs[32 (j / 2) .. + 31] (j even) or high */
static inline void k4_ints(const uint8_t *qs, int j, __m256i q[4]) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
    const __m256i nib = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
    const __m128i lo = _mm256_castsi256_si128(nib), hi = _mm256_extracti128_si256(nib, 1);
    q[0] = _mm256_cvtepu8_epi32(lo);
    q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi);
    q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

/* Q4_K: w = (d * sc) * q - dmin * m */
static inline void q4_k_prep(const uint8_t *b, kstate_t *s) { k4_sub_factors(b, s->ds, s->dm); }
static inline void q4_k_unit(const uint8_t *b, const kstate_t *s, int j, __m256 v[4]) {
    __m256i q[4];
    k4_ints(b + 16, j, q);
    const __m256 vd = _mm256_set1_ps(s->ds[j]), vm = _mm256_set1_ps(s->dm[j]);
    for (int i = 0; i < 4; i++) v[i] = _mm256_sub_ps(_mm256_mul_ps(vd, F32x8(q[i])), vm);
}

/* Q5_K: as Q4_K with a fifth bit: bit j of qh[l] (qh: bytes 16..47) */
#define q5_k_prep q4_k_prep
static inline void q5_k_unit(const uint8_t *b, const kstate_t *s, int j, __m256 v[4]) {
    __m256i q[4];
    k4_ints(b + 48, j, q);
    const __m256 vd = _mm256_set1_ps(s->ds[j]), vm = _mm256_set1_ps(s->dm[j]);
    const __m128i sh = _mm_cvtsi32_si128(j);
    for (int i = 0; i < 4; i++) {
        const __m256i h = _mm256_and_si256(_mm256_srl_epi32(I32x8(b + 16 + 8 * i), sh), _mm256_set1_epi32(1));
        v[i] = _mm256_sub_ps(_mm256_mul_ps(vd, F32x8(_mm256_or_si256(q[i], _mm256_slli_epi32(h, 4)))), vm);
    }
}

/* Q6_K: w = (d * scale) * (q6 - 32), 16 sub-blocks of 16; unit j covers h = j / 4, p = j % 4
 * (units_avx512.h gives the layout) */
static inline void q6_k_prep(const uint8_t *b, kstate_t *s) {
    const __m256 d = _mm256_set1_ps(load_fp16(b + 208));
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    _mm256_storeu_ps(s->ds, _mm256_mul_ps(d, F32x8(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(s->ds + 8, _mm256_mul_ps(d, F32x8(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
}
static inline void q6_k_unit(const uint8_t *b, const kstate_t *s, int j, __m256 v[4]) {
    const int h = j / 4, p = j % 4;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    __m256i lb = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (p % 2)));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    if (p >= 2) lb = _mm256_srli_epi16(lb, 4);
    const __m256i hi2 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * p)), m3);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_slli_epi16(hi2, 4)), off);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m256 d0 = _mm256_set1_ps(s->ds[2 * j]), d1 = _mm256_set1_ps(s->ds[2 * j + 1]);
    v[0] = _mm256_mul_ps(d0, F32x8(_mm256_cvtepi8_epi32(lo)));
    v[1] = _mm256_mul_ps(d0, F32x8(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
    v[2] = _mm256_mul_ps(d1, F32x8(_mm256_cvtepi8_epi32(hi)));
    v[3] = _mm256_mul_ps(d1, F32x8(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}

#endif
#endif
