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
    """``method``: proposer name ("ngram", the default: prompt lookup, its draft length chosen by
    expected gain on the measured cost curve; "hybrid": one tree per step merging Token Recycling's
    successor table and suffix-trie matches over the request and the engine's recent outputs, cut
    by expected gain, and with the gain schedule in a batch of two or more decoding sequences ngram's
    chains instead (tree_proposers.CHAINS_FROM); "recycling" and "suffix" each alone; the default is the
    one measured best on Spec-Bench on a CPU, docs/benchmarks.md: on the default model, int8, one core,
    all 480 questions, ngram 1.43-1.46x AR at batch 1 (Spec-Bench's measure, MAL 1.77-1.81) and 1.04x at
    batch 8 (144 requests), hybrid level with it at batch 1 (1.45x against 1.46x at MAL 2.31) and at
    batch 8 on samples (its chains there), not ahead: its trees' extra accepted tokens cost about as much
    as they add;
    "draft" layer-skip self-draft,
    "draft_model" a separate local draft model, "eagle" a trained EAGLE head, "eagle_ngram" prompt lookup
    where its gain schedule drafts and the EAGLE head elsewhere (measured slower than "ngram" on
    Spec-Bench on a CPU: the head's forwards cost ~0.2 of a step), "mtp" DeepSeek-V4's own
    multi-token-prediction module).
    ``num_candidates`` M: candidates per step (n-gram occurrences / beam width); 1 = chain.
    ``depth`` C: draft tokens per candidate, for the tree methods the tree's deepest level (default:
    8 for "hybrid", "recycling" and "suffix"; 1 for "mtp" — DeepSeek-V4's MTP module, verified
    in the static ``S = 2`` decode shape —, 8 for "ngram", whose gain schedule drafts that far only
    where earlier continuations of the same match length kept agreeing (measured on a 2-core CPU in
    the int16 mode, two runs: code 1.71x / 1.86x vs depth 4's 1.29x / 1.80x, never slower), else 4).
    ``min_n``/``max_n``: n-gram match lengths.
    ``draft_layers``: layers of the self-draft (target's first N + final norm + head).
    ``chunk_size``: speculative chunk verify (SCV, the NWOR/SCV design) — a forward verifies at most
    this many levels of the draft; when they are all accepted and the target's next token is the
    draft's own, the engine verifies the next levels in another forward of the same step, committing
    chunk by chunk and stopping at the first rejection (0 = the whole draft in one forward). Default
    8, the design's: drafts of up to 8 levels (the default depths are at most 8) verify in one forward,
    longer ones in chunks of 8. Measured on a 2-core CPU (docs/speculative.md): chunking was never slower
    than the whole draft, and chunks of 2 were fastest for long chains at batch 16 (depth 12: 1.22x).
    ``draft_model``: local path (GGUF file or HF folder) of the draft for ``method="draft_model"``;
    it must share the target's tokenizer (same vocab size). For ``method="eagle"``: the folder of a
    trained EAGLE head (eagle.py; ``ratchet train-eagle`` makes one for a target); by default the
    bundled head trained for the default model (``ratchetlm/assets/eagle-smollm2``). ``draft_kv_blocks``: blocks of the
    draft's own paged KV cache (0 = as many as the target's cache).
    ``depth_schedule``: "constant" drafts ``depth`` tokens every step; "adaptive" keeps a depth per
    sequence in ``[1, depth]``, +2 after a step that accepted every draft token and -1 otherwise
    (the schedule HF's assisted generation calls "heuristic"); "gain" (n-gram and eagle) drafts,
    per step, the length in ``[0, depth]`` expected to add the most tokens per unit of verify cost,
    judged for n-gram drafts from how far earlier continuations with the same match length agreed
    with the output, for an EAGLE head from its own confidence (gain.py); "auto" (the default) is
    "gain" for n-gram and EAGLE drafts and "constant" otherwise (measured: the gain schedule kept the
    chain's speed on code and summary and stopped it losing on chat and at batch 8,
    docs/speculative.md). Output is the same with every schedule.
    ``verify_token_cost``: the gain schedule's price of verified rows. None (the default): the
    target model's cost curve, measured once per process on this machine (cost_curve.py: a forward
    over 1..32 rows against one row), and for n-gram drafts and the tree methods corrected per batch
    size by the decode steps' measured times, with proposing stopped at a batch size where it measured
    a loss (draft_price.py); a number c: every row after the first costs c one-row forwards (0 on a GPU,
    where a verify forward costs about what a plain one does), nothing measured.
    ``disable_by_batch_size``: a step that schedules at least this many sequences decodes them all
    plainly (no drafts; vLLM's option of the same name); 0 = never. On a CPU the verify forward is
    compute bound once a batch holds many rows, and drafting at batch 8 measured slower than plain
    decoding at every depth (docs/speculative.md); the output is the same either way.
    ``tree_nodes``: most draft nodes of one tree ("hybrid", "recycling", "suffix"); with the gain
    schedule fewer, as many as pay on the cost curve; with "constant" always this many (when found).
    ``recycle_k``: successors kept per token in the recycling table (the paper's k = 8).
    ``history_tokens``: tokens of recent finished outputs the suffix trie keeps per engine (0 = none)."""

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
