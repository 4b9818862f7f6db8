/* RMSNorm and RoPE of fp32 rows (layers/norm_rope.py), bit-identical to the torch ops they replace.
 *
 * RMSNorm: torch.rms_norm on CPU, optionally after a residual add.
 *
 * Why: at batch-1 decode torch.rms_norm is seven small ops (pow, sum, div, add, rsqrt, mul, mul) and
 * RoPE four, ~10-20 us a call where the arithmetic takes well under one; every layer calls them.
 *
 * Bit-identity: every step is one IEEE float operation in torch's order, except the sum of squares,
 * where torch's order is that of its cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp, contiguous
 * inner reduction): the row is read as vectors of V lanes, vectors i*4+k (k < 4) accumulate into
 * four vector partial sums in chunks of 2^p vectors that are themselves summed in levels (at most
 * 4), the four partials are added in order, then the scalar tail, then the V lanes in order (rows
 * shorter than V: the same with one-element vectors). V is
 * the lane count of torch's kernel (8 on the builds seen); ratchetlm/layers/norm_rope.py finds it by
 * comparing with torch at first use and keeps torch where nothing matches. -ffp-contract=off: no
 * fused multiply-add may merge x*x into the sum.
 *   mean = sum / dim;  r = 1 / sqrt(mean + eps);  y = (x * r) * w
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAXV 16
#define LEVELS 4
#define ILP 4

static int64_t ceil_log2(int64_t n) { /* c10's CeilLog2: 1 for n <= 2 */
    if (n <= 2) return 1;
    int64_t b = 0;
    for (uint64_t m = (uint64_t)(n - 1); m; m >>= 1) b++;
    return b;
}

/* torch's float cascade sum of x[i]^2, i < dim, with V-lane vectors */
static float sum_squares(const float *x, int64_t dim, int V) {
    const int64_t nvec = dim / V, size = nvec / ILP;
    const int64_t power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][MAXV];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < V; ++l) {
                    const float v = x[(i * ILP + k) * V + l];
                    acc[0][k][l] += v * v;
                }
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < V; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < V; ++l) {
                const float v = x[(i * ILP + k) * V + l];
                acc[0][k][l] += v * v;
            }
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < V; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t r = size * ILP; r < nvec; ++r) /* vectors past the last full group of four */
        for (int l = 0; l < V; ++l) {
            const float v = x[r * V + l];
            acc[0][0][l] += v * v;
        }
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < V; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = nvec * V; e < dim; ++e) total += x[e] * x[e];
    for (int l = 0; l < V; ++l) total += acc[0][0][l];
    return total;
}

/* rows x [rows, dim] (plus h, if given: x + h, written to sum_out) -> out [rows, dim] */
void ratchet_rms_norm(const float *x, const float *h, float *sum_out, const float *w, int64_t rows, int64_t dim,
                      float eps, int lanes, float *out, int threads) {
    if (lanes < 1 || lanes > MAXV) return;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        if (h != NULL) {
            float *s = sum_out + r * dim;
            for (int64_t e = 0; e < dim; e++) s[e] = xr[e] + h[r * dim + e];
            xr = s;
        }
        /* rows shorter than a vector: torch's scalar path, the same cascade one element per "vector" */
        const float mean = sum_squares(xr, dim, dim >= lanes ? lanes : 1) / (float)dim;
        const float inv = 1.0f / sqrtf(mean + eps);
        float *o = out + r * dim;
        for (int64_t e = 0; e < dim; e++) o[e] = (xr[e] * inv) * w[e];
    }
}

/* RoPE (neox, rotate-half) of x [t, heads, head_dim] (row stride x_t between tokens, heads contiguous),
 * the first rd dims of each head turning, the rest copied: torch's x * cos + roll(x, rd / 2) * sin
 * (layers/norm_rope.py: sin's first half negated), three roundings per value, in that order.
 * cos, sin [t, rd]; out [t, heads, head_dim] contiguous. */
void ratchet_rope(const float *x, int64_t t, int64_t heads, int64_t head_dim, int64_t x_t, const float *cos,
                  const float *sin, int64_t rd, float *out) {
    const int64_t half = rd / 2;
    for (int64_t i = 0; i < t; i++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + i * x_t + h * head_dim, *c = cos + i * rd, *s = sin + i * rd;
            float *o = out + (i * heads + h) * head_dim;
            for (int64_t j = 0; j < rd; j++) {
                const float a = xr[j] * c[j], b = xr[j < half ? j + half : j - half] * s[j];
                o[j] = a + b;
            }
            for (int64_t j = rd; j < head_dim; j++) o[j] = xr[j];
        }
}
