/* The int8 / int16 matmul's inner kernel (matmul_int8.c tells the whole story): one panel of 16 output
 * rows times one tile of up to TT tokens, for each stored-value width in a unit of its own
 * (matmul_int8_vb4.c, _vb5.c, _vb6.c, _vb8.c), so that the build compiles them in parallel. Each unit
 * instantiates panel_tile for its widths' group sizes, both activation widths, with and without offsets
 * and every tile size 1..TR as literals (the accumulators then live in registers), and on AVX-512
 * panel_stream for the tile sizes TR + 1 .. TT (a group's weights in registers, the tokens streamed). */
#ifndef RATCHET_MATMUL_INT8_PANEL_H
#define RATCHET_MATMUL_INT8_PANEL_H
#include <math.h>

#include "ggml_types.h"

#define PN 16 /* output rows per panel (vector lanes) */
#define TR 8  /* tokens per register tile (panel_tile: literal tile sizes 1..TR, the accumulators in registers) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TT 15 /* tokens per tile: TR + 1 .. TT (a full tile and a rest: matmul_int8.c, merge_rest) streamed through a
                 group's weights (panel_stream) */
#else
#define TT TR
#endif

/* A tile of tt tokens' activations, token-interleaved so that one pointer and constant offsets
 * reach every token: word [i][t] is token t's i-th item. */
typedef struct {
    const int32_t *xh;  /* [K / 4][tt] 4 bytes of xq (8 bits) or hi (16 bits); AVX2, 16 bits: items 0, 2 as int16 */
    const int32_t *xl;  /* [K / 4][tt] 4 bytes of lo (16 bits) or NULL; AVX2, 16 bits: items 1, 3 as int16 */
    const float *d32;   /* [K / 32][tt] dx */
    const int32_t *zq32; /* [K / 32][tt] -z * the block's sum of xq (z: the weight's zero point) */
    const int32_t *zq16; /* [K / 16][tt] -z * the half block's sum of xq */
    const float *sx32;  /* [K / 32][tt] dx * q32 */
    const float *sx16;  /* [K / 16][tt] dx * q16 */
    const int32_t *sp32; /* [K / 32][tt] the block's two half-block sums of xq as int16 (low: first, high: second) */
    const int32_t *xu;  /* [K / 4][tt] AVX2, 8 bits: 4 bytes of xq + 128 (unsigned) for the signed-weight kernel, else NULL */
} xtile_t;

/* Groups of 16 weights (Q6_K, Q3_K) with 8-bit activations and no offsets ("paired" panels): the sub-scale
 * multipliers are applied in integers, per 32-activation block b (groups g0 = 2b, g1 = 2b + 1), per lane:
 *   J = c[g0] (U[g0] - z S[g0]) + c[g1] (U[g1] - z S[g1]),  U = sum u xq, S = sum xq over the group
 * (exact in int32: |u - z| <= 255, |J| <= 2 * 128 * 16 * 255 * 127 < 2^28), then ONE float step per block into a super-group
 * accumulator, as = fma(float(J), dx[b], as), and per super-group acc = fma(as, D, acc): where the float
 * form took a convert, a multiply and an fma per 16 weights (llama.cpp applies Q6_K's sub-scales in integers
 * too, over its 256-activation blocks). 16-bit activations (|J| could pass 2^31) and offsets keep one
 * float step per group. Every build forms the same J and the same float steps in the same order. */
#define PAIRED(G, b16, has_m) ((G) == 16 && !(b16) && !(has_m))
/* Beside an unpacked paired panel's K * PN bytes (vb 14): its multipliers as the AVX2 kernel reads them: per
 * group g and half h at int16 (2 g + h) * 16, (c, c) per row; then, from int16 K / 16 * 32, per 32-block b and half
 * h at int32 (2 b + h) * 8, the block's constant -128 (c0 Q0 + c1 Q1) per row (Q: the sum of the group's signed
 * values u - 32; AVX2's unpacked paired panels hold u - 32, see panel_pass). Room is kept for every unpacked panel. */
#define UNPACK_MUL_BYTES(K) ((long)(K) / 16 * 64 + (long)(K) / 32 * 64)

/* y[t * N + l] (t < tt, l < nvalid) = the panel's 16 rows (packed at Q, factors at SM: ratchet_pack_q8) times
 * the tile's tt tokens, for panels of vb-bit values (G, has_m, unit, SB: q8panel_t; b16: 16-bit activations) */
void ratchet_panel_vb4(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt);
void ratchet_panel_vb5(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt);
void ratchet_panel_vb6(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt);
void ratchet_panel_vb8(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt);
/* vb = 13 or 14: a 5- or 6-bit panel unpacked to bytes (matmul_int8.c unpack_panel: values < 2^(vb - 8) in
 * vb 8's layout), for calls of several tiles (prefill): the unpacking is done once per panel, not per tile */
void ratchet_panel_unpacked(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int vb,
                            int b16, int has_m, int unit, int SB, float *y, int N, int nvalid, int tt);

/* bytes a group of G values of width vb takes in a panel (vb 13, 14: one byte a value, as vb 8) */
#define VBYTES(G, vb) ((G) * PN * ((vb) > 8 ? 8 : (vb)) / 8)

#ifdef RATCHET_PANEL_UNIT /* the matmul_int8_vb*.c units: the kernels themselves */

/* Per group: I = sum u xq (- z sum xq, exact in int32), then acc = fma(float(I), s * dx, acc) and with
 * offsets acc = fma(M, dx * sum xq, acc). On AVX-512 the dot products and the float multiplies share
 * the multiply pipes (per group and token: 8 or 16 vpdpbusd against 2 or 3 multiplies), while the
 * nibble split, the zero-point correction (a shift and a subtract: z is a power of two) and the
 * int-to-float conversion run on the other pipes. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Software prefetch of the packed values Q_AHEAD bytes ahead (and of the factors S_AHEAD ahead):
 * unpacking nibbles and planes, or the products of several tokens, cost enough instructions per byte
 * that the out-of-order window no longer keeps enough misses in flight. One thread, 16384 x 4096, one
 * row: Q4_K 2.00 -> 1.46 ms, Q6_K 3.18 -> 2.09 ms (2 KB and 8 KB ahead measured slower). Bytes
 * (Q8_0), 2 threads, weights cold (more copies than the L3 holds, as in a forward), same process:
 * 4-16 tokens 0.68-0.87x the time without it (1B and 135M shapes), 1-3 tokens 0.75-1.06x. */
