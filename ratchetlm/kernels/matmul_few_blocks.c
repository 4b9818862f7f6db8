/* The few-token fp32 matmul of the 32-weight block formats (matmul_few.h): a unit of its own, compiled
 * in parallel with matmul_few_k.c and the rest. */
#include "matmul_few.h"

#if defined(FEW_RF)
FEW_KERNEL(q4_0, 32, 18, tab_t, _MM_HINT_T0)
FEW_KERNEL(q4_1, 32, 20, tab_t, _MM_HINT_T0)
FEW_KERNEL(q5_0, 32, 22, tab_t, _MM_HINT_T0)
FEW_KERNEL(q5_1, 32, 24, tab_t, _MM_HINT_T0)
FEW_KERNEL(q8_0, 32, 34, tab_t, _MM_HINT_T1)
#endif
