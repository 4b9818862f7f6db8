"""Token sampling: a request's logits controls, then temperature, top-k, top-p, min-p; greedy at
temperature 0.

This is the one place where a request's logits become its target distribution:
``target_logits`` applies the request's :class:`~ratchetlm.layers.logits_processors.LogitsControls`
(penalties, bias, bans, grammar mask) to any rows of its logits, and ``filtered_probs`` turns
those into probabilities. Every strategy samples, and speculative rejection sampling tests
drafts, against exactly this.
"""

from __future__ import annotations

from typing import Any

import torch

from ratchetlm import kernels
from ratchetlm.sampling_params import SamplingParams


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[..., vocab]`` -> ``[...]`` int64: ``logits.argmax(dim=-1)``, the same indices (first of the
    maximum; a row's first NaN where it has one). CPU fp32 rows go through kernels/argmax.c: torch's
    CPU argmax of one 49k-logit row takes ~50 us, as long as a decoder layer of the 135M model."""
    lib = kernels.load() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.numel() == 0 or logits.dim() == 0:
        return logits.argmax(dim=-1)
    rows = logits.reshape(-1, logits.shape[-1])  # a view where the rows are evenly strided
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    lib.ratchet_argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
    return out.view(logits.shape[:-1])


def target_logits(logits: torch.Tensor, controls: Any, paths: list[list[int]] | None = None) -> torch.Tensor:
    """``[n, vocab]`` raw logits of one request -> the logits it samples from. ``controls``: the
    request's ``LogitsControls`` (None: unchanged); ``paths[i]``: tentative tokens between the
    committed sequence and row ``i`` (a draft node's path; default none)."""
    return logits if controls is None else controls.process(logits, paths)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[n, vocab]`` fp32 logits → ``[n, vocab]`` probabilities after all filters (temperature > 0).

    Safe for every valid parameter value and any finite logits: the row maximum is subtracted
    *before* dividing by the temperature, so a tiny temperature sends the other logits to -inf
    (the greedy limit: all mass on the top token(s)) instead of overflowing to inf - inf = NaN,
    and every filter keeps the top token, so a row never sums to zero.
    """
    assert p.temperature > 0
    x = logits.float()
    shifted = x - x.max(dim=-1, keepdim=True).values  # [n, vocab], <= 0, == 0 at the top token(s)
    # The division runs in fp32: a temperature below its range rounds to 0 (0/0 at the top would be
    # NaN), one above it to inf (-inf/inf where a logit gap overflowed): keep the top at 0, cap t.
    t = min(p.temperature, torch.finfo(torch.float32).max)
    x = torch.where(shifted == 0, 0.0, shifted / t)
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the top token is always kept, even
        # when top_p is below fp32's smallest value (the comparison would then drop everything)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        drop[..., 0] = False
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
        return argmax(logits)
    return sample_from_probs(filtered_probs(logits, p), generator)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Model logprobs (raw distribution) of ``tokens`` plus the top-``k`` alternatives, per row, as
    :class:`~ratchetlm.outputs.Logprob` floats carrying their rank (1 + tokens strictly more likely)."""
    from ratchetlm.outputs import Logprob

    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, tokens.view(-1, 1).to(lp.device))  # [rows, 1]
    ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
    out: list[dict[int, float]] = []
    top = torch.topk(lp, k, dim=-1) if k > 0 else None
    for i, t in enumerate(tokens.tolist()):
        d: dict[int, float] = {int(t): Logprob(float(picked[i, 0]), ranks[i])}
        if top is not None:
            for r, (v, j) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True)):
                d.setdefault(int(j), Logprob(v, r + 1))
        out.append(d)
    return out
