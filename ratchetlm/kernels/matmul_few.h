/* The few-token fp32 block matmul (matmul.c's ratchet_mm for up to TF tokens), one function few_NAME per
 * format, instantiated by FEW_KERNEL in two translation units of their own (matmul_few_blocks.c: the
 * 32-weight formats; matmul_few_k.c: the K-quants and the float rows), so that the build compiles them
 * in parallel with the rest. */
#ifndef RATCHET_MATMUL_FEW_H
#define RATCHET_MATMUL_FEW_H
#include "matmul_vec.h"

/* ------------------------------------------------------------ few tokens, from registers (AVX-512, AVX2)
 * Decode and short verify read each weight once and use it for at most a few tokens: a trip through
 * the scratch buffer (a 64-byte store and reload per 16 weights) costs as much as the multiply
 * (one token, Q4_K weights in L2: 1.6 ns per 16 weights through the scratch, 0.9 ns here).
 * Here each 32-weight unit of a block is dequantized into 32 / VLEN vectors (units_avx512.h,
 * units_avx2.h: the same operations as to_float) and multiplied at once, up to RF rows x TF tokens per
 * tile. The reduction order is the scratch path's (one accumulator per output, lanes in increasing k,
 * VSUM), so the two paths give the same bits and a call may take either. */
#if defined(__AVX512F__)
#include "units_avx512.h"
#define FEW_RF(tt) ((tt) <= 4 ? 4 : 2) /* rows per tile: 4 x 4 or 2 x 8 accumulators of 32 registers */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "units_avx2.h"
#define FEW_RF(tt) ((tt) <= 2 ? 4 : (tt) <= 4 ? 2 : 1) /* at most 8 accumulators of 16 registers */
#endif
#if defined(FEW_RF)
/* Software prefetch PREFETCH_AHEAD bytes ahead in each row, into L1 (T0) or, for the formats with the
 * most bytes per weight, L2 (T1: 8-bit and 16-bit rows would crowd L1). Measured on 1B decode steps,
 * in one process alternating builds: 8 KB ahead vs 4 KB 1.06x (Q4_K_M); T1 vs T0 1.2x on Q8_0, 0.9x
 * on Q6_K, 0.96x on Q4_1 (AVX-512). */
#define PREFETCH_AHEAD 8192
#define PREFETCH_BLOCK(p, nbytes, hint)                                                            \
    for (int o_ = 0; o_ < (nbytes); o_ += 64) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD + o_, hint)
#define RF 4 /* most weight rows per tile */
#define TF 8 /* most tokens (batch-8 decode through registers: 1.8x faster than through the scratch) */

#define FEW_KERNEL(NAME, UB, UBYTES, STATE, HINT)                                                      \
    ALWAYS_INLINE void few_##NAME##_tile(const uint8_t *const *rows, const float *x, int K, float *y, int N,     \
                                         const int rr, const int tt) {                             \
        vec_t acc[RF][TF];                                                                         \
        for (int r = 0; r < rr; r++)                                                               \
            for (int t = 0; t < tt; t++) acc[r][t] = VZERO();                                      \
        for (int b = 0; b < K / UB; b++) {                                                         \
            STATE st[RF];                                                                          \
            for (int r = 0; r < rr; r++) {                                                         \
                PREFETCH_BLOCK(rows[r] + (long)b * UBYTES, UBYTES, HINT);                             \
                NAME##_prep(rows[r] + (long)b * UBYTES, &st[r]);                                   \
            }                                                                                      \
            for (int j = 0; j < UB / 32; j++) {                                                    \
                const float *xk = x + (long)b * UB + 32 * j;                                       \
                for (int r = 0; r < rr; r++) {                                                     \
                    vec_t v[UNIT_VECS];                                                            \
                    UNIT(NAME, rows[r] + (long)b * UBYTES, &st[r], j, v);                          \
                    for (int t = 0; t < tt; t++)                                                   \
                        for (int i = 0; i < UNIT_VECS; i++)                                        \
                            acc[r][t] = VFMA(VLOAD(xk + (long)t * K + VLEN * i), v[i], acc[r][t]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < rr; r++)                                                               \
            for (int t = 0; t < tt; t++) y[(long)t * N + r] = VSUM(acc[r][t]);                     \
    }                                                                                              \
    FEW_TILES(NAME, 1) FEW_TILES(NAME, 2) FEW_TILES(NAME, 3) FEW_TILES(NAME, 4)                     \
    FEW_TILES(NAME, 5) FEW_TILES(NAME, 6) FEW_TILES(NAME, 7) FEW_TILES(NAME, 8)                     \
    void few_##NAME(const uint8_t *const *rows, const float *x, int K, float *y, int N, int rr, int tt) { \
        const int rf = FEW_RF(tt);                                                                 \
        for (int r0 = 0; r0 < rr;) {                                                               \
            const int n = rr - r0 >= rf ? rf : 1;                                                  \
            switch (tt) {                                                                          \
                FEW_CASE(NAME, 1) FEW_CASE(NAME, 2) FEW_CASE(NAME, 3) FEW_CASE(NAME, 4)            \
                FEW_CASE(NAME, 5) FEW_CASE(NAME, 6) FEW_CASE(NAME, 7)                              \
            default:                                                                               \
                FEW_CALL(NAME, 8);                                                                 \
            }                                                                                      \
            r0 += n;                                                                               \
        }                                                                                          \
    }

/* One function per tile shape (FEW_RF(TT) or 1 rows x TT tokens): gcc's per-function passes take time
 * that grows faster than a function's size; with every shape inlined into few_NAME's switch the
 * few-token kernels took 13 s (AVX2) / 17 s (AVX-512) of CPU to compile in one unit, against 8 / 9 s like
 * this (the same loops, in two units). A shape whose FEW_RF is 1 has one function: the wide call is
 * never made and never emitted. */
#define FEW_TILES(NAME, TT)                                                                        \
    static __attribute__((noinline)) void few_##NAME##_w##TT(const uint8_t *const *rows, const float *x, int K, \
                                                             float *y, int N) {                    \
        few_##NAME##_tile(rows, x, K, y, N, FEW_RF(TT), TT);                                       \
    }                                                                                              \
    static __attribute__((noinline)) void few_##NAME##_n##TT(const uint8_t *const *rows, const float *x, int K, \
                                                             float *y, int N) {                    \
        few_##NAME##_tile(rows, x, K, y, N, 1, TT);                                                \
    }
#define FEW_CALL(NAME, TT)                                                                         \
    if (FEW_RF(TT) > 1 && n > 1)                                                                   \
        few_##NAME##_w##TT(rows + r0, x, K, y + r0, N);                                            \
    else                                                                                           \
        few_##NAME##_n##TT(rows + r0, x, K, y + r0, N)
#define FEW_CASE(NAME, TT)                                                                         \
    case TT:                                                                                       \
        FEW_CALL(NAME, TT);                                                                        \
        break;

#else
#define TF 0
#endif

#endif
