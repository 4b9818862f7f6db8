"""MTP proposer (``method="mtp"``): DeepSeek-V4's multi-token-prediction module drafts the chain.

For a sequence whose committed tokens are ``x_0..x_T`` (``x_T``, the root, has no KV yet) and
whose main-model streams ``h_0..h_{T-1}`` came from the target's own forwards
(``Proposer.observe``), a step drafts with the module (models/deepseek_v4/mtp.py):

1. *catch-up*: one forward over the pairs ``(h_j, x_{j+1})`` the module's ring lacks, up to
   ``j = T - 1`` (at most the last ``window`` of them: the block only attends that far), writing
   their ring rows — both halves of every such pair are committed, so the rows are final. Its
   last row's logits give draft ``d_1`` (the token after the root);
2. for a deeper chain, write-free forwards over the draft pairs ``(g_{T-1}, d_1), (g_T, d_2), ...``
   (the module's own outputs stand in for the main model's unknown streams), each re-fed with
   the earlier draft rows as the in-step overlay.

The engine then verifies ``[x_T, d_1, .., d_k]`` in one staged forward of ``S = 1 + k`` rows
(``k = 1``: the seed's static ``S = 2`` decode shape) and commits the accepted prefix plus the
correction/bonus token — 1 to ``k + 1`` tokens per call. Greedy drafts; acceptance is the
strategy's (exact for greedy and for sampling, whatever the drafts).
"""

from __future__ import annotations

from typing import Any

import torch

from ratchetlm.decoding.speculative.eagle import FeatureRun
from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer
from ratchetlm.sequence import Sequence

_FEATS = "spec_mtp_feats"  # strategy_state key: the main model's streams of recent committed positions
_RING = "spec_mtp_ring"  # strategy_state key: (first, end): pairs [first, end) have ring rows


