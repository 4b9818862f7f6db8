/* The decoder stack of a forward of up to max_rows new tokens as one C call (models/decode_chain.py).
 *
 * Why: at one new token a layer of the bundled 135M model is ~10 kernel calls of ~5-30 us each, and
 * calling them from Python cost ~1 ms a step on top (ctypes argument conversion, tensor views, the
 * torch SiLU and multiply): a fifth of a batch-1 step. This loop makes the same kernel calls with the
 * same arguments in the same order (kernels/norm_rope.c, matmul_int8.c, attention.c), so its results
 * are bit-identical to the layer-by-layer path in the integer modes (tests/core/test_decode_chain.py).
 *
 * ratchet_silu_mul is the integer modes' SwiGLU activation on the layer path: silu(g) * u with an exp
 * of plain IEEE operations (silu.h), so a vectorised and a scalar evaluation of an element give the
 * same bits and a row's result never depends on the rows beside it. The chain computes the same
 * elements as the down projection quantizes its input (ratchet_mm_q8w_swiglu, matmul_int8.c).
 */
#include <stdint.h>
#include <string.h>

#include "silu.h"

void ratchet_rms_norm(const float *x, const float *h, float *sum_out, const float *w, int64_t rows, int64_t dim,
                      float eps, int lanes, float *out, int threads);
void ratchet_rope(const float *x, int64_t t, int64_t heads, int64_t head_dim, int64_t x_t, const float *cos,
                  const float *sin, int64_t rd, float *out);
void ratchet_attention(const float *q, const float *kn, const float *vn, const void *kc, const void *vc,
                       const int64_t *ctx_slots, int max_ctx, const int32_t *seq_meta, int max_new, const float *mask,
                       int B, int H, int Hkv, int D, float scale, float softcap, int kv_half, float *out, int threads);
void ratchet_mm_q8w(const float *x, int M, const void *w, float *y, int threads);
void ratchet_mm_q8w_swiglu(const float *gu, int M, const void *w, float *y, int threads);

/* act [rows, ni] = silu(gu[:, :ni]) * gu[:, ni:] (gu [rows, 2 ni], the fused gate/up projection) */
void ratchet_silu_mul(const float *gu, int64_t rows, int64_t ni, float *act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * ni >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * ni, *u = g + ni;
        float *a = act + r * ni;
        silu_mul_n(g, u, ni, a);
    }
}

/* A layer's constants (decode_chain.py ChainLayer): NULL bias / q_norm / k_norm where the family has none */
typedef struct {
    const float *w_in, *w_post;       /* RMSNorm weights [dim] before attention and before the MLP */
    const void *qkv, *o, *gu, *down;  /* packed integer weights (kernels/__init__.py Q8Weight) */
    const float *qkv_bias;            /* [q + 2 kv] (Qwen2) */
    const float *q_norm, *k_norm;     /* [head_dim] (Qwen3) */
    float q_eps, k_eps, scale, softcap;
    const void *kc, *vc;              /* this layer's cache K / V pools (NULL: no context rows) */
} chain_layer_t;

/* The model's shape and the [max_rows, ...] buffers one kernel writes and the next reads (ChainBuffers) */
typedef struct {
    int32_t nh, nkv, hd, dim, ni, lanes, max_rows, qk_norm;
    float eps;
    float *xs[2];      /* the residual stream, ping-pong [max_rows, dim] */
    float *hn;         /* a matmul's normed input [max_rows, dim] */
    float *qkv;        /* [max_rows, q + 2 kv] */
    float *qb;         /* rotated Q [max_rows, nh, hd] */
    float *k_all, *v_all; /* every layer's new K (rotated) and V [layers, max_rows, nkv, hd] */
    float *attn, *o, *down; /* [max_rows, q], [max_rows, dim], [max_rows, dim] */
    float *qsrc, *ksrc, *qn, *kn; /* Qwen3's QK-norm inputs and outputs */
    float *gu;         /* [max_rows, 2 ni] */
} chain_bufs_t;

/* One forward (ChainStep): the packed new rows, RoPE tables, attention's batch description */
typedef struct {
    const float *x;              /* [t, dim] embedded new tokens */
    const float *cos, *sin;      /* [t, rd] */
    const int64_t *slots;        /* [B, max_ctx] context slots, or NULL */
    const int32_t *meta;         /* [B, 3] (ctx, start, n) */
    const float *mask;           /* [B, max_new, L] additive, or NULL (causal) */
    int32_t t, rd, max_ctx, max_new, B, kv_half, num_layers, threads;
} chain_step_t;

