"""Incremental detokenization: turn a growing list of token ids into text deltas.

Contract shared by every detokenizer here, for a prompt ``P`` and generated ids ``G``
(``decode`` is the tokenizer's plain decode with special tokens kept and no
tokenization-space clean-up):

    "".join(pushes) + flush() == decode(P + G)[len(decode(P)):]

exactly, whatever the tokens are.  A push returns ``""`` while the text so far
ends inside a multi-byte UTF-8 character (decode ends in U+FFFD) and returns that
character at the push of the token that completes it.  The engine never calls
these: it emits token ids, and the streaming layer (``ratchetlm.text.stream``)
owns one detokenizer per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as RawTokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"

# Window size in tokens. A UTF-8 character is at most 4 bytes and every token
# carries at least one byte, so a character ending at the newest token starts
# inside the last 4 tokens.
WINDOW = 4

# Prompt tokens the DecodeStream is primed with; only the tail matters for the
# diff, and priming the whole prompt would decode it inside time-to-first-token.
PRIME_TOKENS = 8

DecodeFn = Callable[[Sequence[int]], str]


@runtime_checkable
class SupportsDecode(Protocol):
    """Anything with ``decode(ids) -> str``; HF tokenizers are recognised and called with
    ``skip_special_tokens=False`` (and ``clean_up_tokenization_spaces=False`` for transformers)."""

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str: ...


def as_ids(ids: Iterable[int] | Any) -> list[int]:
    # Accept torch tensors / numpy arrays (``tolist``) as well as plain sequences.
    if hasattr(ids, "tolist"):
        return [int(i) for i in ids.tolist()]
    return [int(i) for i in ids]


def raw_tokenizer(tokenizer: Any) -> RawTokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` whose ``decode`` is exactly this tokenizer's decode, or None.

    A transformers fast tokenizer qualifies only when its ``_decode`` is the stock one, which (with
    clean-up off) is a plain call into the backend; a subclass that post-processes text does not.
    """
    if isinstance(tokenizer, RawTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, RawTokenizer):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - transformers is a hard dependency today
        return None
    if getattr(type(tokenizer), "_decode", None) is not TokenizersBackend._decode:
        return None
    return backend


def decode_fn(tokenizer: Any) -> DecodeFn:
    """A ``ids -> text`` function for ``tokenizer`` that keeps special tokens and never cleans up spaces."""
    raw = raw_tokenizer(tokenizer)
    if raw is not None:
        # The Rust decode is ~5x cheaper per call than going through transformers.
        return lambda ids: raw.decode(ids, skip_special_tokens=False)
    if hasattr(tokenizer, "clean_up_tokenization_spaces"):  # transformers (slow or customised)
        return lambda ids: tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    if isinstance(tokenizer, SupportsDecode):
        return lambda ids: tokenizer.decode(list(ids))
    raise TypeError(f"cannot decode with {type(tokenizer).__name__}: it has no decode(ids) method")


class IncrementalDetokenizer:
    """Window-diff detokenizer: per push, decode the last ``WINDOW`` tokens and the same window
    without the newest token, and emit the difference.

    Cost per push is two decodes of at most ``WINDOW`` tokens, except at the token that resolves
    a character whose bytes span several tokens: there the re-decoded window prefix itself
    contains U+FFFD, the difference is unreliable (it can be shorter than the prefix), and the
    push falls back to decoding the whole sequence and diffing against ``emitted_len``.  For text
    where most characters span several tokens (CJK or emoji with SmolLM2's English-centric BPE)
    that fallback is the common case and a push costs O(N): ~4 ms at 10k tokens vs ~12 us for
    English (``benchmarks/bench_detok.py``).  It is kept for tokenizers without a Rust backend.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Iterable[int] | Any) -> None:
        self._decode = decode_fn(tokenizer)
        self.tokens: list[int] = as_ids(prompt_ids)
        # Characters of decode(tokens) already accounted for; the prompt counts as emitted.
        self.emitted_len = len(self._decode(self.tokens))

    def push(self, token_id: int) -> str:
        """Append one token; return the text it makes final (possibly ``""``)."""
        tokens = self.tokens
        tokens.append(int(token_id))
        start = max(0, len(tokens) - WINDOW)
        window_text = self._decode(tokens[start:])
        if window_text.endswith(REPLACEMENT):
            return ""  # mid-character: wait for the bytes that complete it
        prefix_text = self._decode(tokens[start:-1])
        if REPLACEMENT in prefix_text:
            # The prefix decode shows partial bytes as U+FFFD that the newest token resolved,
            # so its length says nothing about what was emitted: diff against the global cursor.
            new_text = self._decode(tokens)[self.emitted_len :]
        else:
            new_text = window_text[len(prefix_text) :]
        self.emitted_len += len(new_text)
        return new_text

    def push_many(self, token_ids: Iterable[int] | Any) -> str:
        """Append several tokens committed in one step; same text as pushing them one by one."""
        ids = as_ids(token_ids)
        if len(ids) <= 1:
            return self.push(ids[0]) if ids else ""
        tokens = self.tokens
        before = len(tokens)
        start = max(0, before - (WINDOW - 1))
        tokens.extend(ids)
        window_text = self._decode(tokens[start:])
        prefix_text = self._decode(tokens[start:before])
        if window_text.endswith(REPLACEMENT) or REPLACEMENT in prefix_text:
            # Rare (a character split across the batch edge): replay token by token so text
            # completed inside the batch is still emitted now and the fallback logic applies.
            del tokens[before:]
            return "".join(self.push(t) for t in ids)
        new_text = window_text[len(prefix_text) :]
        self.emitted_len += len(new_text)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a dangling partial character, as U+FFFD)."""
        final = self._decode(self.tokens)
        out = final[self.emitted_len :]
        self.emitted_len = len(final)
        return out


