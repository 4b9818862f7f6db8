/* Greedy token choice: the index of each row's largest logit, as torch.argmax(dim=-1) on CPU (and each
 * row's top-k, below).
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

/* Insert (y, idx) into the descending list val/out, its slot p freed first (the list's end, or the
 * last entry dropped): entries smaller than y move down one; ties keep the earlier index first. */
static inline void insert_at(float *val, int64_t *out, int p, float y, int64_t idx) {
    while (p > 0 && val[p - 1] < y) {
        val[p] = val[p - 1];
        out[p] = out[p - 1];
        p--;
    }
    val[p] = y;
    out[p] = idx;
}

/* Top-k of each row, for Token Recycling's successor table (decoding/speculative/recycling.py): the
 * indices of the k largest entries, best first, ties in index order (the lower index first: the order
 * of a stable descending sort). torch.topk over a 49152-logit row takes ~50-130 us on one core and the
 * table takes one of every row a verify computes; one vector pass against the k-th best so far (a row's
 * entries rarely beat it: ~k ln(n / k) insertions) takes ~10-20 us.
 *
 * One pass: the first k entries sorted, then every entry greater than the current k-th best is inserted
 * after every kept entry >= it (so an equal entry later in the row never displaces an earlier one).
 * Returns the number of rows holding a NaN, whose output is then unspecified (the caller uses torch's
 * order there: NaN ranks highest). Needs 1 <= k <= 64 and k <= n. ``rows``: the row of each output
 * (NULL: rows 0 .. nrows - 1). */
static int row_topk(const float *x, int64_t n, int k, int64_t *out) {
    float val[64];
    int64_t i = 0;
    int nan = 0;
    for (; i < k; i++) { /* the first k entries, insertion-sorted */
        const float v = x[i];
        nan |= v != v;
        insert_at(val, out, (int)i, v, i);
    }
    float thr = val[k - 1];
#if defined(__AVX512F__)
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __mmask16 gt = _mm512_cmp_ps_mask(v, _mm512_set1_ps(thr), _CMP_GT_OQ);
        while (gt) {
            const int j = __builtin_ctz(gt);
            gt &= gt - 1;
            const float y = x[i + j];
            if (!(y > thr)) continue; /* thr rose within this vector */
            insert_at(val, out, k - 1, y, i + j);
            thr = val[k - 1];
        }
    }
    nan |= un != 0;
#endif
    for (; i < n; i++) {
        const float y = x[i];
        nan |= y != y;
        if (!(y > thr)) continue;
        insert_at(val, out, k - 1, y, i);
        thr = val[k - 1];
    }
    return nan;
}

/* out[r * k : (r + 1) * k] = top-k indices of x[rows[r] * stride : ... + n] (rows NULL: row r), r < nrows */
int ratchet_topk_rows(const float *x, const int64_t *rows, int64_t nrows, int64_t n, int64_t stride, int k,
                      int64_t *out) {
    int nan = 0;
    for (int64_t r = 0; r < nrows; r++) nan += row_topk(x + (rows ? rows[r] : r) * stride, n, k, out + r * k);
    return nan;
}
