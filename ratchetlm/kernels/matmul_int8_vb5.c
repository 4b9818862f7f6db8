/* The int8 / int16 panel kernel for 5-bit values, nibbles and a plane of bit 4 (Q5_0, Q5_1, Q5_K):
 * one translation unit per stored-value width, compiled in parallel (matmul_int8_panel.h). */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32_unit, 32, 5, 1, 1, 1) /* Q5_0; Q5_1 */
PANEL_KINDS(g32, 32, 5, 0, 0, 1)      /* Q5_K */

void ratchet_panel_vb5(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (G == 32 && unit)
        g32_unit(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g32(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
