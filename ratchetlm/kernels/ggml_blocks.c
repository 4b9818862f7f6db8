/* Fused dequantize-and-multiply for GGUF block-quantized weights (CPU, fp32 activations).
 *
 *   y[t, n] = sum_k x[t, k] * w[n, k]
 *
 * w is never materialised: each 32-weight block is dequantized in registers with exactly the
 * float operations of gguf-py's dequantizer (Q4_1: d * q + m, Q8_0: q * d, d and m widened from
 * fp16), so the weights are bit-identical to the dense copy; only the summation order differs
 * from a BLAS sgemm. Built with -ffp-contract=off so the compiler cannot fuse d * q + m.
 *
 * Layout (repacked at load time from GGUF's interleaved blocks, rows = output features):
 *   Q4_1: qs [N, K/32, 16] uint8 (byte j: low nibble = weight j, high nibble = weight j + 16),
 *         d, m [N, K/32] fp32
 *   Q8_0: qs [N, K/32, 32] int8, d [N, K/32] fp32
 *   x [M, K] fp32 row-major, y [M, N] fp32 row-major.
 *
 * Small M: one weight row at a time, one dequantized block serving up to TB rows of x. Larger M
 * (AVX-512 builds): register tiles of RT weight rows x TT tokens.
 */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TB 8
#define MIN(a, b) ((a) < (b) ? (a) : (b))
/* Inlined with a literal token count (see ROW_CASES) so the accumulators live in registers. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROW_CASES(CALL)                                                                            \
    switch (tb) {                                                                                  \
    case 1: CALL(1); break;                                                                        \
    case 2: CALL(2); break;                                                                        \
    case 3: CALL(3); break;                                                                        \
    case 4: CALL(4); break;                                                                        \
    case 5: CALL(5); break;                                                                        \
    case 6: CALL(6); break;                                                                        \
    case 7: CALL(7); break;                                                                        \
    default: CALL(TB); break;                                                                      \
    }

#if defined(__AVX512F__)
#define KERNEL_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL_ISA "avx2"
#else
#define KERNEL_ISA "scalar"
#endif

const char *ratchet_kernel_isa(void) { return KERNEL_ISA; }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

ALWAYS_INLINE void q4_1_row(const float *x, const int tb, int K, const uint8_t *qr, const float *dr, const float *mr, int nb,
                     float *out /* [tb] */) {
#if defined(__AVX512F__)
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[TB];
    for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        /* the block's 16 possible weights, d * q + m for q = 0..15; nibbles index into it */
        __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(dr[b]), iota), _mm512_set1_ps(mr[b]));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qr + b * 16)));
        __m512 w0 = _mm512_permutexvar_ps(v, table); /* permutexvar reads index bits 0..3 = low nibble */
        __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w0, acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w1, acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TB];
    for (int t = 0; t < TB; t++) acc[t] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(qr + b * 16));
        __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        __m256 vd = _mm256_set1_ps(dr[b]), vm = _mm256_set1_ps(mr[b]);
        __m256 w[4];
        w[0] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))), vm);
        w[1] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))), vm);
        w[2] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))), vm);
        w[3] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))), vm);
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            for (int j = 0; j < 4; j++) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * j), w[j], acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = hsum256(acc[t]);
#else
    for (int t = 0; t < tb; t++) out[t] = 0.0f;
    for (int b = 0; b < nb; b++) {
        float w[32];
        for (int j = 0; j < 16; j++) {
            w[j] = dr[b] * (float)(qr[b * 16 + j] & 0x0F) + mr[b];
            w[j + 16] = dr[b] * (float)(qr[b * 16 + j] >> 4) + mr[b];
        }
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += xb[j] * w[j];
            out[t] += s;
        }
    }
#endif
}

