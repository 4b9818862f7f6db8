"""EAGLE-style trained draft head (``method="eagle"``): one decoder layer at the feature level.

EAGLE (Li et al., 2024) drafts with the target's own features. ``f_i`` is the target's final
hidden state (after its last norm) at position ``i``; it predicts token ``x_{i+1}`` through the
target's head. The draft head learns ``f_{i+1} ≈ head(embed(x_{i+1}), f_i)``: an input projection
``fc`` of the concatenated pair, then one Llama decoder layer that attends the head's own K/V of
earlier positions, then an RMSNorm (the target's features are taken after its final norm).
Draft index ``j`` holds the pair ``(x_{j+1}, f_j)`` (RoPE position ``j``), and its output
``g_{j+1}`` scores token ``x_{j+2}``.

Drafting, for a sequence whose committed tokens are ``x_0..x_T`` (``x_T``, the root, has no
target K/V yet) and whose committed positions' features ``f_0..f_{T-1}`` came from the target's
forwards (``Proposer.observe``):

1. *catch-up*: one forward over draft indices ``c..T-1`` (``c`` = indices with head K/V) with the
   true pairs, writing their K/V to the head's own paged cache (only committed tokens ever land
   there); the last row's output ``g_T`` gives the first draft token;
2. ``depth - 1`` write-free forwards that feed the drafted tokens paired with the head's own
   outputs ``g_T, g_{T+1}, ...`` in place of the unknown target features.

Scoring uses a *draft vocabulary*: the ``K`` most frequent output tokens (saved with the head),
scored with the target's own head rows (their GGUF blocks when the kernels are on), as EAGLE-3
and FR-Spec do — a draft step then costs ``K`` head rows instead of the whole vocabulary. On a
CPU with fp32 weights the head's own layers run through the block kernels as Q8_0 (the dense
copy holds the same dequantized weights, so both paths draft alike). Chains only
(``num_candidates == 1``). With ``depth_schedule="gain"`` the chain stops where the head's own
confidence says another token no longer pays (gain.py). Training: ``ratchetlm/training/eagle_train.py``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ratchetlm import kernels
from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.draft_cache import DraftCache, DraftSeqState
from ratchetlm.decoding.speculative.gain import draft_value
from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer, verify_cost
from ratchetlm.kv.sink import DirectSink, KVSink, NullSink
from ratchetlm.layers.attention import AttentionBatch, build_attention_batch
from ratchetlm.layers.block_quant import BlockWeight, Linear, set_numerics
from ratchetlm.layers.norm_rope import RMSNorm, RotaryEmbedding
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.llama import DecoderLayer, LlamaModel
from ratchetlm.sequence import Sequence

_STATE = "spec_eagle"  # strategy_state key: the head's paged K/V footprint
_FEATS = "spec_eagle_feats"  # strategy_state key: target features not yet fed to the head
ARCHITECTURE = "RatchetEagleHead"
# trained for the default model by ``ratchet train-eagle`` (docs/speculative.md: data, recipe, acceptance)
BUNDLED_HEAD = Path(__file__).resolve().parents[2] / "assets" / "eagle-smollm2"
# a head forward and its draft-vocab scores, in one-row target forwards (default model, int8, one thread:
# ~2 of ~9.3 ms, mostly Python around ~0.4 ms of matmuls; docs/speculative.md)
HEAD_COST = 0.2


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_vocab_size: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ValueError(f"EAGLE head config: {f.name} must be a positive number, got {v!r}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError("EAGLE head config: draft_vocab_size exceeds target_vocab_size")

    def layer_config(self) -> ModelConfig:
        return ModelConfig("LlamaForCausalLM", self.target_vocab_size, self.hidden_size, self.intermediate_size, 1,
                           self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta, self.rms_norm_eps,
                           self.max_position_embeddings)

    @staticmethod
    def for_target(cfg: ModelConfig, draft_vocab_size: int) -> EagleConfig:
        return EagleConfig(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size, draft_vocab_size, cfg.rope_theta, cfg.rms_norm_eps,
                           cfg.max_position_embeddings)


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg.layer_config(), 0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # outputs live where the target's features do: after a norm
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.register_buffer("draft_vocab", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def forward(
        self,
        emb: torch.Tensor,  # [n, hidden] target embeddings of x_{j+1}
        feat: torch.Tensor,  # [n, hidden] target (or draft) features f_j
        batch: AttentionBatch,  # positions = draft indices j; K/V through batch.sink
    ) -> torch.Tensor:  # [n, hidden] g_{j+1}
        x = self.fc(torch.cat([emb, feat.to(emb.dtype)], dim=-1))
        return self.norm(self.layer(x, self.rope.cos_sin(batch.positions), batch))

    def save(self, path: str | os.PathLike[str]) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"architecture": ARCHITECTURE, **asdict(self.config)}, indent=1))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(out / "model.safetensors"))

    @staticmethod
    def load(path: str | os.PathLike[str]) -> EagleHead:
        """Raises ``ValueError`` naming the problem (missing files, wrong architecture, bad tensors)."""
        folder = Path(path)
        if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
            raise ValueError(f"EAGLE head {str(folder)!r}: expected a folder with config.json and model.safetensors")
        d = json.loads((folder / "config.json").read_text())
        if d.pop("architecture", None) != ARCHITECTURE:
            raise ValueError(f"EAGLE head {str(folder)!r}: config.json architecture must be {ARCHITECTURE!r}")
        try:
            head = EagleHead(EagleConfig(**d))
            head.load_state_dict(load_file(str(folder / "model.safetensors")))
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"EAGLE head {str(folder)!r}: {e}") from None
        return head.eval()


@dataclass
class FeatureRun:
    """Target features of consecutive committed positions ``start .. start + len(feats) - 1``."""

    start: int
    feats: torch.Tensor  # [n, hidden]

    @property
    def end(self) -> int:
        return self.start + self.feats.shape[0]


@register_proposer("eagle")
class EagleProposer(Proposer):
    wants_features = True

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        if cfg.num_candidates != 1:
            raise ValueError("speculative method='eagle' drafts chains only: num_candidates must be 1")
        runner = ctx.runner
        target: LlamaModel = runner.model
        if target.tp.size > 1:  # it reads the target's embedding and head rows, which are split over the ranks
            raise ValueError("speculative method='eagle' does not run with tensor_parallel_size > 1; use 'ngram', "
                             "'draft' (layer-skip) or 'draft_model'")
        dtype, dev = runner.dtype, runner.device
        path = cfg.draft_model or BUNDLED_HEAD
        head = EagleHead.load(path)
        hc, tc = head.config, ctx.model_config
        if (hc.hidden_size, hc.target_vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"EAGLE head {str(path)!r} was trained for hidden size "
                             f"{hc.hidden_size} and vocab {hc.target_vocab_size}, the target has {tc.hidden_size} "
                             f"and {tc.vocab_size}")
        self.head = head.to(device=dev, dtype=dtype)
        self.head.rope.set_context_len(ctx.max_model_len)  # RoPE tables grow on demand
        self.vocab: torch.Tensor = cast(torch.Tensor, self.head.draft_vocab).to(dev)  # [K] -> target token ids
        self.embed = target.embed
        self.lm = self._draft_vocab_head(target, dtype)
        if dev.type == "cpu" and dtype == torch.float32 and kernels.load() is not None:
            self._to_blocks()
            # the target's numerics (int8 by default: VNNI products, ~3x the exact kernels at one row); drafts
            # never change the output, only how often they are right
            set_numerics(self.head, target.numerics)
            set_numerics(self.lm, target.numerics)
            layer = self.head.layer
            # the C attention and SiLU kernels, as the target's layers use them
            layer.fixed_order_attention = layer.kernel_silu = target.numerics != "exact"
        self.draft = DraftCache(_STATE, 1, cfg.draft_kv_blocks or runner.blocks.num_blocks, runner.blocks.block_size,
                                hc.num_kv_heads, hc.head_dim, dtype, dev)
        self.num_forwards = 0
        self.verify_cost = verify_cost(cfg, ctx) if cfg.depth_schedule == "gain" else CostCurve.linear(0.0)
        # a head forward (catch-up or chain step) in one-row target forwards, for the gain rule: its matmuls
        # are ~5% of the target's on the default model; the rest is Python (HEAD_COST)
        self.head_cost = HEAD_COST if cfg.verify_token_cost is None else 0.0

    def _draft_vocab_head(self, target: LlamaModel, dtype: torch.dtype) -> Linear:
        """The target's head restricted to the draft vocabulary (rows in draft-vocab order; GGUF
        blocks stay blocks, selected by a row map)."""
        src = target.lm_head if target.lm_head is not None else target.embed
        hidden, k = target.config.hidden_size, self.vocab.numel()
        if src.blocks is not None:
            lm = Linear(hidden, k, bias=False, device="meta")
            lm.use_blocks(src.blocks.take_rows(self.vocab.cpu().numpy()))
            return lm
        lm = Linear(hidden, k, bias=False).to(device=src.weight.device, dtype=dtype)
        lm.weight.data.copy_(src.weight[self.vocab])
        return lm

    @torch.no_grad()
    def _to_blocks(self) -> None:
        """Q8_0 for the head's own matmuls (the block kernels read 4x fewer bytes); the dense
        weights are dropped, so every path (kernels or dequantized) drafts with the same values."""
        for mod in (self.head.fc, self.head.layer.qkv, self.head.layer.o_proj, self.head.layer.gate_up,
                    self.head.layer.down):
            assert isinstance(mod, Linear)
            mod.use_blocks(BlockWeight.quantize_q8_0(mod.weight))

    # ------------------------------------------------------------------ features and state

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        run = seq.strategy_state.get(_FEATS)
        if run is None or start < run.start or start > run.end:  # first features, a recompute, or a gap
            seq.strategy_state[_FEATS] = FeatureRun(start, hidden.detach().clone())
            return
        kept = run.feats[: start - run.start]  # a recompute overwrites from ``start`` on
        run.feats = torch.cat([kept, hidden.detach()])

    def release(self, seq: Sequence) -> None:
        self.draft.release(seq)
        seq.strategy_state.pop(_FEATS, None)

    def _ready(self, seq: Sequence) -> bool:
        """Features of draft indices ``c .. T-1`` are known and the head cache covers ``T`` indices."""
        run = seq.strategy_state.get(_FEATS)
        st = self.draft.state(seq)
        if run is not None and st.num_cached == 0 and run.start > 0:
            # The target reused a cached prefix and computed no features there: the head's own
            # context starts at the first position it has features for (drafts may be a little
            # worse; verification keeps the output exact).
            st.start = st.num_cached = run.start
        c, t = st.num_cached, len(seq.token_ids) - 1
        if run is None or run.start > c or run.end < t or t <= c:
            return False
        return self.draft.reserve(seq, t)

    # ------------------------------------------------------------------ drafting

    def _forward(self, states: list[DraftSeqState], tokens: list[list[int]], feats: list[torch.Tensor],
                 starts: list[int], sink: KVSink) -> torch.Tensor:  # [B, hidden]: each sequence's last row
        dev = self.vocab.device
        pos = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, tokens, strict=True)]).to(dev)
        cache = self.draft.cache
        batch = build_attention_batch(pos, [len(t) for t in tokens],
                                      [self.draft.slots(st, st.start, st.num_cached) for st in states],
                                      [None] * len(tokens), sink, cache, dtype=cache.dtype)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=dev)
        out = self.head(self.embed(ids), torch.cat(feats), batch)
        last = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        self.num_forwards += 1
        return out[last.to(dev)]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        ready = [i for i, s in enumerate(seqs) if self._ready(s)]
        out: list[DraftBeam | None] = [None] * len(seqs)
        if not ready:
            return out
        rs = [seqs[i] for i in ready]
        states = [self.draft.state(s) for s in rs]
        tokens, feats, starts, writes = [], [], [], []
        for s, st in zip(rs, states, strict=True):
            c, t = st.num_cached, len(s.token_ids) - 1
            run: FeatureRun = s.strategy_state[_FEATS]
            tokens.append(s.token_ids[c + 1 : t + 1])  # pairs (x_{j+1}, f_j) for j = c .. t-1
            feats.append(run.feats[c - run.start : t - run.start])
            starts.append(c)
            writes.append(self.draft.slots(st, c, t))
        sink = DirectSink(self.draft.cache, torch.cat(writes).to(self.draft.cache.device))
        g = self._forward(states, tokens, feats, starts, sink)  # [B, hidden] g_T per sequence
        for s, st in zip(rs, states, strict=True):
            t = len(s.token_ids) - 1
            st.num_cached = t
            run = s.strategy_state[_FEATS]
            run.feats, run.start = run.feats[t - run.start :], t  # fed: keep f_T onwards
        want = [depths[i] for i in ready]
        drafted: list[list[int]] = [[] for _ in rs]
        scores: list[list[float]] = [[] for _ in rs]  # cumulative log-probs
        outs: list[list[torch.Tensor]] = [[] for _ in rs]  # g_T, g_{T+1}, ... per sequence
        gain = self.cfg.depth_schedule == "gain"
        cost = self.verify_cost
        ctxs = [s.num_cached for s in rs]  # each verified row reads the sequence's cached tokens
        value = [(draft_value(1.0, 0, cost, len(seqs), context=c), 0) for c in ctxs]  # (best, its length)
        expected = [1.0] * len(rs)
        live = list(range(len(rs)))
        for k in range(max(want)):
            lp = torch.log_softmax(self.lm(g).float(), dim=-1)  # [len(live), K]
            best = lp.max(dim=-1)
            for row, i in enumerate(live):
                drafted[i].append(int(self.vocab[best.indices[row]]))
                scores[i].append((scores[i][-1] if scores[i] else 0.0) + float(best.values[row]))
                outs[i].append(g[row])
                if gain:  # stop once one more token lowers the expected tokens per unit of cost
                    expected[i] += math.exp(scores[i][-1])  # P(first k+1 drafts all right)
                    v = draft_value(expected[i], k + 1, cost, len(seqs), context=ctxs[i],
                                    drafting=self.head_cost * (k + 1))
                    if v > value[i][0]:
                        value[i] = (v, k + 1)
                    else:
                        want[i] = k + 1
            live = [i for i in live if want[i] > k + 1]
            if not live:
                break
            # write-free: re-feed this sequence's drafted tokens with the head's own outputs as features
            g = self._forward([states[i] for i in live], [drafted[i] for i in live],
                              [torch.stack(outs[i]) for i in live], [states[i].num_cached for i in live], NullSink())
        for j, i in enumerate(ready):
            d = value[j][1] if gain else len(drafted[j])
            if d:
                out[i] = DraftBeam(torch.tensor([drafted[j][:d]]), torch.tensor([scores[j][:d]]))
        return out

    def metrics(self) -> dict[str, float]:
        return {"spec_draft_forwards": self.num_forwards, **self.draft.metrics()}
