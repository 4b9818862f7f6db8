/* y = x @ w.T for GGUF block weights, fp32 activations, at any number of rows (CPU).
 *
 *   x [M, K] fp32 row-major, y [M, N] fp32 row-major, w [N, K] as one or more parts: each part is
 *   a run of output rows stored as blocks of one format (a fused QKV weight is three parts, maybe of
 *   three formats), read in place (usually the mmapped GGUF file); an optional row map says which
 *   stored row feeds each output row (undoing llama.cpp's Q/K permutation without a copy).
 *
 * Each thread takes panels of P weight rows. It dequantizes a panel's rows, KC weights at a time,
 * into a small scratch buffer with the format's to_float (ggml_types.h: the only format-specific
 * step), then multiplies the scratch rows with every token of x in R-row x T-token register tiles.
 *
 * Reduction order, the numerics contract: the dot product of output row n and token t is one
 * vector accumulator of VLEN lanes; lane l sums x[t, k] * w[n, k] for k = l, l + VLEN, ... in
 * increasing k with fused multiply-adds, and the lanes are summed by one fixed tree at the end. No
 * choice of P, R, T, KC, M or thread count changes that order (tiling only decides which
 * accumulators share registers; a K chunk spills and reloads whole vectors), so a row's result does
 * not depend on how many rows share the call: decode, verify and prefill agree bit for bit.
 */
#include <stdlib.h>

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

#ifndef KC
#define KC 256 /* weights per K chunk when many tokens share a panel (multiple of every block size) */
#endif
#ifndef KC_FEW
#define KC_FEW 2048 /* weights per K chunk for few tokens: the panel's scratch stays in L1/L2 */
#endif
#ifndef P_MAX
#define P_MAX 16
#endif

const char *ratchet_kernel_isa(void) { return KERNEL_ISA; }

typedef struct {
    int32_t type;         /* row of RATCHET_TYPES */
    int32_t rows;         /* output rows this part produces */
    const uint8_t *data;  /* stored rows of blocks */
    int64_t row_bytes;    /* bytes per stored row */
    const int32_t *rowmap; /* NULL, or [rows]: stored row feeding output row i */
} part_t;

/* Accumulate an rr-row x tt-token tile over klen weights of K. w: scratch rows (stride ldw),
 * x: first token at the chunk start (stride K), acc: [rows of the panel][T] vectors (stride T per
 * row). first: start from zero; last: reduce into y (stride N) instead of storing acc. */
ALWAYS_INLINE void tile(const float *w, int ldw, const float *x, int K, int klen, vec_t *acc, int first, int last,
                        float *y, int N, const int rr, const int tt) {
    vec_t a[R * T];
    for (int r = 0; r < rr; r++)
        for (int t = 0; t < tt; t++) a[r * T + t] = first ? VZERO() : acc[r * T + t];
    int k = 0;
    for (; k + VLEN <= klen; k += VLEN) {
        vec_t wv[R];
        for (int r = 0; r < rr; r++) wv[r] = VLOAD(w + (long)r * ldw + k);
        for (int t = 0; t < tt; t++) {
            vec_t xv = VLOAD(x + (long)t * K + k);
            for (int r = 0; r < rr; r++) a[r * T + t] = VFMA(xv, wv[r], a[r * T + t]);
        }
    }
    if (k < klen) { /* K not a multiple of the vector width (F16 / F32 rows): masked lanes add 0 */
        vec_t wv[R];
        for (int r = 0; r < rr; r++) wv[r] = VLOAD_N(w + (long)r * ldw + k, klen - k);
        for (int t = 0; t < tt; t++) {
            vec_t xv = VLOAD_N(x + (long)t * K + k, klen - k);
            for (int r = 0; r < rr; r++) a[r * T + t] = VFMA(xv, wv[r], a[r * T + t]);
        }
    }
    for (int r = 0; r < rr; r++)
        for (int t = 0; t < tt; t++) {
            if (last)
                y[(long)t * N + r] = VSUM(a[r * T + t]);
            else
                acc[r * T + t] = a[r * T + t];
        }
}

/* literal tile sizes so the accumulators live in registers */
#define TILE_T(RR, TT) tile(w, ldw, x, K, klen, acc, first, last, y, N, RR, TT)
#define TILES(RR)                                                                                  \
    switch (tt) {                                                                                  \
    case 1: TILE_T(RR, 1); break;                                                                  \
    case 2: TILE_T(RR, MIN(2, T)); break;                                                          \
    case 3: TILE_T(RR, MIN(3, T)); break;                                                          \
    case 4: TILE_T(RR, MIN(4, T)); break;                                                          \
    case 5: TILE_T(RR, MIN(5, T)); break;                                                          \
    case 6: TILE_T(RR, MIN(6, T)); break;                                                          \
    case 7: TILE_T(RR, MIN(7, T)); break;                                                          \
    default: TILE_T(RR, T); break;                                                                 \
    }

