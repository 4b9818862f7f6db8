"""Plain decoding: every known-but-uncached token is fed, the last one's logits pick the next.

Grammar-forced tokens (jump-forward): where a request's grammar admits only one continuation,
those tokens ride behind the root as tentative tokens and are verified and committed in the same
forward as the model's next token (decoding/tentative.py) — the same output as one token per
forward, in fewer forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, register
from ratchetlm.decoding.tentative import chain, chain_limit, chain_proposal, forced_chain, observe_forced, verify_tree
from ratchetlm.layers.sampler import filtered_probs, sample, target_logits, top_logprobs
from ratchetlm.layers.seeded_draw import inverse_cdf, position_uniform
from ratchetlm.sequence import Sequence


def catch_up_proposal(seq: Sequence, budget: int) -> Proposal:
    """Feed up to ``budget`` committed-but-uncached tokens (prefill, chunked prefill, the last
    sampled token). Their K/V are final, so they are written directly. Logits are requested for
    the last row when it reaches the end of the known tokens, and for every prompt row when the
    request asked for prompt logprobs."""
    start = seq.num_cached
    pending = len(seq.token_ids) - start
    assert pending > 0 and budget > 0
    n = min(budget, pending)
    rows: list[int] = []
    if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
        rows = list(range(min(n, seq.num_prompt_tokens - start)))
    if n == pending and (not rows or rows[-1] != n - 1):
        rows.append(n - 1)
    return Proposal(
        token_ids=seq.token_ids[start : start + n],
        positions=list(range(start, start + n)),
        logit_rows=rows,
        direct_write=True,
    )


def catch_up_commit(seq: Sequence, prop: Proposal, logits: torch.Tensor, sample_next: bool = True,
                    greedy: int | None = None) -> Commit:
    """Commit every fed row; sample the next token if the proposal reached the end (and
    ``sample_next``: WeDLM's prefill produces no token, its first window forward does). ``greedy``:
    the last row's ``argmax`` where already known (a greedy request without logits controls or
    logprobs then takes it as its token, without reducing the row again)."""
    n = len(prop.token_ids)
    start = prop.positions[0]
    reached_end = sample_next and start + n == len(seq.token_ids)
    prompt_lp = None
    k_prompt = seq.params.prompt_logprobs
    if k_prompt is not None and start < seq.num_prompt_tokens:
        # logits row i predicts token at position start + i + 1 (if it is a prompt token)
        m = min(n, seq.num_prompt_tokens - start)
        nxt = [start + i + 1 for i in range(m) if start + i + 1 < seq.num_prompt_tokens]
        targets = torch.tensor([seq.token_ids[p] for p in nxt], dtype=torch.long)
        prompt_lp = ([None] if start == 0 else []) + list(top_logprobs(logits[: len(nxt)], targets, k_prompt))
    tokens: list[int] = []
    lps = None
    if reached_end and greedy is not None and seq.params.greedy and seq.controls is None \
            and seq.params.logprobs is None:
        tokens = [greedy]
    elif reached_end:
        last = logits[-1:]
        x = target_logits(last, seq.controls)
        if seq.params.seed is not None and not seq.params.greedy:  # keyed by position: layers/seeded_draw.py
            u = position_uniform(seq.params.seed, len(seq.token_ids))
            tok = torch.tensor([inverse_cdf(filtered_probs(x, seq.params)[0], u)])
        else:
            tok = sample(x, seq.params, seq.generator)
        tokens = [int(tok[0])]
        if seq.params.logprobs is not None:
            lps = top_logprobs(last, tok, seq.params.logprobs)
    return Commit(kv_rows=list(range(n)), token_ids=tokens, logprobs=lps, prompt_logprobs=prompt_lp)


def room(seq: Sequence, max_model_len: int) -> int:
    """Tokens the sequence may still append."""
    return min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids))


@dataclass(frozen=True)
class ForcedState:
    tokens: list[int]  # the grammar-forced tokens proposed after the root


@register("autoregressive")
class Autoregressive(DecodeStrategy):
    def tokens_wanted(self, seq: Sequence) -> int:
        pending = len(seq.token_ids) - seq.num_cached
        if pending == 1 and seq.controls is not None:
            return 1 + len(forced_chain(seq, 1 << 30, room(seq, self.ctx.max_model_len), chain_limit(self.ctx.runner)))
        return pending

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        out = []
        for s, b in zip(seqs, budgets, strict=True):
            forced = forced_chain(s, b, room(s, self.ctx.max_model_len), chain_limit(self.ctx.runner))
            out.append(chain_proposal(s, forced, ForcedState(forced)) if forced else catch_up_proposal(s, b))
        return out

    def commit(self, seqs: list[Sequence], proposals: list[Proposal], logits: list[torch.Tensor]) -> list[Commit]:
        out = []
        for s, p, lg in zip(seqs, proposals, logits, strict=True):
            if isinstance(p.state, ForcedState):
                c, path = verify_tree(s, chain(p.state.tokens), lg, room(s, self.ctx.max_model_len))
                observe_forced(s, len(p.state.tokens), len(path))
                out.append(c)
            else:
                out.append(catch_up_commit(s, p, lg))
        return out
