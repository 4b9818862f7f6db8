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
 *
 * Up to TF tokens go through the few-token kernels instead (matmul_few.h; their own translation units,
 * matmul_few_blocks.c and matmul_few_k.c, so that the build compiles them in parallel), same order.
 */
#include <stdlib.h>

#include "matmul_few.h" /* TF: the most tokens of the few-token kernels (0: none on this ISA) */
#include "matmul_vec.h"

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
