/* The int8 / int16 panel kernel for 4-bit values, two a byte (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K):
 * one translation unit per stored-value width, compiled in parallel (matmul_int8_panel.h). */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32_unit, 32, 4, 1, 1, 1) /* Q4_0; Q4_1 */
PANEL_KINDS(g32, 32, 4, 0, 0, 1)      /* Q4_K */
PANEL_KINDS(g16, 16, 4, 0, 1, 1)      /* Q3_K; Q2_K */

void ratchet_panel_vb4(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (G == 32 && unit)
        g32_unit(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else if (G == 32)
        g32(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g16(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
