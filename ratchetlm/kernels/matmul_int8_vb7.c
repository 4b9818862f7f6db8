/* The int8 / int16 panel kernel for 5- and 6-bit panels unpacked to bytes (vb 7: values < 64 in the
 * layout of vb 8; unpack_panel in matmul_int8.c makes them once per panel for a call of several
 * tiles): the kernels of matmul_int8_vb5.c / _vb6.c without the unpacking (the same integer sums and
 * the same float steps, so the same bits), one translation unit of its own (matmul_int8_panel.h). */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32_unit, 32, 7, 1, 1, 1) /* Q5_0; Q5_1 */
PANEL_KINDS(g32, 32, 7, 0, 0, 1)      /* Q5_K */
PANEL_KINDS(g16, 16, 7, 0, 1, 0)      /* Q6_K */

void ratchet_panel_vb7(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int b16, int has_m,
                       int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (G == 32 && unit)
        g32_unit(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else if (G == 32)
        g32(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g16(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
