/* Attention with a fixed reduction order per query row (the integer numerics modes' attention).
 *
 * Why: BLAS-based attention (SDPA) sums a query row's scores and weighted values in an order that
 * depends on how many queries and keys share the call, so the same row differs in the last bits
 * between a decode step, a verify step and a prefill. In the exact mode that noise never reaches
 * the greedy tokens in practice; in the integer modes a last-bit change can flip an activation's
 * rounding, and the flips compound. Here each row's result depends only on its own visible keys:
 *   s_j = scale * sum_d q[d] k_j[d]   (d in increasing order, one fused multiply-add per d; one key per lane)
 *   s_j = softcap * tanh(s_j / softcap) (if any), + mask; invisible keys are skipped
 *   p_j = exp(s_j - max_j s_j);  sum = 16 lane sums of the p_j > 0 (the r-th of them in lane r % 16, in
 *   key order per lane) reduced by one fixed tree;  out = (sum_j p_j v_j) / sum  (j increasing)
 * Keys that are masked out (-inf), beyond the causal limit or with p_j = 0 contribute nothing, so
 * padding a batch to more keys or more queries changes no bit.
 *
 * Work: the queries that share a KV head (the G heads of a group, every new row of the sequence)
 * are taken QT at a time, so each key vector loaded is used for QT queries; the keys are transposed
 * (one key per lane) by the thread that reads them, right before, into its own buffer (a half cache's
 * keys as halves, widened exactly as the scores load them; AVX-512: as pairs of dims, 32-bit items, see
 * PKI and scores_pk; cold K/V, 2 threads, 8 sequences: 0.80-0.96x the time at 70-300 keys, one thread
 * 2000 keys 0.80x); exp is a
 * polynomial (exp_neg). AVX2 builds run the same operations 8 lanes a vector (attention_avx2.h; a half
 * cache's keys widened before the transposition) and portable C one lane at a time, so every build
 * gives the AVX-512 build's bits. (AVX2 vs its former portable loop, 2 threads: a 512-token prefill's
 * attention 31.6 -> 4.7 ms a layer, AVX-512 2.4; a decode step of 8 sequences at 300 keys 1.69 -> 0.14 ms.)
 * A half cache's context rows take lean loops (AVX-512 keys: whole blocks of KL slots in transpose_keys; values:
 * pv64 / AVX2 pv16): row addresses straight from the slots, the query count a literal so the
 * accumulators stay in registers, and the skipped keys (invisible, p = 0) a mask or blend instead of a
 * branch. The same operations in the same order: no bit changes. Decode steps of 4 sequences x 1,000
 * cached keys, 30 layers, one thread (cold K/V, a shared 2-core box): 22.1 -> 18-19 ms (AVX-512).
 * Verify steps (several tiles a KV head): the tiles are taken TG at a time, scores key block by key block
 * for every tile of the group (a half block widened once, not per tile: its conversions share the FMAs'
 * ports; AVX-512: two blocks a tile at once, 8 keys' dims (d, d + 1) side by side times the query's pair
 * broadcast as one item, and without softcap the mask, limit and running max taken as each block's
 * scores leave the registers), then every tile's softmax (the sum adding each vector of compacted p as
 * it completes), then (AVX-512) the values VSPAN keys at a time for the group's rows in sets of up to
 * QS (pv_group: each value row read and widened once for the group, the accumulators kept in memory
 * between spans); a block that every query of a set keeps (all p > 0, all visible) takes plain FMAs
 * instead of the masked ones. Per output the same operations in the same order: no bit changes. 9
 * verify rows (a tree) over 1,000 half keys, 30 layers, one thread, warm: 0.76x the former time (attn2);
 * then 0.84-0.87x again over 150-1,500 keys, chains of 4-5 rows 0.87-0.93x (attn3; docs/benchmarks.md,
 * issue 37).
 *
 * Layouts: q, out [T, H, D] and this forward's kn, vn [T, Hkv, D] packed over the sequences; context
 * keys read in place from the cache layer kc, vc [slots, Hkv, D] (fp32, or IEEE half with kv_half: a
 * half cache, read widened exactly; see kv_row) by slot (query head h reads KV head
 * h / (H / Hkv)); nothing is gathered or padded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATT_AVX2 1 /* attention_avx2.h: the AVX-512 path's operations on 8 lanes */
#endif

#define KL 16 /* keys per vector of scores */
#if defined(__AVX512F__)
#define VT_DIMS 16 /* head dims a vector transpose of the keys takes at once */
#else
#define VT_DIMS 8
#endif
#define QT 4  /* queries per tile */
#if defined(__AVX512F__)
#define TG 8 /* tiles taken together (a verify step's group of tiles: see the header) */
#else
#define TG 1 /* (AVX2, portable: measured no faster with groups) */
#endif
/* Transposed keys: blocks of KL keys, each [D][KL] (one key per lane) and contiguous, so that a block's
 * scores read D * KL consecutive items (the prefetchers follow one stream, not D rows LP apart) */
#define KTI(d, j, D) ((long)((unsigned)(j) / KL) * KL * (D) + (long)(d) * KL + (unsigned)(j) % KL)
/* AVX-512, a half cache's keys (D a multiple of 16): blocks of KL keys, each [D / 2][KL][2] (dims d, d + 1
 * of a key side by side: transposed as 32-bit items, half the shuffles; see scores_pk) */
#define PKI(d, j, D) ((long)((unsigned)(j) / KL) * KL * (D) + (long)((d) / 2) * 2 * KL + (long)((unsigned)(j) % KL) * 2 + (d) % 2)
/* Software prefetch of context rows: a (sequence, KV head)'s keys and values are 64-256 byte pieces
 * of cache rows spread over the slots, too short and too scattered for the hardware prefetcher, and
 * a layer's K/V of a batch are usually out of cache (every other layer and the weights ran since).
 * Keys: the next block of KL rows while one is transposed; values: V_AHEAD rows ahead. */
