"""TextStream on the real tokenizer: detokenizer + stop strings as the server drives them."""

from __future__ import annotations

import pytest

from ratchetlm.text.detokenizer import DecodeStreamDetokenizer, IncrementalDetokenizer
from ratchetlm.text.stream import TextDelta, TextStream

SENTENCE = "Hello world, this is a test."  # Hello | Ġworld | , | Ġthis | Ġis | Ġa | Ġtest | .


@pytest.fixture(params=[IncrementalDetokenizer, DecodeStreamDetokenizer])
def make(request, hf_tokenizer):
    prompt = hf_tokenizer.encode("Say something:", add_special_tokens=False)

    def build(stop=None, include=False):
        detok = request.param(hf_tokenizer, prompt)
        return TextStream(
            hf_tokenizer, prompt, stop=stop, include_stop_str_in_output=include, detokenizer=detok
        )

    return build


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def feed_each(stream, token_ids):
    return [stream.feed([t]) for t in token_ids]


def test_without_stop_strings_stream_equals_full_decode(make, hf_tokenizer):
    s = make()
    gen = ids(hf_tokenizer, " 你好 🫨 done<|im_end|>")
    deltas = feed_each(s, gen)
    assert "".join(d.text for d in deltas) + s.finish() == " 你好 🫨 done<|im_end|>" == s.text
    assert not any(d.stopped for d in deltas)


def test_stop_string_spanning_two_tokens(make, hf_tokenizer):
    s = make(stop="lo wor")
    deltas = feed_each(s, ids(hf_tokenizer, SENTENCE))
    # "Hello" -> "lo" may begin the stop string and is held; " world" completes it.
    assert deltas[:2] == [TextDelta("Hel", False), TextDelta("", True)]
    assert all(d == TextDelta("", True) for d in deltas[2:])
    assert s.finish() == "" and s.text == "Hel" and s.matched_stop == "lo wor"


def test_stop_inside_a_multi_token_commit_earliest_match_wins(make, hf_tokenizer):
    s = make(stop=[" test", "is", "Hello"])
    # Committed in one step: "Hello" ends first (not the list order, not " test").
    assert s.feed(ids(hf_tokenizer, SENTENCE)) == TextDelta("", True)
    assert s.matched_stop == "Hello"
    s = make(stop=[" test", "is"])
    assert s.feed(ids(hf_tokenizer, SENTENCE)) == TextDelta("Hello world, th", True)
    assert s.feed(ids(hf_tokenizer, " more")) == TextDelta("", True)
    assert s.finish() == ""


def test_stop_never_completed_is_released_at_finish(make, hf_tokenizer):
    s = make(stop=["test!"])
    deltas = feed_each(s, ids(hf_tokenizer, SENTENCE[:-1]))  # ends in " test"
    assert "".join(d.text for d in deltas) == "Hello world, this is a "
    assert s.finish() == "test"
    assert not s.stopped and s.text == SENTENCE[:-1]


def test_include_stop_str_in_output(make, hf_tokenizer):
    s = make(stop="world", include=True)
    deltas = feed_each(s, ids(hf_tokenizer, SENTENCE))
    assert "".join(d.text for d in deltas) == "Hello world"
    assert deltas[1].stopped and not deltas[0].stopped


@pytest.mark.parametrize("stops", [["ab", "abc"], ["abc", "ab"]])
def test_overlapping_stop_prefixes(make, hf_tokenizer, stops):
    s = make(stop=stops)
    assert s.feed(ids(hf_tokenizer, "grab abcdef")) == TextDelta("gr", True)
    assert s.matched_stop == "ab"


def test_stop_string_made_of_a_multi_token_character(make, hf_tokenizer):
    s = make(stop="🫨!")
    gen = ids(hf_tokenizer, "a 🫨 b 🫨! c")
    deltas = feed_each(s, gen)
    assert "".join(d.text for d in deltas) == "a 🫨 b "
    first = next(k for k, d in enumerate(deltas) if d.stopped)
    # The stop is reported at the token that completes it, not earlier or later.
    assert "🫨!" in hf_tokenizer.decode(gen[: first + 1]) and "🫨!" not in hf_tokenizer.decode(gen[:first])
    assert not any("\ufffd" in d.text for d in deltas)


def test_mid_character_end_drains_through_the_stop_matcher(make, hf_tokenizer):
    s = make(stop="zzz")
    assert s.feed(ids(hf_tokenizer, "ok ") + [10813, 121]) == TextDelta("ok ", False)
    assert s.finish() == "\ufffd"


def test_default_detokenizer_is_built_from_the_tokenizer(hf_tokenizer):
    s = TextStream(hf_tokenizer, ids(hf_tokenizer, "x"), stop=".")
    assert isinstance(s.detokenizer, DecodeStreamDetokenizer)
    assert s.feed(ids(hf_tokenizer, " yes. no")) == TextDelta(" yes", True)


# skip_special_tokens (vLLM's default): the text is HF's decode(..., skip_special_tokens=True)
SPECIAL_IDS = [0, 1, 2, 3, 16]  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, <empty_output>


def test_special_token_ids_are_what_hf_decode_skips(hf_tokenizer):
    from ratchetlm.text.detokenizer import special_token_ids

    special = special_token_ids(hf_tokenizer)
    assert set(SPECIAL_IDS) <= special and ids(hf_tokenizer, "Hello")[0] not in special
    for t in sorted(special):  # each one alone decodes to nothing when skipped, and to itself when kept
        assert hf_tokenizer.decode([t], skip_special_tokens=True) == ""
        assert hf_tokenizer.decode([t], skip_special_tokens=False) != ""


@pytest.mark.parametrize("chunk", [1, 3])
def test_skipped_special_tokens_leave_the_text_as_hf_decodes_it(hf_tokenizer, chunk):
    from ratchetlm.text.detokenizer import special_token_ids

    prompt = [1] + ids(hf_tokenizer, "user\nSay hi") + [2, 198, 1] + ids(hf_tokenizer, "assistant\n")
    gen = ids(hf_tokenizer, "Hi there!") + [2, 198, 1] + ids(hf_tokenizer, "user\nMore é") + [0, 16]
    for skip in (True, False):
        ts = TextStream(hf_tokenizer, prompt, skip_ids=special_token_ids(hf_tokenizer) if skip else frozenset())
        out = "".join(ts.feed(gen[i:i + chunk]).text for i in range(0, len(gen), chunk)) + ts.finish()
        full, head = (hf_tokenizer.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                      for x in (prompt + gen, prompt))
        assert out == full[len(head):]
        assert ("<|im_end|>" in out) is not skip


def test_a_stop_string_is_matched_on_the_skipped_text(hf_tokenizer):
    from ratchetlm.text.detokenizer import special_token_ids

    gen = ids(hf_tokenizer, "Hi") + [2] + ids(hf_tokenizer, " there. Bye")
    ts = TextStream(hf_tokenizer, [], stop="Hi there", skip_ids=special_token_ids(hf_tokenizer))
    assert ts.feed(gen).stopped and ts.text == ""
