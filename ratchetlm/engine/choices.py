"""One prompt's ``n`` / ``best_of`` choices: the engine requests they become, and the
:class:`~ratchetlm.outputs.RequestOutput` they are gathered back into (vLLM's parallel sampling,
done in front of the engine as vLLM does it: one engine request per choice)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.outputs import CompletionOutput, RequestOutput, with_decoded
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence
from ratchetlm.text.stream import TextStream


def choice_params(sp: SamplingParams, j: int) -> SamplingParams:
    """Engine params of choice ``j``: one sequence; with a seed, ``seed + j`` (vLLM's child seeds),
    so the choices are independent and each is reproducible. Prompt logprobs are computed once, by
    choice 0; ``best_of`` needs every sample's logprob to rank them."""
    seed = None if sp.seed is None else sp.seed + j
    logprobs = sp.logprobs
    if sp.best_of is not None and sp.best_of > sp.n and logprobs is None:
        logprobs = 0
    return dataclasses.replace(sp, n=1, best_of=None, seed=seed, logprobs=logprobs,
                               prompt_logprobs=sp.prompt_logprobs if j == 0 else None)


@dataclass
class ChoiceRun:
    """What one choice's engine request produced (filled by :func:`choice_events`)."""

    index: int  # prompt position in the submitted list
    choice: int
    params: SamplingParams  # the prompt's params (n, best_of, logprobs as the user gave them)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class StreamEvent:
    """Committed tokens of one choice of one request in one engine step, with the text they release."""

    index: int  # position of the request in the submitted list
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    choice: int = 0  # which of the prompt's n choices
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it


def submit_choices(engine: LLMEngine, tokenizer: Any, encoded: list[list[int]],
                   sampling_params: SamplingParams | Seq[SamplingParams],
                   special_ids: frozenset[int] = frozenset()) -> dict[int, tuple[ChoiceRun, TextStream]]:
    """Queue every choice of every prompt; returns, per engine request id, its ``(ChoiceRun, TextStream)``.
    ``special_ids``: the tokenizer's special tokens, left out of the text of a choice with
    ``skip_special_tokens`` (text/detokenizer.py:special_token_ids).
    Everything is validated before anything stays queued: on an error every queued choice is released."""
    if isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * len(encoded)
    elif len(sampling_params) != len(encoded):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(encoded)} prompts")
    else:
        params_list = list(sampling_params)
    runs: dict[int, tuple[ChoiceRun, TextStream]] = {}
    try:
        for i, (ids_i, sp) in enumerate(zip(encoded, params_list, strict=True)):
            leader = None  # the prompt's first choice; the others share its prompt KV
            for j in range(sp.num_samples):
                cp = choice_params(sp, j)
                sid = engine.add_request(ids_i, cp, share_prompt_with=leader)
                leader = sid if leader is None else leader
                runs[sid] = (ChoiceRun(i, j, sp), TextStream.for_request(tokenizer, ids_i, cp, special_ids))
    except BaseException:
        for sid in runs:
            engine.abort(sid)
            engine.release(sid)
        raise
    return runs


def choice_events(engine: LLMEngine, runs: dict[int, tuple[ChoiceRun, TextStream]]) -> Iterator[StreamEvent]:
    """Step the engine until it is idle, yielding each choice's committed tokens and the text they release
    (stop strings end a request here, in the text layer; EOS / stop token ids end it but are not text)."""
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id not in runs:
                continue
            run, ts = runs[out.seq_id]
            visible = out.new_token_ids
            stop_tok = bool(visible) and engine.is_stop_token(out.seq_id, visible[-1])
            if out.finish_reason == "stop" and stop_tok:
                visible = visible[:-1]
            delta = ts.feed(visible)
            finished, reason = out.finished, out.finish_reason
            if delta.stopped and not finished:
                engine.abort(out.seq_id, "stop")
                finished, reason = True, "stop"
            text = delta.text + (ts.finish() if finished else "")
            run.token_ids += out.new_token_ids
            run.text += text
            if finished:
                run.finish_reason = reason
                run.stop_reason = ts.matched_stop
                last = out.new_token_ids[-1] if out.new_token_ids else None
                if reason == "stop" and run.stop_reason is None and last in run.params.stop_token_ids \
                        and last not in engine.seqs[out.seq_id].eos_token_ids:
                    run.stop_reason = last
            yield StreamEvent(run.index, out.new_token_ids, text, finished, reason, run.choice, run.stop_reason)


def completion(run: ChoiceRun, seq: Sequence, decode: Callable[[int], str]) -> CompletionOutput:
    # a stop string ends the request in the text layer: the tokens are those the events carried
    ids = seq.output_ids if run.finish_reason != "stop" or not run.token_ids else run.token_ids
    lps = seq.logprobs[: len(ids)] if seq.logprobs else None
    cumulative = None
    if lps is not None:
        cumulative = float(sum(float(d[t]) for d, t in zip(lps, ids, strict=False) if t in d))
    keep = run.params.logprobs is not None
    return CompletionOutput(
        index=run.choice, text=run.text, token_ids=list(ids), cumulative_logprob=cumulative,
        logprobs=[with_decoded(d, decode) or {} for d in lps] if keep and lps is not None else None,
        finish_reason=run.finish_reason, stop_reason=run.stop_reason)


def request_output(request_id: str, prompt: str | None, leader: Sequence, params: SamplingParams,
                   outs: list[CompletionOutput], decode: Callable[[int], str]) -> RequestOutput:
    """Gather a prompt's choices; with ``best_of`` keep the ``n`` of highest cumulative logprob."""
    outs = sorted(outs, key=lambda o: o.index)
    if params.best_of is not None and params.best_of > params.n:
        outs = sorted(outs, key=lambda o: -(o.cumulative_logprob or 0.0))[: params.n]
        outs = [dataclasses.replace(o, index=k) for k, o in enumerate(outs)]
    prompt_lps = None
    if leader.prompt_logprobs:
        prompt_lps = [with_decoded(d, decode) for d in leader.prompt_logprobs]
    return RequestOutput(
        request_id=request_id, prompt=prompt, prompt_token_ids=leader.token_ids[: leader.num_prompt_tokens],
        prompt_logprobs=prompt_lps, outputs=outs, finished=all(o.finish_reason is not None for o in outs),
        metrics=dict(leader.stats, num_preemptions=leader.num_preemptions),
        num_cached_tokens=leader.num_prefix_hit_tokens)