#ifndef V_AHEAD
#define V_AHEAD 8
#endif
#ifndef VSPAN
#define VSPAN 64 /* keys whose values pv_group widens at once (a multiple of KL) */
#endif

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (and -inf): x = n ln2 + r, |r| <= ln2 / 2, 2^n * a degree-6 polynomial in r
 * (Cephes' expf coefficients, ~1 ulp); below -87.3 the result is 0 */
static inline __m512 exp_neg(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps((__mmask16)~under, e);
}
#endif

#if defined(__AVX512F__)
/* r[j][d] -> r[d][j] for a 16 x 16 block (pure data movement: 64 shuffles instead of 256 scalar
 * moves). Step 1 interleaves row pairs, step 2 row quads, so vector 4i + k holds in its 128-bit
 * lane L the 4 rows 4i..4i+3 of column 4L + k; step 3 gathers each column's four lanes. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 v = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), w = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), w2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_f32x4(v, v2, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(v, v2, 0xdd);
        r[4 + k] = _mm512_shuffle_f32x4(w, w2, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(w, w2, 0xdd);
    }
}
/* Scores of keys j0..j0+15 (one per lane, from the transposed block of kb at item kj: see KTI) for nq queries: two
 * chains per query (even and odd d), added at the end: a fixed order */
static inline __attribute__((always_inline)) __m512 key16(const float *kb, int D, int d, int j0) {
    return _mm512_load_ps(kb + KTI(d, j0, D));
}
/* A block of scores s_j (j = jb .. jb + 15) of one query, without a softcap, as the softmax pass takes
 * them: + the mask's column (context key j: column j, new key j: column max_ctx + j - ctx; a masked
 * load, so nothing past the row is read), then -inf from the query's limit on. The caller's running
 * max takes the blocks below the limit in increasing order, as that pass's max does (NaN included). */
static inline __attribute__((always_inline)) __m512 score_block(__m512 sv, const float *mr, int jb, int lim, int ctx,
                                                                int max_ctx) {
    const int nl = lim - jb, nc = ctx - jb; /* lanes below the limit; context lanes */
    if (nl >= KL && nc >= KL) return mr ? _mm512_add_ps(sv, _mm512_loadu_ps(mr + jb)) : sv; /* (most blocks) */
    const __mmask16 in = nl >= KL ? 0xffff : nl <= 0 ? 0 : (__mmask16)((1u << nl) - 1);
    if (mr) {
        const __mmask16 cm = nc >= KL ? 0xffff : nc <= 0 ? 0 : (__mmask16)((1u << nc) - 1);
        __m512 x = _mm512_maskz_loadu_ps(cm & in, mr + jb);
        x = _mm512_mask_loadu_ps(x, (__mmask16)~cm & in, mr + max_ctx - ctx + jb);
        sv = _mm512_add_ps(sv, x);
    }
    return _mm512_mask_mov_ps(sv, (__mmask16)~in, _mm512_set1_ps(-INFINITY));
}
/* The end of a score vector (keys jb .. jb + 15 of query u): the softmax's first steps if fuse, stored */
static inline __attribute__((always_inline)) void score_out(__m512 sv, int fuse, const float *mr, int jb, int lim, int ctx,
                                                            int max_ctx, __m512 *mv, float *su) {
    if (fuse) { /* the softmax's first steps on this block, in its order (see score_block) */
        sv = score_block(sv, mr, jb, lim, ctx, max_ctx);
        if (jb < lim) *mv = _mm512_max_ps(*mv, sv);
    }
    _mm512_store_ps(su + jb, sv);
}
/* fp32 keys in KTI blocks. nb (a literal, 1 or 2) blocks of KL keys at once: each query's broadcast serves
 * nb blocks and 4 nb accumulator chains per query keep the FMA ports busy (one block: 10 loads for 8 FMAs,
 * load-bound) */
static inline __attribute__((always_inline)) void scores16(const float *kb, int kj, int LP, int j0, int D,
                                                           const float *const *qr, const int nq, const int nb, float scale,
                                                           float *s, int fuse, const float *const *mr, const int *lim,
                                                           int ctx, int max_ctx, __m512 *mv) {
    __m512 a[QT][2], c[QT][2];
    for (int u = 0; u < nq; u++)
        for (int i = 0; i < nb; i++) a[u][i] = c[u][i] = _mm512_setzero_ps();
    for (int d = 0; d + 1 < D; d += 2) {
        __m512 k0[2], k1[2];
        for (int i = 0; i < nb; i++) k0[i] = key16(kb, D, d, kj + KL * i), k1[i] = key16(kb, D, d + 1, kj + KL * i);
        for (int u = 0; u < nq; u++) {
            const __m512 q0 = _mm512_set1_ps(qr[u][d]), q1 = _mm512_set1_ps(qr[u][d + 1]);
            for (int i = 0; i < nb; i++) {
                a[u][i] = _mm512_fmadd_ps(q0, k0[i], a[u][i]);
                c[u][i] = _mm512_fmadd_ps(q1, k1[i], c[u][i]);
            }
        }
    }
    if (D % 2)
        for (int i = 0; i < nb; i++) {
            const __m512 k = key16(kb, D, D - 1, kj + KL * i);
            for (int u = 0; u < nq; u++) a[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(qr[u][D - 1]), k, a[u][i]);
        }
    for (int u = 0; u < nq; u++)
        for (int i = 0; i < nb; i++)
            score_out(_mm512_mul_ps(_mm512_add_ps(a[u][i], c[u][i]), _mm512_set1_ps(scale)), fuse, mr[u], j0 + KL * i, lim[u],
                      ctx, max_ctx, mv + u, s + (long)u * LP);
}
/* Keys in PKI blocks (halves with kh, widened here: exact; else fp32, a widened copy): a vector of 8 keys'
 * dims (d, d + 1) side by side times the query's pair (q[d], q[d + 1]) broadcast as one 64-bit item, so
 * lane 2l carries key l's even-d chain and lane 2l + 1 its odd-d chain: scores16's two chains, the same
 * FMAs in the same order, with half the broadcasts (8 loads for 16 FMAs); at the end the even and odd
 * lanes are gathered apart and added as scores16 adds its chains. */
static inline __attribute__((always_inline)) __m512 keypk(const float *kb, int kh, int D, int p, int j0, int hi) {
    const long it = (long)((unsigned)j0 / KL) * KL * D + (long)p * 2 * KL + hi * KL; /* PKI(2p, j0 + 8 hi) */
    if (kh) return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((const uint16_t *)kb + it)));
    return _mm512_load_ps(kb + it);
}
static inline __attribute__((always_inline)) void scores_pk(const float *kb, const int kh, int kj, int LP, int j0, int D,
                                                            const float *const *qr, const int nq, const int nb, float scale,
                                                            float *s, int fuse, const float *const *mr, const int *lim,
                                                            int ctx, int max_ctx, __m512 *mv) {
    __m512 a[QT][4];
    for (int u = 0; u < nq; u++)
        for (int i = 0; i < 2 * nb; i++) a[u][i] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m512 k[4];
        for (int i = 0; i < nb; i++) k[2 * i] = keypk(kb, kh, D, p, kj + KL * i, 0), k[2 * i + 1] = keypk(kb, kh, D, p, kj + KL * i, 1);
        for (int u = 0; u < nq; u++) {
            double qq; /* (q[2p], q[2p + 1]) */
            memcpy(&qq, qr[u] + 2 * p, sizeof qq);
            const __m512 q2 = _mm512_castpd_ps(_mm512_set1_pd(qq));
            for (int i = 0; i < 2 * nb; i++) a[u][i] = _mm512_fmadd_ps(q2, k[i], a[u][i]);
        }
    }
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int u = 0; u < nq; u++)
        for (int i = 0; i < nb; i++) {
            const __m512 e = _mm512_permutex2var_ps(a[u][2 * i], ev, a[u][2 * i + 1]);
            const __m512 o = _mm512_permutex2var_ps(a[u][2 * i], od, a[u][2 * i + 1]);
            score_out(_mm512_mul_ps(_mm512_add_ps(e, o), _mm512_set1_ps(scale)), fuse, mr[u], j0 + KL * i, lim[u], ctx,
                      max_ctx, mv + u, s + (long)u * LP);
        }
}
#endif