#define Q_AHEAD 4096
#define S_AHEAD 1024
/* acc += w (unsigned bytes) . x (4 signed bytes broadcast from memory into every lane): the broadcast is
 * part of the instruction's load (compilers emit a separate vpbroadcastd, which costs a vector op) */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* G, vb, b16, has_m and tt are literals at every call (PANEL_TT below), so each combination compiles to
 * its own fully unrolled loop with the accumulators in registers */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *Q, const uint8_t *SM, int z,
                                                             const xtile_t *xs, int K, const int G, const int vb,
                                                             const int b16, const int has_m, const int unit, int SB,
                                                             float *y, int N,
                                                             int nvalid, const int tt) {
    const int P = PAIRED(G, b16, has_m);
    __m512 acc[TR]; /* paired panels: the super-group's accumulator as, the total in accm */
    __m512i J[TR];
    /* Paired panels: J's steps are exact in float where |J| < 2^24: |u - z| <= 32 (4-bit values; 6-bit ones
     * with z = 32, Q6_K: 2 * 128 * 16 * 32 * 127 = 16646144), then formed by vcvtdq2ps and vmulps / vfmadd (which
     * the second 512-bit port takes) rather than vpmulld (2 uops on the port of vpdpbusd: 1.17x the time
     * at one row, 2048 x 2048 Q6_K, one thread); the same J, so the same bits */
    const int fexact = P && (vb == 4 || ((vb == 6 || vb == 14) && z == 32));
    __m512 Jf[TR];
    float accm[P ? TR : 1][PN] __attribute__((aligned(64)));
    #pragma GCC unroll 8
    for (int t = 0; t < tt; t++) {
        acc[t] = _mm512_setzero_ps();
        if (P) _mm512_store_ps(accm[t], acc[t]);
    }
    const int C = G / 4, NG = K / G, GPS = SB / G, SBB = (1 + has_m) * (2 + (unit ? 0 : GPS)) * PN;
    /* GPS is a power of two: a shift and a mask per group, not g / GPS and g % GPS (gcc emitted an idiv, a
     * microcoded instruction, in every group: removing it took 8- and 16-token tiles to 0.73x the time,
     * one thread, the default model's layer shapes, 2026-11-28) */
    const int gsh = __builtin_ctz((unsigned)GPS);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 Dv = _mm512_setzero_ps(), Dmv = _mm512_setzero_ps();
    const int GS = P ? 2 : 1; /* paired panels: both groups of a block in one pass of the loop (no branch on g's parity) */
    for (int gb = 0; gb < NG; gb += GS) {
    #pragma GCC unroll 2
    for (int gi = 0; gi < GS; gi++) {
        const int g = gb + gi;
        const uint8_t *sbp = SM + (long)(g >> gsh) * SBB, *qg = Q + (long)g * VBYTES(G, vb);
        #pragma GCC unroll 8
        for (int o = 0; o < VBYTES(G, vb) && vb <= 8; o += 64) _mm_prefetch((const char *)qg + Q_AHEAD + o, _MM_HINT_T0);
        if ((g & (GPS - 1)) == 0) { /* a super-group's D and D_m (fp16 -> fp32, exact) */
            for (int o = 0; o < SBB; o += 64) _mm_prefetch((const char *)sbp + S_AHEAD + o, _MM_HINT_T0);
            Dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sbp));
            if (has_m) Dmv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sbp + 2 * PN)));
        }
        /* s = D * c and m = D_m * c_m: the format's own products (d * sc), exact as to_q8w's */
        const int8_t *cp = (const int8_t *)sbp + (1 + has_m) * 2 * PN + (g & (GPS - 1)) * (1 + has_m) * PN;
        const __m512 sv = unit || P ? Dv : _mm512_mul_ps(Dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cp))));
        const __m512 mv = !has_m ? _mm512_setzero_ps()
                          : unit ? Dmv
                                 : _mm512_mul_ps(Dmv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cp + PN)))));
        __m512i W[8];
        if (vb < 8) { /* nibbles, then bits 4 (and 5) from the plane: W |= (plane shifted) & mask, one ternlog */
            const __m512i *qv = (const __m512i *)qg;
            #pragma GCC unroll 8
            for (int v = 0; v < C / 2; v++) {
                const __m512i b = _mm512_loadu_si512(qv + v);
                W[v] = _mm512_and_si512(b, m4);
                W[v + C / 2] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
            }
            if (vb == 6) { /* item 4p + j: bits 2j..2j+1 of plane p to bits 4..5 (16-bit shifts: the mask drops what crosses bytes) */
                const __m512i m30 = _mm512_set1_epi8(0x30);
                #pragma GCC unroll 8
                for (int c = 0; c < C; c++) {
                    const __m512i pl = _mm512_loadu_si512(qv + C / 2 + c / 4);
                    const int j = c % 4;
                    const __m512i sh = j < 2 ? _mm512_slli_epi16(pl, 4 - 2 * j) : j == 2 ? pl : _mm512_srli_epi16(pl, 2);
                    W[c] = _mm512_ternarylogic_epi32(sh, m30, W[c], 0xEA); /* (sh & m30) | W */
                }
            } else if (vb == 5) { /* item j: bit j of the plane to bit 4 */
                const __m512i m10 = _mm512_set1_epi8(0x10), pl = _mm512_loadu_si512(qv + C / 2);
                #pragma GCC unroll 8
                for (int c = 0; c < C; c++) {
                    const __m512i sh = c < 4 ? _mm512_slli_epi16(pl, 4 - c) : c == 4 ? pl : _mm512_srli_epi16(pl, c - 4);
                    W[c] = _mm512_ternarylogic_epi32(sh, m10, W[c], 0xEA);
                }
            }
        } else {
            const __m512i *qv = (const __m512i *)qg;
            #pragma GCC unroll 8
            for (int c = 0; c < C; c++) W[c] = _mm512_loadu_si512(qv + c);
        }
        /* one integer chain per token, the tokens interleaved (tt independent chains in flight),
         * starting from -z * sum xq (16 bits: added after the high bytes' products are scaled) */
        __m512i I[TR];
#pragma GCC unroll 8
        for (int t = 0; t < tt; t++)
            I[t] = z && !b16 ? _mm512_set1_epi32(G == 32 ? xs->zq32[g * tt + t] : xs->zq16[g * tt + t])
                             : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < C; c++)
#pragma GCC unroll 8
            for (int t = 0; t < tt; t++) I[t] = dpbusd_bcast(I[t], W[c], xs->xh + ((long)g * C + c) * tt + t);
        if (b16) { /* I = 256 * I_hi - z * sum xq + I_lo: the lo products continue the same chain */
#pragma GCC unroll 8
            for (int t = 0; t < tt; t++) {
                I[t] = _mm512_slli_epi32(I[t], 8);
                if (z) I[t] = _mm512_add_epi32(I[t], _mm512_set1_epi32(G == 32 ? xs->zq32[g * tt + t] : xs->zq16[g * tt + t]));
            }
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
#pragma GCC unroll 8
                for (int t = 0; t < tt; t++) I[t] = dpbusd_bcast(I[t], W[c], xs->xl + ((long)g * C + c) * tt + t);
        }
        if (P) { /* J += c * (U - z S) per lane (exact), one float step per block, D per super-group */
            const __m512i cv = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cp));
            if (fexact) { /* J in float, every step exact (a convert, a multiply or fma, no vpmulld) */
                const __m512 cf = _mm512_cvtepi32_ps(cv);
#pragma GCC unroll 8
                for (int t = 0; t < tt; t++)
                    Jf[t] = gi ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[t]), cf, Jf[t]) : _mm512_mul_ps(_mm512_cvtepi32_ps(I[t]), cf);
            } else {
#pragma GCC unroll 8
                for (int t = 0; t < tt; t++)
                    J[t] = gi ? _mm512_add_epi32(J[t], _mm512_mullo_epi32(I[t], cv)) : _mm512_mullo_epi32(I[t], cv);
            }
            if (gi) {
#pragma GCC unroll 8
                for (int t = 0; t < tt; t++)
                    acc[t] = _mm512_fmadd_ps(fexact ? Jf[t] : _mm512_cvtepi32_ps(J[t]), _mm512_set1_ps(xs->d32[g / 2 * tt + t]), acc[t]);
                if (((g + 1) & (GPS - 1)) == 0) {
#pragma GCC unroll 8
                    for (int t = 0; t < tt; t++) {
                        _mm512_store_ps(accm[t], _mm512_fmadd_ps(acc[t], Dv, _mm512_load_ps(accm[t])));
                        acc[t] = _mm512_setzero_ps();
                    }
                }
            }
            continue;
        }
#pragma GCC unroll 8
        for (int t = 0; t < tt; t++) {
            const float dx = G == 32 ? xs->d32[g * tt + t] : xs->d32[g / 2 * tt + t];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[t]), _mm512_mul_ps(sv, _mm512_set1_ps(dx)), acc[t]);
            if (has_m)
                acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(G == 32 ? xs->sx32[g * tt + t] : xs->sx16[g * tt + t]), acc[t]);
        }
    }
    }
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    #pragma GCC unroll 8
    for (int t = 0; t < tt; t++) _mm512_mask_storeu_ps(y + (long)t * N, mask, P ? _mm512_load_ps(accm[t]) : acc[t]);
}