class DecodeStreamDetokenizer:
    """Same contract as ``IncrementalDetokenizer``, driven by ``tokenizers.decoders.DecodeStream``.

    The Rust stream keeps only the ids since its previous emission and does one boundary
    crossing per token, with no O(N) fallback for multi-token characters.  Two gaps in the
    stream's own behaviour are closed here:

    * primed with ids whose decode ends mid-character, the stream keeps no prefix and its first
      emission restarts at the primed text; those characters are cut off again;
    * a non-monotonic decode raises ``Invalid prefix``; the step is then answered from the global
      cursor and the stream is re-primed.

    ``flush`` decodes the whole sequence once (end of request only).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Iterable[int] | Any) -> None:
        raw = raw_tokenizer(tokenizer)
        if raw is None:
            raise TypeError(f"{type(tokenizer).__name__} has no plain tokenizers.Tokenizer backend")
        self._raw = raw
        self.tokens: list[int] = as_ids(prompt_ids)
        self._prompt_len = len(self.tokens)
        self._prompt_chars: int | None = None  # len(decode(prompt)), computed only when needed
        self._emitted_chars = 0  # generated characters emitted so far
        self._prime(unemitted=0)  # the prompt counts as emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._raw.decode(ids, skip_special_tokens=False)

    def _prime(self, unemitted: int) -> None:
        """Restart the stream on the last tokens; ``unemitted`` trailing characters of the current
        full decode have not been emitted yet."""
        ids = self.tokens[-PRIME_TOKENS:]
        self._stream = DecodeStream(ids=ids, skip_special_tokens=False)
        primed_text = self._decode(ids) if ids else ""
        # A primed decode ending mid-character is not adopted as the stream's prefix, so its
        # next emission repeats the primed text; cut what of it was already emitted.
        self._cut = len(primed_text) - unemitted if primed_text.endswith(REPLACEMENT) else 0

    def push(self, token_id: int) -> str:
        """Append one token; return the text it makes final (possibly ``""``)."""
        token_id = int(token_id)
        self.tokens.append(token_id)
        try:
            chunk = self._stream.step(self._raw, token_id)
        except Exception as exc:  # the binding raises a bare Exception for InvalidPrefix
            if "Invalid prefix" not in str(exc):
                raise
            return self._resync()
        if chunk is None:
            return ""
        if self._cut:
            chunk, self._cut = chunk[self._cut :], 0
        self._emitted_chars += len(chunk)
        return chunk

    def push_many(self, token_ids: Iterable[int] | Any) -> str:
        """Append several tokens committed in one step; same text as pushing them one by one."""
        return "".join(self.push(t) for t in as_ids(token_ids))

    def _emitted_offset(self) -> int:
        if self._prompt_chars is None:
            self._prompt_chars = len(self._decode(self.tokens[: self._prompt_len]))
        return self._prompt_chars + self._emitted_chars

    def _resync(self) -> str:
        # The tokenizer produced a decode that does not extend the stream's prefix: answer this
        # step from the global cursor, as the window-diff fallback does, and start a new stream.
        full = self._decode(self.tokens)
        offset = self._emitted_offset()
        new_text = "" if full.endswith(REPLACEMENT) else full[offset:]
        self._emitted_chars += len(new_text)
        self._prime(unemitted=len(full) - offset - len(new_text))
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a dangling partial character, as U+FFFD)."""
        out = self._decode(self.tokens)[self._emitted_offset() :]
        self._emitted_chars += len(out)
        self._prime(unemitted=0)
        return out


Detokenizer = IncrementalDetokenizer | DecodeStreamDetokenizer


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(ids, skip_special_tokens=True)`` leaves out: the added tokens marked special
    (the Rust decode drops exactly those before decoding the rest), else the tokenizer's
    ``all_special_ids``. Thousands of added tokens take milliseconds to read (Gemma 3: 6,249 special
    ones, ~5 ms): an owner computes this once per tokenizer, not per request."""
    raw = raw_tokenizer(tokenizer)
    if raw is not None:
        return frozenset(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
    return frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", None) or ())


def make_detokenizer(tokenizer: Any, prompt_ids: Iterable[int] | Any) -> Detokenizer:
    """The detokenizer the server uses: DecodeStream when the tokenizer has a plain Rust backend,
    else the window-diff one.  Both are exact; DecodeStream measured ~3x faster per push on English
    and flat on CJK/emoji, where the window-diff fallback is O(N) (``benchmarks/bench_detok.py``)."""
    if raw_tokenizer(tokenizer) is not None:
        return DecodeStreamDetokenizer(tokenizer, prompt_ids)
    return IncrementalDetokenizer(tokenizer, prompt_ids)
