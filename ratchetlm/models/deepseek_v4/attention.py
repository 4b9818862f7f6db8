"""V4 attention weights and the per-token math shared by the unpaged reference and the
paged decode path: projections, compressor pooling, indexer scoring, sink softmax and the
grouped output projection. Nothing here knows how KV is stored.
"""

from __future__ import annotations

import torch
from torch import nn

from ratchetlm.models.deepseek_v4.blocks import RMSNorm, rms_normalize
from ratchetlm.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.rope import RopeTable


def sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-KV (MQA) attention whose softmax denominator carries a per-head sink logit.

    q: ``[N, H, D]``; kv: ``[N or 1, K, D]`` (keys are also values); visible: ``[N, K]``;
    sinks: ``[H]``. Returns ``[N, H, D]``. A row with nothing visible returns zeros.
    """
    logits = torch.matmul(q.float(), kv.float().transpose(-1, -2)) * scale  # [N, H, K]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, kv.float()).to(q.dtype)


class WindowCompressor(nn.Module):
    """Learned gated pooling of ``ratio`` consecutive tokens into one compressed entry.

    With ``overlap`` (ratio 4) each token projects to ``2*dim``: the first half feeds the
    *next* window's entry, the second half its own, so an entry pools ``2*ratio`` rows.
    """

    def __init__(self, cfg: DeepseekV4Config, ratio: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = self.coff * dim
        self.kv_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(dim, cfg.rms_norm_eps)

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def window_rows(self) -> int:
        """How many per-token state rows one pooled entry reads."""
        return self.coff * self.ratio

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token state rows. x: ``[*lead, hidden]``, positions: ``lead`` ->
        (kv, score) each ``[*lead, coff*dim]`` in float32; score already includes the bias."""
        kv = self.kv_proj(x).float()
        score = self.gate_proj(x).float() + self.position_bias.float()[positions % self.ratio]
        return kv, score

    def pool(self, kv: torch.Tensor, score: torch.Tensor, first_pos: torch.Tensor, rope: RopeTable,
             out_dtype: torch.dtype) -> torch.Tensor:
        """kv, score: ``[N, window_rows, coff*dim]`` oldest row first (absent rows: kv 0,
        score -inf); first_pos: ``[N]`` position of the window's first token -> ``[N, dim]``."""
        if self.overlap:
            r, d = self.ratio, self.dim
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # per-channel softmax over the rows
        return rope.apply(self.kv_norm(pooled.to(out_dtype)), first_pos)


# Indexer slots are scored in whole blocks of this many: a slot's score is then the same bits however
# many blocks are scored (its tail-free position in every vector loop), so callers score only the
# slots their queries can see. Checked in tests/deepseek_v4/test_sparse_attn.py.
SCORE_BLOCK = 128


class IndexerScorer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)


