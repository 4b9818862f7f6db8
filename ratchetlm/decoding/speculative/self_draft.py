"""Layer-skip self-draft: the target's first N layers + final norm + head as the draft model.

Because the draft's layers *are* the target's first N layers, the target's committed K/V for
layers ``< N`` are exactly the draft's K/V for the committed tokens: the draft attends the
engine's own paged cache and needs no KV of its own. Draft forwards write nothing (a
:class:`~ratchetlm.kv.cache.NullSink`): attention only sees committed cache + the forward's
own tokens, so every draft step re-feeds the root and the current beams, packed as a prefix
tree (for a chain of depth C that is 1 + 2 + ... + C token rows over C forwards — cheap next
to the weight reads a CPU forward is bound by, and it avoids a draft-KV side cache).
Greedy chain for ``num_candidates == 1``, beam search of width M otherwise.
"""

from __future__ import annotations

import torch

from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer
from ratchetlm.decoding.speculative.tree_attention import pack, with_root
from ratchetlm.engine.sequence import Sequence
from ratchetlm.kv.cache import NullSink
from ratchetlm.layers.attention import build_attention_batch


@torch.inference_mode()
def draft_forward(
    runner: object,  # ModelRunner
    seqs: list[Sequence],
    tokens: list[list[int]],  # per seq [n_i] tokens fed on top of the committed cache
    offsets: list[list[int]],  # per seq [n_i] position offsets from num_cached
    masks: list[torch.Tensor],  # per seq [n_i, n_i] bool visibility
    rows: list[list[int]],  # per seq rows whose logits are wanted
    num_layers: int,
) -> list[torch.Tensor]:  # per seq [len(rows_i), vocab] fp32
    """A write-free forward through the first ``num_layers`` layers + norm + head."""
    dev = runner.device  # type: ignore[attr-defined]
    pos = [s.num_cached + o for s, off in zip(seqs, offsets, strict=True) for o in off]
    ids = [t for tt in tokens for t in tt]
    positions = torch.tensor(pos, dtype=torch.long, device=dev)
    batch = build_attention_batch(positions, [len(t) for t in tokens],
                                  [runner.context_slots(s) for s in seqs],  # type: ignore[attr-defined]
                                  masks, NullSink(), runner.cache)  # type: ignore[attr-defined]
    model = runner.model  # type: ignore[attr-defined]
    hidden = model(torch.tensor(ids, dtype=torch.long, device=dev), batch, num_layers=num_layers)
    flat, o = [], 0
    for tt, rr in zip(tokens, rows, strict=True):
        flat += [o + r for r in rr]
        o += len(tt)
    logits = model.logits(hidden[torch.tensor(flat, dtype=torch.long, device=dev)]).cpu()
    out, o = [], 0
    for rr in rows:
        out.append(logits[o : o + len(rr)])
        o += len(rr)
    return out


@register_proposer("draft")
class SelfDraftProposer(Proposer):
    """Beam search (greedy chain when M == 1) with the first ``draft_layers`` target layers."""

    def __init__(self, cfg: object, ctx: object) -> None:
        super().__init__(cfg, ctx)
        n_layers = ctx.model_config.num_layers  # type: ignore[attr-defined]
        self.num_layers = cfg.draft_layers  # type: ignore[attr-defined]
        if self.num_layers >= n_layers:
            raise ValueError(f"draft_layers must be < the model's {n_layers} layers, got {self.num_layers}")
        self.num_forwards = 0

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        m = self.cfg.num_candidates
        beams: list[torch.Tensor] = [torch.empty(1, 0, dtype=torch.long) for _ in seqs]  # [M_i, k]
        scores: list[torch.Tensor] = [torch.zeros(1, 0) for _ in seqs]  # [M_i, k] cumulative log-prob
        for k in range(max(depths)):
            live = [i for i, d in enumerate(depths) if d > k]
            feed_tok, feed_off, feed_mask, feed_rows = [], [], [], []
            for i in live:
                root = seqs[i].token_ids[-1]
                if k == 0:
                    feed_tok.append([root])
                    feed_off.append([0])
                    feed_mask.append(torch.ones(1, 1, dtype=torch.bool))
                    feed_rows.append([0])
                    continue
                packed, mask, offsets, umap = pack(beams[i][None])
                feed_tok.append([root] + packed[0].tolist())
                feed_off.append([0] + (offsets[0] + 1).tolist())
                feed_mask.append(with_root(mask[0]))
                feed_rows.append((umap[0, :, k - 1] + 1).tolist())  # each beam's last node
            logits = draft_forward(self.ctx.runner, [seqs[i] for i in live], feed_tok, feed_off,
                                   feed_mask, feed_rows, self.num_layers)
            self.num_forwards += 1
            for i, lg in zip(live, logits, strict=True):
                lp = torch.log_softmax(lg, dim=-1)  # [M_i, V]
                base = scores[i][:, -1:] if k else torch.zeros(1, 1)
                total = (base + lp).flatten()  # [M_i * V]
                top = torch.topk(total, min(m, total.numel()))
                parent = top.indices // lp.shape[1]
                tok = top.indices % lp.shape[1]
                beams[i] = torch.cat([beams[i][parent], tok[:, None]], dim=1)
                scores[i] = torch.cat([scores[i][parent], top.values[:, None]], dim=1)
        return [DraftBeam(b, s) for b, s in zip(beams, scores, strict=True)]