@register_proposer("mtp")
class MTPProposer(Proposer):
    wants_features = True

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        runner = ctx.runner
        model = getattr(runner, "model", None)
        if getattr(model, "mtp", None) is None:
            raise ValueError("speculative method='mtp' needs a model with an MTP module "
                             "(a DeepSeek-V4 checkpoint with mtp.* weights)")
        if cfg.num_candidates != 1:
            raise ValueError("speculative method='mtp' drafts chains only: num_candidates must be 1")
        assert model is not None and model.mtp is not None
        self.model = model
        self.mtp = model.mtp[0]
        self.runner = runner
        self.window = runner.cap.window
        self.num_forwards = 0

    # ------------------------------------------------------------------ features

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """hidden: ``[n, hc, H]`` main-model streams of positions ``start ..``; only the last
        ``window`` are ever read, so only those are kept."""
        run = seq.strategy_state.get(_FEATS)
        if run is None or start < run.start or start > run.end:  # first features, a recompute, or a gap
            run = FeatureRun(start, hidden.detach().clone())
        else:
            run.feats = torch.cat([run.feats[: start - run.start], hidden.detach()])
        if run.feats.shape[0] > self.window:
            cut = run.feats.shape[0] - self.window
            run.feats, run.start = run.feats[cut:].clone(), run.start + cut
        seq.strategy_state[_FEATS] = run

    def _pairs(self, seq: Sequence) -> tuple[int, int, int] | None:
        """``(first, lo, T)``: the catch-up feeds pairs ``[lo, T)`` and the ring then holds pairs
        ``[first, T)``; None when the streams of those pairs are not known.

        The ring normally starts at pair 0. A sequence whose main-model streams start later (its
        first tokens came from a cache, not a forward) starts its ring at the first pair it has
        streams for: earlier pairs are simply not attended (drafts may be a little worse, the
        output is unchanged: verification decides)."""
        t = len(seq.token_ids) - 1
        run = seq.strategy_state.get(_FEATS)
        if run is None or t < 1 or run.end < t:
            return None
        first, end = seq.strategy_state.get(_RING, (0, 0))
        # at least pair T-1, whose output drafts: after a discarded step it is fed again (its ring
        # row is rewritten with the same committed inputs)
        lo = min(max(end, t - self.window), t - 1)
        if run.start > lo:  # a gap: restart the ring where the streams begin
            first = lo = run.start
        return (first, lo, t) if lo < t else None

    # ------------------------------------------------------------------ drafting

    def _forward(self, starts: list[int], tokens: list[list[int]], prev: list[torch.Tensor],
                 write: list[int], seq_ids: list[int], first: list[int]) -> torch.Tensor:
        """One module step over pairs ``starts[b] + i``; the first ``write[b]`` rows write their
        ring rows; pairs before ``first[b]`` are not attended. -> each sequence's last row's
        output streams ``[B, hc, H]``."""
        from ratchetlm.kv.sink import DirectSink
        from ratchetlm.models.deepseek_v4.mtp import mtp_forward
        from ratchetlm.models.deepseek_v4.paging import WindowMeta, lower_window

        cap, layout = self.runner.cap, self.runner.layout
        B, S = len(tokens), max(len(t) for t in tokens)
        start = torch.tensor(starts)
        ori_table = layout.tables(seq_ids).ori
        pos, ori, swa = lower_window(start, S, torch.tensor(write), ori_table, cap.window, cap.block_size,
                                     torch.tensor(first))
        meta = WindowMeta(position_ids=pos, ori_slot_mapping=ori, ori_block_table=ori_table, swa_indices=swa,
                          window=cap.window, decode_seq=S, step_start=start)
        ids = torch.zeros(B, S, dtype=torch.long)
        hc, h = prev[0].shape[-2:]
        feats = torch.zeros(B, S, hc, h, dtype=prev[0].dtype)
        for b, (t, p) in enumerate(zip(tokens, prev, strict=True)):
            ids[b, : len(t)], ids[b, len(t) :] = torch.tensor(t), t[-1]
            feats[b, : len(t)] = p
        sink = DirectSink(layout.pools, {"ori": ori.flatten()})
        out = mtp_forward(self.model, self.mtp, layout.pools, meta, ids, feats, sink, cap)
        self.num_forwards += 1
        last = torch.tensor([len(t) - 1 for t in tokens])
        return out[torch.arange(B), last]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        from ratchetlm.models.deepseek_v4.mtp import mtp_logits

        out: list[DraftBeam | None] = [None] * len(seqs)
        ready = [(i, r) for i, s in enumerate(seqs) if (r := self._pairs(s)) is not None]
        if not ready:
            return out
        rs = [seqs[i] for i, _ in ready]
        starts, tokens, prev, firsts = [], [], [], []
        for s, (_, (first, lo, t)) in zip(rs, ready, strict=True):
            run: FeatureRun = s.strategy_state[_FEATS]
            starts.append(lo)
            firsts.append(first)
            tokens.append(s.token_ids[lo + 1 : t + 1])  # x_{j+1} for j = lo .. T-1
            prev.append(run.feats[lo - run.start : t - run.start])
        g = self._forward(starts, tokens, prev, [len(t) for t in tokens], [s.seq_id for s in rs], firsts)
        for s, (_, (first, _lo, t)) in zip(rs, ready, strict=True):  # the rows exist once the forward ran
            s.strategy_state[_RING] = (first, t)
        want = [depths[i] for i, _ in ready]
        drafted: list[list[int]] = [[] for _ in rs]
        scores: list[list[float]] = [[] for _ in rs]
        outs: list[list[torch.Tensor]] = [[] for _ in rs]  # g_{T-1}, g_T, ... per sequence
        live = list(range(len(rs)))
        for k in range(max(want)):
            lp = torch.log_softmax(mtp_logits(self.model, self.mtp, g), dim=-1)  # [len(live), V]
            best = lp.max(dim=-1)
            for row, i in enumerate(live):
                drafted[i].append(int(best.indices[row]))
                scores[i].append((scores[i][-1] if scores[i] else 0.0) + float(best.values[row]))
                outs[i].append(g[row])
            live = [i for i in live if want[i] > k + 1]
            if not live:
                break
            # pairs T .. T+k: (g_{T-1}, d_1), .., (g_{T+k-1}, d_{k+1}); nothing written
            t0 = [len(rs[i].token_ids) - 1 for i in live]  # pair T: the root's position
            g = self._forward(t0, [drafted[i] for i in live], [torch.stack(outs[i]) for i in live],
                              [0] * len(live), [rs[i].seq_id for i in live], [firsts[i] for i in live])
        for (i, _), d, sc in zip(ready, drafted, scores, strict=True):
            out[i] = DraftBeam(torch.tensor([d], dtype=torch.long), torch.tensor([sc]))
        return out

    def metrics(self) -> dict[str, float]:
        return {"spec_mtp_forwards": self.num_forwards}
