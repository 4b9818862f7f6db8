"""The WeDLM oracle: the same window algorithm with no KV cache at all.

Every step recomputes the whole sequence from token ids: ``committed prefix + window in
topological order`` under a plain causal mask, positions ``0..L-1`` then ``L + slot``. Nothing
is cached, staged or batched, so it shares no attention/KV code with the engine: it is the oracle
of the engine's cache, staging and batching. It does share the window and fill functions
(:mod:`ratchetlm.decoding.wedlm_window`), so it cannot catch a wrong fill rule; those are checked
on their own: tests/wedlm/test_window.py (seed 000's worked examples; the seed has no distance
penalty) and tests/wedlm/test_distance_penalty.py (every fill of the running engine against the
paper's Eq. 11, computed independently).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ratchetlm.decoding.wedlm_window import WeDLMConfig, commit_length, fill, new_window, refill
from ratchetlm.layers.logits_processors import LogitsControls
from ratchetlm.sampling_params import SamplingParams

# (input ids [n], position ids [n]) -> logits [n, V], causal attention over the given order
LogitsFn = Callable[[list[int], list[int]], torch.Tensor]


@dataclass
class ReferenceResult:
    output_ids: list[int]
    finish_reason: str
    forwards: int = 0  # window forwards (prefill excluded, like the engine's stats)
    commits_per_step: list[int] = field(default_factory=list)
    fills_per_step: list[int] = field(default_factory=list)
    out_of_order_fills: int = 0  # slots filled while a slot before them stays a mask


def hf_logits_fn(model) -> LogitsFn:  # noqa: ANN001 - any HF causal LM
    """Adapter for a transformers causal LM: explicit position ids and an explicit 4-D causal
    mask (without one, transformers reads non-monotonic position ids as packed sequences and
    hides the window's filled slots from the masks before them)."""

    @torch.inference_mode()
    def fn(ids: list[int], pos: list[int]) -> torch.Tensor:
        n, dev = len(ids), next(model.parameters()).device
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None]
        out = model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                    attention_mask=causal, use_cache=False)
        return out.logits[0].float().cpu()

    return fn


def wedlm_generate_reference(
    logits_fn: LogitsFn,
    prompt_ids: list[int],
    params: SamplingParams,
    cfg: WeDLMConfig,
    mask_token_id: int,
    max_model_len: int,
    eos_token_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    controls: LogitsControls | None = None,
) -> ReferenceResult:
    """Generate with WeDLM window decoding, recomputing everything each step. ``controls``: the
    request's logits controls, fresh (they never see a commit here: each mask is judged with the
    whole output before its slot as its path)."""
    seq = list(prompt_ids)
    n_prompt = len(seq)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    w = new_window(mask_token_id, cfg.window_size, max_model_len - len(seq))
    res = ReferenceResult([], "length")
    judge = None
    if controls is not None:
        def judge(rows: torch.Tensor, ks: list[int]) -> torch.Tensor:  # seq and w change in place
            return controls.process(rows, [seq[n_prompt:] + w.tokens[:k] for k in ks])
    in_order = controls is not None and controls.reads_context
    while True:
        refill(w, mask_token_id, max_model_len - len(seq) - len(w))
        order = w.order()
        prune = w.leading_filled()
        num_filled = sum(1 for k in order if not w.is_mask[k])
        ids = seq + [w.tokens[k] for k in order]
        pos = list(range(len(seq))) + [len(seq) + k for k in order]
        logits = logits_fn(ids, pos)[len(seq) + num_filled :]
        res.forwards += 1
        room = min(params.max_tokens - (len(seq) - n_prompt), max_model_len - len(seq))
        n = commit_length(w.tokens[:prune], stop_ids, room)
        seq += w.tokens[:n]
        res.commits_per_step.append(n)
        if n and seq[-1] in stop_ids:
            res.finish_reason = "stop"
            break
        if n == room:
            break
        mask_slots = order[num_filled:]
        w.drop_front(n)
        before = list(w.is_mask)
        res.fills_per_step.append(fill(w, [k - n for k in mask_slots], logits, cfg, params, generator, judge,
                                       in_order))
        res.out_of_order_fills += sum(1 for k, m in enumerate(before) if m and not w.is_mask[k] and any(w.is_mask[:k]))
    res.output_ids = seq[n_prompt:]
    return res
