"""Stop-string matcher: unit cases and a brute-force oracle over random chunkings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.text.stop import StopStringMatcher, normalize_stop


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan character by character: stop at the first position where any stop string ends
    (the longest one if several end there)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def releasable(text: str, stops: list[str]) -> str:
    """Everything except the longest suffix that could still grow into a stop string."""
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


def run(stops, chunks, include=False):
    m = StopStringMatcher(stops, include)
    out = [m.feed(c) for c in chunks]
    return out, m.flush(), m


def test_no_stop_strings_pass_everything_through():
    out, tail, m = run(None, ["ab", "", "c"])
    assert out == ["ab", "", "c"] and tail == "" and not m.stopped


def test_partial_match_is_held_only_while_it_can_still_match():
    out, tail, m = run(["world"], ["Hello wo", "r", "m!"])
    # "wo" could start "world"; "worm" cannot, so it is released at once - not max(len)-1 chars late.
    assert out == ["Hello ", "", "worm!"]
    assert tail == "" and not m.stopped


def test_stop_spanning_chunks_is_excluded():
    out, tail, m = run(["STOP"], ["abc ST", "OP def"])
    assert out == ["abc ", ""] and tail == "" and m.matched == "STOP"


def test_include_stop_str_in_output_releases_without_holding_back():
    out, tail, m = run(["STOP"], ["abc ST", "OP def"], include=True)
    assert out == ["abc ST", "OP"] and m.stopped


def test_never_completed_prefix_is_released_at_the_end():
    out, tail, m = run(["</answer>"], ["42 </ans"])
    assert out == ["42 "] and tail == "</ans" and not m.stopped


def test_earliest_completion_wins_within_one_chunk():
    # "bc" completes (at index 3) before "abcd" would (index 4), whatever the list order.
    assert run(["abcd", "bc"], ["xabcd tail"])[0] == ["xa"]
    assert run(["z", "b", "a"], ["xyzab"])[0] == ["xy"]


@pytest.mark.parametrize("stops", [["ab", "abc"], ["abc", "ab"]])
def test_overlapping_prefixes_stop_at_the_shorter_one(stops):
    out, _, m = run(stops, ["x", "a", "bc", "y"])
    assert out == ["x", "", "", ""] and m.matched == "ab"
    out, _, m = run(stops, ["xab"], include=True)
    assert out == ["xab"] and m.matched == "ab"


def test_same_end_prefers_the_longer_stop():
    out, _, m = run(["abc", "bc"], ["xabc"])
    assert out == ["x"] and m.matched == "abc"


def test_nothing_after_a_stop_is_released():
    m = StopStringMatcher(["."])
    assert m.feed("one. two.") == "one"
    assert m.feed("three") == "" and m.flush() == "" and m.matched == "."


def test_normalize_stop():
    assert normalize_stop("x") == ("x",)
    assert normalize_stop(["a", "", "a", "b"]) == ("a", "b")
    assert normalize_stop(None) == ()
    with pytest.raises(TypeError):
        normalize_stop([1])


ALPHA = st.text(alphabet="abc", max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(ALPHA, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_matches_char_by_char_reference_for_any_chunking(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    want, want_stop = reference(text, stops, include)

    m = StopStringMatcher(stops, include)
    released, seen = "", ""
    for chunk in chunks:
        released += m.feed(chunk)
        seen += chunk
        if m.stopped:
            break
        # Released as soon as it cannot be the beginning of a stop string, never later.
        assert released == (seen if include else releasable(seen, [s for s in stops if s]))
    released += m.flush()
    assert released == want
    assert m.matched == want_stop
