"""Grammar-forced chains (jump-forward, on by default) on DeepSeek-V4: a verify step holds at most
the layout's state span, so a grammar that forces more tokens is proposed in several chains — the
request neither fails nor changes its output."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.layers.logits_processors import LogitsControls
from ratchetlm.sampling_params import SamplingParams

from .conftest import v4_engine

FORCED = [(7 * i + 3) % 96 for i in range(40)]  # 40 tokens the "grammar" forces after the prompt


class FixedPrefixGrammar:
    """The grammar-matcher surface LogitsControls uses, for a language ``FORCED`` + anything
    (the tiny V4 has no tokenizer a real grammar engine could compile against)."""

    def __init__(self) -> None:
        self.output: list[int] = []
        self.done = False

    def forced_tokens(self) -> list[int]:
        return FORCED[len(self.output):]

    def valid_prefix(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            i = len(self.output) + n
            if i < len(FORCED) and t != FORCED[i]:
                break
            n += 1
        return n

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:  # [n, V]
        out = torch.ones(len(paths), 96, dtype=torch.bool)
        for row, path in enumerate(paths):
            i = len(self.output) + len(path)
            if i < len(FORCED):
                out[row] = False
                out[row, FORCED[i]] = True
        return out

    def accept(self, tokens: list[int]) -> None:
        self.output += tokens


def _run(engine, jump_forward: bool):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    sid = engine.add_request([5, 6, 7, 8], params)
    seq = engine.seqs[sid]
    seq.controls = LogitsControls(params, seq.token_ids[:], 96, (), [], grammar=FixedPrefixGrammar(),
                                  jump_forward=jump_forward)
    chains = []
    while engine.has_unfinished():
        before = seq.num_output_tokens
        engine.step()
        chains.append(seq.num_output_tokens - before)
    assert seq.finish_reason == "length", seq.finish_reason
    return seq.output_ids, chains


@pytest.mark.parametrize("decoding", ["autoregressive", "mtp"])
def test_long_forced_chains_are_split_at_the_state_span(model, decoding):
    kw = {"decoding": "speculative", "decoding_options": {"method": "mtp"}} if decoding == "mtp" else {}
    plain, _ = _run(v4_engine(model), jump_forward=False)
    engine = v4_engine(model, **kw)
    out, chains = _run(engine, jump_forward=True)
    span = engine.runner.max_chain_tokens
    assert out == plain and out[:40] == FORCED
    assert max(chains) == span  # 15 forced tokens + the token after them, per verify step
