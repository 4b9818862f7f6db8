"""A separate draft model (any local model with the target's tokenizer) on its own paged KV cache.

The draft is loaded with the engine's loader (GGUF file or HF folder) in the target's dtype
and device, and gets its own :class:`~ratchetlm.kv.cache.KVCache` + :class:`BlockManager`
with the target's block size. Per sequence, ``seq.strategy_state`` holds a
:class:`DraftSeqState`: the draft block table and how many committed tokens have draft K/V.

Each step, for each decoding sequence (its committed tokens are ``token_ids``; the last one,
the *root*, has no target K/V yet):

1. *catch-up* forward: the committed tokens the draft cache lacks plus the root, causal,
   writing K/V straight to the draft cache for every token but the root (so the draft cache
   mirrors the target's committed KV: only committed tokens ever land in it); the root's
   logits give the first draft token;
2. C - 1 *write-free* forwards (greedy chain, or beam search of width M) that re-feed the
   root and the current beams packed as a prefix tree, exactly like the layer-skip self-draft.

Draft blocks are freed when the sequence finishes or is preempted (the strategy's hooks call
:meth:`DraftModelProposer.release`). If the draft cache has no room for a sequence, that
sequence gets no draft this step (a plain step) and gives its draft blocks back, so a full
draft cache never stalls or crashes decoding — it only costs speed.
"""

from __future__ import annotations

from typing import Any

import torch

from ratchetlm.decoding.speculative.beam_search import beam_search, tree_feed
from ratchetlm.decoding.speculative.draft_cache import DraftCache, DraftSeqState
from ratchetlm.decoding.speculative.draft_forward import draft_forward
from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer
from ratchetlm.kv.sink import DirectSink, NullSink
from ratchetlm.models.loader import ModelLoadError
from ratchetlm.models.registry import load_model
from ratchetlm.sequence import Sequence

_STATE = "spec_draft_model"  # strategy_state key


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    """Greedy chain (M == 1) or beam search of width M with a separate draft model."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        runner = ctx.runner
        dtype = runner.dtype
        try:
            loaded = load_model(cfg.draft_model, runner.device, dtype, progress=False)
        except ModelLoadError as e:
            raise ValueError(f"speculative draft_model: {e}") from e
        dc = loaded.config
        if dc.vocab_size != ctx.model_config.vocab_size:
            raise ValueError(
                f"speculative draft_model {cfg.draft_model!r} has vocab size {dc.vocab_size} but the target "
                f"has {ctx.model_config.vocab_size}: the draft must use the target's tokenizer")
        self.model = loaded.model
        self.model.set_context_len(ctx.max_model_len)  # RoPE tables grow on demand
        self.draft = DraftCache(_STATE, dc.num_layers, cfg.draft_kv_blocks or runner.blocks.num_blocks,
                                runner.blocks.block_size, dc.num_kv_heads, dc.head_dim, dtype, runner.device)
        self.cache = self.draft.cache
        self.num_forwards = 0

    def release(self, seq: Sequence) -> None:
        self.draft.release(seq)

    # ------------------------------------------------------------------ drafting

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        # the draft table covers the committed tokens but the root
        ready = [i for i, s in enumerate(seqs) if self.draft.reserve(s, len(s.token_ids) - 1)]
        rseqs = [seqs[i] for i in ready]
        states = [self.draft.state(s) for s in rseqs]

        def step(k: int, live: list[int], beams: list[torch.Tensor]) -> list[torch.Tensor]:
            self.num_forwards += 1
            if k == 0:  # every ready sequence drafts >= 1 token, so all are live
                return self._catch_up(rseqs, states)
            feeds = [tree_feed(rseqs[i].token_ids[-1], b) for i, b in zip(live, beams, strict=True)]
            return draft_forward(
                self.model, self.cache, [self.draft.slots(states[i], 0, states[i].num_cached) for i in live],
                [f.tokens for f in feeds],
                [[states[i].num_cached + o for o in f.offsets] for i, f in zip(live, feeds, strict=True)],
                [f.mask for f in feeds], [f.rows for f in feeds], NullSink())

        found = beam_search(step, [depths[i] for i in ready], self.cfg.num_candidates)
        out: list[DraftBeam | None] = [None] * len(seqs)
        for i, beam in zip(ready, found, strict=True):
            out[i] = beam
        return out

    def _catch_up(self, seqs: list[Sequence], states: list[DraftSeqState]) -> list[torch.Tensor]:
        """Feed each sequence's committed tokens the draft cache lacks plus the root; write all
        but the root. Returns each root's logits ``[1, V]``."""
        tokens, positions, ctx, writes = [], [], [], []
        for s, st in zip(seqs, states, strict=True):
            end = len(s.token_ids)
            tokens.append(s.token_ids[st.num_cached : end])
            positions.append(list(range(st.num_cached, end)))
            ctx.append(self.draft.slots(st, 0, st.num_cached))
            writes += [self.draft.slots(st, st.num_cached, end - 1), torch.full((1,), -1, dtype=torch.long)]
        slot_mapping = torch.cat(writes).to(self.cache.device)  # -1: the root is not committed KV
        out = draft_forward(self.model, self.cache, ctx, tokens, positions, [None] * len(seqs),
                            [[len(t) - 1] for t in tokens], DirectSink(self.cache, slot_mapping))
        for s, st in zip(seqs, states, strict=True):
            st.num_cached = len(s.token_ids) - 1
        return out

    def metrics(self) -> dict[str, float]:
        return {"spec_draft_forwards": self.num_forwards, **self.draft.metrics()}