/* panel_stream's step for the S tokens t0 .. t0 + S - 1 of a tile of tt (S a literal: the S integer chains
 * interleaved in registers) over group gb (a paired panel's block gb, gb + 1): the weights W, the scales
 * (sv, mv; paired: cf, cv, Dv) in registers, the accumulators in memory */
static inline __attribute__((always_inline)) void stream_tokens(const __m512i W[2][8], __m512 sv, __m512 mv,
                                                                const __m512 cf[2], const __m512i cv[2], __m512 Dv,
                                                                int z, const xtile_t *xs, const int G, const int b16,
                                                                const int has_m, const int P, const int fexact,
                                                                int GPS, int gb, int tt, int t0, const int S,
                                                                float (*acc)[PN], float (*accm)[PN]) {
    const int C = G / 4, GS = P ? 2 : 1;
    const int32_t *xh = xs->xh + (long)gb * C * tt + t0, *xl = b16 ? xs->xl + (long)gb * C * tt + t0 : NULL;
    __m512 Jf[8];
    __m512i J[8];
#pragma GCC unroll 2
    for (int gi = 0; gi < GS; gi++) {
        const int g = gb + gi;
        const int32_t *zq = (G == 32 ? xs->zq32 : xs->zq16) + (long)g * tt + t0;
        __m512i I[8];
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) I[s] = z && !b16 ? _mm512_set1_epi32(zq[s]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < C; c++)
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) I[s] = dpbusd_bcast(I[s], W[gi][c], xh + ((long)gi * C + c) * tt + s);
        if (b16) {
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                I[s] = _mm512_slli_epi32(I[s], 8);
                if (z) I[s] = _mm512_add_epi32(I[s], _mm512_set1_epi32(zq[s]));
            }
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
#pragma GCC unroll 8
                for (int s = 0; s < S; s++) I[s] = dpbusd_bcast(I[s], W[gi][c], xl + ((long)gi * C + c) * tt + s);
        }
        if (P) {
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                if (fexact)
                    Jf[s] = gi ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[s]), cf[gi], Jf[s]) : _mm512_mul_ps(_mm512_cvtepi32_ps(I[s]), cf[gi]);
                else
                    J[s] = gi ? _mm512_add_epi32(J[s], _mm512_mullo_epi32(I[s], cv[gi])) : _mm512_mullo_epi32(I[s], cv[gi]);
            }
        } else {
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                const long t = t0 + s;
                const float dx = G == 32 ? xs->d32[g * tt + t] : xs->d32[g / 2 * tt + t];
                __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[s]), _mm512_mul_ps(sv, _mm512_set1_ps(dx)), _mm512_load_ps(acc[t]));
                if (has_m)
                    a = _mm512_fmadd_ps(mv, _mm512_set1_ps(G == 32 ? xs->sx32[g * tt + t] : xs->sx16[g * tt + t]), a);
                _mm512_store_ps(acc[t], a);
            }
        }
    }
    if (P) {
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            const long t = t0 + s;
            __m512 a = _mm512_fmadd_ps(fexact ? Jf[s] : _mm512_cvtepi32_ps(J[s]), _mm512_set1_ps(xs->d32[gb / 2 * tt + t]),
                                       _mm512_load_ps(acc[t]));
            if (((gb + 2) & (GPS - 1)) == 0) {
                _mm512_store_ps(accm[t], _mm512_fmadd_ps(a, Dv, _mm512_load_ps(accm[t])));
                a = _mm512_setzero_ps();
            }
            _mm512_store_ps(acc[t], a);
        }
    }
}

/* Tiles of TR + 1 .. TT tokens (a full tile and the rest of a call of 9-15, 17-23, ... rows: matmul_int8.c, merge_rest).
 * The register tile above holds at most TR tokens' accumulators beside a group's 8 weight vectors (32 zmm), and
 * a call of 9 rows as tiles of 8 and 1 paid the per-group work again (weight loads, nibble and plane unpacking,
 * scales) for the ninth token: ~2x a token's marginal time in the kernel (SmolLM2-135M's shapes, one thread,
 * weights in cache), 1.3 of the 1.6 ms the ninth row added to its forward (perf, 2026-11-29). Here a group's (a
 * paired panel's block's two groups') weight vectors are loaded and unpacked once into registers and the tokens
 * go through them in two halves (stream_tokens: each half's integer chains interleaved, as panel_tile's), each
 * token's accumulator in memory (L1: a load and a store per group and token, on the load and store ports, while
 * the products keep the multiply port busy; the first half's accumulators held in registers instead measured no
 * faster: gcc spilled). Each token's sequence is panel_tile's: the same integer chain (zero point first, products
 * in increasing c; 16 bits: hi, shift, zero point, lo), the same float steps in the same order (paired panels:
 * the same J, fexact or not, one step per block, D per super-group): the same bits at any tile size. tt is a
 * literal (PANEL_STREAM_TT: with tt read at run time the activations' addresses took an add each and the
 * kernel 1.15-1.3x the time) except in the rare kinds (PANEL_KIND_RARE: 8, 4, 2, 1 tokens at a time). */
static inline __attribute__((always_inline)) void panel_stream(const uint8_t *Q, const uint8_t *SM, int z,
                                                               const xtile_t *xs, int K, const int G, const int vb,
                                                               const int b16, const int has_m, const int unit, int SB,
                                                               float *y, int N, int nvalid, int tt) {
    const int P = PAIRED(G, b16, has_m);
    const int fexact = P && (vb == 4 || ((vb == 6 || vb == 14) && z == 32)); /* as panel_tile */
    float acc[TT][PN] __attribute__((aligned(64))); /* [tt][PN]; paired panels: the super-group's accumulator as */
    float accm[P ? TT : 1][PN] __attribute__((aligned(64)));
    for (int t = 0; t < tt; t++) {
        _mm512_store_ps(acc[t], _mm512_setzero_ps());
        if (P) _mm512_store_ps(accm[t], _mm512_setzero_ps());
    }
    const int C = G / 4, NG = K / G, GPS = SB / G, SBB = (1 + has_m) * (2 + (unit ? 0 : GPS)) * PN;
    const int gsh = __builtin_ctz((unsigned)GPS);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 Dv = _mm512_setzero_ps(), Dmv = _mm512_setzero_ps();
    const int GS = P ? 2 : 1; /* paired panels: a block's two groups (GPS is even: one super-group) */
    for (int gb = 0; gb < NG; gb += GS) {
        __m512i W[2][8];
        __m512 sv = _mm512_setzero_ps(), mv = _mm512_setzero_ps(), cf[2];
        __m512i cv[2];
        const uint8_t *sbp = SM + (long)(gb >> gsh) * SBB;
        if ((gb & (GPS - 1)) == 0) {
            for (int o = 0; o < SBB; o += 64) _mm_prefetch((const char *)sbp + S_AHEAD + o, _MM_HINT_T0);
            Dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sbp));
            if (has_m) Dmv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sbp + 2 * PN)));
        }
