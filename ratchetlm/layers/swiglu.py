"""SwiGLU's ``silu(gate) * up`` in the integer numerics modes: one C kernel (``ratchet_silu_mul``,
kernels/chain.c) whose element function (kernels/silu.h) the decode chain computes inside the down
projection's activation quantization, so the layer-by-layer path and the chain give the same bits
(batch invariance holds whichever path a forward takes).

Why not torch's SiLU there: its bits come from the exp of torch's own vectorised CPU kernel (Sleef),
which this C cannot reproduce; the C kernel's exp is plain IEEE arithmetic (~1 ulp), the same bits
vectorised or not. The exact mode keeps torch's ops (HF-identical)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers.block_quant import usable


def silu_mul(gu: torch.Tensor) -> torch.Tensor:  # [rows, 2 * ffn] fused gate/up -> [rows, ffn]
    lib = kernels.load()
    if lib is None or not usable(gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up
    gu = gu.contiguous()
    rows, ni = gu.shape[0], gu.shape[1] // 2
    assert gu.shape[1] == 2 * ni, gu.shape
    act = torch.empty(rows, ni, dtype=torch.float32)
    lib.ratchet_silu_mul(gu.data_ptr(), rows, ni, act.data_ptr(), torch.get_num_threads())
    return act