/* Runs layers [0, num_layers): the stream after them is xs[returned index] + down (rows [0, t)). */
int ratchet_chain(const chain_bufs_t *c, const chain_layer_t *layers, const chain_step_t *s) {
    const int t = s->t, nt = s->threads, nh = c->nh, nkv = c->nkv, hd = c->hd, dim = c->dim;
    const int64_t qs = (int64_t)nh * hd, kvs = (int64_t)nkv * hd, width = qs + 2 * kvs;
    const int64_t kv_layer = (int64_t)c->max_rows * kvs; /* floats from one layer's K (V) rows to the next's */
    const float *x = s->x, *h = NULL;
    int nxt = 0;
    for (int i = 0; i < s->num_layers; i++) {
        const chain_layer_t *ly = &layers[i];
        float *k = c->k_all + i * kv_layer, *v = c->v_all + i * kv_layer;
        if (h != NULL) { /* the previous layer's last residual add, fused into this norm */
            ratchet_rms_norm(x, h, c->xs[nxt], ly->w_in, t, dim, c->eps, c->lanes, c->hn, nt);
            x = c->xs[nxt];
            nxt ^= 1;
        } else {
            ratchet_rms_norm(x, NULL, NULL, ly->w_in, t, dim, c->eps, c->lanes, c->hn, nt);
        }
        ratchet_mm_q8w(c->hn, t, ly->qkv, c->qkv, nt);
        if (ly->qkv_bias != NULL) /* Qwen2: Linear.forward's y + bias, one rounding */
            for (int r = 0; r < t; r++)
                for (int64_t j = 0; j < width; j++) c->qkv[r * width + j] += ly->qkv_bias[j];
        if (c->qk_norm) { /* Qwen3: norm each head of Q and of K (contiguous heads), then rotate each */
            const float *qsrc = c->qkv, *ksrc = c->qkv + qs;
            if (t > 1) {
                for (int r = 0; r < t; r++) {
                    memcpy(c->qsrc + r * qs, c->qkv + r * width, sizeof(float) * qs);
                    memcpy(c->ksrc + r * kvs, c->qkv + r * width + qs, sizeof(float) * kvs);
                }
                qsrc = c->qsrc;
                ksrc = c->ksrc;
            }
            ratchet_rms_norm(qsrc, NULL, NULL, ly->q_norm, (int64_t)t * nh, hd, ly->q_eps, c->lanes, c->qn, nt);
            ratchet_rms_norm(ksrc, NULL, NULL, ly->k_norm, (int64_t)t * nkv, hd, ly->k_eps, c->lanes, c->kn, nt);
            ratchet_rope(c->qn, t, nh, hd, qs, s->cos, s->sin, s->rd, c->qb);
            ratchet_rope(c->kn, t, nkv, hd, kvs, s->cos, s->sin, s->rd, k);
        } else { /* Q and K heads of the fused output, each head on its own */
            ratchet_rope(c->qkv, t, nh, hd, width, s->cos, s->sin, s->rd, c->qb);
            ratchet_rope(c->qkv + qs, t, nkv, hd, width, s->cos, s->sin, s->rd, k);
        }
        for (int r = 0; r < t; r++) memcpy(v + r * kvs, c->qkv + r * width + qs + kvs, sizeof(float) * kvs);
        const int ctx = s->slots != NULL && ly->kc != NULL;
        ratchet_attention(c->qb, k, v, ctx ? ly->kc : NULL, ctx ? ly->vc : NULL, ctx ? s->slots : NULL, s->max_ctx,
                          s->meta, s->max_new, s->mask, s->B, nh, nkv, hd, ly->scale, ly->softcap, s->kv_half,
                          c->attn, nt);
        ratchet_mm_q8w(c->attn, t, ly->o, c->o, nt);
        ratchet_rms_norm(x, c->o, c->xs[nxt], ly->w_post, t, dim, c->eps, c->lanes, c->hn, nt);
        x = c->xs[nxt];
        nxt ^= 1;
        ratchet_mm_q8w(c->hn, t, ly->gu, c->gu, nt);
        ratchet_mm_q8w_swiglu(c->gu, t, ly->down, c->down, nt); /* silu(g) * u as the down input is quantized */
        h = c->down;
    }
    return nxt ^ 1;
}