#pragma GCC unroll 2
        for (int gi = 0; gi < GS; gi++) {
            const int g = gb + gi;
            const uint8_t *qg = Q + (long)g * VBYTES(G, vb);
            #pragma GCC unroll 8
            for (int o = 0; o < VBYTES(G, vb) && vb <= 8; o += 64) _mm_prefetch((const char *)qg + Q_AHEAD + o, _MM_HINT_T0);
            const int8_t *cp = (const int8_t *)sbp + (1 + has_m) * 2 * PN + (g & (GPS - 1)) * (1 + has_m) * PN;
            if (P) {
                cv[gi] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cp));
                cf[gi] = _mm512_cvtepi32_ps(cv[gi]);
            } else {
                sv = unit ? Dv : _mm512_mul_ps(Dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cp))));
                mv = !has_m ? _mm512_setzero_ps()
                     : unit ? Dmv
                            : _mm512_mul_ps(Dmv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cp + PN)))));
            }
            const __m512i *qv = (const __m512i *)qg;
            if (vb < 8) { /* panel_tile's unpacking */
                #pragma GCC unroll 8
                for (int v = 0; v < C / 2; v++) {
                    const __m512i b = _mm512_loadu_si512(qv + v);
                    W[gi][v] = _mm512_and_si512(b, m4);
                    W[gi][v + C / 2] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
                }
                if (vb == 6) {
                    const __m512i m30 = _mm512_set1_epi8(0x30);
                    #pragma GCC unroll 8
                    for (int c = 0; c < C; c++) {
                        const __m512i pl = _mm512_loadu_si512(qv + C / 2 + c / 4);
                        const int j = c % 4;
                        const __m512i sh = j < 2 ? _mm512_slli_epi16(pl, 4 - 2 * j) : j == 2 ? pl : _mm512_srli_epi16(pl, 2);
                        W[gi][c] = _mm512_ternarylogic_epi32(sh, m30, W[gi][c], 0xEA);
                    }
                } else if (vb == 5) {
                    const __m512i m10 = _mm512_set1_epi8(0x10), pl = _mm512_loadu_si512(qv + C / 2);
                    #pragma GCC unroll 8
                    for (int c = 0; c < C; c++) {
                        const __m512i sh = c < 4 ? _mm512_slli_epi16(pl, 4 - c) : c == 4 ? pl : _mm512_srli_epi16(pl, c - 4);
                        W[gi][c] = _mm512_ternarylogic_epi32(sh, m10, W[gi][c], 0xEA);
                    }
                }
            } else {
                #pragma GCC unroll 8
                for (int c = 0; c < C; c++) W[gi][c] = _mm512_loadu_si512(qv + c);
            }
        }
        /* the tokens in two halves, their integer chains interleaved (a literal tt: 9 = 5 + 4 rather than 8 + 1,
         * whose lone chain of 8 (16 bits: 16) dependent products waits on their latency), the weights in registers;
         * a run-time tt 8 at a time, then 4, 2, 1 */
        if (__builtin_constant_p(tt) && tt <= TT) {
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, 0, (tt + 1) / 2, acc, accm);
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, (tt + 1) / 2, tt / 2, acc, accm);
            continue;
        }
        int t0 = 0;
        for (; t0 + 8 <= tt; t0 += 8)
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, t0, 8, acc, accm);
        if (tt - t0 >= 4) {
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, t0, 4, acc, accm);
            t0 += 4;
        }
        if (tt - t0 >= 2) {
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, t0, 2, acc, accm);
            t0 += 2;
        }
        if (tt - t0 >= 1)
            stream_tokens(W, sv, mv, cf, cv, Dv, z, xs, G, b16, has_m, P, fexact, GPS, gb, tt, t0, 1, acc, accm);
    }
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    for (int t = 0; t < tt; t++) _mm512_mask_storeu_ps(y + (long)t * N, mask, _mm512_load_ps(P ? accm[t] : acc[t]));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (no VNNI): a 16-row panel is two 8-row halves of 32 bytes (each 64-byte VNNI-order vector's
 * first and second half). 16-bit activations (int16 mode) come as int16 pairs (items 0, 2 and 1, 3 of
 * each 4: prep_tile_blocks) and a lane's bytes 0, 2 and 1, 3 are widened to int16, so a lane's 4-item
 * dot product is two vpmaddwd (s16 x s16, pairs summed to int32: |w| < 256, |x| <= 32639, exact) and
 * I = u . x - z sum xq is the same exact integer as the VNNI kernel's 256 (u . hi) + u . lo - z sum xq,
 * then the same float epilogue per lane (the same bits). (It replaced vpmaddubsw over the hi and lo
 * bytes: 6 operations a lane and token for 4-6 bit weights, 16 for bytes split into nibbles, against 4
 * here.) 8-bit activations (int8 mode): vpmaddubsw (u8 x s8 -> pairs summed to int16) then vpmaddwd by
 * 1 (paired panels: by the rows' multipliers c, the integer sub-scale step), exact while a pair's
 * |u0 x0 + u1 x1| <= 32767: weights of up to 6 bits (2 * 63 * 128 = 16128);
 * bytes (Q8_0) split into nibbles, 16 * hi + lo. Tokens go TS (3; 4 for 6-bit weights) at a
 * time through the panel's groups, both halves at once. */
#define Q_AHEAD 4096
/* the 32 weight bytes of half h of vector c of group g: unsigned values < 64 (vb < 8; vb 13, 14: stored as bytes), or raw bytes */
static inline __attribute__((always_inline)) __m256i unpack_avx2(const uint8_t *qg, int C, int vb, int c, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (vb >= 8) return _mm256_loadu_si256((const __m256i *)(qg + c * 64 + 32 * h)); /* bytes */
    const int v = c % (C / 2);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(qg + v * 64 + 32 * h));
    __m256i w = c < C / 2 ? _mm256_and_si256(b, m4) : _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    const uint8_t *pl = qg + C / 2 * 64;
    if (vb == 6) { /* bits 2j..2j+1 of plane c / 4 to bits 4..5 (16-bit shifts: the mask drops what crosses bytes) */
        const __m256i p = _mm256_loadu_si256((const __m256i *)(pl + (c / 4) * 64 + 32 * h));
        const int j = c % 4;
        const __m256i sh = j < 2 ? _mm256_slli_epi16(p, 4 - 2 * j) : j == 2 ? p : _mm256_srli_epi16(p, 2);
        w = _mm256_or_si256(w, _mm256_and_si256(sh, _mm256_set1_epi8(0x30)));
    } else if (vb == 5) { /* bit c of the plane to bit 4 */
        const __m256i p = _mm256_loadu_si256((const __m256i *)(pl + 32 * h));
        const __m256i sh = c < 4 ? _mm256_slli_epi16(p, 4 - c) : c == 4 ? p : _mm256_srli_epi16(p, c - 4);
        w = _mm256_or_si256(w, _mm256_and_si256(sh, _mm256_set1_epi8(0x10)));
    }
    return w;
}

/* 8-bit activations: I += (w . x) * sc for every lane (sc: int16 pairs, 1 or a paired panel's c); bytes
 * (vb = 8) as 16 (hi nibble) + lo nibble */
static inline __attribute__((always_inline)) __m256i dot_w_avx2(__m256i I, __m256i w, int32_t x4, int vb, __m256i sc) {
    const __m256i x = _mm256_set1_epi32(x4);
    if (vb != 8) return _mm256_add_epi32(I, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), sc));
    const __m256i m4 = _mm256_set1_epi8(0x0F); /* |16 c| <= 2048, nibble pair sums <= 3810: exact */
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), x),
                                         _mm256_slli_epi16(sc, 4));
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, m4), x), sc);
    return _mm256_add_epi32(I, _mm256_add_epi32(hi, lo));
}

/* 8 rows' int8 multipliers (8 bytes at c) as int16 pairs (c_l, c_l) per int32 lane */
static inline __attribute__((always_inline)) __m256i pairs_of(const int8_t *c) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)c);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
}

#define AVX2_TS 4 /* the most tokens a pass over a panel's groups takes */
#define PANEL_PASSES 1 /* the kinds below instantiate panel_pass, not panel_tile */
/* Q6_K's heavier unpacking pays for a fourth token per pass (kernel 1.09-1.18x at 8-256 rows), the
 * other formats measured 0.91-1.08x with it */
#define AVX2_PASS(vb) ((vb) == 6 || (vb) > 8 ? 4 : 3)
/* One pass over the panel's groups for the S tokens t0 .. t0 + S - 1 of a tile of tt. S is a literal
 * at every call (the integer chains live in registers); tt and t0 only move pointers, literals where
 * the kinds below say so. */
