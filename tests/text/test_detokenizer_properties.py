"""Property tests: random Unicode text through the real tokenizer, pushed in random chunks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from ratchetlm.text.detokenizer import DecodeStreamDetokenizer, IncrementalDetokenizer

DETOKENIZERS = [IncrementalDetokenizer, DecodeStreamDetokenizer]
SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

SKIN_TONES = ["\U0001f3fb", "\U0001f3fc", "\U0001f3fd", "\U0001f3fe", "\U0001f3ff"]
EMOJI = [
    "🫨",
    "👍",
    "😀",
    "👨\u200d👩\u200d👧\u200d👦",  # family: ZWJ sequence
    "🏳️\u200d🌈",  # flag with variation selector + ZWJ
    "🧑🏽\u200d💻",  # skin tone inside a ZWJ sequence
    "🇯🇵",  # regional indicator pair
    "1️⃣",  # keycap
]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>assistant\n"]


def _alphabet(*ranges: tuple[int, int]) -> st.SearchStrategy[str]:
    return st.one_of(*(st.characters(min_codepoint=lo, max_codepoint=hi) for lo, hi in ranges))


PIECE = st.one_of(
    st.text(_alphabet((0x20, 0x7E)), max_size=6),  # ASCII
    st.text(_alphabet((0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3)), min_size=1, max_size=4),
    st.sampled_from(EMOJI),
    st.tuples(st.sampled_from(["👋", "👍", "🧑", "👩"]), st.sampled_from(SKIN_TONES)).map("".join),
    # base letter + 1-3 combining marks
    st.tuples(st.sampled_from("aeiouAZ"), st.text(_alphabet((0x0300, 0x036F)), min_size=1, max_size=3)).map(
        "".join
    ),
    st.text(_alphabet((0x0590, 0x05FF), (0x0600, 0x06FF)), min_size=1, max_size=5),  # Hebrew, Arabic
    st.sampled_from(SPECIAL),
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=4),
    st.sampled_from([" ", "\n", "\t", "  "]),
)
TEXT = st.lists(PIECE, min_size=1, max_size=12).map("".join)


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


@pytest.mark.parametrize("cls", DETOKENIZERS)
@SETTINGS
@given(text=TEXT, split=st.floats(0, 1), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_random_text_streams_exactly(raw_tokenizer, cls, text, split, sizes):
    ids = raw_tokenizer.encode(text, add_special_tokens=False).ids
    cut = int(split * len(ids))
    prompt, gen = ids[:cut], ids[cut:]
    full = raw_tokenizer.decode(ids, skip_special_tokens=False)
    want = full[len(raw_tokenizer.decode(prompt, skip_special_tokens=False)) :]

    batched, single = cls(raw_tokenizer, prompt), cls(raw_tokenizer, prompt)
    pieces = []
    for chunk in _chunks(gen, sizes):
        piece = batched.push_many(chunk)
        # A multi-token commit releases exactly what pushing its tokens one by one would.
        assert piece == "".join(single.push(t) for t in chunk)
        pieces.append(piece)
    streamed = "".join(pieces)
    assert streamed + batched.flush() == want
    if "\ufffd" not in full:
        # Valid text: nothing is left for flush and no replacement character ever leaks.
        assert "\ufffd" not in streamed
        assert streamed == want


@SETTINGS
@given(text=TEXT, split=st.floats(0, 1))
def test_per_token_output_matches_tokenizers_decode_stream(raw_tokenizer, text, split):
    ids = raw_tokenizer.encode(text, add_special_tokens=False).ids
    cut = int(split * len(ids))
    prompt, gen = ids[:cut], ids[cut:]
    # A raw DecodeStream run over the prompt; comparable only when the prompt ends on a character
    # boundary (otherwise the raw stream re-emits prompt text, which our contract forbids).
    if raw_tokenizer.decode(prompt, skip_special_tokens=False).endswith("\ufffd"):
        return
    reference = DecodeStream(skip_special_tokens=False)
    for t in prompt:
        reference.step(raw_tokenizer, t)
    expected = [reference.step(raw_tokenizer, t) or "" for t in gen]
    for cls in DETOKENIZERS:
        d = cls(raw_tokenizer, prompt)
        assert [d.push(t) for t in gen] == expected, cls.__name__


@pytest.mark.parametrize("cls", DETOKENIZERS)
@SETTINGS
@given(data=st.data())
def test_arbitrary_token_ids_still_match_full_decode(raw_tokenizer, cls, data):
    # Garbage a sampler could produce: stray continuation bytes, truncated characters, specials.
    vocab = raw_tokenizer.get_vocab_size()
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from([10813, 121, 118, 18645, 250, 216, 2, 0]))
    prompt = data.draw(st.lists(token, max_size=6))
    gen = data.draw(st.lists(token, max_size=24))
    d = cls(raw_tokenizer, prompt)
    out = "".join(d.push(t) for t in gen) + d.flush()
    dec = lambda ids: raw_tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert out == dec(prompt + gen)[len(dec(prompt)) :]


class ByteTokenizer:
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


@SETTINGS
@given(prompt=st.binary(max_size=8), gen=st.binary(max_size=40))
def test_window_diff_matches_python_utf8_codec_on_arbitrary_bytes(prompt, gen):
    # Independent oracle: CPython's UTF-8 decoder with maximal-subpart replacement.
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, list(prompt))
    out = "".join(d.push(b) for b in gen) + d.flush()
    assert out == (prompt + gen).decode("utf-8", "replace")[len(prompt.decode("utf-8", "replace")) :]
