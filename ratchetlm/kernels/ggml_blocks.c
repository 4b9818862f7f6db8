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
 * Each instruction set has one block dequantizer (dequant_block) and everything else is shared:
 * up to ROWS_MAX tokens one weight row at a time, one dequantized block serving up to TB tokens
 * (weight-read bound); above it, on AVX-512, register tiles of RT rows x TT tokens (FMA bound).
 */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TB 8       /* tokens per pass of the row loop */
#define RT 4       /* weight rows per register tile (AVX-512) */
#define TT 4       /* tokens per register tile (AVX-512) */
#define ROWS_MAX 8 /* row loop up to here, tiles above (measured on the default model) */
#define MIN(a, b) ((a) < (b) ? (a) : (b))
/* Kernels are inlined with literal token / row counts (see CASES) so accumulators stay in registers. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define CASES(n, MAXN, CALL)                                                                       \
    switch (n) {                                                                                   \
    case 1: CALL(1); break;                                                                        \
    case 2: CALL(MIN(2, MAXN)); break;                                                             \
    case 3: CALL(MIN(3, MAXN)); break;                                                             \
    case 4: CALL(MIN(4, MAXN)); break;                                                             \
    case 5: CALL(MIN(5, MAXN)); break;                                                             \
    case 6: CALL(MIN(6, MAXN)); break;                                                             \
    case 7: CALL(MIN(7, MAXN)); break;                                                             \
    default: CALL(MAXN); break;                                                                    \
    }

enum { Q4_1 = 0, Q8_0 = 1 };
typedef struct {
    int kind;
    const uint8_t *qs; /* Q8_0: int8 bytes */
    const float *d, *m;
} blocks_t;

/* ---- one block dequantizer per instruction set: block rb -> 32 fp32 weights in vec[] ---- */
#if defined(__AVX512F__)
#define KERNEL_ISA "avx512"
#define NVEC 2
typedef __m512 vec_t;
#define VZERO() _mm512_setzero_ps()
#define VFMA(x, w, acc) _mm512_fmadd_ps(_mm512_loadu_ps(x), w, acc)
#define VSUM(v) _mm512_reduce_add_ps(v)

ALWAYS_INLINE void dequant_block(const int kind, blocks_t w, long rb, vec_t out[NVEC]) {
    if (kind == Q4_1) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        /* the block's 16 possible weights, d * q + m for q = 0..15; nibbles index into it */
        __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(w.d[rb]), iota), _mm512_set1_ps(w.m[rb]));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w.qs + rb * 16)));
        out[0] = _mm512_permutexvar_ps(v, table); /* permutexvar reads index bits 0..3 = low nibble */
        out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else {
        __m512 vd = _mm512_set1_ps(w.d[rb]);
        const __m128i *q = (const __m128i *)(w.qs + rb * 32);
        out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), vd);
        out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), vd);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL_ISA "avx2"
#define NVEC 4
typedef __m256 vec_t;
#define VZERO() _mm256_setzero_ps()
#define VFMA(x, w, acc) _mm256_fmadd_ps(_mm256_loadu_ps(x), w, acc)
static inline float VSUM(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

ALWAYS_INLINE void dequant_block(const int kind, blocks_t w, long rb, vec_t out[NVEC]) {
    __m256 vd = _mm256_set1_ps(w.d[rb]);
    if (kind == Q4_1) {
        const __m128i low4 = _mm_set1_epi8(0x0F);
        __m128i raw = _mm_loadu_si128((const __m128i *)(w.qs + rb * 16));
        __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        __m256 vm = _mm256_set1_ps(w.m[rb]);
        for (int j = 0; j < 4; j++)
            out[j] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]))), vm);
    } else {
        const uint8_t *q = w.qs + rb * 32;
        for (int j = 0; j < 4; j++)
            out[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j)))),
                                   vd);
    }
}
#else
#define KERNEL_ISA "scalar"
#define NVEC 32 /* one "vector" per weight: the shared loops below become plain C */
typedef float vec_t;
#define VZERO() 0.0f
#define VFMA(x, w, acc) ((acc) + *(x) * (w))
#define VSUM(v) (v)

