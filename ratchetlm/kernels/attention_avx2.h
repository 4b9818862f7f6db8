/* The AVX2 (+ FMA, F16C) pieces of kernels/attention.c: its AVX-512 path's per-lane operations in the
 * same order, 8 lanes a vector where that path has 16, so an AVX2 build's attention gives the AVX-512
 * build's bits (tests/core/test_int8_kernels.py compares the builds). Included by attention.c only. */
#include <immintrin.h>

/* exp(x) for x <= 0 (and -inf): attention.c's exp_neg with the same constants and operations; its
 * scalef(p, n) is p * 2^n, here one multiply by 2^n made from exponent bits (n >= -126: a normal float) */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* r[j][d] -> r[d][j] for an 8 x 8 block: row pairs interleaved, then quads (vector k of a half holds
 * column k in its low 128 bits and column k + 4 in its high ones), then the 128-bit halves swapped */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* 8 dims of a K/V row from d, widened as kv_load1 reads them (a half cache's new rows rounded to half) */
static inline __m256 kv_load8(kvrow_t r, int d, int kv_half) {
    if (!kv_half) return _mm256_loadu_ps((const float *)r.p + d);
    if (r.cached) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)r.p + d)));
    return _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps((const float *)r.p + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* Scores of keys j0..j0+7 (lanes of the transposed kb, fp32: see KTI) for nq queries: scores16's
 * two chains per query (even and odd d), added at the end */
static inline __attribute__((always_inline)) void scores8(const float *kb, int LP, int j0, int D,
                                                          const float *const *qr, const int nq, float scale, float *s) {
    __m256 a[QT], c[QT];
    for (int u = 0; u < nq; u++) a[u] = c[u] = _mm256_setzero_ps();
    for (int d = 0; d + 1 < D; d += 2) {
        const __m256 k0 = _mm256_load_ps(kb + KTI(d, j0, D)), k1 = _mm256_load_ps(kb + KTI(d + 1, j0, D));
        for (int u = 0; u < nq; u++) {
            a[u] = _mm256_fmadd_ps(_mm256_set1_ps(qr[u][d]), k0, a[u]);
            c[u] = _mm256_fmadd_ps(_mm256_set1_ps(qr[u][d + 1]), k1, c[u]);
        }
    }
    if (D % 2)
        for (int u = 0; u < nq; u++)
            a[u] = _mm256_fmadd_ps(_mm256_set1_ps(qr[u][D - 1]), _mm256_load_ps(kb + KTI(D - 1, j0, D)), a[u]);
    for (int u = 0; u < nq; u++)
        _mm256_store_ps(s + (long)u * LP + j0, _mm256_mul_ps(_mm256_add_ps(a[u], c[u]), _mm256_set1_ps(scale)));
}

/* acc[u][d0 .. d0 + dn) (rows of D + 16; dn a multiple of 16) = sum_j p_uj v_j over the keys j < lmax in
 * increasing order, skipping j >= lim[u] and p_uj = 0 (a blend, not a branch; the caller has set p_uj = 0
 * for j >= lim[u], so the test is one compare of the broadcast p: the scalar tests and their broadcast
 * cost ~6 more operations a key and query, ~1/5 of the AVX2 attention's time at a 512-token prefill), for nq (a literal)
 * queries of KV head hk, 16 dims a pass: attention.c's pv64 on 8 lanes. Context rows are read by slot
 * (cs: this sequence's slots), the rest from this forward's vn. */
static inline __attribute__((always_inline)) void pv16(const float *vn, const void *vc, int kv_half, const int64_t *cs,
                                                       int ctx, int start, int Hkv, int hk, int D, int d0, int dn,
                                                       int lmax, const int *lim, const float *s, int LP, const int nq,
                                                       float *acc) {
    (void)lim; /* (p = 0 beyond it) */
    const long es = kv_half ? 2 : 4, rs = (long)Hkv * D * es; /* a slot's row, bytes */
    const char *base = (const char *)vc + ((long)hk * D + d0) * es;
    const int nc = ctx < lmax ? ctx : lmax;
    for (int d1 = 0; d1 < dn; d1 += 16) {
        __m256 o[QT][2];
        for (int u = 0; u < nq; u++) o[u][0] = o[u][1] = _mm256_setzero_ps();
        for (int j = 0; j < lmax; j++) {
            __m256 v0, v1;
            if (j < nc) {
                if (d1 == 0 && j + V_AHEAD < nc) {
                    const char *np = base + cs[j + V_AHEAD] * rs;
                    for (long c = 0; c < dn * es; c += 64) _mm_prefetch(np + c, _MM_HINT_T0);
                }
                const char *r = base + cs[j] * rs + d1 * es;
                if (kv_half) {
                    v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)r));
                    v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 16)));
                } else {
                    v0 = _mm256_loadu_ps((const float *)r);
                    v1 = _mm256_loadu_ps((const float *)r + 8);
                }
            } else { /* this forward's row, rounded to half with a half cache (as the cache will hold it) */
                const kvrow_t vr = {(const char *)(vn + ((long)(start + j - ctx) * Hkv + hk) * D), 0};
                v0 = kv_load8(vr, d0 + d1, kv_half);
                v1 = kv_load8(vr, d0 + d1 + 8, kv_half);
            }
            for (int u = 0; u < nq; u++) {
                const __m256 pv = _mm256_broadcast_ss(s + (long)u * LP + j);
                const __m256 keep = _mm256_cmp_ps(pv, _mm256_setzero_ps(), _CMP_NEQ_UQ); /* p != 0.0f (NaN: kept) */
                o[u][0] = _mm256_blendv_ps(o[u][0], _mm256_fmadd_ps(pv, v0, o[u][0]), keep);
                o[u][1] = _mm256_blendv_ps(o[u][1], _mm256_fmadd_ps(pv, v1, o[u][1]), keep);
            }
        }
        for (int u = 0; u < nq; u++) {
            _mm256_storeu_ps(acc + (long)u * (D + 16) + d0 + d1, o[u][0]);
            _mm256_storeu_ps(acc + (long)u * (D + 16) + d0 + d1 + 8, o[u][1]);
        }
    }
}