class Indexer(WindowCompressor):
    """Lightning indexer: its own ratio-4 compressor for keys, plus a multi-head ReLU scorer."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg, cfg.csa_ratio, cfg.index_head_dim, overlap=True)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = IndexerScorer(cfg)

    def queries(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q ``[*lead, Hi, Di]`` roped, head weights ``[*lead, Hi]`` float32)."""
        q = self.q_b_proj(q_res).unflatten(-1, (self.n_heads, self.dim))
        q = rope.apply(q, positions)
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I[n, s] = sum_h w[n, h] * relu(q[n, h] . k[s]) / sqrt(Di).

        q: ``[N, Hi, Di]``, w: ``[N, Hi]``, keys: ``[N or 1, T, Di]`` -> ``[N, T]`` float32; or, for
        ``G`` sequences of ``n`` queries each against their own keys, q: ``[G, n, Hi, Di]``,
        w: ``[G, n, Hi]``, keys: ``[G, T, Di]`` -> ``[G, n, T]``. One matmul per key set (no copy of
        the keys per query), then in place: the ``[N, Hi, T]`` products are the big tensor here."""
        if q.dim() == 3:
            if keys.shape[0] == 1 and q.shape[0] != 1:  # one key set for every query
                return self.scores(q[None], w[None], keys)[0]
            dots = torch.matmul(q.float(), keys.float().transpose(-1, -2))  # [N, Hi, T]
        else:
            G, n, H, D = q.shape
            dots = torch.matmul(q.float().flatten(1, 2), keys.float().transpose(-1, -2)).view(G * n, H, -1)
        # relu(dots) * scale * w, summed over heads (the same operations in the same order, in place)
        out = dots.relu_().mul_(self.dim**-0.5).mul_(w.reshape(-1, w.shape[-1]).unsqueeze(-1)).sum(dim=1)
        return out if q.dim() == 3 else out.view(q.shape[0], q.shape[1], -1)


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` along the last dim, ties broken towards the lower slot.

    Exact ties are common (a slot scores exactly 0 whenever every head's ReLU is 0) and
    ``torch.topk`` breaks them differently for different widths, so the unpaged reference
    (width = visible entries) and the decode path (width = SCORE_LEN) would otherwise pick
    different slots. The choice is a function of the scores alone: every slot above the k-th
    largest value, then the lowest slots equal to it; ordered as a stable descending sort would
    (value, then slot). Only the ``k`` picked are sorted (a full sort of a 4096-wide row costs
    more than the partial selection).
    -> (values, indices), each ``[..., k]``."""
    n = scores.shape[-1]
    if k >= n:
        values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    kth = torch.topk(scores, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [..., 1]
    above, tie = scores > kth, scores == kth  # fewer than k above; enough ties to fill up to k
    take = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    # the taken slots in ascending order: each goes to its rank among the taken (the rest to column k)
    dest = torch.where(take, take.cumsum(-1) - 1, k)
    slots = torch.arange(n, device=scores.device).expand_as(scores)
    picked = torch.zeros(*scores.shape[:-1], k + 1, dtype=torch.long, device=scores.device)
    picked = picked.scatter_(-1, dest, slots)[..., :k]
    values, order = torch.sort(scores.gather(-1, picked), dim=-1, descending=True, stable=True)
    return values, picked.gather(-1, order)


class CSACompressor(WindowCompressor):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg, cfg.csa_ratio, cfg.head_dim, overlap=True)
        self.indexer = Indexer(cfg)


class Attention(nn.Module):
    """Weights of one V4 attention block (shared-KV MQA, 1 KV head, sink, grouped o-proj)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.kind, self.ratio = cfg.layer_types[layer], cfg.ratio(layer)
        h, d = cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.groups, self.eps = h, d, cfg.o_groups, cfg.rms_norm_eps
        self.scale = d**-0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor: WindowCompressor | None = None
        if self.kind == CSA:
            self.compressor = CSACompressor(cfg)
        elif self.kind != SLIDING:
            self.compressor = WindowCompressor(cfg, cfg.hca_ratio, d, overlap=False)

    def csa_compressor(self) -> CSACompressor:
        """The CSA compressor (with its indexer); only CSA layers have one."""
        assert isinstance(self.compressor, CSACompressor), f"layer kind {self.kind} has no CSA compressor"
        return self.compressor

    def window_compressor(self) -> WindowCompressor:
        """The compressor of a CSA or HCA layer."""
        assert self.compressor is not None, f"layer kind {self.kind} has no compressor"
        return self.compressor

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: ``[*lead, hidden]`` -> (q ``[*lead, H, D]``, kv ``[*lead, D]``, q_res ``[*lead, q_lora]``)."""
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = rms_normalize(self.q_b_proj(q_res).unflatten(-1, (self.num_heads, self.head_dim)), self.eps)
        kv = self.kv_norm(self.kv_proj(x))
        return rope.apply(q, positions), rope.apply(kv, positions), q_res

    def output(self, o: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """o: ``[*lead, H, D]`` -> ``[*lead, hidden]``.

        K = V carries RoPE, so the output's rope channels are de-rotated at the query position
        before the per-group projection (block-diagonal ``o_a``) and the mixing ``o_b``.
        """
        o = rope.apply(o, positions, inverse=True)
        grouped = o.flatten(-2).unflatten(-1, (self.groups, -1))  # [*lead, G, H*D/G]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
        mid = torch.einsum("...gi,goi->...go", grouped, w).flatten(-2)
        return self.o_b_proj(mid)