ALWAYS_INLINE void q8_0_row(const float *x, const int tb, int K, const int8_t *qr, const float *dr, int nb, float *out) {
#if defined(__AVX512F__)
    __m512 acc[TB];
    for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 vd = _mm512_set1_ps(dr[b]);
        const int8_t *q = qr + b * 32;
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), vd);
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), vd);
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w0, acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w1, acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TB];
    for (int t = 0; t < TB; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 vd = _mm256_set1_ps(dr[b]);
        const int8_t *q = qr + b * 32;
        __m256 w[4];
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j)))), vd);
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            for (int j = 0; j < 4; j++) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * j), w[j], acc[t]);
        }
    }
    for (int t = 0; t < tb; t++) out[t] = hsum256(acc[t]);
#else
    for (int t = 0; t < tb; t++) out[t] = 0.0f;
    for (int b = 0; b < nb; b++) {
        float w[32];
        for (int j = 0; j < 32; j++) w[j] = (float)qr[b * 32 + j] * dr[b];
        for (int t = 0; t < tb; t++) {
            const float *xb = x + (long)t * K + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += xb[j] * w[j];
            out[t] += s;
        }
    }
#endif
}

static void q4_1_mm_rows(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m, int N, float *y,
                     int threads) {
    int nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        float out[TB];
        for (int t0 = 0; t0 < M; t0 += TB) {
            int tb = MIN(M - t0, TB);
#define CALL(T) q4_1_row(x + (long)t0 * K, T, K, qs + (long)n * nb * 16, d + (long)n * nb, m + (long)n * nb, nb, out)
            ROW_CASES(CALL)
#undef CALL
            for (int t = 0; t < tb; t++) y[(long)(t0 + t) * N + n] = out[t];
        }
    }
}

static void q8_0_mm_rows(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int threads) {
    int nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        float out[TB];
        for (int t0 = 0; t0 < M; t0 += TB) {
            int tb = MIN(M - t0, TB);
#define CALL(T) q8_0_row(x + (long)t0 * K, T, K, qs + (long)n * nb * 32, d + (long)n * nb, nb, out)
            ROW_CASES(CALL)
#undef CALL
            for (int t = 0; t < tb; t++) y[(long)(t0 + t) * N + n] = out[t];
        }
    }
}
#if defined(__AVX512F__)
/* AVX-512: register tiles of RT weight rows x T tokens. Each block of x is loaded once per tile
 * and each dequantized block of w serves T tokens, so the loop issues ~2 FMAs per load instead
 * of 1; R and T are compile-time constants after inlining (the switch below), so the
 * accumulators stay in registers. */
#define RT 4
#define TT 4

