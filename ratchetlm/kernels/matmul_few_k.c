/* The few-token fp32 matmul of the float rows and the K-quants (matmul_few.h): a unit of its own,
 * compiled in parallel with matmul_few_blocks.c and the rest. */
#include "matmul_few.h"

#if defined(FEW_RF)
FEW_KERNEL(f32, 32, 128, none_t, _MM_HINT_T1)
FEW_KERNEL(f16, 32, 64, none_t, _MM_HINT_T1)
FEW_KERNEL(bf16, 32, 64, none_t, _MM_HINT_T1)
FEW_KERNEL(q4_k, 256, 144, kstate_t, _MM_HINT_T0)
FEW_KERNEL(q5_k, 256, 176, kstate_t, _MM_HINT_T0)
FEW_KERNEL(q6_k, 256, 210, kstate_t, _MM_HINT_T0)
#endif
