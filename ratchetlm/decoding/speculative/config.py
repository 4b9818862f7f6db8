"""Options of the ``speculative`` strategy (``LLM(speculative={...})``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ratchetlm.decoding.base import config_from_options

TREE_METHODS = ("hybrid", "recycling", "suffix")  # tree_proposers.py: trees shaped by expected gain
EAGLE_METHODS = ("eagle", "eagle_ngram")  # eagle.py, eagle_lookup.py: a trained head (draft_model: its folder)
GAIN_METHODS = ("ngram", *EAGLE_METHODS, *TREE_METHODS)  # methods the gain schedule applies to


@dataclass(frozen=True)
class SpecConfig:
    """Options of ``LLM(speculative={...})`` (the CLI's ``--speculative JSON``, the same keys). The
    measurements behind each default: docs/speculative.md and docs/benchmarks.md (*Spec-Bench whole*).

    * ``method``: the proposer (proposers.py's registry).
      * ``"ngram"`` (the default): prompt lookup, its length chosen by expected gain on the measured cost
        curve. It measured best on Spec-Bench on a CPU: on the default model, int8, one core, all 480
        questions, 1.43-1.46x plain decoding at batch 1 (MAL 1.77-1.81) and 1.04x at batch 8.
      * ``"hybrid"``: one tree per step, merging Token Recycling's successor table and suffix-trie matches
        over the request and the engine's recent outputs, cut by expected gain (at batch >= 2, ngram's
        chains instead: tree_proposers.CHAINS_FROM). Level with ngram on a CPU (1.45x against 1.46x, MAL
        2.31): its trees' extra accepted tokens cost about what they add. ``"recycling"`` and
        ``"suffix"``: each of its two sources alone.
      * ``"draft"``: layer-skip self-draft. ``"draft_model"``: a separate local draft model.
      * ``"eagle"``: a trained EAGLE head. ``"eagle_ngram"``: prompt lookup where its gain schedule
        drafts, the head elsewhere. Both measured slower than ngram on a CPU (a head forward costs ~0.2
        of a step).
      * ``"mtp"``: DeepSeek-V4's own multi-token-prediction module.
    * ``num_candidates`` M: candidates per step (n-gram occurrences, beam width); 1 = a chain.
    * ``depth`` C: draft tokens per candidate; for the tree methods, the tree's deepest level. Default: 8
      for ngram, eagle_ngram and the tree methods (ngram drafts that far only where earlier continuations
      of the same match length kept agreeing), 1 for mtp (verified in V4's static ``S = 2`` decode
      shape), else 4.
    * ``min_n``/``max_n``: n-gram match lengths.
    * ``draft_layers``: the self-draft's layers (the target's first N, its final norm and head).
    * ``chunk_size``: speculative chunk verify (SCV). A forward verifies at most this many levels; when they
      are all accepted and the target's next token is the draft's own, the next levels are verified in
      another forward of the same step, chunk by chunk, stopping at the first rejection. 0 = the whole
      draft in one forward. Default 8: the default depths verify in one forward.
    * ``draft_model``: for ``"draft_model"``, a local GGUF file or HF folder sharing the target's
      tokenizer; for the EAGLE methods, a head's folder (``ratchet train-eagle`` makes one; default: the
      bundled head for the default model, ``ratchetlm/assets/eagle-smollm2``).
    * ``draft_kv_blocks``: blocks of a drafter's own paged KV cache (0 = as many as the target's).
    * ``depth_schedule``:
      * ``"constant"``: ``depth`` tokens every step.
      * ``"adaptive"``: a depth per sequence in ``[1, depth]``, +2 after a step that accepted every draft
        token and -1 otherwise (HF assisted generation's "heuristic").
      * ``"gain"`` (ngram, EAGLE and tree methods): per step, the draft expected to add the most tokens per
        unit of verify cost (gain.py, tree_select.py).
      * ``"auto"`` (the default): ``"gain"`` where it applies, else ``"constant"``.
      The output is the same under every schedule.
    * ``verify_token_cost``: the gain schedule's price of verified rows.
      * None (the default): the target's cost curve, measured once per process (cost_curve.py), corrected per
        batch size by the decode steps' measured times, with proposing stopped at a batch size where it
        measured a loss (draft_price.py).
      * A number c: every row after the first costs c one-row forwards, nothing measured. 0 suits a GPU,
        where a verify forward costs about what a plain one does.
    * ``disable_by_batch_size``: a step that schedules at least this many sequences decodes them all plainly
      (vLLM's option of the same name); 0 = never.
    * ``tree_nodes``: the most draft nodes in one tree (the tree methods). Under ``"gain"`` a tree keeps as
      many as pay on the cost curve; under ``"constant"`` always this many, where found.
    * ``recycle_k``: successors kept per token in the recycling table (the paper's k = 8).
    * ``history_tokens``: tokens of recent finished outputs the suffix trie keeps per engine (0 = none)."""

    method: str = "ngram"
    num_candidates: int = 1
    depth: int = None  # type: ignore[assignment]  # None: the method's default, resolved below
    min_n: int = 1
    max_n: int = 4
    draft_layers: int = 8
    chunk_size: int = 8
    draft_model: str | None = None
    draft_kv_blocks: int = 0
    depth_schedule: str = "auto"
    verify_token_cost: float | None = None
    disable_by_batch_size: int = 0
    tree_nodes: int = 16
    recycle_k: int = 8
    history_tokens: int = 65536

    def __post_init__(self) -> None:
        from ratchetlm.decoding.speculative.proposers import proposer_names

        if self.method not in proposer_names():
            raise ValueError(f"speculative method must be one of {proposer_names()}, got {self.method!r}")
        if self.depth is None:
            default = {"mtp": 1, "ngram": 8, "eagle_ngram": 8, **dict.fromkeys(TREE_METHODS, 8)}
            object.__setattr__(self, "depth", default.get(self.method, 4))
        for name, lo in (("num_candidates", 1), ("depth", 1), ("min_n", 1), ("max_n", 1),
                         ("draft_layers", 1), ("chunk_size", 0), ("draft_kv_blocks", 0),
                         ("disable_by_batch_size", 0), ("tree_nodes", 1), ("recycle_k", 1),
                         ("history_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"speculative {name} must be an integer >= {lo}, got {v!r}")
        if self.depth_schedule == "auto":  # the measured best (docs/speculative.md) where it applies
            object.__setattr__(self, "depth_schedule", "gain" if self.method in GAIN_METHODS else "constant")
        if self.depth_schedule not in ("constant", "adaptive", "gain"):
            raise ValueError("speculative depth_schedule must be 'auto', 'constant', 'adaptive' or 'gain', "
                             f"got {self.depth_schedule!r}")
        if self.depth_schedule == "gain" and self.method not in GAIN_METHODS:
            raise ValueError(f"speculative depth_schedule='gain' needs method in {GAIN_METHODS} "
                             f"(method is {self.method!r})")
        c = self.verify_token_cost
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < float("inf")):
            raise ValueError(f"speculative verify_token_cost must be None (measured) or a finite number >= 0, "
                             f"got {c!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"speculative min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        if isinstance(self.draft_model, os.PathLike):
            object.__setattr__(self, "draft_model", os.fspath(self.draft_model))
        if self.method == "draft_model" or (self.method in EAGLE_METHODS and self.draft_model is not None):
            what = "model path (GGUF file or HF folder)" if self.method == "draft_model" else "EAGLE head folder"
            if not isinstance(self.draft_model, str) or not self.draft_model:
                raise ValueError(f"speculative draft_model must be a local {what} when method={self.method!r}, "
                                 f"got {self.draft_model!r}")
        elif self.draft_model is not None:
            raise ValueError("speculative draft_model is only used with method='draft_model', 'eagle' or 'eagle_ngram' "
                             f"(method is {self.method!r})")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SpecConfig:
        return config_from_options(cls, options, "speculative")
