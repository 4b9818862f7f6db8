/* SwiGLU's silu(g) * u in the integer numerics modes, shared by chain.c (ratchet_silu_mul) and
 * matmul_int8.c (the down projection's activations computed as they are quantized): one definition,
 * plain IEEE operations (no libm; the library is built with -ffp-contract=off), so every caller,
 * vectorised or not, gives an element the same bits. */
#ifndef RATCHET_SILU_H
#define RATCHET_SILU_H
#include <stdint.h>
#include <string.h>

/* exp(x): x = n ln2 + r (n = x log2(e) rounded to nearest even by the 1.5 * 2^23 trick, r by
 * Cody-Waite in two parts), 2^n times Cephes' degree-6 polynomial in r (~1 ulp). Clamped to
 * [-87.3, 88], where 2^n stays a normal float (silu's x / (1 + exp(-x)) is x there, or within
 * 1e-36 of 0). */
static inline float exp_ieee(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.3f ? -87.3f : x;
    const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, ties to even */
    const float n = (x * 1.44269504088896341f + big) - big;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float silu_mul1(float g, float u) { return (g / (1.0f + exp_ieee(-g))) * u; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* silu_mul1 on 16 elements: the same operations in the same order (the clamps as selects, so a NaN
 * passes as in the scalar code), hence the same bits. Written out because gcc's own vectorisation of
 * the scalar loop used 256-bit vectors and three masked divisions per 8 elements: the down
 * projection's activations (ratchet_mm_q8w_swiglu) measured ~2-3 cycles an element. */
static inline __m512 exp_ieee16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.0f), lo = _mm512_set1_ps(-87.3f), big = _mm512_set1_ps(12582912.0f);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), hi);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u)));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ieee16(neg))), u);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* silu_mul1 on 8 elements, as silu_mul16 (the same operations in the same order, the clamps as blends that
 * keep a NaN; no fma: every multiply and add rounds on its own as in the scalar code), hence the same bits.
 * The AVX2 build's scalar loop (gcc's vectorisation with masked divisions) took ~5% of a 512-token prefill of
 * 1B Q6_K at one thread (perf, 2026-11-29). */
static inline __m256 exp_ieee8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.3f), big = _mm256_set1_ps(12582912.0f);
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), big), big);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 neg = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ieee8(neg))), u);
}
#endif

/* act[j] = silu_mul1(g[j], u[j]) for j < n, in the widest vectors the build has (the same bits) */
static inline void silu_mul_n(const float *g, const float *u, int64_t n, float *act) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(act + j, silu_mul16(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(act + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
#endif
    for (; j < n; j++) act[j] = silu_mul1(g[j], u[j]);
}

#endif