static inline __attribute__((always_inline)) void panel_pass(const uint8_t *Q, const uint8_t *SM, int z,
                                                             const xtile_t *xs, int K, const int G, const int vb,
                                                             const int b16, const int has_m, const int unit, int SB,
                                                             float *y, int N, int nvalid, int tt, int t0,
                                                             const int S) {
    const int C = G / 4, NG = K / G, GPS = SB / G, SBB = (1 + has_m) * (2 + (unit ? 0 : GPS)) * PN;
    const int gsh = __builtin_ctz((unsigned)GPS); /* GPS is a power of two: shifts, not a division per group */
    const __m256i m00ff = _mm256_set1_epi16(0xFF), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* paired panels (PAIRED above): both groups of a 32-block go into one integer chain, each group's products
     * widened by vpmaddwd with its multipliers c (int16 pairs) where the other kinds widen by 1 */
    const int P = PAIRED(G, b16, has_m), GS = P ? 2 : 1;
    /* Unpacked paired panels (vb 14, Q6_K) hold signed values u - 32 (unpack_panel) and take the activations as
     * xq + 128 (unsigned: vpmaddubsw's first operand), so that the zero point is a constant per row and block:
     * sum (xq + 128)(u - 32) = sum xq u - 32 sum xq + 128 Q, Q = sum (u - 32) over the group, and
     *   J = sum_g c_g [sum (xq + 128)(u - 32)] - 128 (c0 Q0 + c1 Q1) + (32 - z)(c0 S0 + c1 S1)
     * is the same integer as c0 (U0 - z S0) + c1 (U1 - z S1) (so the same bits), where the constant is made once
     * per unpacked panel and the last term is 0 for Q6_K (z = 32): no vpmaddwd of the token's sums per block */
    const int SW = P && vb > 8;
    /* The float accumulators live in memory (L1), touched once per group (paired: block) and token, so that
     * the 16 ymm registers hold the integer chains and the weight vectors (in registers beside them:
     * 0.85-1.09x the time of this, measured with the chains' asm below in place). Paired panels: acc is the
     * super-group's accumulator, accm the total. */
    float acc[AVX2_TS][2][8] __attribute__((aligned(32)));
    float accm[P ? AVX2_TS : 1][2][8] __attribute__((aligned(32)));
    for (int t = 0; t < AVX2_TS; t++)
        for (int h = 0; h < 2; h++) {
            _mm256_store_ps(acc[t][h], _mm256_setzero_ps());
            if (P) _mm256_store_ps(accm[t][h], _mm256_setzero_ps());
        }
    for (int gb = 0; gb < NG; gb += GS) {
        const uint8_t *sbp = SM + (long)(gb >> gsh) * SBB;
        const int8_t *cp0 = (const int8_t *)sbp + (1 + has_m) * 2 * PN + (gb & (GPS - 1)) * (1 + has_m) * PN;
        /* one int32 chain per token and half: u . x (16 bits) or u . xq (8 bits); paired: from -z (c0 S0 + c1 S1),
         * one vpmaddwd of the rows' (-z c0, -z c1) (|z c| <= 16384) by the token's (S0, S1) (|S| <= 2032). (One
         * half at a time for 6 tokens, unpacking a half's weights once for 6: 0.88-1.01x; both halves per token
         * with its pairs broadcast once: 0.98-1.03x; neither kept.) */
        __m256i I[AVX2_TS][2];
        /* vb 14: the multipliers' vectors made once per unpacked panel (UNPACK_MUL_BYTES) */
        const int16_t *um = (const int16_t *)(Q + (long)K * PN);
        if (SW) { /* from the block's constant -128 (c0 Q0 + c1 Q1), and where z != 32 the rest of the zero point */
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i kv = _mm256_loadu_si256((const __m256i *)((const int32_t *)(um + (long)K * 2) + ((long)gb + h) * 8));
                #pragma GCC unroll 4
                for (int t = 0; t < S; t++) I[t][h] = kv;
            }
            if (z != 32) { /* (32 - z) (c0 S0 + c1 S1): |(32 - z) c| <= 32 * 128, an int16 */
                #pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m128i c01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(cp0 + 8 * h)),
                                                          _mm_loadl_epi64((const __m128i *)(cp0 + PN + 8 * h)));
                    const __m256i zc = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(c01), _mm256_set1_epi16((int16_t)(32 - z)));
                    #pragma GCC unroll 4
                    for (int t = 0; t < S; t++)
                        I[t][h] = _mm256_add_epi32(I[t][h], _mm256_madd_epi16(zc, _mm256_set1_epi32(xs->sp32[(long)(gb / 2) * tt + t0 + t])));
                }
            }
        } else if (P && z) {
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m128i c01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(cp0 + 8 * h)),
                                                      _mm_loadl_epi64((const __m128i *)(cp0 + PN + 8 * h)));
                const __m256i zc = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(c01), _mm256_set1_epi16((int16_t)-z));
                #pragma GCC unroll 4
                for (int t = 0; t < S; t++)
                    I[t][h] = _mm256_madd_epi16(zc, _mm256_set1_epi32(xs->sp32[(long)(gb / 2) * tt + t0 + t]));
            }
        } else {
            for (int t = 0; t < AVX2_TS; t++) I[t][0] = I[t][1] = _mm256_setzero_si256();
        }
        #pragma GCC unroll 2
        for (int gi = 0; gi < GS; gi++) {
        const int g = gb + gi;
        const uint8_t *qg = Q + (long)g * VBYTES(G, vb);
        if (t0 == 0 && vb <= 8) /* (vb 13, 14: the unpacked panels sit in L2) */
            for (int o = 0; o < VBYTES(G, vb); o += 64) _mm_prefetch((const char *)qg + Q_AHEAD + o, _MM_HINT_T0);
        __m256i sc[2]; /* the widening's int16 pairs per half: 1, or the rows' multipliers of group g */
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            sc[h] = !P ? _mm256_set1_epi16(1)
                    : vb > 8 ? _mm256_loadu_si256((const __m256i *)(um + ((long)g * 2 + h) * 16))
                             : pairs_of(cp0 + gi * PN + 8 * h);
        if (!b16 && vb != 8) {
            /* 8 bits, weights u < 2^vb (<= 63): vpmaddubsw's pair sums |u0 x0 + u1 x1| <= 2 * 63 * 127 = 16002,
             * so two vectors' sums add up exactly in int16 before one vpmaddwd by sc widens them (|c| <= 128:
             * 2 * 32004 * 128, exact): the same int32 I, one widening (and one int32 add) per two vectors
             * instead of each; C = G / 4 is 4 or 8, even */
            #pragma GCC unroll 8
            for (int c0 = 0; c0 < C; c0 += 2) {
                __m256i w[2][2];
                #pragma GCC unroll 2
                for (int j = 0; j < 2; j++)
                    #pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) w[j][h] = unpack_avx2(qg, C, vb, c0 + j, h);
                const int32_t *xa = SW ? xs->xu : xs->xh;
                #pragma GCC unroll 4
                for (int t = 0; t < S; t++) {
                    const long i = ((long)g * C + c0) * tt + t0 + t;
                    const __m256i x0 = _mm256_set1_epi32(xa[i]), x1 = _mm256_set1_epi32(xa[i + tt]);
                    #pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        /* signed weights: (xq + 128) (u - 32), pair sums |.| <= 2 * 255 * 32 = 16320, two of them 32640 */
                        const __m256i s16 = SW ? _mm256_add_epi16(_mm256_maddubs_epi16(x0, w[0][h]), _mm256_maddubs_epi16(x1, w[1][h]))
                                               : _mm256_add_epi16(_mm256_maddubs_epi16(w[0][h], x0), _mm256_maddubs_epi16(w[1][h], x1));
                        I[t][h] = _mm256_add_epi32(I[t][h], _mm256_madd_epi16(s16, sc[h]));
                        __asm__("" : "+x"(I[t][h]));
                    }
                }
            }
        } else
        #pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i w = unpack_avx2(qg, C, vb, c, h);
                /* 16 bits: bytes 0, 2 and 1, 3 of each lane's four as int16 (unsigned, < 256) */
                const __m256i w02 = _mm256_and_si256(w, m00ff), w13 = _mm256_srli_epi16(w, 8);
                #pragma GCC unroll 4
                for (int t = 0; t < S; t++) {
                    const long i = ((long)g * C + c) * tt + t0 + t;
                    if (b16) { /* int16 pairs: (w0 x0 + w2 x2) + (w1 x1 + w3 x3), one vpmaddwd each */
                        I[t][h] = _mm256_add_epi32(I[t][h], _mm256_madd_epi16(w02, _mm256_set1_epi32(xs->xh[i])));
                        I[t][h] = _mm256_add_epi32(I[t][h], _mm256_madd_epi16(w13, _mm256_set1_epi32(xs->xl[i])));
                    } else {
                        I[t][h] = dot_w_avx2(I[t][h], w, xs->xh[i], vb, sc[h]);
                    }
                    /* keep the chain a chain: GCC otherwise reassociates the unrolled integer sums into
                     * trees whose products no longer fit the 16 registers and spills them */
                    __asm__("" : "+x"(I[t][h]));
                }
            }
        }
        }
        if (P) { /* as = fma(float(J), dx, as); at the super-group's end acc = fma(as, D, acc) */
            const int sb_end = ((gb + 2) & (GPS - 1)) == 0;
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sbp + 16 * h)));
                #pragma GCC unroll 4
                for (int t = 0; t < S; t++) {
                    const float dx = xs->d32[(long)(gb / 2) * tt + t0 + t];
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[t][h]), _mm256_set1_ps(dx), _mm256_load_ps(acc[t][h]));
                    if (sb_end) {
                        _mm256_store_ps(accm[t][h], _mm256_fmadd_ps(a, D, _mm256_load_ps(accm[t][h])));
                        _mm256_store_ps(acc[t][h], _mm256_setzero_ps());
                    } else {
                        _mm256_store_ps(acc[t][h], a);
                    }
                }
            }
            continue;
        }
        const int g = gb;
        const int8_t *cp = cp0;
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* s = D * c and m = D_m * c_m, as the AVX-512 kernel forms them */
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sbp + 16 * h)));
            const __m256 sv = unit ? D : _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(cp + 8 * h)))));
            __m256 mv = _mm256_setzero_ps();
            if (has_m) {
                const __m256 Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sbp + 2 * PN + 16 * h)));
                mv = unit ? Dm : _mm256_mul_ps(Dm, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(cp + PN + 8 * h)))));
            }
            #pragma GCC unroll 4
            for (int t = 0; t < S; t++) {
                const long gt = (long)g * tt + t0 + t;
                const int32_t zq = z ? (G == 32 ? xs->zq32[gt] : xs->zq16[gt]) : 0;
                const float dx = G == 32 ? xs->d32[gt] : xs->d32[(long)g / 2 * tt + t0 + t];
                const __m256i It = z ? _mm256_add_epi32(I[t][h], _mm256_set1_epi32(zq)) : I[t][h];
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(It), _mm256_mul_ps(sv, _mm256_set1_ps(dx)), _mm256_load_ps(acc[t][h]));
                if (has_m)
                    a = _mm256_fmadd_ps(mv, _mm256_set1_ps(G == 32 ? xs->sx32[gt] : xs->sx16[gt]), a);
                _mm256_store_ps(acc[t][h], a);
            }
        }
    }
    for (int t = 0; t < S; t++)
        for (int h = 0; h < 2; h++) {
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid - 8 * h), lane);
            _mm256_maskstore_ps(y + (long)(t0 + t) * N + 8 * h, mask, _mm256_load_ps(P ? accm[t][h] : acc[t][h]));
        }
}
#else
/* portable C : the same sequence per lane */
static inline void panel_tile(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, const int G,
                              const int vb, const int b16, const int has_m, const int unit, int SB, float *y, int N,
                              int nvalid, const int tt) {
    const int P = PAIRED(G, b16, has_m);
    float acc[TT][PN], as[TT][PN]; /* paired panels: as the super-group's accumulator */
    int32_t J[TT][PN];
    for (int t = 0; t < tt; t++)
        for (int l = 0; l < PN; l++) acc[t][l] = as[t][l] = 0.0f;
    const int C = G / 4, NG = K / G, GPS = SB / G, SBB = (1 + has_m) * (2 + (unit ? 0 : GPS)) * PN;
    for (int g = 0; g < NG; g++) {
        const uint8_t *sbp = SM + (long)(g / GPS) * SBB;
        const int8_t *cp = (const int8_t *)sbp + (1 + has_m) * 2 * PN + (g % GPS) * (1 + has_m) * PN;
        float sv[PN], mv[PN];
        for (int l = 0; l < PN; l++) {
            sv[l] = load_fp16(sbp + 2 * l) * (unit ? 1.0f : (float)cp[l]);
            mv[l] = has_m ? load_fp16(sbp + 2 * PN + 2 * l) * (unit ? 1.0f : (float)cp[PN + l]) : 0.0f;
        }
        uint8_t w[32 * PN]; /* [C][PN][4] unsigned weights of the group */
        if (vb < 8) { /* the layout of plane_pack */
            const uint8_t *qg = Q + (long)g * VBYTES(G, vb), *pl = qg + C / 2 * 64;
            for (int i = 0; i < C / 2 * PN * 4; i++) {
                w[i] = qg[i] & 0x0F;
                w[i + C / 2 * PN * 4] = qg[i] >> 4;
            }
            for (int c = 0; c < C && vb > 4; c++)
                for (int i = 0; i < 64; i++)
                    w[c * 64 + i] |= (uint8_t)(vb == 6 ? ((pl[(c / 4) * 64 + i] >> (2 * (c % 4))) & 3) << 4
                                                       : ((pl[i] >> c) & 1) << 4);
        } else {
            memcpy(w, Q + (long)g * G * 16, (size_t)G * PN);
        }
        for (int t = 0; t < tt; t++) {
            const int32_t zq = z ? (G == 32 ? xs->zq32[g * tt + t] : xs->zq16[g * tt + t]) : 0;
            const float dx = G == 32 ? xs->d32[g * tt + t] : xs->d32[g / 2 * tt + t];
            const float sx = has_m ? (G == 32 ? xs->sx32[g * tt + t] : xs->sx16[g * tt + t]) : 0.0f;
            for (int l = 0; l < PN; l++) {
                int32_t hi = 0, lo = 0;
                for (int c = 0; c < C; c++) {
                    const int32_t wh = xs->xh[((long)g * C + c) * tt + t], wl = b16 ? xs->xl[((long)g * C + c) * tt + t] : 0;
                    for (int j = 0; j < 4; j++) {
                        hi += (int32_t)w[(c * PN + l) * 4 + j] * (int8_t)(wh >> (8 * j));
                        if (b16) lo += (int32_t)w[(c * PN + l) * 4 + j] * (int8_t)(wl >> (8 * j));
                    }
                }
                const int32_t I = (b16 ? hi * 256 + lo : hi) + zq;
                if (P) { /* J = c0 (U0 - z S0) + c1 (U1 - z S1), one float step per block, D per super-group */
                    J[t][l] = (g & 1 ? J[t][l] : 0) + (int32_t)cp[l] * I;
                    if (g & 1) as[t][l] = fmaf((float)J[t][l], dx, as[t][l]);
                    if ((g & 1) && ((g + 1) % GPS) == 0) {
                        acc[t][l] = fmaf(as[t][l], load_fp16(sbp + 2 * l), acc[t][l]);
                        as[t][l] = 0.0f;
                    }
                    continue;
                }
                acc[t][l] = fmaf((float)I, sv[l] * dx, acc[t][l]);
                if (has_m) acc[t][l] = fmaf(mv[l], sx, acc[t][l]);
            }
        }
    }
    for (int t = 0; t < tt; t++)
        for (int l = 0; l < nvalid; l++) y[(long)t * N + l] = acc[t][l];
}
#endif

