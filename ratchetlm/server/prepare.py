"""Request preparation off the event loop and off the engine thread, in a bounded pool.

Parsing, chat-template rendering, tokenization and grammar compilation run on :class:`PrepPool`'s
threads (``prep_workers``: by default the machine's cores, at least 2), each request under its own
deadline (``prep_timeout`` -> 400 naming it), so a large or slow request delays only itself:

* bodies over ``LARGE_BODY`` may hold at most ``workers - 1`` threads at once, so a small request
  always finds one free however many megabyte prompts are being prepared;
* a prompt's text much longer than the context is not tokenized whole (:func:`encode_bounded`): past
  the longest token's length x ``max_model_len`` characters it cannot fit whatever its tokens, and
  otherwise its first ``CHARS_PER_TOKEN x max_model_len`` characters, cut at a word boundary, may
  already have more tokens than the context holds; either way it is refused on that count.

A thread cannot be stopped, so a request past its deadline is answered at once and its thread
finishes in the background, still counted against the large-body share until it does.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ratchetlm.server.errors import APIError

T = TypeVar("T")

LARGE_BODY = 1 << 20  # bytes: a body this large may take all workers but one
CHARS_PER_TOKEN = 8  # no tokenizer in use averages more characters a token over a context's worth of text


def default_workers() -> int:
    return min(32, max(2, os.cpu_count() or 1))


class PrepPool:
    def __init__(self, workers: int | None = None, timeout: float = 30.0) -> None:
        self.workers = workers or default_workers()
        assert self.workers >= 1
        self.timeout = timeout
        self.executor = ThreadPoolExecutor(self.workers, thread_name_prefix="ratchet-prep")
        self._large: asyncio.Semaphore | None = None  # made on the event loop at first use

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker; ``size``: the request body's bytes. Raises what ``fn`` raises,
        or a 400 when it takes longer than ``timeout`` (queueing for a worker included)."""
        loop = asyncio.get_running_loop()
        large = size > LARGE_BODY and self.workers > 1
        if large and self._large is None:
            self._large = asyncio.Semaphore(self.workers - 1)

        async def prepared() -> T:
            if large:
                assert self._large is not None
                await self._large.acquire()
            try:
                fut = loop.run_in_executor(self.executor, fn, *args)
            except BaseException:
                if large:
                    self._large.release()  # type: ignore[union-attr]
                raise
            if large:  # released when the thread is done, not when the client was answered
                fut.add_done_callback(lambda _: self._large.release())  # type: ignore[union-attr]
            return await asyncio.shield(fut)

        try:
            return await asyncio.wait_for(prepared(), self.timeout)
        except TimeoutError:
            raise APIError(f"preparing the request (parsing, chat template, tokenization, grammar) took over "
                           f"{self.timeout:g} s; send a smaller or simpler request", 400) from None

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def encode_bounded(encode: Callable[[str], list[int]], text: str, max_model_len: int, param: str,
                   max_token_chars: int | None = None) -> list[int]:
    """``encode(text)``, except that a text far longer than the context is refused without being
    tokenized whole (400 naming ``max_model_len``):

    * when ``max_token_chars`` (the longest token in the vocabulary, in characters) is given and the
      text has more than ``max_token_chars x max_model_len`` characters, it has at least
      ``max_model_len`` tokens whatever they are (one token covers at most that many characters):
      refused without tokenizing anything (a text with no whitespace, one enormous word, is the
      slowest to tokenize: BPE merges within a word);
    * a text longer than ``CHARS_PER_TOKEN x max_model_len`` characters is first tokenized only up to
      its last word boundary within that prefix: when that part alone has ``max_model_len`` tokens
      or more, refused. The part's tokens are a prefix of the whole text's: tokenizers split text at
      whitespace before merging (byte-level BPE's pre-tokenizer regex, SentencePiece's metaspace),
      and the cut is just before a whitespace character that follows a non-space."""
    if max_token_chars is not None and len(text) > max_token_chars * max_model_len:
        raise APIError(f"the prompt has {len(text)} characters, so at least {len(text) // max_token_chars} tokens "
                       f"(no token is longer than {max_token_chars} characters), but max_model_len is "
                       f"{max_model_len}", 400, param)
    limit = CHARS_PER_TOKEN * max_model_len
    if len(text) > limit:
        cut = _word_boundary(text, limit)
        if cut > 0:
            n = len(encode(text[:cut]))
            if n >= max_model_len:
                raise APIError(f"the prompt has more than {n} tokens (counted in its first {cut} of {len(text)} "
                               f"characters) but max_model_len is {max_model_len}", 400, param)
    return encode(text)


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest entry in ``tokenizer``'s vocabulary (byte-level entries count one
    character a byte, which is at least the characters they decode to); None when it has none."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (no bound: encode_bounded falls back to the prefix count)
        return None
    return max((len(t) for t in vocab), default=None) if vocab else None


def _word_boundary(text: str, limit: int) -> int:
    """The largest ``i <= limit`` with ``text[i]`` whitespace and ``text[i - 1]`` not; 0 if none."""
    i = limit
    while i > 0:
        if text[i].isspace() and not text[i - 1].isspace():
            return i
        i -= 1
    return 0