static float lane_tree_sum(const float *l) { /* fixed tree over 16 lanes */
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    for (int i = 0; i < 2; i++) a[i] = a[i] + a[i + 2];
    return a[0] + a[1];
}

#define RUN_TILES 16 /* fewest query tiles a run of a split (sequence, head) takes */

static int run_count(int tiles, int runs) { /* runs for one (sequence, head) of `tiles` tiles */
    const int most = tiles / RUN_TILES > 1 ? tiles / RUN_TILES : 1;
    return tiles == 0 ? 0 : runs < most ? runs : most;
}

typedef struct {
    int b, hk, t0, t1; /* sequence, KV head, its query tiles [t0, t1) */
} work_t;

/* Row j of sequence b's keys (or values) for KV head hk: context rows come from the cache layer (fp32,
 * or IEEE half with kv_half), new rows from this forward's fp32 rows. With a half cache a new row is
 * read rounded to half (round to nearest even, as the cache write rounds it), so every row is seen as
 * the cache holds it: a token's K/V are the same numbers in the step that makes them and in every
 * later one (speculative == plain decoding, alone == batched). */
typedef struct {
    const char *p;
    int cached;
} kvrow_t;

/* exp_neg in plain C: the same constants and operations one lane at a time (fmaf is the fused
 * multiply-add, rintf rounds half to even as roundscale does, ldexpf(p, n) is scalef's p * 2^n), so the
 * portable build's probabilities are the vector builds' bits */
static inline float exp_neg1(float x) {
    if (x < -87.33654f) return 0.0f;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    return ldexpf(p, (int)n);
}

static inline kvrow_t kv_row(const float *fresh, const void *cache, int kv_half, const int64_t *ctx_slots, int max_ctx,
                             int b, int j, int ctx, int start, int Hkv, int hk, int D) {
    if (j < ctx)
        return (kvrow_t){(const char *)cache + (ctx_slots[(long)b * max_ctx + j] * Hkv + hk) * D * (kv_half ? 2L : 4L), 1};
    return (kvrow_t){(const char *)(fresh + ((long)(start + j - ctx) * Hkv + hk) * D), 0};
}

