/* Attention with a fixed reduction order per query row (the int8 mode's attention).
 *
 * Why: BLAS-based attention (SDPA) sums a query row's scores and weighted values in an order that
 * depends on how many queries and keys share the call, so the same row differs in the last bits
 * between a decode step, a verify step and a prefill. In the exact mode that noise never reaches
 * the greedy tokens in practice; in the int8 mode a last-bit change can flip an activation's int8
 * rounding, and the flips compound. Here each row's result depends only on its own visible keys:
 *   s_j = scale * sum_d q[d] k_j[d]   (d in increasing order, one key per vector lane)
 *   s_j = softcap * tanh(s_j / softcap) (if any), + mask; invisible keys are skipped
 *   out = (sum_j exp(s_j - max) v_j) / (sum_j exp(s_j - max))   (j in increasing order)
 * Keys that are masked out (-inf) or beyond the causal limit contribute nothing, so padding a
 * batch to more keys or more queries changes no bit.
 *
 * Layouts: q, out [B, n, H, D]; k, v [B, L, Hkv, D] (query head h reads KV head h / (H / Hkv));
 * mask [B, n, L] additive or NULL; causal: key j visible to query i iff j <= i + L - n.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KL 16 /* keys per vector of scores */

void ratchet_attention(const float *q, const float *k, const float *v, const float *mask, int causal, int B, int n,
                       int L, int H, int Hkv, int D, float scale, float softcap, float *out, int threads) {
    const int G = H / Hkv;
    const int LP = (L + KL - 1) / KL * KL;
    /* K transposed per (b, kv head): kt[b][hk][d][LP] (zero-padded keys), one key per lane */
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)B * Hkv * D * LP);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) collapse(2)
        for (int b = 0; b < B; b++)
            for (int hk = 0; hk < Hkv; hk++) {
                float *dst = kt + ((long)b * Hkv + hk) * D * LP;
                for (int d = 0; d < D; d++) {
                    for (int j = 0; j < L; j++) dst[(long)d * LP + j] = k[(((long)b * L + j) * Hkv + hk) * D + d];
                    for (int j = L; j < LP; j++) dst[(long)d * LP + j] = 0.0f;
                }
            }
        float *s = aligned_alloc(64, sizeof(float) * (size_t)LP);
        float *acc = aligned_alloc(64, sizeof(float) * (size_t)(D + 16));
#pragma omp for schedule(static) collapse(3)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < n; i++)
                for (int h = 0; h < H; h++) {
                    const int hk = h / G;
                    const float *qr = q + (((long)b * n + i) * H + h) * D;
                    const float *kb = kt + ((long)b * Hkv + hk) * D * LP;
                    const float *mr = mask ? mask + ((long)b * n + i) * L : NULL;
                    const int lim = causal ? i + L - n + 1 : L; /* keys [0, lim) may be visible */
                    const int limp = (lim + KL - 1) / KL * KL;
                    for (int j0 = 0; j0 < limp; j0 += KL) {
                        float a[KL];
                        for (int l = 0; l < KL; l++) a[l] = 0.0f;
                        for (int d = 0; d < D; d++) {
                            const float qd = qr[d], *kd = kb + (long)d * LP + j0;
                            for (int l = 0; l < KL; l++) a[l] = a[l] + qd * kd[l];
                        }
                        for (int l = 0; l < KL; l++) s[j0 + l] = a[l] * scale;
                    }
                    float mx = -INFINITY;
                    for (int j = 0; j < lim; j++) {
                        float x = s[j];
                        if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
                        if (mr) x = x + mr[j];
                        s[j] = x;
                        mx = x > mx ? x : mx;
                    }
                    for (int d = 0; d < D; d++) acc[d] = 0.0f;
                    float sum = 0.0f;
                    if (mx > -INFINITY) {
                        for (int j = 0; j < lim; j++) {
                            if (s[j] == -INFINITY) continue;
                            const float p = expf(s[j] - mx);
                            sum = sum + p;
                            const float *vr = v + (((long)b * L + j) * Hkv + hk) * D;
                            for (int d = 0; d < D; d++) acc[d] = acc[d] + p * vr[d];
                        }
                    }
                    float *o = out + (((long)b * n + i) * H + h) * D;
                    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
                }
        free(s);
        free(acc);
    }
    free(kt);
}
