/* The int8 / int16 panel kernel for bytes (Q8_0, and any panel whose values need 8 bits):
 * one translation unit per stored-value width, compiled in parallel (matmul_int8_panel.h). */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32_unit, 32, 8, 1, 1, 0) /* Q8_0 */
PANEL_KINDS(g32, 32, 8, 0, 0, 0)
PANEL_KINDS(g16, 16, 8, 0, 0, 0)

void ratchet_panel_vb8(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (G == 32 && unit)
        g32_unit(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else if (G == 32)
        g32(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g16(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
