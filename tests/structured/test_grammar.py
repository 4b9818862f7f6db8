"""Constraints compile (or fail with a message naming the problem, in bounded time) and the
engine's output matches them: JSON schema, json_object, regex, choice, GBNF/Lark grammars."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ratchetlm import SamplingParams
from ratchetlm.sampling_params import StructuredOutputsParams as S
from ratchetlm.structured.grammar import GrammarCompiler, GrammarError


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer):
    return GrammarCompiler(smollm_tokenizer, len(smollm_tokenizer), (2,))


@pytest.mark.parametrize("spec, needle", [
    (S(json={"type": "strin"}), "strin"),
    (S(json={"type": "string", "pattern": "(((a"}), "unclosed group"),
    (S(regex="[0-9"), "regex"),
    (S(grammar="root ::= ( \"a\" "), "grammar"),
])
def test_invalid_constraints_name_the_problem(compiler, spec, needle):
    with pytest.raises(GrammarError, match=re.escape(needle)):
        compiler.compile(spec)


def test_invalid_json_schema_text_is_a_value_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{not json")


def test_compilation_is_bounded_in_time(smollm_tokenizer):
    slow = GrammarCompiler(smollm_tokenizer, len(smollm_tokenizer), (2,), timeout_s=0.0)  # its first compile
    with pytest.raises(GrammarError, match="did not compile within"):                    # builds the token trie
        slow.compile(S(regex="[a-z]+"))


def test_compiled_constraints_are_cached(compiler):
    a = compiler.compile(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert compiler.compile(S(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')) is a


def gen(llm, prompt: str, spec: S, max_tokens: int = 40, **kw) -> str:
    chat = llm.apply_chat_template([{"role": "user", "content": prompt}])
    out = llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec, **kw))[0]
    assert out.finish_reason == "stop", out
    return out.text


def test_outputs_match_their_constraints(llm_fp32):
    assert re.fullmatch(r"\d{3}-\d{4}", gen(llm_fp32, "Give me a phone number.", S(regex=r"\d{3}-\d{4}")))
    assert gen(llm_fp32, "Is the sky green? Answer yes or no.", S(choice=["yes", "no"])) in ("yes", "no")
    assert isinstance(json.loads(gen(llm_fp32, "Describe a cat as JSON.", S(json_object=True), max_tokens=60)), dict)
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    assert re.fullmatch(r"The answer is \d+\.", gen(llm_fp32, "What is 2 + 2?", S(grammar=gbnf)))
    lark = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    assert gen(llm_fp32, "Name a color.", S(grammar=lark)) in ("color: red", "color: green", "color: blue")


def test_sampled_output_validates_against_its_schema(llm_fp32):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "minItems": 1, "maxItems": 3}},
              "required": ["n", "tags"], "additionalProperties": False}
    chat = llm_fp32.apply_chat_template([{"role": "user", "content": "Make up some JSON."}])
    outs = llm_fp32.generate([chat] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                         structured=S(json=schema)) for s in range(4)])
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)


def test_ignore_eos_still_stops_when_the_grammar_is_complete(llm_fp32):
    assert gen(llm_fp32, "Pick one.", S(choice=["alpha", "beta"]), ignore_eos=True) in ("alpha", "beta")


def test_a_tokenizer_llguidance_cannot_convert_is_spelled_out():
    """The bundled WeDLM model's SentencePiece-style word tokenizer (a Metaspace decoder llguidance
    does not read; every token starts with "▁"): token bytes are given explicitly, and the mask for
    " 1[0-9]" admits exactly the tokens " 1" and " 10" .. " 19". (This toy vocabulary has no token for
    a bare space, so a grammar that forces one cannot be served with it; real SentencePiece
    vocabularies have byte fallback.)"""
    from ratchetlm.models.loader import resolve
    from ratchetlm.models.tokenizer import load_tokenizer
    from tests.wedlm.conftest import TRAINED

    tok = load_tokenizer(resolve(str(TRAINED)))
    m = GrammarCompiler(tok, len(tok), (tok.eos_token_id,)).matcher(S(regex=" 1[0-9]"))
    allowed = set(m.allowed([[]])[0].nonzero().flatten().tolist())
    expect = {t for t in range(len(tok)) if re.fullmatch(r"▁1[0-9]?", tok.convert_ids_to_tokens(t))}
    assert len(expect) == 11 and allowed == expect