ALWAYS_INLINE void q4_1_tile(const float *x, int K, const uint8_t *qs, const float *d, const float *m, int nb, int n0,
                             const int R, const int T, float *y, int N) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[RT][TT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 xv[TT][2];
        for (int t = 0; t < T; t++) {
            xv[t][0] = _mm512_loadu_ps(x + (long)t * K + b * 32);
            xv[t][1] = _mm512_loadu_ps(x + (long)t * K + b * 32 + 16);
        }
        for (int r = 0; r < R; r++) {
            long rb = (long)(n0 + r) * nb + b;
            /* the block's 16 possible weights, d * q + m for q = 0..15; nibbles index into it */
            __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d[rb]), iota), _mm512_set1_ps(m[rb]));
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + rb * 16)));
            __m512 w0 = _mm512_permutexvar_ps(v, table); /* permutexvar reads index bits 0..3 = low nibble */
            __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int t = 0; t < T; t++) {
                acc[r][t] = _mm512_fmadd_ps(xv[t][0], w0, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(xv[t][1], w1, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) y[(long)t * N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

ALWAYS_INLINE void q8_0_tile(const float *x, int K, const int8_t *qs, const float *d, int nb, int n0, const int R,
                             const int T, float *y, int N) {
    __m512 acc[RT][TT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 xv[TT][2];
        for (int t = 0; t < T; t++) {
            xv[t][0] = _mm512_loadu_ps(x + (long)t * K + b * 32);
            xv[t][1] = _mm512_loadu_ps(x + (long)t * K + b * 32 + 16);
        }
        for (int r = 0; r < R; r++) {
            long rb = (long)(n0 + r) * nb + b;
            __m512 vd = _mm512_set1_ps(d[rb]);
            const int8_t *q = qs + rb * 32;
            __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), vd);
            __m512 w1 =
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), vd);
            for (int t = 0; t < T; t++) {
                acc[r][t] = _mm512_fmadd_ps(xv[t][0], w0, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(xv[t][1], w1, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) y[(long)t * N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Dispatch a tile to the instance with constant R (RT or 1) and T (1..TT). */
#define DISPATCH(CALL_R_T)                                                      \
    do {                                                                         \
        switch (tt) {                                                            \
        case 1: CALL_R_T(1); break;                                              \
        case 2: CALL_R_T(2); break;                                              \
        case 3: CALL_R_T(3); break;                                              \
        default: CALL_R_T(TT); break;                                            \
        }                                                                        \
    } while (0)

static void q4_1_mm_tiled(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m, int N, float *y,
                     int threads) {
    int nb = K / 32, ntiles = (N + RT - 1) / RT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int tile = 0; tile < ntiles; tile++) {
        int n0 = tile * RT, rr = MIN(RT, N - n0);
        for (int t0 = 0; t0 < M; t0 += TT) {
            int tt = MIN(TT, M - t0);
            const float *xt = x + (long)t0 * K;
            float *yt = y + (long)t0 * N;
            if (rr == RT) {
#define FULL(T) q4_1_tile(xt, K, qs, d, m, nb, n0, RT, T, yt, N)
                DISPATCH(FULL);
#undef FULL
            } else {
                for (int r = 0; r < rr; r++) {
#define ONE(T) q4_1_tile(xt, K, qs, d, m, nb, n0 + r, 1, T, yt, N)
                    DISPATCH(ONE);
#undef ONE
                }
            }
        }
    }
}

static void q8_0_mm_tiled(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int threads) {
    int nb = K / 32, ntiles = (N + RT - 1) / RT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int tile = 0; tile < ntiles; tile++) {
        int n0 = tile * RT, rr = MIN(RT, N - n0);
        for (int t0 = 0; t0 < M; t0 += TT) {
            int tt = MIN(TT, M - t0);
            const float *xt = x + (long)t0 * K;
            float *yt = y + (long)t0 * N;
            if (rr == RT) {
#define FULL(T) q8_0_tile(xt, K, qs, d, nb, n0, RT, T, yt, N)
                DISPATCH(FULL);
#undef FULL
            } else {
                for (int r = 0; r < rr; r++) {
#define ONE(T) q8_0_tile(xt, K, qs, d, nb, n0 + r, 1, T, yt, N)
                    DISPATCH(ONE);
#undef ONE
                }
            }
        }
    }
}
#endif

/* Up to ROWS_MAX tokens the row-at-a-time loop is fastest (weight-read bound, one dequantization
 * per weight); above it the AVX-512 register tiles win (FMA bound). Measured on the default model. */
#define ROWS_MAX 8

void ratchet_q4_1_mm(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m, int N, float *y,
                     int threads) {
#if defined(__AVX512F__)
    if (M > ROWS_MAX) {
        q4_1_mm_tiled(x, M, K, qs, d, m, N, y, threads);
        return;
    }
#endif
    q4_1_mm_rows(x, M, K, qs, d, m, N, y, threads);
}

void ratchet_q8_0_mm(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int threads) {
#if defined(__AVX512F__)
    if (M > ROWS_MAX) {
        q8_0_mm_tiled(x, M, K, qs, d, N, y, threads);
        return;
    }
#endif
    q8_0_mm_rows(x, M, K, qs, d, N, y, threads);
}