/* One function per panel kind (G, VB, B16, HM, U) and tile shape, each one panel_tile (panel_pass) with
 * literal arguments (the accumulators then live in registers): gcc's per-function passes (points-to
 * analysis, value numbering) take time that grows faster than a function's size, and when a unit's every
 * kind and tile size was inlined into one function (one switch) the AVX2 build of the int8 kernels took
 * 154 s of CPU instead of ~74 (the same loops; the tile size is picked through a table of functions). */
#if defined(PANEL_PASSES)
/* AVX2: a tile of tt tokens is passes of AVX2_PASS(VB) (TS) tokens and one shorter; with a function per
 * tile size 1..8 (each its passes, 36 token-passes a kind) the four AVX2 units took 74 s of CPU to
 * compile. The pass functions here, with S and t0 literals (t0 read at run time measured 5-20% slower):
 * tt = S for tiles of one pass (decode, short verify), the passes of a full tile of TT (prefill, tt a
 * literal too), and for tiles of 4-7 tokens a first pass of TS and the rest at t0 = TS (and 6) with tt
 * read at run time (the same speed within noise): 24 token-passes a kind (28 for TS = 4). A function
 * never called is never emitted (e.g. S = 4 where passes take 3). */
#define PANEL_S(NAME, G, VB, B16, HM, U, S, TTL, T0L)                                                                  \
    static __attribute__((noinline)) void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K,   \
                                               int SB, float *y, int N, int nvalid, int tt, int t0) {                  \
        panel_pass(Q, SM, z, xs, K, G, VB, B16, HM, U, SB, y, N, nvalid, TTL ? TTL : tt, T0L < 0 ? t0 : T0L, S);       \
    }
