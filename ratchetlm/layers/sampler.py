"""Token sampling: temperature, top-k, top-p, min-p; greedy at temperature 0.

``filtered_probs`` is the *target distribution* of a request — speculative rejection
sampling must test drafts against exactly this, so it lives in one place.
"""

from __future__ import annotations

import torch

from ratchetlm.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[n, vocab]`` fp32 logits → ``[n, vocab]`` probabilities after all filters (temperature > 0)."""
    assert p.temperature > 0
    x = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``[n, vocab]`` → ``[n]`` one draw per row (uses the request's generator when seeded)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """``[n, vocab]`` logits of one request → ``[n]`` token ids."""
    if p.greedy:
        return logits.argmax(dim=-1)
    return sample_from_probs(filtered_probs(logits, p), generator)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Model logprobs (raw distribution) of ``tokens`` plus the top-``k`` alternatives, per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    top = torch.topk(lp, k, dim=-1) if k > 0 else None
    for i, t in enumerate(tokens.tolist()):
        d = {int(t): float(lp[i, t])}
        if top is not None:
            for v, j in zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True):
                d.setdefault(int(j), float(v))
        out.append(d)
    return out
