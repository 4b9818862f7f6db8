/* The vector type of the fp32 block matmul (matmul.c) and its few-token kernels (matmul_few.h): one
 * accumulator of VLEN lanes per output, per instruction set, and the register tile of the scratch path. */
#ifndef RATCHET_MATMUL_VEC_H
#define RATCHET_MATMUL_VEC_H
#include "ggml_types.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define KERNEL_ISA "avx512"
#define VLEN 16
#ifndef R
#define R 4 /* weight rows per register tile */
#define T 6 /* tokens per register tile: R * T accumulators + R weight vectors <= 32 registers */
#endif
typedef __m512 vec_t;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOAD_N(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define VFMA(a, b, acc) _mm512_fmadd_ps(a, b, acc)
#define VSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL_ISA "avx2"
#define VLEN 8
#define R 4
#define T 3 /* 12 accumulators + 4 weights of 16 registers */
typedef __m256 vec_t;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
static inline __m256 VLOAD_N(const float *p, int n) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota));
}
#define VFMA(a, b, acc) _mm256_fmadd_ps(a, b, acc)
static inline float VSUM(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#else
#define KERNEL_ISA "scalar"
#define VLEN 8 /* 8 independent lanes in plain C (the compiler may use SSE for them) */
#define R 2
#define T 2
typedef struct {
    float v[VLEN];
} vec_t;
static inline vec_t VZERO(void) {
    vec_t r;
    for (int i = 0; i < VLEN; i++) r.v[i] = 0.0f;
    return r;
}
static inline vec_t VLOAD_N(const float *p, int n) {
    vec_t r;
    for (int i = 0; i < VLEN; i++) r.v[i] = i < n ? p[i] : 0.0f;
    return r;
}
#define VLOAD(p) VLOAD_N(p, VLEN)
static inline vec_t VFMA(vec_t a, vec_t b, vec_t acc) { /* no fused multiply-add in portable C */
    for (int i = 0; i < VLEN; i++) acc.v[i] = acc.v[i] + a.v[i] * b.v[i];
    return acc;
}
static inline float VSUM(vec_t a) {
    for (int w = VLEN / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a.v[i] = a.v[i] + a.v[i + w];
    return a.v[0];
}
#endif

#endif