ALWAYS_INLINE void dequant_block(const int kind, blocks_t w, long rb, vec_t out[NVEC]) {
    for (int j = 0; j < 16; j++) {
        if (kind == Q4_1) {
            out[j] = w.d[rb] * (float)(w.qs[rb * 16 + j] & 0x0F) + w.m[rb];
            out[j + 16] = w.d[rb] * (float)(w.qs[rb * 16 + j] >> 4) + w.m[rb];
        } else {
            out[j] = (float)((const int8_t *)w.qs)[rb * 32 + j] * w.d[rb];
            out[j + 16] = (float)((const int8_t *)w.qs)[rb * 32 + j + 16] * w.d[rb];
        }
    }
}
#endif
#define VLEN (32 / NVEC) /* floats per vec_t */

const char *ratchet_kernel_isa(void) { return KERNEL_ISA; }

/* ---- R weight rows (n0 ..) x T tokens, dequantizing each block once for all T tokens ---- */
ALWAYS_INLINE void mm_tile(const int kind, const float *x, int K, blocks_t w, int nb, int n0, const int R,
                           const int T, float *y, int N) {
    /* one accumulator per (row, token), at r * T + t; 16 = max(RT * TT, TB) */
    vec_t acc[16];
    for (int i = 0; i < R * T; i++) acc[i] = VZERO();
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            vec_t wv[NVEC];
            dequant_block(kind, w, (long)(n0 + r) * nb + b, wv);
            for (int t = 0; t < T; t++)
                for (int j = 0; j < NVEC; j++)
                    acc[r * T + t] = VFMA(x + (long)t * K + b * 32 + j * VLEN, wv[j], acc[r * T + t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) y[(long)t * N + n0 + r] = VSUM(acc[r * T + t]);
}

/* Rows one at a time, up to TB tokens per dequantized block (weight-read bound: few tokens). */
static void mm_rows(const float *x, int M, int K, blocks_t w, int N, float *y, int threads) {
    int nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        for (int t0 = 0; t0 < M; t0 += TB) {
            int tt = MIN(TB, M - t0);
            const float *xt = x + (long)t0 * K;
            float *yt = y + (long)t0 * N;
#define ROW(T) mm_tile(Q4_1, xt, K, w, nb, n, 1, T, yt, N)
#define ROW8(T) mm_tile(Q8_0, xt, K, w, nb, n, 1, T, yt, N)
            if (w.kind == Q4_1) {
                CASES(tt, TB, ROW)
            } else {
                CASES(tt, TB, ROW8)
            }
        }
    }
}

#if defined(__AVX512F__)
/* RT-row x TT-token register tiles (FMA bound: many tokens); a partial last tile goes row by row. */
static void mm_tiled(const float *x, int M, int K, blocks_t w, int N, float *y, int threads) {
    int nb = K / 32, ntiles = (N + RT - 1) / RT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < ntiles; i++) {
        int n0 = i * RT, rr = MIN(RT, N - n0);
        for (int t0 = 0; t0 < M; t0 += TT) {
            int tt = MIN(TT, M - t0);
            const float *xt = x + (long)t0 * K;
            float *yt = y + (long)t0 * N;
#define TILE(T) mm_tile(Q4_1, xt, K, w, nb, n0 + r, R, T, yt, N)
#define TILE8(T) mm_tile(Q8_0, xt, K, w, nb, n0 + r, R, T, yt, N)
            for (int r = 0; r < rr; r += (rr == RT ? RT : 1)) {
                if (rr == RT) {
                    const int R = RT;
                    if (w.kind == Q4_1) { CASES(tt, TT, TILE) } else { CASES(tt, TT, TILE8) }
                } else {
                    const int R = 1;
                    if (w.kind == Q4_1) { CASES(tt, TT, TILE) } else { CASES(tt, TT, TILE8) }
                }
            }
        }
    }
}
#endif

static void mm(const float *x, int M, int K, blocks_t w, int N, float *y, int threads) {
#if defined(__AVX512F__)
    if (M > ROWS_MAX) {
        mm_tiled(x, M, K, w, N, y, threads);
        return;
    }
#endif
    mm_rows(x, M, K, w, N, y, threads);
}

void ratchet_q4_1_mm(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m, int N, float *y,
                     int threads) {
    blocks_t w = {Q4_1, qs, d, m};
    mm(x, M, K, w, N, y, threads);
}

void ratchet_q8_0_mm(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int threads) {
    blocks_t w = {Q8_0, (const uint8_t *)qs, d, 0};
    mm(x, M, K, w, N, y, threads);
}
