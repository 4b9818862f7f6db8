"""Incremental detokenizers against the full decode, on the real SmolLM2 tokenizer and a byte toy."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from ratchetlm.text.detokenizer import (
    DecodeStreamDetokenizer,
    IncrementalDetokenizer,
    decode_fn,
    make_detokenizer,
)

DETOKENIZERS = [IncrementalDetokenizer, DecodeStreamDetokenizer]
SHAKE = [10813, 121, 118]  # 🫨 in SmolLM2's byte-level BPE: three tokens, four bytes
NI = [18645, 250]  # 你


class ByteTokenizer:
    """Protocol-only tokenizer: one id per byte, decoded by Python's own UTF-8 codec."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def oracle(tok, prompt, generated):
    """What the stream must add up to: the full decode minus the decoded prompt."""
    decode = decode_fn(tok)
    return decode(prompt + generated)[len(decode(prompt)) :]


@pytest.fixture(params=["hf", "raw"])
def tok(request, hf_tokenizer, raw_tokenizer):
    return hf_tokenizer if request.param == "hf" else raw_tokenizer


def encode(tok, text):
    if isinstance(tok, Tokenizer):
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode(text, add_special_tokens=False)


def test_tokenizer_facts_from_the_issue(raw_tokenizer):
    assert encode(raw_tokenizer, "🫨") == SHAKE
    assert encode(raw_tokenizer, "你") == NI


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize("char,ids", [("🫨", SHAKE), ("你", NI)])
def test_multi_token_character_emits_at_the_resolving_token(cls, tok, char, ids):
    prompt = encode(tok, "Say it:")
    d = cls(tok, prompt)
    pushes = [d.push(i) for i in ids]
    # Without the U+FFFD-in-prefix fallback the last push would return "" and the
    # character would only surface at flush().
    assert pushes == [""] * (len(ids) - 1) + [char]
    assert d.flush() == ""


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize(
    "prompt_text,gen_text",
    [
        ("Translate to Chinese:", " 你好世界，今天天气很好。"),
        ("Emoji please", " 👍🏽 and 👨\u200d👩\u200d👧 🫨🫨 done"),
        ("<|im_start|>user\n日本語<|im_end|>\n", "<|im_start|>assistant\nはい、é שלום مرحبا<|im_end|>"),
        ("", "plain ASCII text, nothing fancy."),
    ],
)
def test_stream_concatenation_equals_full_decode(cls, tok, prompt_text, gen_text):
    prompt, gen = encode(tok, prompt_text), encode(tok, gen_text)
    d = cls(tok, prompt)
    pieces = [d.push(i) for i in gen]
    assert "".join(pieces) == oracle(tok, prompt, gen) == gen_text
    assert not any("\ufffd" in p for p in pieces)
    assert d.flush() == ""


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_generation_ending_mid_character_drains_on_flush(cls, tok):
    prompt = encode(tok, "x")
    d = cls(tok, prompt)
    assert d.push_many(SHAKE[:2]) == ""
    tail = d.flush()
    assert tail == oracle(tok, prompt, SHAKE[:2]) == "\ufffd"
    assert d.flush() == ""


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_prompt_ending_mid_character_never_re_emits_prompt_text(cls, tok):
    # The prompt's dangling bytes already count as emitted (as one U+FFFD), so by the
    # contract the completed character is not streamed; prompt text must never leak.
    prompt = encode(tok, "hello ") + SHAKE[:2]
    gen = [SHAKE[2]] + encode(tok, " ok")
    d = cls(tok, prompt)
    out = "".join(d.push(i) for i in gen) + d.flush()
    assert out == oracle(tok, prompt, gen) == " ok"


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_special_tokens_are_kept_mid_stream(cls, tok):
    prompt = encode(tok, "hi")
    gen = encode(tok, " there<|im_end|>")
    d = cls(tok, prompt)
    assert d.push_many(gen) == " there<|im_end|>"


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_prompt_ids_may_be_a_tensor(cls, tok):
    prompt = encode(tok, "Count: 1 2 3")
    d = cls(tok, torch.tensor(prompt))
    assert d.push_many(torch.tensor(encode(tok, " 4 5"))) == " 4 5"


@pytest.mark.parametrize(
    "prompt,gen",
    [
        (list(b"ab"), list("日本🫨é".encode())),
        (list("日".encode())[:2], list("日".encode())[2:] + list(b"x")),
        ([], [0xF0, 0x9F, 0x98, ord("a"), 0x80, 0xE6, 0x97]),  # truncated + stray bytes
    ],
)
def test_window_diff_works_with_any_decode_protocol(prompt, gen):
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, prompt)
    out = "".join(d.push(i) for i in gen) + d.flush()
    assert out == tok.decode(prompt + gen)[len(tok.decode(prompt)) :]


def test_factory_prefers_decode_stream_when_a_rust_backend_exists(hf_tokenizer, raw_tokenizer):
    assert isinstance(make_detokenizer(hf_tokenizer, []), DecodeStreamDetokenizer)
    assert isinstance(make_detokenizer(raw_tokenizer, []), DecodeStreamDetokenizer)
    assert isinstance(make_detokenizer(ByteTokenizer(), []), IncrementalDetokenizer)
    with pytest.raises(TypeError):
        DecodeStreamDetokenizer(ByteTokenizer(), [])
    with pytest.raises(TypeError):
        make_detokenizer(object(), [])


def test_decode_stream_recovers_from_a_non_monotonic_decoder():
    # Fuse + Replace("ab" -> "X") rewrites text that was already emitted ("a" then "X"), which
    # makes tokenizers' DecodeStream raise "Invalid prefix" and stay broken. Exactness is
    # impossible here; the detokenizer must keep going and agree with the window-diff one.
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    gen = [1, 2, 3, 1, 3]
    outputs = []
    for cls in DETOKENIZERS:
        d = cls(tok, [3])
        outputs.append([d.push(i) for i in gen] + [d.flush()])
    assert outputs[0] == outputs[1] == ["a", "", "c", "a", "c", ""]
