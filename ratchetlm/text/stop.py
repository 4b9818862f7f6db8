"""Stop strings over streamed text, with partial-match holdback.

The matcher sees a request's generated text in arbitrary chunks (one per engine step, which may
carry several committed tokens) and decides, independently of how the text was chunked:

* **where to stop** - at the first character position at which some stop string is complete.
  When two stop strings complete at the same position the longer one (earlier start) wins, so
  ``stop=["ab", "abc"]`` stops inside ``"abc"`` after ``"ab"``, and with ``["abc", "bc"]`` the text
  ``"xabc"`` is cut at ``"x"``;
* **what to release** - text is released as soon as it cannot be the beginning of a stop string;
  only the longest suffix that is a proper prefix of some stop string is held back.  With
  ``include_stop_str_in_output`` nothing needs holding back (a stop never removes text).  Text after
  the stop point is never released;
* held-back text is released by ``flush()`` if the request ends without completing a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable


def normalize_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """The OpenAI ``stop`` field (a string, a list of strings or None) as a tuple.

    Empty strings are dropped (they would match before any text); duplicates are removed.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__}")
    return tuple(dict.fromkeys(s for s in items if s))


class StopStringMatcher:
    """Per-request stop-string state.

    ``feed(text)`` returns the text that may be shown now; once a stop string completes,
    ``stopped`` is True, ``matched`` names it, the returned text ends at the stop (or after it,
    with ``include_stop_str_in_output``) and later feeds return ``""``.  ``flush()`` returns text still
    held back at the end of the request.
    """

    def __init__(self, stop: str | Iterable[str] | None = None, include_stop_str_in_output: bool = False):
        self.stops = normalize_stop(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._finished = False
        # Matches can straddle chunks, so keep the last (longest stop - 1) characters seen; the
        # final ``_held`` of them have not been released yet.
        self._context_len = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""
        self._held = 0

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        """Consume the next chunk of generated text; return what can be released now."""
        if self._finished or not text:
            return ""
        if not self.stops:
            return text
        seen = self._tail + text
        first_unreleased = len(self._tail) - self._held
        match = self._earliest_match(seen)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._finished = True
            self._tail, self._held = "", 0
            cut = start + len(stop) if self.include_stop_str_in_output else start
            return seen[first_unreleased:cut]
        hold = 0 if self.include_stop_str_in_output else self._partial_suffix_len(seen)
        # A suffix that could start a stop string never reaches into released text: if it did,
        # the released part would itself have been such a suffix and been held.
        hold = min(hold, len(seen) - first_unreleased)
        self._tail = seen[max(0, len(seen) - self._context_len) :] if self._context_len else ""
        self._held = hold
        return seen[first_unreleased : len(seen) - hold]

    def flush(self) -> str:
        """End of request without a stop: release any held-back text (``""`` after a stop)."""
        if self._finished:
            return ""
        self._finished = True
        out = self._tail[len(self._tail) - self._held :] if self._held else ""
        self._tail, self._held = "", 0
        return out

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        # The first occurrence of each stop string is its earliest-ending one; among stop strings,
        # order by end position, then by start (longer first).
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
