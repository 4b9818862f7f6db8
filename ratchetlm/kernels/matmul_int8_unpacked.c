/* The int8 / int16 panel kernels for 5- and 6-bit panels unpacked to bytes (vb 13 / 14: values < 32 / 64 in
 * the layout of vb 8; unpack_panel in matmul_int8.c makes them once per block of panels for a call of several
 * tiles): the kernels of matmul_int8_vb5.c / _vb6.c without the unpacking (the same integer sums and the
 * same float steps, so the same bits), one translation unit of their own (matmul_int8_panel.h). (On AVX2,
 * adding four vectors' vpmaddubsw sums of the 5-bit values in int16 before one vpmaddwd, exact at 4 * 7874,
 * measured 1.06-1.13x the time of two at a time, and one half of the rows at a time (4 chains live instead of 8)
 * 1.01-1.13x, 2048 x 8192, 512 rows, one thread: neither kept.) */
#define RATCHET_PANEL_UNIT
#include "matmul_int8_panel.h"

PANEL_KINDS(g32_unit5, 32, 13, 1, 2, 2) /* Q5_0; Q5_1 */
PANEL_KINDS(g32_5, 32, 13, 0, 0, 2)     /* Q5_K */
PANEL_KINDS(g32_6, 32, 14, 0, 0, 0)
PANEL_KINDS(g16_6, 16, 14, 0, 2, 0)     /* Q6_K */

void ratchet_panel_unpacked(const uint8_t *Q, const uint8_t *SM, int z, const xtile_t *xs, int K, int G, int vb,
                            int b16, int has_m, int unit, int SB, float *y, int N, int nvalid, int tt) {
    if (vb == 13 && unit)
        g32_unit5(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else if (vb == 13)
        g32_5(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else if (G == 32)
        g32_6(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
    else
        g16_6(Q, SM, z, xs, K, b16, has_m, SB, y, N, nvalid, tt);
}