#define PANEL_KIND(NAME, G, VB, B16, HM, U)                                                                            \
    PANEL_S(NAME##_1, G, VB, B16, HM, U, 1, 1, 0) PANEL_S(NAME##_2, G, VB, B16, HM, U, 2, 2, 0)                        \
    PANEL_S(NAME##_3, G, VB, B16, HM, U, 3, 3, 0) PANEL_S(NAME##_4, G, VB, B16, HM, U, 4, 4, 0)                        \
    PANEL_S(NAME##_8p0, G, VB, B16, HM, U, AVX2_PASS(VB), TT, 0)                                                       \
    PANEL_S(NAME##_8p1, G, VB, B16, HM, U, AVX2_PASS(VB), TT, AVX2_PASS(VB))                                           \
    PANEL_S(NAME##_8p2, G, VB, B16, HM, U, 2, TT, 6)                                                                   \
    PANEL_S(NAME##_rf, G, VB, B16, HM, U, AVX2_PASS(VB), 0, 0)                                                         \
    PANEL_S(NAME##_rm1, G, VB, B16, HM, U, 1, 0, AVX2_PASS(VB))                                                        \
    PANEL_S(NAME##_rm2, G, VB, B16, HM, U, 2, 0, AVX2_PASS(VB))                                                        \
    PANEL_S(NAME##_rm3, G, VB, B16, HM, U, 3, 0, AVX2_PASS(VB))                                                        \
    PANEL_S(NAME##_rt1, G, VB, B16, HM, U, 1, 0, 6)                                                                    \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        const int TS = AVX2_PASS(VB);                                                                                  \
        if (tt == 1) {                                                                                                 \
            NAME##_1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                        \
        } else if (tt == 2) {                                                                                          \
            NAME##_2(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                        \
        } else if (tt == 3) {                                                                                          \
            NAME##_3(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                        \
        } else if (AVX2_PASS(VB) == 4 && tt == 4) {                                                                    \
            NAME##_4(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                        \
        } else if (tt == TT) { /* passes of TS tokens at t0 = 0, TS (and 2 at 6 where TS = 3) */                      \
            NAME##_8p0(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                      \
            NAME##_8p1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, TS);                                                     \
            if (AVX2_PASS(VB) == 3) NAME##_8p2(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 6);                              \
        } else { /* 4-7 tokens: TS at t0 = 0, the rest at TS (and 1 at 6: 7 tokens where TS = 3) */                   \
            NAME##_rf(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                       \
            const int rest = tt - TS;                                                                                  \
            if (rest == 1)                                                                                             \
                NAME##_rm1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, TS);                                                 \
            else if (rest == 2)                                                                                        \
                NAME##_rm2(Q, SM, z, xs, K, SB, y, N, nvalid, tt, TS);                                                 \
            else                                                                                                       \
                NAME##_rm3(Q, SM, z, xs, K, SB, y, N, nvalid, tt, TS);                                                 \
            if (AVX2_PASS(VB) == 3 && rest == 4) NAME##_rt1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 6);                 \
        }                                                                                                              \
    }
/* a kind no single format's panels take (PANEL_KINDS' FAST flags): only passes with tt and t0 read at
 * run time (the same bits, 5-20% slower on AVX2; 6-10 token-passes instead of 24-28) */
#define PANEL_KIND_RARE(NAME, G, VB, B16, HM, U)                                                                       \
    PANEL_S(NAME##_r1, G, VB, B16, HM, U, 1, 0, -1) PANEL_S(NAME##_r2, G, VB, B16, HM, U, 2, 0, -1)                    \
    PANEL_S(NAME##_r3, G, VB, B16, HM, U, 3, 0, -1) PANEL_S(NAME##_r4, G, VB, B16, HM, U, 4, 0, -1)                    \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        const int TS = AVX2_PASS(VB);                                                                                  \
        for (int t0 = 0; t0 < tt; t0 += TS) {                                                                          \
            const int S = tt - t0 < TS ? tt - t0 : TS;                                                                 \
            if (S == 1)                                                                                                \
                NAME##_r1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, t0);                                                  \
            else if (S == 2)                                                                                           \
                NAME##_r2(Q, SM, z, xs, K, SB, y, N, nvalid, tt, t0);                                                  \
            else if (AVX2_PASS(VB) == 4 && S == 4)                                                                     \
                NAME##_r4(Q, SM, z, xs, K, SB, y, N, nvalid, tt, t0);                                                  \
            else                                                                                                       \
                NAME##_r3(Q, SM, z, xs, K, SB, y, N, nvalid, tt, t0);                                                  \
        }                                                                                                              \
    }
/* a kind only calls of several full tiles take (the unpacked 5- and 6-bit panels: prefill, long verifies, where
 * all tiles but the last hold TT tokens): the passes of a full tile with tt and t0 literals, any other tile
 * through the run-time passes of PANEL_KIND_RARE (the same bits) */
#define PANEL_KIND_FULL(NAME, G, VB, B16, HM, U)                                                                       \
    PANEL_S(NAME##_8p0, G, VB, B16, HM, U, AVX2_PASS(VB), TT, 0)                                                       \
    PANEL_S(NAME##_8p1, G, VB, B16, HM, U, AVX2_PASS(VB), TT, AVX2_PASS(VB))                                           \
    PANEL_S(NAME##_8p2, G, VB, B16, HM, U, 2, TT, 6)                                                                   \
    PANEL_KIND_RARE(NAME##_r, G, VB, B16, HM, U)                                                                       \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        if (tt != TT) {                                                                                                \
            NAME##_r(Q, SM, z, xs, K, SB, y, N, nvalid, tt);                                                           \
            return;                                                                                                    \
        }                                                                                                              \
        NAME##_8p0(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 0);                                                          \
        NAME##_8p1(Q, SM, z, xs, K, SB, y, N, nvalid, tt, AVX2_PASS(VB));                                              \
        if (AVX2_PASS(VB) == 3) NAME##_8p2(Q, SM, z, xs, K, SB, y, N, nvalid, tt, 6);                                  \
    }
#else
#define PANEL_TT(NAME, G, VB, B16, HM, U, T)                                                                            \
    static __attribute__((noinline)) void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K,   \
                                               int SB, float *y, int N, int nvalid) {                                  \
        panel_tile(Q, SM, z, xs, K, G, VB, B16, HM, U, SB, y, N, nvalid, T);                                          \
    }
#if TT > TR /* AVX-512: tiles of TR + 1 .. TT tokens go through panel_stream: tt a literal (PANEL_STREAM_TT, the
               * table's entries 9..15), or read at run time (PANEL_STREAM: one function for a rare kind) */
#define PANEL_STREAM(NAME, G, VB, B16, HM, U)                                                                          \
    static __attribute__((noinline)) void NAME##_s(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs,      \
                                                   int K, int SB, float *y, int N, int nvalid, int tt) {               \
        panel_stream(Q, SM, z, xs, K, G, VB, B16, HM, U, SB, y, N, nvalid, tt);                                       \
    }
#define PANEL_STREAMED(NAME)                                                                                           \
    if (tt > TR) {                                                                                                     \
        NAME##_s(Q, SM, z, xs, K, SB, y, N, nvalid, tt);                                                               \
        return;                                                                                                        \
    }
#define PANEL_ST(NAME, G, VB, B16, HM, U, T)                                                                            \
    static __attribute__((noinline)) void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K,   \
                                               int SB, float *y, int N, int nvalid) {                                  \
        panel_stream(Q, SM, z, xs, K, G, VB, B16, HM, U, SB, y, N, nvalid, T);                                        \
    }
#define PANEL_STREAM_TT(NAME, G, VB, B16, HM, U)                                                                       \
    PANEL_ST(NAME##_9, G, VB, B16, HM, U, 9) PANEL_ST(NAME##_10, G, VB, B16, HM, U, 10)                                \
    PANEL_ST(NAME##_11, G, VB, B16, HM, U, 11) PANEL_ST(NAME##_12, G, VB, B16, HM, U, 12)                              \
    PANEL_ST(NAME##_13, G, VB, B16, HM, U, 13) PANEL_ST(NAME##_14, G, VB, B16, HM, U, 14)                              \
    PANEL_ST(NAME##_15, G, VB, B16, HM, U, 15)
#define PANEL_STREAM_F(NAME) , NAME##_9, NAME##_10, NAME##_11, NAME##_12, NAME##_13, NAME##_14, NAME##_15
#else
#define PANEL_STREAM(NAME, G, VB, B16, HM, U)
#define PANEL_STREAMED(NAME)
#define PANEL_STREAM_TT(NAME, G, VB, B16, HM, U)
#define PANEL_STREAM_F(NAME)
#endif
#define PANEL_KIND(NAME, G, VB, B16, HM, U)                                                                            \
    PANEL_TT(NAME##_1, G, VB, B16, HM, U, 1) PANEL_TT(NAME##_2, G, VB, B16, HM, U, 2)                                  \
    PANEL_TT(NAME##_3, G, VB, B16, HM, U, 3) PANEL_TT(NAME##_4, G, VB, B16, HM, U, 4)                                  \
    PANEL_TT(NAME##_5, G, VB, B16, HM, U, 5) PANEL_TT(NAME##_6, G, VB, B16, HM, U, 6)                                  \
    PANEL_TT(NAME##_7, G, VB, B16, HM, U, 7) PANEL_TT(NAME##_8, G, VB, B16, HM, U, 8)                                  \
    PANEL_STREAM_TT(NAME, G, VB, B16, HM, U)                                                                           \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        static void (*const f[])(const uint8_t *, const uint8_t *, int, const xtile_t *, int, int, float *, int, int) = \
            {NAME##_1, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7,                           \
             NAME##_8 PANEL_STREAM_F(NAME)};                                                                           \
        f[tt](Q, SM, z, xs, K, SB, y, N, nvalid);                                                                      \
    }
/* a kind no single format's panels take (PANEL_KINDS' FAST flags): one function with tt read at run time (the
 * same bits: each token's chain is its own; the accumulators live in memory, not registers), and on AVX-512 one
 * panel_stream with tt read at run time for tiles of more than TR */
#define PANEL_KIND_RARE(NAME, G, VB, B16, HM, U)                                                                       \
    static __attribute__((noinline)) void NAME##_t(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs,      \
                                                   int K, int SB, float *y, int N, int nvalid, int tt) {               \
        panel_tile(Q, SM, z, xs, K, G, VB, B16, HM, U, SB, y, N, nvalid, tt);                                         \
    }                                                                                                                  \
    PANEL_STREAM(NAME, G, VB, B16, HM, U)                                                                              \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        PANEL_STREAMED(NAME)                                                                                           \
        NAME##_t(Q, SM, z, xs, K, SB, y, N, nvalid, tt);                                                               \
    }
/* a kind only calls of several full tiles take (see the AVX2 form): TR a literal, smaller tiles at run time
 * (mm_q8 keeps tiles of TR where it unpacks panels: the streamed form is compiled but not reached) */
#define PANEL_KIND_FULL(NAME, G, VB, B16, HM, U)                                                                       \
    PANEL_TT(NAME##_8, G, VB, B16, HM, U, TR) PANEL_KIND_RARE(NAME##_r, G, VB, B16, HM, U)                           \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int SB, float *y, int N,    \
                     int nvalid, int tt) {                                                                             \
        if (tt == TR)                                                                                                  \
            NAME##_8(Q, SM, z, xs, K, SB, y, N, nvalid);                                                               \
        else                                                                                                           \
            NAME##_r(Q, SM, z, xs, K, SB, y, N, nvalid, tt);                                                           \
    }
#endif

#define PANEL_KIND_FAST2 PANEL_KIND_FULL
#define PANEL_KIND_FAST1 PANEL_KIND
#define PANEL_KIND_FAST0 PANEL_KIND_RARE
/* the four kinds of one (G, VB, U), 8- or 16-bit activations, with or without offsets, and function NAME
 * that picks one. F0, F1 (0, 1 or 2): how the kinds without / with offsets compile. 1: panels a single format
 * makes (Q4_0 ... Q8_0, the K-quants: matmul_int8.c), every tile shape with literals (PANEL_KIND); 2: the
 * same, in a unit only calls of several full tiles reach (PANEL_KIND_FULL); 0: kinds that arise only where a
 * fused weight mixes formats (a zero point or offsets from another part, e.g. Q6_K rows beside Q8_0 rows:
 * 8-bit values in groups of 16), compiled as the cheaper PANEL_KIND_RARE. */
#define PANEL_KINDS(NAME, G, VB, U, F0, F1)                                                                            \
    PANEL_KIND_FAST##F0(NAME##_a8, G, VB, 0, 0, U)                                                                     \
    PANEL_KIND_FAST##F1(NAME##_a8m, G, VB, 0, 1, U)                                                                    \
    PANEL_KIND_FAST##F0(NAME##_a16, G, VB, 1, 0, U)                                                                    \
    PANEL_KIND_FAST##F1(NAME##_a16m, G, VB, 1, 1, U)                                                                   \
    static void NAME(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int b16, int has_m, int SB, \
                     float *y, int N, int nvalid, int tt) {                                                            \
        (b16 ? (has_m ? NAME##_a16m : NAME##_a16) : (has_m ? NAME##_a8m : NAME##_a8))(Q, SM, z, xs, K, SB, y, N,       \
                                                                                     nvalid, tt);                      \
    }

#endif /* RATCHET_PANEL_UNIT */
#endif
