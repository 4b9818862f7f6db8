/* Greedy token choice: the index of each row's largest logit, as torch.argmax(dim=-1) on CPU.
 *
 * Why: torch's CPU argmax of one 49152-logit row takes ~50 us (a scalar index-tracking reduction),
 * the same order as a whole decoder layer of the 135M model at batch 1, and every greedy step of
 * every sequence (and every row of a speculative verify) takes one. Two passes over the row (the
 * second from L2) take ~10 us: the vector maximum, then the first index holding it.
 *
 * Same result as torch: the first index of the maximum (ties: the lowest index; -0.0 == 0.0), and a
 * row holding a NaN gives the index of its first NaN (torch's argmax treats NaN as the maximum).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static int64_t row_argmax(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
    }
    nan = un != 0;
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    for (i = 0; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0; /* n == 0 is refused by the caller */
}

/* out[r] = argmax of x[r * stride : r * stride + n], r < rows */
void ratchet_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n);
}
