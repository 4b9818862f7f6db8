"""Seeded sampling keyed by position: the draw of a seeded request's token ``n`` is a function of
``(seed, n)`` alone.

A per-request ``torch.Generator`` consumed in order makes a token depend on how many draws came
before it, and a speculative step consumes a number that depends on its drafts (one uniform per
tried draft, then a residual draw): whatever changes the drafts — the scheduler's prompt chunking
(timed: the step-time budget), the batch (rounding), a draft length — changes every later token.
Here token ``n`` of a seeded request is ``inverse_cdf(p_n, u(seed, n))``: plain decoding samples
that, and speculative verification accepts a draft exactly when it *is* that token (the
"sample, then match" rule, verify.py's ``match_rule``). Each token is then drawn from its target
distribution exactly (``u`` uniform, a fresh one per position), the output does not depend on the
drafts, the chunking or the batch, and speculative sampling equals plain sampling token for token
(up to the rounding of ``p_n`` itself, which only moves a token when ``u`` lies within that
rounding of a CDF boundary).

``u`` is 53 bits of splitmix64 over ``(seed, n)``, not a ``torch.Generator`` per position: a CPU
generator keeps only 32 bits of its seed, so positions of one long request would share streams.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_uniform(seed: int, index: int) -> float:
    """The uniform in ``[0, 1)`` of token ``index`` (its position in the sequence) of a request
    seeded ``seed``: independent across positions and seeds (two splitmix64 rounds)."""
    return (_splitmix64(_splitmix64(seed & _MASK) ^ index) >> 11) * 2.0**-53


def position_uniforms(seed: int, start: int, n: int) -> list[float]:
    """The uniforms of tokens ``start .. start + n - 1`` of a request seeded ``seed``."""
    return [position_uniform(seed, start + i) for i in range(n)]


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """probs: ``[vocab]`` (any scale, >= 0, some mass) -> the token whose CDF interval holds ``u``:
    token ``x`` with probability ``probs[x] / sum`` for ``u`` uniform. Never a zero-mass token."""
    p = probs.double()
    cdf = torch.cumsum(p, 0)  # [vocab]
    tok = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    if tok >= p.shape[0] or float(p[tok]) <= 0.0:  # u * total rounded onto the last boundary
        tok = int(p.nonzero()[-1])
    return tok
