"""Grammar-constrained decoding on llguidance: compile a constraint once, match it per request.

Why llguidance (benchmarks/bench_grammar.py, docs/structured_outputs.md): on the default
tokenizer a JSON schema compiles in <1 ms (xgrammar: ~12 ms, it precomputes a token-mask cache)
and a mask costs ~15 us (xgrammar ~4 us) — both far below one decode forward (~20 ms), so a
request's total grammar cost is lower with llguidance for outputs under ~1000 tokens; it reports
forced tokens directly (xgrammar gives a string to re-tokenize), bounds its own work with fuel
limits, and its wheel has no dependencies (xgrammar pulls in triton, ~1 GB).

A :class:`GrammarCompiler` belongs to one engine (one tokenizer). :meth:`GrammarCompiler.compile`
turns a :class:`StructuredOutputsParams` into a validated template matcher (cached by the
constraint's key); every request gets its own :class:`GrammarMatcher`, a copy that tracks the
request's committed output tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from ratchetlm.sampling_params import StructuredOutputsParams

# Per-step lexer/parser work is capped by llguidance's fuel limits (a mask computation that would
# exceed them puts the matcher in an error state instead of running away); compiling is further
# bounded by a wall-clock timeout, since a pathological schema could still take long to build.
COMPILE_TIMEOUT_S = 10.0


class GrammarError(ValueError):
    """A constraint that is invalid or cannot be compiled (the server answers 400)."""


def _limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
                                     step_lexer_fuel=200_000, max_grammar_size=200_000, verbose_errors=False)


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet validated)."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = spec.json if kind == "json" else {"type": "object"}
        options: dict[str, Any] = {"whitespace_flexible": spec.whitespace_flexible}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice or ())))
    try:  # Lark, or GBNF/EBNF (llama.cpp's format) converted to Lark
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except ValueError as e:
        raise GrammarError(f"invalid grammar: {e}") from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe (the server compiles in handler threads
    while the engine thread matches). ``eos_token_ids`` end a completed grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 64, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._lltok: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ratchet-grammar")

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:  # ~1 s once per engine: the token trie of the whole vocabulary
                import llguidance
                import llguidance.hf

                eos = list(self.eos_token_ids) or None
                try:
                    self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
                except ValueError:  # a decoder llguidance does not read (e.g. a Metaspace variant): spell it out
                    try:
                        wrapped = llguidance.TokenizerWrapper(_TokenBytes(self.tokenizer, self.vocab_size))
                        self._lltok = llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=eos)
                    except Exception as e:  # noqa: BLE001 - reported to the client as a 400
                        raise GrammarError(f"the grammar engine cannot read this model's tokenizer: {e}") from None
            return self._lltok

    def _build(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        source = grammar_source(spec)
        tok = self._ll_tokenizer()
        limits = _limits()
        err = llguidance.LLMatcher.validate_grammar(source, tok, limits=limits)
        if err:
            raise GrammarError(f"invalid {spec.kind} constraint: {err}")
        m = llguidance.LLMatcher(tok, source, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {m.get_error()}")
        return m

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A validated template matcher for ``spec`` (cached). Raises :class:`GrammarError` for an
        invalid constraint or one that does not compile within ``timeout_s``."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        fut = self._pool.submit(self._build, spec)
        try:
            m = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {spec.kind} constraint did not compile within {self.timeout_s:g} s "
                               "(too complex)") from None
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec).deep_copy(), self.vocab_size)


class _TokenBytes:
    """What llguidance needs of a tokenizer it cannot convert itself: every token's bytes (byte
    fallback ``<0xNN>`` as that byte, SentencePiece's ``▁`` as a space, byte-level BPE through
    its byte map), the special ids, and an encode function over those bytes."""

    def __init__(self, tok: Any, vocab_size: int) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_level = {v: k for k, v in bytes_to_unicode().items()}
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.special_token_ids = sorted(set(tok.all_special_ids))
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            piece = pieces[i] if i < len(pieces) and pieces[i] is not None else ""
            self.tokens.append(_piece_bytes(piece, byte_level))
        specials = set(self.special_token_ids)
        self._by_bytes = {b: i for i, b in enumerate(self.tokens) if b and i not in specials}
        self._longest = max((len(b) for b in self._by_bytes), default=1)

    def __call__(self, s: str | bytes) -> list[int]:
        """Greedy longest match over the token bytes: faithful to the bytes (llguidance tokenizes
        forced text with it), unlike a tokenizer that maps unknown text to <unk>; bytes no token
        starts with are skipped."""
        data = s.encode("utf-8") if isinstance(s, str) else s
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._by_bytes.get(data[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                i += 1
        return out


def _piece_bytes(piece: str, byte_level: dict[str, int]) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    if piece and all(c in byte_level for c in piece) and ("Ġ" in piece or "Ċ" in piece):
        return bytes(byte_level[c] for c in piece)
    return piece.replace("▁", " ").encode("utf-8")


class GrammarMatcher:
    """One request's grammar state: it has consumed exactly the request's committed output tokens.

    Masks for tentative rows (a draft tree, forced tokens) are computed on a copy of the matcher
    that consumed the row's path (~6 us a copy), so the committed state never moves until
    :meth:`accept`. Not consume-then-rollback: a path that leads to a dead end (e.g. a regex byte
    no token spells) stops llguidance's matcher with an error that ``rollback`` does not undo, and
    the committed state would then read as finished before any of the path was committed."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.m = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.failed = False  # a committed token the grammar did not allow (should not happen)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS)."""
        return self.failed or bool(self.m.is_stopped())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows after the committed output."""
        return int(self.m.validate_tokens(tokens)) if tokens else 0

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """``[n, vocab]`` bool: tokens allowed after the committed output plus ``paths[i]``. A row
        whose path the grammar rejects can never be reached (an ancestor's token has probability
        0), so it is left unconstrained."""
        import llguidance.torch as llt

        n = len(paths)
        bitmask = torch.full((n, self.words), -1, dtype=torch.int32)  # [n, ceil(V / 32)]
        for i, path in enumerate(paths):
            if path and self.valid_prefix(path) < len(path):
                continue
            if not path:
                llt.fill_next_token_bitmask(self.m, bitmask, i)
                continue
            m = self.m.deep_copy()
            m.consume_tokens(path)
            llt.fill_next_token_bitmask(m, bitmask, i)
        bits = torch.arange(32, dtype=torch.int32)
        unpacked = (bitmask.unsqueeze(-1) >> bits) & 1  # [n, words, 32]
        return unpacked.reshape(n, -1)[:, : self.vocab_size].bool()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (the only continuation, canonically tokenized)."""
        if self.done:
            return []
        return [int(t) for t in self.m.compute_ff_tokens()]

    def accept(self, tokens: list[int]) -> None:
        if not self.failed and tokens and not self.m.consume_tokens(tokens):
            self.failed = True
