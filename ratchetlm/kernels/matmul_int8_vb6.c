/* The int8 / int16 panel kernel for 6-bit values, nibbles and a plane of bits 4-5 (Q6_K):
 * one translation unit per stored-value width, compiled in parallel (matmul_int8_panel.h). */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32, 32, 6, 0, 0, 0)
PANEL_KINDS(g16, 16, 6, 0, 1, 0) /* Q6_K */

void ratchet_panel_vb6(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (G == 32)
        g32(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g16(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