/* IEEE half <-> float in plain C (no _Float16: older compilers lack it, and a failed build would
 * disable every kernel). half_to_float is exact; float_to_half rounds to nearest even, as vcvtps2ph
 * and torch's .half() do (the branch-light form of F. Giesen's public-domain float_to_half_fast3_rtne). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu, bits;
    if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m) { /* subnormal: m * 2^-24, normalized */
        uint32_t ex = 113u;
        while (!(m & 0x400u)) {
            m <<= 1;
            ex--;
        }
        bits = sign | (ex << 23) | ((m & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float round_to_half(float f) { /* f rounded to the nearest half, as a float */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= (143u << 23)) { /* >= 2^16: inf (or nan) */
        o = x > (255u << 23) ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) { /* below 2^-14: a subnormal half, rounded by one float addition */
        const uint32_t magic_bits = 126u << 23;
        float magic, t;
        memcpy(&magic, &magic_bits, 4);
        memcpy(&t, &x, 4);
        t += magic;
        uint32_t tb;
        memcpy(&tb, &t, 4);
        o = (uint16_t)(tb - magic_bits);
    } else {
        const uint32_t odd = (x >> 13) & 1u;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(x >> 13);
    }
    return half_to_float((uint16_t)(o | (sign >> 16)));
}

static inline float kv_load1(kvrow_t r, int d, int kv_half) {
    if (!kv_half) return ((const float *)r.p)[d];
    if (r.cached) return half_to_float(((const uint16_t *)r.p)[d]);
    return round_to_half(((const float *)r.p)[d]);
}

#if defined(ATT_AVX2)
#include "attention_avx2.h"
#endif

#if defined(__AVX512F__)
static inline __m512 kv_load16(kvrow_t r, int d, int kv_half) {
    if (!kv_half) return _mm512_loadu_ps((const float *)r.p + d);
    if (r.cached) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)r.p + d)));
    return _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps((const float *)r.p + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/* Keys [0, Lk) of sequence b, KV head hk, transposed: dst[KTI(d, j)] (AVX-512 with a half cache and D a
 * multiple of 16: halves at PKI(d, j)) (LP = Lk rounded up to KL; zero
 * padding), one key per lane. Context key j is cache row ctx_slots[b][j], new key j >= ctx packed row
 * start + j - ctx. */
static void transpose_keys(const float *kn, const void *kc, int kv_half, const int64_t *ctx_slots, int max_ctx, int b,
                           int hk, int ctx, int start, int Lk, int Hkv, int D, float *dst) {
    const int LP = (Lk + KL - 1) / KL * KL;
    int jf = 0; /* blocks before jf: taken by the lean loop below */
#if defined(__AVX512F__)
    if (kv_half && D % 16 == 0) { /* a half cache's whole blocks of context rows: row addresses from the
                                   * slots directly, the next block's rows prefetched, no per-row kinds */
        const int nfull = (ctx < Lk ? ctx : Lk) / KL * KL;
        const int64_t *cs = ctx_slots + (long)b * max_ctx;
        const uint16_t *kh = (const uint16_t *)kc + (long)hk * D;
        const long rs = (long)Hkv * D; /* a slot's row, halves */
        uint16_t *dh = (uint16_t *)dst;
        for (; jf < nfull; jf += KL) {
            const uint16_t *rp[KL];
            for (int j = 0; j < KL; j++) rp[j] = kh + cs[jf + j] * rs;
            if (jf + 2 * KL <= nfull)
                for (int j = 0; j < KL; j++) {
                    const char *np = (const char *)(kh + cs[jf + KL + j] * rs);
                    for (int d = 0; d < 2 * D; d += 64) _mm_prefetch(np + d, _MM_HINT_T0);
                }
            for (int d0 = 0; d0 < D; d0 += 32) { /* 32 dims (16 pairs) a transposition; 16 at the end of D = 16 mod 32 */
                const int w = D - d0 >= 32 ? 16 : 8;
                __m512 r[KL];
                for (int j = 0; j < KL; j++) r[j] = _mm512_maskz_loadu_ps(w == 16 ? 0xffff : 0xff, rp[j] + d0);
                transpose16(r);
                for (int i = 0; i < w; i++) _mm512_store_ps((float *)(dh + PKI(d0 + 2 * i, jf, D)), r[i]);
            }
        }
    }
#endif
    for (int j0 = jf; j0 < LP; j0 += KL) { /* KL key rows at a time (they stay in L1) */
        kvrow_t kr[KL];
        for (int j = 0; j < KL; j++)
            kr[j] = j0 + j >= Lk ? (kvrow_t){NULL, 0}
                                 : kv_row(kn, kc, kv_half, ctx_slots, max_ctx, b, j0 + j, ctx, start, Hkv, hk, D);
#if defined(__AVX512F__) || defined(ATT_AVX2)
        if (D % VT_DIMS == 0) /* (the vector transposes) the next block's rows, scattered by slot: see V_AHEAD */
            for (int j = 0; j < KL; j++) {
                const int jj = j0 + KL + j;
                if (jj >= Lk) break;
                const kvrow_t nr = kv_row(kn, kc, kv_half, ctx_slots, max_ctx, b, jj, ctx, start, Hkv, hk, D);
                for (int d = 0; d < D * (nr.cached && kv_half ? 2 : 4); d += 64) _mm_prefetch(nr.p + d, _MM_HINT_T0);
            }
#endif
#if defined(__AVX512F__)
        if (D % VT_DIMS == 0) { /* 16 x 16 blocks, transposed in registers */
            if (kv_half) { /* halves stay halves, in pairs: dst is uint16 in PKI blocks (scores_pk widens them) */
                uint16_t *dh = (uint16_t *)dst;
                for (int d0 = 0; d0 < D; d0 += 32) {
                    const int w = D - d0 >= 32 ? 16 : 8; /* pairs */
                    __m512 r[KL];
                    for (int j = 0; j < KL; j++) {
                        if (!kr[j].p) {
                            r[j] = _mm512_setzero_ps();
                        } else if (kr[j].cached) {
                            r[j] = _mm512_maskz_loadu_ps(w == 16 ? 0xffff : 0xff, (const uint16_t *)kr[j].p + d0);
                        } else { /* this forward's row, rounded to half as the cache will hold it */
                            const float *f = (const float *)kr[j].p + d0;
                            const __m256i lo = _mm512_cvtps_ph(_mm512_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                            const __m256i hi = w == 16 ? _mm512_cvtps_ph(_mm512_loadu_ps(f + 16), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                                       : _mm256_setzero_si256();
                            r[j] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
                        }
                    }
                    transpose16(r); /* (32-bit items: pure data movement, any bits) */
                    for (int i = 0; i < w; i++) _mm512_store_ps((float *)(dh + PKI(d0 + 2 * i, j0, D)), r[i]);
                }
                continue;
            }
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512 r[KL];
                for (int j = 0; j < KL; j++) r[j] = kr[j].p ? kv_load16(kr[j], d0, kv_half) : _mm512_setzero_ps();
                transpose16(r);
                for (int d = 0; d < 16; d++) _mm512_store_ps(dst + KTI(d0 + d, j0, D), r[d]);
            }
            continue;
        }
#elif defined(ATT_AVX2)
        if (D % VT_DIMS == 0) { /* 8 x 8 blocks in registers; a half cache's keys widened (the scores read fp32) */
            for (int h = 0; h < KL; h += 8)
                for (int d0 = 0; d0 < D; d0 += 8) {
                    __m256 r[8];
                    for (int j = 0; j < 8; j++) r[j] = kr[h + j].p ? kv_load8(kr[h + j], d0, kv_half) : _mm256_setzero_ps();
                    transpose8(r);
                    for (int d = 0; d < 8; d++) _mm256_store_ps(dst + KTI(d0 + d, j0 + h, D), r[d]);
                }
            continue;
        }
#endif
        for (int d = 0; d < D; d++)
            for (int j = 0; j < KL; j++) dst[KTI(d, j0 + j, D)] = kr[j].p ? kv_load1(kr[j], d, kv_half) : 0.0f;
    }
}

#if defined(__AVX512F__)
/* acc[u][d0 .. d0 + 63] (rows of D + 16) = sum_j p_uj v_j over the keys j < lmax in increasing order,
 * skipping j >= lim[u] and p_uj = 0 (the order every build follows), for nq queries of KV head hk (a
 * literal: the 4 nq accumulators stay in registers). Context rows are read by slot (cs: this
 * sequence's slots), the rest from this forward's vn. nzm[u][j / KL] bit j % KL: p_uj is a number != 0
 * and j < lim[u] (0 from lim's block on): a block of KL keys that every query keeps takes plain FMAs,
 * the same operations as the masked ones with every lane kept, without the per-key scalar tests (they
 * cost about as much as the FMAs); any other block takes the masked loop. */
static inline __attribute__((always_inline)) __m512 pv_load(const char *base, const int64_t *cs, long rs, int nc,
                                                            const float *vn, int start, int ctx, int Hkv, int hk,
                                                            int D, int d0, int kv_half, int j, int c) {
    if (j < nc) {
        const char *r = base + cs[j] * rs;
        return kv_half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 32 * c)))
                       : _mm512_loadu_ps((const float *)r + 16 * c);
    }
    /* this forward's row, rounded to half with a half cache (as the cache will hold it) */
    const kvrow_t vr = {(const char *)(vn + ((long)(start + j - ctx) * Hkv + hk) * D), 0};
    return kv_load16(vr, d0 + 16 * c, kv_half);
}
static inline __attribute__((always_inline)) void pv64(const float *vn, const void *vc, int kv_half, const int64_t *cs,
                                                       int ctx, int start, int Hkv, int hk, int D, int d0, int lmax,
                                                       const int *lim, const float *s, int LP, const uint16_t *nzm,
                                                       int NB, const int nq, float *acc) {
    __m512 o[QT][4];
    for (int u = 0; u < nq; u++)
        for (int c = 0; c < 4; c++) o[u][c] = _mm512_setzero_ps();
    const long es = kv_half ? 2 : 4, rs = (long)Hkv * D * es; /* a slot's row, bytes */
    const char *base = (const char *)vc + ((long)hk * D + d0) * es;
    const int nc = ctx < lmax ? ctx : lmax;
    for (int j0 = 0; j0 < lmax; j0 += KL) {
        const int je = j0 + KL < lmax ? j0 + KL : lmax;
        unsigned all = 0xffffu;
        for (int u = 0; u < nq; u++) all &= nzm[(long)u * NB + j0 / KL];
        for (int j = j0; j < je; j++) {
            if (j + V_AHEAD < nc) {
                const char *np = base + cs[j + V_AHEAD] * rs;
                for (long c = 0; c < 64 * es; c += 64) _mm_prefetch(np + c, _MM_HINT_T0);
            }
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = pv_load(base, cs, rs, nc, vn, start, ctx, Hkv, hk, D, d0, kv_half, j, c);
            if (all == 0xffffu) {
                for (int u = 0; u < nq; u++) {
                    const __m512 pv = _mm512_set1_ps(s[(long)u * LP + j]);
                    for (int c = 0; c < 4; c++) o[u][c] = _mm512_fmadd_ps(pv, v[c], o[u][c]);
                }
                continue;
            }
            for (int u = 0; u < nq; u++) { /* skipped as a mask, not a branch: a long context's p = 0 (exp
                                              * underflow) fall anywhere, and mispredicted branches cost more */
                const float p = s[(long)u * LP + j];
                const __mmask16 m = (__mmask16)-(int)(j < lim[u] && p != 0.0f);
                const __m512 pv = _mm512_set1_ps(p);
                for (int c = 0; c < 4; c++) o[u][c] = _mm512_mask3_fmadd_ps(pv, v[c], o[u][c], m);
            }
        }
    }
    for (int u = 0; u < nq; u++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (long)u * (D + 16) + d0 + 16 * c, o[u][c]);
}
#endif

