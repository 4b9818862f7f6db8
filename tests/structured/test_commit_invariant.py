"""The ratchet invariant under grammars (issue 40): whatever the constraint — regexes and grammars
with bytes no token spells, control characters, multi-byte characters split across tokens — plain,
jump-forward and speculative decoding commit the same tokens, the committed K/V never runs ahead of
the committed tokens (``num_cached <= len(token_ids)`` after every step and at the finish), and
the K/V of every committed token equals a plain recompute of those tokens (one prefill in a fresh
engine). The regex ``"\\x80\\x16"`` was the case found: ``\\x16`` has no token in SmolLM2's
vocabulary, so after the forced ``"\\x80"`` the grammar is at a dead end; computing that tentative
row's mask used to stop the committed matcher, the engine then ended the request inside its
three-row commit and kept all three K/V rows for one token."""

from __future__ import annotations

import json

import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sampling_params import StructuredOutputsParams as S
from ratchetlm.structured.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from tests.speculative.conftest import make_engine

MAX_TOKENS = 8
# (decoding, options, jump-forward); the first is the reference: one token per forward, no forced tokens
MODES = [
    ("autoregressive", {}, False),
    ("autoregressive", {}, True),
    ("speculative", dict(method="ngram", depth=4), False),
    ("speculative", dict(method="ngram", depth=4, num_candidates=2), True),
    ("speculative", dict(method="ngram", depth=6, chunk_size=2), True),  # SCV: chunks on committed chunks
]

_COMPILERS: dict[int, GrammarCompiler] = {}


def _compiler(llm) -> GrammarCompiler:
    """One compiler for every engine of the test (each engine's own would build the ~1 s token trie
    again); a generous timeout, since the shared 2-core machine may be very busy."""
    if id(llm) not in _COMPILERS:
        _COMPILERS[id(llm)] = GrammarCompiler(llm.tokenizer, llm.model_config.vocab_size,
                                              llm.model_config.eos_token_ids, timeout_s=300)
    return _COMPILERS[id(llm)]


def engine(llm, decoding: str = "autoregressive", **kw) -> LLMEngine:
    eng = make_engine(llm, decoding, kv_cache_blocks=24, **kw)
    eng.controls._compiler = _compiler(llm)
    return eng


# Regex atoms (regex source text): ASCII, characters of 2-4 UTF-8 bytes (a token may hold part of one),
# bytes no SmolLM2 token spells (\x16, \x00), control characters raw and escaped, classes over them.
ATOMS = ["a", "b", "0", " ", "é", "€", "😀", r"\x80", "\x80", r"\x16", "\x16", r"\x00", "\x01", r"\x7f", r"\xff",
         r"\n", "\t", r"\u2028", "[a-c]", r"[\x00-\x1f]", r"[\x80-\xff]", "[é€]"]
QUANT = ["", "", "", "?", "{1,2}", "+"]


@st.composite
def regexes(draw) -> str:
    def seq() -> str:
        n = draw(st.integers(1, 4))
        return "".join(draw(st.sampled_from(ATOMS)) + draw(st.sampled_from(QUANT)) for _ in range(n))
    return seq() if draw(st.booleans()) else f"({seq()})|({seq()})"


@st.composite
def lark_grammars(draw) -> str:
    """``start:`` a sequence of string literals (JSON-escaped: \\u0016, \\u0080 ...) and regex terminals."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            text = "".join(draw(st.sampled_from(["a", "é", "\x80", "\x16", "\x00", "\x7f", "€", " "]))
                           for _ in range(draw(st.integers(1, 3))))
            parts.append(json.dumps(text))
        else:
            parts.append("/" + draw(st.sampled_from(["[a-c]+", r"[\x00-\x1f]", r"[\x80-\xff]{1,2}", "é?0"])) + "/")
    return "start: " + " ".join(parts)


constraints = st.one_of(regexes().map(lambda r: S(regex=r)), lark_grammars().map(lambda g: S(grammar=g)))
prompts = st.sampled_from(["0", "a\x80\x80a\x80\x80", "é€é€ abc abc", "\x16\x16\x16", "Write it: "])


class Probe:
    """Wraps an engine: checks the invariant after every step and keeps, for each finished request,
    its committed tokens and the K/V of the cached ones, read just before its blocks are freed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.final: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        finish = engine.scheduler.finish

        def finish_and_keep(seq, reason):
            if seq.seq_id not in self.final:
                self.check(seq)
                slots = engine.blocks.slots(seq, 0, seq.num_cached)
                self.final[seq.seq_id] = (list(seq.token_ids), engine.cache.k[:, slots].clone(),
                                          engine.cache.v[:, slots].clone())
            finish(seq, reason)

        engine.scheduler.finish = finish_and_keep

    @staticmethod
    def check(seq) -> None:
        assert seq.num_cached <= len(seq.token_ids), ("committed KV beyond committed tokens",
                                                      seq.num_cached, len(seq.token_ids))

    def run(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[int]:
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, params, strict=True)]
        while self.engine.has_unfinished():
            outs = self.engine.step()
            assert not [o.error for o in outs if o.error], [o.error for o in outs if o.error]
            for s in self.engine.seqs.values():
                if not s.is_finished:
                    self.check(s)
        return ids