static void tile_any(const float *w, int ldw, const float *x, int K, int klen, vec_t *acc, int first, int last,
                     float *y, int N, int rr, int tt) {
    if (rr == R) {
        TILES(R)
    } else {
        TILES(1)
    }
}

/* per-thread scratch, grown on demand and kept (OpenMP reuses its threads) */
static __thread float *scratch_w;
static __thread size_t scratch_w_cap;
static __thread vec_t *scratch_acc;
static __thread size_t scratch_acc_cap;

static void *grow(void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    free(p);
    *cap = need + need / 2;
    return aligned_alloc(64, (*cap + 63) / 64 * 64);
}

typedef struct {
    const part_t *part;
    int row0, rows, col0;
} panel_t;

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
    void few_##NAME(const uint8_t *const *rows, const float *x, int K, float *y, int N, int rr, int tt) { \
        const int rf = FEW_RF(tt);                                                                 \
        for (int r0 = 0; r0 < rr;) {                                                               \
            const int n = rr - r0 >= rf ? rf : 1;                                                  \
            switch ((n > 1) * 16 + tt) {                                                           \
            case 16 + 1: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(1), 1); break;       \
            case 16 + 2: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(2), 2); break;       \
            case 16 + 3: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(3), 3); break;       \
            case 16 + 4: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(4), 4); break;       \
            case 16 + 5: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(5), 5); break;       \
            case 16 + 6: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(6), 6); break;       \
            case 16 + 7: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(7), 7); break;       \
            case 16 + 8: few_##NAME##_tile(rows + r0, x, K, y + r0, N, FEW_RF(8), 8); break;       \
            case 1: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 1); break;                    \
            case 2: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 2); break;                    \
            case 3: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 3); break;                    \
            case 4: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 4); break;                    \
            case 5: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 5); break;                    \
            case 6: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 6); break;                    \
            case 7: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 7); break;                    \
            default: few_##NAME##_tile(rows + r0, x, K, y + r0, N, 1, 8); break;                   \
            }                                                                                      \
            r0 += n;                                                                               \
        }                                                                                          \
    }

FEW_KERNEL(f32, 32, 128, none_t, _MM_HINT_T1)
FEW_KERNEL(f16, 32, 64, none_t, _MM_HINT_T1)
FEW_KERNEL(bf16, 32, 64, none_t, _MM_HINT_T1)
FEW_KERNEL(q4_0, 32, 18, tab_t, _MM_HINT_T0)
FEW_KERNEL(q4_1, 32, 20, tab_t, _MM_HINT_T0)
FEW_KERNEL(q5_0, 32, 22, tab_t, _MM_HINT_T0)
FEW_KERNEL(q5_1, 32, 24, tab_t, _MM_HINT_T0)
FEW_KERNEL(q8_0, 32, 34, tab_t, _MM_HINT_T1)
FEW_KERNEL(q4_k, 256, 144, kstate_t, _MM_HINT_T0)
FEW_KERNEL(q5_k, 256, 176, kstate_t, _MM_HINT_T0)
FEW_KERNEL(q6_k, 256, 210, kstate_t, _MM_HINT_T0)
#else
#define TF 0
#endif

/* whether every part has a few-token kernel for this K (F32 / F16 / BF16 need K % 32 == 0) */
static int few_ok(const part_t *parts, int nparts, int K) {
    if (K % 32) return 0;
    for (int i = 0; i < nparts; i++)
        if (!RATCHET_TYPES[parts[i].type].few) return 0;
    return 1;
}