#if defined(__AVX512F__)
/* pv64 for the nrows query rows of a group (row r: query r % QT of its tile r / QT; s [.][LP], acc
 * [.][D + 16], nzm [.][NB] and lim [.] by row), VSPAN keys at a time: their values are read and widened
 * once into vbuf [VSPAN][64] for every row (pv64 converts them again in each tile), the accumulators
 * kept in acc between spans. The rows are taken in sets of up to QS (not tiles: 6 queries' 24
 * accumulators per value row loaded, fewer loads and accumulator round trips per FMA than 4); within a
 * span, block by block of KL keys as pv64 (plain FMAs where every query of the set keeps the block). Per
 * output the same FMAs in the same key order as pv64: the same bits. */
#define QS 6
static inline __attribute__((always_inline)) void pv_block(const float *vbuf, int jb, int je, const int *lim,
                                                          const float *s, int LP, const uint16_t *nzm, int NB,
                                                          const int nq, float *acc, int D, int d0) {
    __m512 o[QS][4];
    for (int u = 0; u < nq; u++)
        for (int c = 0; c < 4; c++) o[u][c] = _mm512_load_ps(acc + (long)u * (D + 16) + d0 + 16 * c);
    for (int j0 = jb; j0 < je; j0 += KL) {
        const int jn = j0 + KL < je ? j0 + KL : je;
        unsigned all = 0xffffu;
        for (int u = 0; u < nq; u++) all &= nzm[(long)u * NB + j0 / KL];
        if (all == 0xffffu) {
            for (int j = j0; j < jn; j++) {
                __m512 v[4];
                for (int c = 0; c < 4; c++) v[c] = _mm512_load_ps(vbuf + (j - jb) * 64 + 16 * c);
                for (int u = 0; u < nq; u++) {
                    const __m512 pv = _mm512_set1_ps(s[(long)u * LP + j]);
                    for (int c = 0; c < 4; c++) o[u][c] = _mm512_fmadd_ps(pv, v[c], o[u][c]);
                }
            }
        } else {
            for (int j = j0; j < jn; j++) {
                __m512 v[4];
                for (int c = 0; c < 4; c++) v[c] = _mm512_load_ps(vbuf + (j - jb) * 64 + 16 * c);
                for (int u = 0; u < nq; u++) {
                    const float p = s[(long)u * LP + j];
                    const __mmask16 m = (__mmask16)-(int)(j < lim[u] && p != 0.0f);
                    const __m512 pv = _mm512_set1_ps(p);
                    for (int c = 0; c < 4; c++) o[u][c] = _mm512_mask3_fmadd_ps(pv, v[c], o[u][c], m);
                }
            }
        }
    }
    for (int u = 0; u < nq; u++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(acc + (long)u * (D + 16) + d0 + 16 * c, o[u][c]);
}
static void pv_group(const float *vn, const void *vc, int kv_half, const int64_t *cs, int ctx, int start, int Hkv, int hk,
                     int D, int d0, int nrows, const int *rlim, const float *sg, int LP, const uint16_t *gnzm, int NB,
                     float *gacc, float *vbuf) {
    const int nset = (nrows + QS - 1) / QS; /* sets of nearly equal sizes (<= QS) */
    int r0[TG * QT / 2 + 2], smax[TG * QT / 2 + 1], lmax = 0;
    for (int k = 0; k <= nset; k++) r0[k] = nrows * k / nset;
    for (int k = 0; k < nset; k++) {
        smax[k] = 0;
        for (int r = r0[k]; r < r0[k + 1]; r++) smax[k] = rlim[r] > smax[k] ? rlim[r] : smax[k];
        lmax = smax[k] > lmax ? smax[k] : lmax;
    }
    for (int r = 0; r < nrows; r++)
        for (int c = 0; c < 64; c += 16) _mm512_store_ps(gacc + (long)r * (D + 16) + d0 + c, _mm512_setzero_ps());
    const long es = kv_half ? 2 : 4, rs = (long)Hkv * D * es; /* a slot's row, bytes */
    const char *base = (const char *)vc + ((long)hk * D + d0) * es;
    const int nc = ctx < lmax ? ctx : lmax;
    for (int j0 = 0; j0 < lmax; j0 += VSPAN) {
        const int je = j0 + VSPAN < lmax ? j0 + VSPAN : lmax;
        for (int j = j0; j < je; j++) {
            if (j + KL < nc) {
                const char *np = base + cs[j + KL] * rs;
                for (long c = 0; c < 64 * es; c += 64) _mm_prefetch(np + c, _MM_HINT_T0);
            }
            for (int c = 0; c < 4; c++)
                _mm512_store_ps(vbuf + (j - j0) * 64 + 16 * c, pv_load(base, cs, rs, nc, vn, start, ctx, Hkv, hk, D, d0, kv_half, j, c));
        }
        for (int k = 0; k < nset; k++) {
            if (j0 >= smax[k]) continue;
            const int jt = je < smax[k] ? je : smax[k], r = r0[k];
#define PVB(NQ) pv_block(vbuf, j0, jt, rlim + r, sg + (long)r * LP, LP, gnzm + (long)r * NB, NB, NQ, gacc + (long)r * (D + 16), D, d0)
            switch (r0[k + 1] - r) { /* literal query counts: the accumulators stay in registers */
            case 1: PVB(1); break;
            case 2: PVB(2); break;
            case 3: PVB(3); break;
            case 4: PVB(4); break;
            case 5: PVB(5); break;
            default: PVB(QS); break;
            }
#undef PVB
        }
    }
}
#endif

/* Query u < nq (the count returned) of tile tq of a (sequence b, KV head hk) with NQ = G n queries: row
 * row[u], head head[u] of the group; keys [0, lim[u]) may be visible; *limp: the largest lim rounded up to KL */
static inline int tile_setup(int tq, int NQ, int n, int hk, int G, int H, int D, int start, int b, int ctx, int L,
                             int max_ctx, int max_new, const float *q, const float *mask, const float **qr,
                             const float **mr, int *row, int *head, int *lim, int *limp) {
    const int nq = NQ - tq * QT < QT ? NQ - tq * QT : QT;
    *limp = 0;
    for (int u = 0; u < nq; u++) {
        const int e = tq * QT + u;
        row[u] = e % n;
        head[u] = hk * G + e / n;
        qr[u] = q + ((long)(start + row[u]) * H + head[u]) * D;
        mr[u] = mask ? mask + ((long)b * max_new + row[u]) * (max_ctx + max_new) : NULL;
        lim[u] = mask ? L : ctx + row[u] + 1;
        const int lp = (lim[u] + KL - 1) / KL * KL;
        *limp = lp > *limp ? lp : *limp;
    }
    return nq;
}

/* Keys of sequence b, in order: its ctx context rows (cache rows ctx_slots[b][j]), then its n new
 * tokens (packed rows start .. start + n - 1 of kn/vn). seq_meta[b] = (ctx, start, n). Visibility:
 * mask[b][i][j] (additive; context key j in column j, new key i2 in column max_ctx + i2), or without
 * a mask every context key and the new keys i2 <= i (causal).
 * Work items are (sequence, KV head, a run of query tiles); each transposes the keys its tiles may see
 * into a buffer of its thread just before using them (in cache), so a long context is not written
 * out and read back for every head. A (sequence, head)'s tiles are split into runs only as far as
 * the threads need work and each run keeps RUN_TILES tiles or more (a long prefill; a verify step's
 * few tiles share one transposition), each run transposing its own keys. */
void ratchet_attention(const float *q, const float *kn, const float *vn, const void *kc, const void *vc,
                       const int64_t *ctx_slots, int max_ctx, const int32_t *seq_meta, int max_new, const float *mask,
                       int B, int H, int Hkv, int D, float scale, float softcap, int kv_half, float *out, int threads) {
    const int G = H / Hkv;
    int LPmax = 0, nwork = 0, pairs = 0;
    for (int b = 0; b < B; b++) {
        const int Lb = seq_meta[3 * b] + seq_meta[3 * b + 2], LP = (Lb + KL - 1) / KL * KL;
        LPmax = LP > LPmax ? LP : LPmax;
        pairs += seq_meta[3 * b + 2] > 0 ? Hkv : 0;
    }
    const int runs = pairs >= 4 * threads ? 1 : (4 * threads + pairs - 1) / (pairs > 0 ? pairs : 1);
    for (int b = 0; b < B; b++) {
        const int nt = (G * seq_meta[3 * b + 2] + QT - 1) / QT;
        nwork += Hkv * run_count(nt, runs);
    }
    work_t *work = malloc(sizeof(work_t) * (size_t)(nwork > 0 ? nwork : 1));
    nwork = 0;
    for (int b = 0; b < B; b++) {
        const int nt = (G * seq_meta[3 * b + 2] + QT - 1) / QT, nr = run_count(nt, runs);
        for (int hk = 0; hk < Hkv; hk++)
            for (int r = 0; r < nr; r++) work[nwork++] = (work_t){b, hk, (int)((long)nt * r / nr), (int)((long)nt * (r + 1) / nr)};
    }
#pragma omp parallel num_threads(threads)
    {
        float *kt = aligned_alloc(64, sizeof(float) * (size_t)D * (LPmax > 0 ? LPmax : 16));
        float *sg = aligned_alloc(64, sizeof(float) * (size_t)TG * QT * (LPmax > 0 ? LPmax : 16)); /* [TG][QT][LP] */
        float *gacc = aligned_alloc(64, sizeof(float) * (size_t)TG * QT * (D + 16)); /* [TG][QT][D + 16] */
        float *kw = aligned_alloc(64, sizeof(float) * (size_t)D * 2 * KL);            /* two blocks of keys, widened */
        float *vbuf = aligned_alloc(64, sizeof(float) * (size_t)VSPAN * 64);          /* a span of values, widened */
        float *pc = aligned_alloc(64, sizeof(float) * (size_t)((LPmax > 0 ? LPmax : 16) + KL)); /* p > 0, compacted */
        const int NB = (LPmax > 0 ? LPmax : 16) / KL; /* key blocks */
        uint16_t *gnzm = malloc(sizeof(uint16_t) * (size_t)TG * QT * NB); /* [TG][QT][NB]: see pv64 */
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < nwork; w++) {
            const int b = work[w].b, hk = work[w].hk;
            const int ctx = seq_meta[3 * b], start = seq_meta[3 * b + 1], n = seq_meta[3 * b + 2];
            const int L = ctx + n, NQ = G * n;
            /* the run's keys: all L with a mask, else up to the latest row among its queries */
            int Lk = L;
            if (!mask) {
                const int e0 = work[w].t0 * QT, e1 = (work[w].t1 * QT < NQ ? work[w].t1 * QT : NQ) - 1;
                Lk = e1 / n > e0 / n ? L : ctx + e1 % n + 1; /* one head's rows e0 % n .. e1 % n, else all */
            }
            const int LP = (Lk + KL - 1) / KL * KL;
            transpose_keys(kn, kc, kv_half, ctx_slots, max_ctx, b, hk, ctx, start, Lk, Hkv, D, kt);
            const float *kb = kt; /* this run's keys, [LP / KL][D][KL] (kh: halves, [LP / KL][D / 2][KL][2]) */
#if defined(__AVX512F__)
            const int kh = kv_half && D % 16 == 0; /* transpose_keys kept them halves, in PKI blocks */
#endif
            for (int tg = work[w].t0; tg < work[w].t1; tg += TG) {
                const int tge = tg + TG < work[w].t1 ? tg + TG : work[w].t1;
                /* scores of the group's tiles, KL keys at a time for every query: a block of transposed keys
                 * is read (from L1 after the first tile) by every tile of the group */
                const float *gqr[TG][QT], *gmr[TG][QT];
                int gnq[TG], glimp[TG], glq[TG][QT], gl = 0;
                for (int tq = tg; tq < tge; tq++) {
                    int row[QT], head[QT];
                    gnq[tq - tg] = tile_setup(tq, NQ, n, hk, G, H, D, start, b, ctx, L, max_ctx, max_new, q, mask, gqr[tq - tg],
                                              gmr[tq - tg], row, head, glq[tq - tg], &glimp[tq - tg]);
                    gl = glimp[tq - tg] > gl ? glimp[tq - tg] : gl;
                }
#if defined(__AVX512F__)
                /* no softcap: each score block leaves scores16 masked and limited, and each query's running
                 * max is kept there (no separate passes for them) */
                const int fuse = softcap == 0.0f;
                __m512 gmv[TG][QT];
                for (int t = 0; t < TG; t++)
                    for (int u = 0; u < QT; u++) gmv[t][u] = _mm512_set1_ps(-INFINITY);
#endif
#if defined(__AVX512F__)
                const int wide = kh && tge - tg > 1; /* several tiles: a block of half keys widened once, to kw */
#endif
#if defined(__AVX512F__)
                for (int j0 = 0; j0 < gl; j0 += 2 * KL) { /* two blocks at a time where a tile sees both */
                    const int nbw = j0 + KL < gl ? 2 : 1;
                    if (wide) /* (exact: the same scores; the conversions would share the FMAs' ports in every tile) */
                        for (int i = 0; i < nbw * D * KL; i += 16)
                            _mm512_store_ps(kw + i, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((const uint16_t *)kb + (long)j0 * D + i))));
                    for (int tq = tg; tq < tge; tq++) {
                        if (j0 >= glimp[tq - tg]) continue;
                        const int nq = gnq[tq - tg];
                        const float *const *qr = gqr[tq - tg];
                        float *s = sg + (long)(tq - tg) * QT * LP;
    /* literal query and block counts: the loops unroll, the key loads are fixed */
#define SCORES16(NQ, NB2) (kh ? scores_pk(wide ? kw : kb, !wide, wide ? 0 : j0, LP, j0, D, qr, NQ, NB2, scale, s, fuse, gmr[tq - tg], glq[tq - tg], ctx, max_ctx, gmv[tq - tg]) \
                                : scores16(kb, j0, LP, j0, D, qr, NQ, NB2, scale, s, fuse, gmr[tq - tg], glq[tq - tg], ctx, max_ctx, gmv[tq - tg]))
                        if (j0 + KL < glimp[tq - tg])
                            switch (nq) {
                            case 1: SCORES16(1, 2); break;
                            case 2: SCORES16(2, 2); break;
                            case 3: SCORES16(3, 2); break;
                            default: SCORES16(QT, 2); break;
                            }
                        else
                            switch (nq) {
                            case 1: SCORES16(1, 1); break;
                            case 2: SCORES16(2, 1); break;
                            case 3: SCORES16(3, 1); break;
                            default: SCORES16(QT, 1); break;
                            }
#undef SCORES16
                    }
                }
#else
                for (int j0 = 0; j0 < gl; j0 += KL) {
                    for (int tq = tg; tq < tge; tq++) {
                        if (j0 >= glimp[tq - tg]) continue;
                        const int nq = gnq[tq - tg];
                        const float *const *qr = gqr[tq - tg];
                        float *s = sg + (long)(tq - tg) * QT * LP;
#if defined(ATT_AVX2)
#define SCORES8(NQ) (scores8(kb, LP, j0, D, qr, NQ, scale, s), scores8(kb, LP, j0 + 8, D, qr, NQ, scale, s))
                        switch (nq) { /* the keys are fp32 at every D */
                        case 1: SCORES8(1); break;
                        case 2: SCORES8(2); break;
                        case 3: SCORES8(3); break;
                        default: SCORES8(QT); break;
                        }
#undef SCORES8
#else
                        const float *kbb = kb + (long)j0 * D; /* this block, [D][KL] */
                        for (int u = 0; u < nq; u++) {
                            float a[KL], c[KL];
                            for (int l = 0; l < KL; l++) a[l] = c[l] = 0.0f;
                            for (int d = 0; d + 1 < D; d += 2)
                                for (int l = 0; l < KL; l++) {
                                    a[l] = fmaf(qr[u][d], kbb[d * KL + l], a[l]);
                                    c[l] = fmaf(qr[u][d + 1], kbb[(d + 1) * KL + l], c[l]);
                                }
                            if (D % 2)
                                for (int l = 0; l < KL; l++) a[l] = fmaf(qr[u][D - 1], kbb[(D - 1) * KL + l], a[l]);
                            for (int l = 0; l < KL; l++) s[(long)u * LP + j0 + l] = (a[l] + c[l]) * scale;
                        }
#endif
                    }
                }
#endif
                float ginv[TG][QT];
                int glim[TG][QT];
#if defined(__AVX512F__)
                const int grouped = D % 64 == 0 && tge - tg > 1; /* values: pv_group after every tile's softmax */
#else
                const int grouped = 0;
#endif
                for (int tq = tg; tq < tge; tq++) {
                    float *s = sg + (long)(tq - tg) * QT * LP;
                    const float *qr[QT], *mr[QT];
                    int row[QT], head[QT], lim[QT], limp;
                    const int nq = tile_setup(tq, NQ, n, hk, G, H, D, start, b, ctx, L, max_ctx, max_new, q, mask, qr, mr, row, head,
                                              lim, &limp);
                    (void)qr;
                    float *inv = ginv[tq - tg], *acc = gacc + (long)(tq - tg) * QT * (D + 16);
                    uint16_t *nzm = gnzm + (long)(tq - tg) * QT * NB;
                    for (int u = 0; u < nq; u++) {
                        float *su = s + (long)u * LP;
                        const int lp = (lim[u] + KL - 1) / KL * KL;
                        float m = -INFINITY; /* a max: exact in any order */
#if defined(__AVX512F__)
                        if (fuse) {
                            m = _mm512_reduce_max_ps(gmv[tq - tg][u]);
                            goto have_max;
                        }
#endif
                        if (softcap > 0.0f)
                            for (int j = 0; j < lim[u]; j++) su[j] = tanhf(su[j] / softcap) * softcap;
                        if (mr[u]) { /* the mask's context columns, then its new-key columns */
                            for (int j = 0; j < ctx && j < lim[u]; j++) su[j] = su[j] + mr[u][j];
                            for (int j = ctx; j < lim[u]; j++) su[j] = su[j] + mr[u][max_ctx + j - ctx];
                        }
                        for (int j = lim[u]; j < lp; j++) su[j] = -INFINITY;
#if defined(__AVX512F__)
                        __m512 mv = _mm512_set1_ps(-INFINITY);
                        for (int j0 = 0; j0 < lp; j0 += KL) mv = _mm512_max_ps(mv, _mm512_load_ps(su + j0));
                        m = _mm512_reduce_max_ps(mv);
                    have_max:
#elif defined(ATT_AVX2)
                        __m256 mv = _mm256_set1_ps(-INFINITY);
                        for (int j0 = 0; j0 < lp; j0 += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(su + j0));
                        float ml[8];
                        _mm256_storeu_ps(ml, mv);
                        for (int l = 0; l < 8; l++) m = ml[l] > m ? ml[l] : m;
#else
                        for (int j = 0; j < lp; j++) m = su[j] > m ? su[j] : m;
#endif
                        /* p_j = exp(s_j - max) in place; the keys with p_j > 0 summed by rank among them
                         * (rank r in lane r % 16, in key order per lane), then a fixed tree: a key's lane
                         * does not depend on the invisible keys before it (a tree draft's siblings) */
                        float lanes[KL];
                        for (int l = 0; l < KL; l++) lanes[l] = 0.0f;
#if defined(__AVX512F__)
                        for (int k = m > -INFINITY ? lp / KL : 0; k < LP / KL; k++) nzm[(long)u * NB + k] = 0;
#endif
                        if (m > -INFINITY) {
#if defined(__AVX512F__)
                            /* the compacted p > 0 summed 16 at a time as they complete: a block of 16 p > 0
                             * while none wait is such a vector itself; the others wait in pc (< 16 of them) */
                            int cnt = 0;
                            __m512 sum = _mm512_setzero_ps();
                            for (int j0 = 0; j0 < lp; j0 += KL) {
                                const __m512 p = exp_neg(_mm512_sub_ps(_mm512_load_ps(su + j0), _mm512_set1_ps(m)));
                                _mm512_store_ps(su + j0, p);
                                const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_OQ);
                                nzm[(long)u * NB + j0 / KL] = nz;
                                if (nz == 0xffff && cnt == 0) {
                                    sum = _mm512_add_ps(sum, p);
                                    continue;
                                }
                                _mm512_storeu_ps(pc + cnt, _mm512_maskz_compress_ps(nz, p)); /* register form: the store form is slow on Zen 4 */
                                cnt += __builtin_popcount(nz);
                                if (cnt >= KL) {
                                    sum = _mm512_add_ps(sum, _mm512_loadu_ps(pc));
                                    _mm512_storeu_ps(pc, _mm512_loadu_ps(pc + KL));
                                    cnt -= KL;
                                }
                            }
                            if (cnt > 0) { /* the last, partial vector, zero-padded */
                                for (int j = cnt; j < KL; j++) pc[j] = 0.0f;
                                sum = _mm512_add_ps(sum, _mm512_loadu_ps(pc));
                            }
                            _mm512_storeu_ps(lanes, sum);
#elif defined(ATT_AVX2)
                            int cnt = 0; /* compacted 8 at a time where all 8 are > 0, else one by one */
                            for (int j0 = 0; j0 < lp; j0 += 8) {
                                const __m256 p = exp_neg8(_mm256_sub_ps(_mm256_load_ps(su + j0), _mm256_set1_ps(m)));
                                _mm256_store_ps(su + j0, p);
                                const int nz = _mm256_movemask_ps(_mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_OQ));
                                if (nz == 0xff) {
                                    _mm256_storeu_ps(pc + cnt, p);
                                    cnt += 8;
                                } else {
                                    for (int l = 0; l < 8; l++)
                                        if (nz >> l & 1) pc[cnt++] = su[j0 + l];
                                }
                            }
                            for (int j = cnt; j < (cnt + KL - 1) / KL * KL; j++) pc[j] = 0.0f;
                            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(); /* lanes 0-7, 8-15 */
                            for (int j0 = 0; j0 < cnt; j0 += KL) {
                                s0 = _mm256_add_ps(s0, _mm256_loadu_ps(pc + j0));
                                s1 = _mm256_add_ps(s1, _mm256_loadu_ps(pc + j0 + 8));
                            }
                            _mm256_storeu_ps(lanes, s0);
                            _mm256_storeu_ps(lanes + 8, s1);
#else
                            int cnt = 0;
                            for (int j = 0; j < lp; j++) {
                                su[j] = exp_neg1(su[j] - m);
                                if (su[j] != 0.0f) lanes[cnt++ % KL] += su[j];
                            }
#endif
                        } else {
                            for (int j = 0; j < lp; j++) su[j] = 0.0f;
                        }
                        const float tot = lane_tree_sum(lanes);
                        inv[u] = tot > 0.0f ? 1.0f / tot : 0.0f;
                    }
                    /* weighted values, keys in increasing order per output; each value row loaded once
                     * per tile, 64 dims at a time in registers */
                    int lmax = 0;
                    for (int u = 0; u < nq; u++) lmax = lim[u] > lmax ? lim[u] : lmax;
                    for (int u = 0; u < nq; u++) glim[tq - tg][u] = lim[u];
                    if (grouped) continue;