def recompute_kv(llm, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens``' K/V from one plain prefill in a fresh engine (no prefix cache): the oracle."""
    cfg = EngineConfig(device="cpu", dtype="float32", kv_cache_blocks=16, progress=False, enable_prefix_caching=False)
    eng = LLMEngine(cfg, llm.engine.model, llm.model_config, tokenizer=llm.tokenizer)
    sid = eng.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    eng.step()
    seq = eng.seqs[sid]
    assert seq.num_cached == len(tokens) and not seq.is_finished
    slots = eng.blocks.slots(seq, 0, len(tokens))
    return eng.cache.k[:, slots], eng.cache.v[:, slots]


def assert_invariant_holds(llm, specs: list[S], prompt: str) -> None:
    prompt_ids = [llm.tokenize(prompt)] * len(specs)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=s) for s in specs]
    results = []
    for decoding, opts, jf in MODES:
        eng = engine(llm, decoding, jump_forward=jf,
                     **(dict(opts, depth_schedule="constant") if decoding == "speculative" else {}))
        probe = Probe(eng)
        ids = probe.run(prompt_ids, params)
        results.append([probe.final[i] for i in ids])
    for i in range(len(specs)):
        ref_tokens = results[0][i][0]
        for (decoding, opts, jf), res in zip(MODES, results, strict=True):
            assert res[i][0] == ref_tokens, (decoding, opts, jf, specs[i], res[i][0], ref_tokens)
        # one recompute of the longest cached prefix: a causal prefix's K/V is the prefix of it
        n = max(res[i][1].shape[1] for res in results)
        rk, rv = recompute_kv(llm, ref_tokens[:n])
        for res in results:
            _, k, v = res[i]
            torch.testing.assert_close(k, rk[:, : k.shape[1]], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, rv[:, : v.shape[1]], atol=1e-4, rtol=1e-4)


def test_the_found_case_commits_what_plain_decoding_does(llm_fp32):
    """``"\x80\x16"`` (issue 40's ``LLM().generate`` case): forced ``Â`` + ``\x80``, then only EOS (no
    token spells ``\x16``) — the jump-forward commit is those three tokens, as one token per forward gives."""
    probe = Probe(engine(llm_fp32, jump_forward=True))
    prompt = llm_fp32.tokenize("0")
    (sid,) = probe.run([prompt], [SamplingParams(max_tokens=16, temperature=0, structured=S(regex="\x80\x16"))])
    seq = probe.engine.seqs[sid]
    assert seq.finish_reason == "stop" and llm_fp32.tokenizer.decode(seq.output_ids, skip_special_tokens=True) == "\x80"
    assert seq.stats.get("forced_tokens_accepted") == 2, "the two forced tokens rode one forward"
    assert_invariant_holds(llm_fp32, [S(regex="\x80\x16")], "0")


def test_a_dead_end_in_a_tentative_row_leaves_the_committed_grammar_as_it_was(llm_fp32):
    m: GrammarMatcher = _compiler(llm_fp32).matcher(S(regex="\x80\x16"))
    forced = m.forced_tokens()
    assert len(forced) == 2
    rows = m.allowed([[], forced[:1], forced])  # the last row is the dead end: only EOS
    assert rows[2].nonzero().flatten().tolist() == [2]
    assert not m.done and m.valid_prefix(forced) == 2 and m.forced_tokens() == forced


def test_an_early_end_inside_a_commit_keeps_no_kv_past_its_last_token(llm_fp32, monkeypatch):
    """The engine's own half: if the controls end a request inside a multi-token commit (here: a
    matcher made to stop on a tentative row, as llguidance's consume-and-rollback did), the K/V rows
    past the last kept token are not committed, and those kept are the kept tokens' own."""
    def allowed_on_the_committed_matcher(self, paths):  # the old, state-moving way
        import llguidance.torch as llt

        bitmask = torch.full((len(paths), self.words), -1, dtype=torch.int32)
        for i, path in enumerate(paths):
            self.m.consume_tokens(path)
            llt.fill_next_token_bitmask(self.m, bitmask, i)
            self.m.rollback(len(path))
        unpacked = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return unpacked.reshape(len(paths), -1)[:, : self.vocab_size].bool()

    monkeypatch.setattr(GrammarMatcher, "allowed", allowed_on_the_committed_matcher)
    probe = Probe(engine(llm_fp32, jump_forward=True))
    prompt = llm_fp32.tokenize("0")
    (sid,) = probe.run([prompt], [SamplingParams(temperature=0.0, max_tokens=16, structured=S(regex="\x80\x16"))])
    tokens, k, v = probe.final[sid]
    assert len(tokens) == len(prompt) + 1, "the stopped matcher ended the 3-token commit after its first token"
    assert k.shape[1] == len(tokens)  # 3 rows were computed and accepted: the third is no committed token's
    rk, rv = recompute_kv(llm_fp32, tokens)
    torch.testing.assert_close(k, rk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, rv, atol=1e-4, rtol=1e-4)


@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(specs=st.lists(constraints, min_size=2, max_size=3), prompt=prompts)
@example(specs=[S(regex="\x80\x16"), S(regex=r"\x80\x16"), S(grammar='start: "a\\u0080\\u0016"')], prompt="0")
def test_random_constraints_keep_the_invariant_in_every_mode(llm_fp32, specs, prompt):
    compiler = _compiler(llm_fp32)
    valid = [s for s in specs if _compiles(compiler, s)]
    assume(valid)
    assert_invariant_holds(llm_fp32, valid, prompt)




def _compiles(compiler: GrammarCompiler, spec: S) -> bool:
    try:
        compiler.compile(spec)
    except GrammarError:
        return False
    return True
