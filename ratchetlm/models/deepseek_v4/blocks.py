"""Position-independent V4 building blocks: RMS norms, mHC hyper-connections, MoE.

Parameter names mirror HF's ``DeepseekV4*`` modules so an HF state dict loads as is.
None of these touch the KV cache, so the unpaged reference and the paged decode path
share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm.models.deepseek_v4.config import DeepseekV4Config


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm computed in float32, returned in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class HyperConnection(nn.Module):
    """mHC: mixes ``hc_mult`` residual streams into one block input and back out.

    ``pre`` collapses the streams, ``post`` scales the block output into each stream and
    ``comb`` (Sinkhorn-projected towards doubly stochastic) mixes the old streams.
    """

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: ``[*lead, hc, hidden]`` -> (post ``[*lead, hc]``, comb ``[*lead, hc, hc]``,
        collapsed block input ``[*lead, hidden]``)."""
        hc = self.hc
        mixes = F.linear(rms_normalize(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * s_comb + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
               streams: torch.Tensor) -> torch.Tensor:
        """new_stream[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final stream collapse before the output norm (sigmoid weights, no Sinkhorn)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: ``[*lead, hc, hidden]`` -> ``[*lead, hidden]``."""
        mixes = F.linear(rms_normalize(streams.flatten(-2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


ROWWISE_MAX = 64  # tokens per MoE call up to which experts see every row (batch-composition invariant)


class Experts(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; expert_ids, weights: ``[num_tokens, top_k]``.

        Decode-size calls (at most ``ROWWISE_MAX`` tokens) run every picked expert over all the
        call's rows and keep the rows that picked it, so a token's output depends on the call's
        row count only, never on which other tokens picked the same expert (a GEMM's bits change
        with its row count): a verify step's committed row is then bit-identical to the same row
        decoded beside a placeholder. At decode sizes the weights' reads dominate, which is the
        same either way. Larger calls (prefill) group rows by expert."""
        out = torch.zeros_like(x)
        dense = x.shape[0] <= ROWWISE_MAX
        for e in expert_ids.unique().tolist():
            tok, slot = torch.where(expert_ids == e)
            y = self._expert(x, e)[tok] if dense else self._expert(x[tok], e)
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(_clamped_swiglu(gate, up, self.limit), self.down_proj[e])


class Router(nn.Module):
    """Top-k router (learned selection with a bias) or hash router (``tid2eid`` selection).

    Either way the selected experts are weighted by the normalised learned scores.
    """

    tid2eid: torch.Tensor  # [vocab, k] buffer (hash routing only)
    e_score_correction_bias: torch.Tensor  # [num_experts] buffer (top-k routing only)

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k = hashed, cfg.experts_per_token
        self.scoring, self.scale = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.experts_per_token, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: ``[num_tokens, hidden]``, token_ids: ``[num_tokens]`` -> (expert ids, weights) ``[num_tokens, k]``."""
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            ids = self.tid2eid[token_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(cfg, hashed=cfg.mlp_layer_types[layer] == "hash_moe")
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: ``[*lead, hidden]``, token_ids: ``lead`` -> ``[*lead, hidden]``."""
        flat = x.reshape(-1, x.shape[-1])
        ids, w = self.gate(flat, token_ids.reshape(-1))
        return self.experts(flat, ids, w).view_as(x) + self.shared_experts(x)