void ratchet_mm(const float *x, int M, int K, const part_t *parts, int nparts, float *y, int N, int threads) {
    if (M <= 0 || N <= 0) return;
    if (M <= TF && few_ok(parts, nparts, K)) {
        /* guided schedule: long runs of adjacent panels first (each thread streams its own stretch of
         * the weight: 1.25x over one panel at a time at 1B decode), then shorter ones as threads come
         * free, so a thread that loses its core on a busy machine does not hold up the call */
        int npanels = 0;
        for (int i = 0; i < nparts; i++) npanels += (parts[i].rows + P_MAX - 1) / P_MAX;
        panel_t *panels = malloc(sizeof(panel_t) * (size_t)npanels);
        for (int i = 0, j = 0, col = 0; i < nparts; col += parts[i].rows, i++)
            for (int r = 0; r < parts[i].rows; r += P_MAX, j++)
                panels[j] = (panel_t){&parts[i], r, MIN(P_MAX, parts[i].rows - r), col + r};
#pragma omp parallel for schedule(guided) num_threads(threads)
        for (int pi = 0; pi < npanels; pi++) {
            const panel_t pn = panels[pi];
            const uint8_t *rows[P_MAX];
            for (int r = 0; r < pn.rows; r++) {
                long row = pn.part->rowmap ? pn.part->rowmap[pn.row0 + r] : pn.row0 + r;
                rows[r] = pn.part->data + row * pn.part->row_bytes;
            }
            RATCHET_TYPES[pn.part->type].few(rows, x, K, y + pn.col0, N, pn.rows, M);
        }
        free(panels);
        return;
    }
    /* Few tokens: the weights are read once and the whole K fits one chunk (no accumulator spills).
     * Many tokens: short K chunks keep a panel's scratch and a tile's tokens in L1. */
    const int P = M <= 8 ? R : P_MAX;
    const int kc = M <= 8 ? KC_FEW : KC;
    int npanels = 0;
    for (int i = 0; i < nparts; i++) npanels += (parts[i].rows + P - 1) / P;
    panel_t *panels = malloc(sizeof(panel_t) * (size_t)npanels);
    for (int i = 0, j = 0, col = 0; i < nparts; col += parts[i].rows, i++)
        for (int r = 0; r < parts[i].rows; r += P, j++) panels[j] = (panel_t){&parts[i], r, MIN(P, parts[i].rows - r), col + r};
    const int ldw = (MIN(kc, K) + 15) / 16 * 16;
    const int spill = kc < K; /* accumulators live across K chunks */
    const int ngroups = (M + T - 1) / T;
#pragma omp parallel num_threads(threads)
    {
        scratch_w = grow(scratch_w, &scratch_w_cap, sizeof(float) * (size_t)P * ldw);
        vec_t *accbuf = NULL;
        if (spill) accbuf = scratch_acc = grow(scratch_acc, &scratch_acc_cap, sizeof(vec_t) * (size_t)ngroups * P * T);
        float *wbuf = scratch_w;
#pragma omp for schedule(static, 1)
        for (int pi = 0; pi < npanels; pi++) {
            const panel_t pn = panels[pi];
            const ggml_type_t *ty = &RATCHET_TYPES[pn.part->type];
            for (int kb = 0; kb < K; kb += kc) {
                const int klen = MIN(kc, K - kb);
                for (int r = 0; r < pn.rows; r++) {
                    long row = pn.part->rowmap ? pn.part->rowmap[pn.row0 + r] : pn.row0 + r;
                    ty->to_float(pn.part->data + row * pn.part->row_bytes + (long)(kb / ty->blck) * ty->bytes,
                                 wbuf + (long)r * ldw, klen / ty->blck);
                }
                const int first = kb == 0, last = kb + klen == K;
                for (int g = 0; g < ngroups; g++) {
                    const int t0 = g * T, tt = MIN(T, M - t0);
                    for (int r0 = 0; r0 < pn.rows;) {
                        const int rr = pn.rows - r0 >= R ? R : 1;
                        vec_t local[R * T];
                        vec_t *acc = accbuf ? accbuf + ((long)g * P + r0) * T : local;
                        tile_any(wbuf + (long)r0 * ldw, ldw, x + (long)t0 * K + kb, K, klen, acc, first, last,
                                 y + (long)t0 * N + pn.col0 + r0, N, rr, tt);
                        r0 += rr;
                    }
                }
            }
        }
    }
    free(panels);
}

/* Embedding lookup: out[i] = dequantized stored row ids[i] of one part (K weights per row). */
void ratchet_get_rows(const part_t *part, int K, const int64_t *ids, int n, float *out, int threads) {
    const ggml_type_t *ty = &RATCHET_TYPES[part->type];
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 16)
    for (int i = 0; i < n; i++) {
        long row = part->rowmap ? part->rowmap[ids[i]] : ids[i];
        ty->to_float(part->data + row * part->row_bytes, out + (long)i * K, K / ty->blck);
    }
}

/* Output rows [row0, row0 + n) of a weight made of parts, dequantized into out [n, K] (the dense
 * tile a BLAS multiply reads when many tokens share the call). */
void ratchet_dequant_rows(const part_t *parts, int nparts, int row0, int n, int K, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 16)
    for (int i = 0; i < n; i++) {
        int row = row0 + i, p = 0;
        while (p < nparts - 1 && row >= parts[p].rows) row -= parts[p++].rows;
        const part_t *pt = &parts[p];
        const ggml_type_t *ty = &RATCHET_TYPES[pt->type];
        long stored = pt->rowmap ? pt->rowmap[row] : row;
        ty->to_float(pt->data + stored * pt->row_bytes, out + (long)i * K, K / ty->blck);
    }
}