#if defined(ATT_AVX2) /* pv16 skips p = 0: the keys from lim[u] (p = 0 up to lp, raw scores beyond) made 0 up to lmax */
                    for (int u = 0; u < nq; u++)
                        for (int j = (lim[u] + KL - 1) / KL * KL; j < lmax; j++) s[(long)u * LP + j] = 0.0f;
#endif
                    for (int d0 = 0; d0 < D; d0 += 64) {
                        const int dn = D - d0 < 64 ? D - d0 : 64;
#if defined(__AVX512F__)
                        if (dn == 64) { /* literal query count: the accumulators stay in registers */
#define PV64(NQ) pv64(vn, vc, kv_half, ctx_slots + (long)b * max_ctx, ctx, start, Hkv, hk, D, d0, lmax, lim, s, LP, nzm, NB, NQ, acc)
                            switch (nq) {
                            case 1: PV64(1); break;
                            case 2: PV64(2); break;
                            case 3: PV64(3); break;
                            default: PV64(QT); break;
                            }
#undef PV64
                            continue;
                        }
#elif defined(ATT_AVX2)
                        if (dn % 16 == 0) { /* 16 dims a pass (literal query count: 2 nq accumulators in registers) */
#define PV16(NQ) pv16(vn, vc, kv_half, ctx_slots + (long)b * max_ctx, ctx, start, Hkv, hk, D, d0, dn, lmax, lim, s, LP, NQ, acc)
                            switch (nq) {
                            case 1: PV16(1); break;
                            case 2: PV16(2); break;
                            case 3: PV16(3); break;
                            default: PV16(QT); break;
                            }
#undef PV16
                            continue;
                        }
#endif
                        for (int u = 0; u < nq; u++)
                            for (int d = 0; d < dn; d++) acc[(long)u * (D + 16) + d0 + d] = 0.0f;
                        for (int j = 0; j < lmax; j++) {
                            const kvrow_t vr = kv_row(vn, vc, kv_half, ctx_slots, max_ctx, b, j, ctx, start, Hkv, hk, D);
                            for (int u = 0; u < nq; u++) {
                                const float p = s[(long)u * LP + j];
                                if (j >= lim[u] || p == 0.0f) continue;
                                float *au = acc + (long)u * (D + 16) + d0;
                                for (int d = 0; d < dn; d++) au[d] = fmaf(p, kv_load1(vr, d0 + d, kv_half), au[d]);
                            }
                        }
                    }
                    for (int u = 0; u < nq; u++) {
                        float *o = out + ((long)(start + row[u]) * H + head[u]) * D;
                        for (int d = 0; d < D; d++) o[d] = acc[(long)u * (D + 16) + d] * inv[u];
                    }
                }
