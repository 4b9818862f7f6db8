"""One prompt's ``n`` / ``best_of`` choices: the engine requests they become, and the
:class:`~ratchetlm.outputs.RequestOutput` they are gathered back into (vLLM's parallel sampling,
done in front of the engine as vLLM does it: one engine request per choice)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ratchetlm.outputs import CompletionOutput, RequestOutput, with_decoded
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence


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
    """What one choice's engine request produced (filled by ``LLM``'s event loop)."""

    index: int  # prompt position in the submitted list
    choice: int
    params: SamplingParams  # the prompt's params (n, best_of, logprobs as the user gave them)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
