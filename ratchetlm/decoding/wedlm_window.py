"""WeDLM's sliding mask window and entropy sampler, as pure functions over token lists.

These are the algorithm; :mod:`ratchetlm.decoding.wedlm` runs them on the paged engine and
:mod:`ratchetlm.decoding.wedlm_reference` runs them with no KV cache at all (the oracle).

Window invariants (seed 000): the window follows the committed prefix of length ``L``; slot
``k`` sits at absolute position ``L + k``. A slot is either a ``[MASK]`` or *filled* with a
predicted token. The leading filled slots are committed by the next forward, because the
topological order feeds filled slots first so they attend exactly to what an AR forward would
(the prefix and the filled slots before them), never to a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.decoding.base import config_from_options
from ratchetlm.layers.sampler import sample, top_logprobs


@dataclass(frozen=True)
class WeDLMConfig:
    """``wedlm={...}`` options. ``entropy_threshold=None`` fills one mask per step (argmin)."""

    window_size: int = 16
    entropy_threshold: float | None = 0.4  # τ, nats
    position_penalty: float = 0.02  # λ, added per window slot of distance from the first mask
    mask_token_id: int | None = None  # overrides the model's declared mask token

    def __post_init__(self) -> None:
        if not isinstance(self.window_size, int) or self.window_size <= 0:
            raise ValueError(f"wedlm window_size must be a positive integer, got {self.window_size!r}")
        if self.entropy_threshold is not None and not self.entropy_threshold > 0:
            raise ValueError(f"wedlm entropy_threshold must be > 0 or None, got {self.entropy_threshold!r}")
        if not self.position_penalty >= 0:
            raise ValueError(f"wedlm position_penalty must be >= 0, got {self.position_penalty!r}")
        if self.mask_token_id is not None and (not isinstance(self.mask_token_id, int) or self.mask_token_id < 0):
            raise ValueError(f"wedlm mask_token_id must be a non-negative integer, got {self.mask_token_id!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> WeDLMConfig:
        return config_from_options(cls, options, "wedlm")


@dataclass
class Window:
    """One sequence's window: ``tokens[k]`` is the mask id where ``is_mask[k]``."""

    tokens: list[int]
    is_mask: list[bool]
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # per slot, set when filled

    def __len__(self) -> int:
        return len(self.tokens)

    def leading_filled(self) -> int:
        """How many slots at the front are filled (= what the next forward commits)."""
        for k, m in enumerate(self.is_mask):
            if m:
                return k
        return len(self.tokens)

    def order(self) -> list[int]:
        """Topological input order: filled slots first, then masks, each in window order."""
        filled = [k for k, m in enumerate(self.is_mask) if not m]
        return filled + [k for k, m in enumerate(self.is_mask) if m]

    def drop_front(self, n: int) -> None:
        del self.tokens[:n], self.is_mask[:n], self.logprobs[:n]


def new_window(mask_id: int, window_size: int, room: int) -> Window:
    """After prefill: ``min(window_size, room)`` masks, ``room`` = positions left before ``max_model_len``."""
    n = max(0, min(window_size, room))
    return Window([mask_id] * n, [True] * n, [None] * n)


def refill(w: Window, mask_id: int, room: int) -> int:
    """Append one mask per leading filled slot, capped by the *current* budget ``room`` (positions
    left after the window; recomputed every step, never a stale copy). Returns the count added."""
    n = max(0, min(w.leading_filled(), room))
    w.tokens += [mask_id] * n
    w.is_mask += [True] * n
    w.logprobs += [None] * n
    return n


def entropy(logits: torch.Tensor) -> torch.Tensor:  # [m, V] -> [m] nats, of the raw (unfiltered) logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    plogp = logp.exp() * logp
    return -plogp.masked_fill(torch.isneginf(logp), 0.0).sum(-1)  # a banned token (-inf) adds 0, not NaN