#if defined(__AVX512F__)
                if (grouped) {
                    /* the group's query rows t * QT + u: contiguous (only a head's last tile has fewer than QT) */
                    int rlim[TG * QT], nrows = 0;
                    for (int t = 0; t < tge - tg; t++)
                        for (int u = 0; u < gnq[t]; u++) rlim[nrows++] = glim[t][u];
                    for (int d0 = 0; d0 < D; d0 += 64)
                        pv_group(vn, vc, kv_half, ctx_slots + (long)b * max_ctx, ctx, start, Hkv, hk, D, d0, nrows, rlim, sg,
                                 LP, gnzm, NB, gacc, vbuf);
                    for (int tq = tg; tq < tge; tq++) {
                        const float *qr[QT], *mr[QT];
                        int row[QT], head[QT], lim[QT], limp;
                        const int nq = tile_setup(tq, NQ, n, hk, G, H, D, start, b, ctx, L, max_ctx, max_new, q, mask, qr, mr,
                                                  row, head, lim, &limp);
                        const float *acc = gacc + (long)(tq - tg) * QT * (D + 16);
                        for (int u = 0; u < nq; u++) {
                            float *o = out + ((long)(start + row[u]) * H + head[u]) * D;
                            for (int d = 0; d < D; d++) o[d] = acc[(long)u * (D + 16) + d] * ginv[tq - tg][u];
                        }
                    }
                }
#endif
            }
        }
        free(kt);
        free(sg);
        free(gacc);
        free(kw);
        free(vbuf);
        free(pc);
        free(gnzm);
    }
    free(work);
}
