/* SwiGLU's silu(g) * u in the integer numerics modes, shared by chain.c (ratchet_silu_mul) and
 * matmul_int8.c (the down projection's activations computed as they are quantized): one definition,
 * plain IEEE operations (no libm; the library is built with -ffp-contract=off), so every caller,
 * vectorised or not, gives an element the same bits. */
#ifndef RATCHET_SILU_H
#define RATCHET_SILU_H
#include <stdint.h>
#include <string.h>

/* exp(x): x = n ln2 + r (n = x log2(e) rounded to nearest even by the 1.5 * 2^23 trick, r by
 * Cody-Waite in two parts), 2^n times Cephes' degree-6 polynomial in r (~1 ulp). Clamped to
 * [-87.3, 88], where 2^n stays a normal float (silu's x / (1 + exp(-x)) is x there, or within
 * 1e-36 of 0). */
static inline float exp_ieee(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.3f ? -87.3f : x;
    const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, ties to even */
    const float n = (x * 1.44269504088896341f + big) - big;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float silu_mul1(float g, float u) { return (g / (1.0f + exp_ieee(-g))) * u; }

#endif