def select_fills(
    logits: torch.Tensor,  # [m, V] one row per remaining mask, in window order
    slots: list[int],  # [m] their window indices (ascending)
    threshold: float | None,
    penalty: float,
) -> list[int]:
    """Indices into ``slots`` to fill: every mask whose distance-adjusted entropy
    ``H + λ·(slot − slot_first)`` is under τ, else the single argmin. Never empty when m > 0."""
    assert logits.shape[0] == len(slots) > 0
    dist = torch.tensor([s - slots[0] for s in slots], dtype=torch.float32)
    adjusted = entropy(logits) + penalty * dist
    if threshold is not None:
        under = (adjusted < threshold).nonzero().flatten().tolist()
        if under:
            return under
    return [int(adjusted.argmin())]


def commit_length(tokens: list[int], stop_ids: set[int], room_tokens: int) -> int:
    """How many of ``tokens`` (the leading filled slots) to commit: at most ``room_tokens``
    (``max_tokens``/``max_model_len``), and through the first stop token inclusive."""
    n = min(len(tokens), room_tokens)
    for j in range(n):
        if tokens[j] in stop_ids:
            return j + 1
    return n


# (rows [m, V] raw logits, their window slots [m]) -> [m, V] the logits to sample from: a request's
# logits controls, each row judged as the position after the committed tokens and every window
# slot before it (as the window holds them when it is called)
Judge = Callable[[torch.Tensor, list[int]], torch.Tensor]


def fill(
    w: Window,
    slots: list[int],  # [m] window indices of the masks the forward predicted, ascending
    logits: torch.Tensor,  # [m, V] their raw logits (the distribution of the token *at* the slot)
    cfg: WeDLMConfig,
    params: Any,  # SamplingParams
    generator: torch.Generator | None,
    judge: Judge | None = None,
    in_order: bool = False,
) -> int:
    """Choose which masks to fill and with what; fill them in place. Returns the fill count.

    Tokens are drawn for every mask (greedy argmax at temperature 0, else the request's
    temperature/top-k/top-p/min-p sampler) and only the selected slots keep theirs, so the RNG
    stream does not depend on the selection (in order: one draw per mask filled). ``judge`` (the
    request's logits controls) shapes the distributions the entropies and draws come from;
    logprobs stay the model's own.

    ``in_order``: the controls read the tokens before a slot, not just their count (penalties,
    a bad word of several tokens, a grammar), so a slot may be filled only once every slot before
    it is: the masks are judged one by one from the first, each after the fills before it, and the
    fills are the first mask plus the run of masks after it whose adjusted entropy is under τ."""
    if not slots:
        return 0
    if in_order:
        return _fill_in_order(w, slots, logits, cfg, params, generator, judge)
    x = judge(logits, slots) if judge is not None else logits
    chosen = select_fills(x, slots, cfg.entropy_threshold, cfg.position_penalty)
    toks = sample(x, params, generator)  # [m]
    for c in chosen:
        _put(w, slots[c], int(toks[c]), logits[c], params)
    return len(chosen)


def _fill_in_order(w: Window, slots: list[int], logits: torch.Tensor, cfg: WeDLMConfig, params: Any,
                   generator: torch.Generator | None, judge: Judge | None) -> int:
    assert not any(w.is_mask[:slots[0]]), "in-order filling: the first mask predicted is the window's first"
    n = 0
    for j, k in enumerate(slots):
        if any(w.is_mask[:k]):  # a mask before it stays unfilled: so do all later ones
            break
        x = judge(logits[j : j + 1], [k]) if judge is not None else logits[j : j + 1]  # [1, V]
        if j > 0:  # the first mask is always filled (at least one per step)
            adjusted = float(entropy(x)[0]) + cfg.position_penalty * (k - slots[0])
            if cfg.entropy_threshold is None or not adjusted < cfg.entropy_threshold:
                break
        _put(w, k, int(sample(x, params, generator)[0]), logits[j], params)
        n += 1
    return n


def _put(w: Window, k: int, token: int, raw: torch.Tensor, params: Any) -> None:
    assert w.is_mask[k]
    w.tokens[k] = token
    w.is_mask[k] = False
    if params.logprobs is not None:
        w.logprobs[k] = top_logprobs(raw[None], torch.tensor([token]), params.logprobs)[0]
