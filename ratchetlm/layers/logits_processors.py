"""Per-request logits controls: penalties, bias, bans, minimum length, grammar mask.

:class:`LogitsControls` turns one request's raw logits into the logits its sampler draws from
(temperature and the top-k/top-p/min-p filters come after, in :mod:`ratchetlm.layers.sampler`).
Every decoding strategy calls it the same way, on any number of rows at once: row ``i`` predicts
the token after the committed sequence plus ``paths[i]``, the tentative tokens between them (``[]``
for the plain next token; a draft node's root-to-node tokens in a speculative tree; the filled
window slots before a mask in a WeDLM window). So a draft is verified against exactly the distribution
plain decoding would sample at that position, and speculative decoding stays exact under every
control. Only :meth:`LogitsControls.accept` (called once per commit by the engine) moves the state.

Order (vLLM's): allowed ids, bad words, min_tokens, logit_bias, then repetition / frequency /
presence penalties, then the grammar mask. Bans are ``-inf``. A row left with no finite logit
(e.g. ``min_tokens`` banning EOS where the grammar allows only EOS) falls back to the grammar mask
alone: the grammar is a hard constraint, the others are preferences.
"""

from __future__ import annotations

from typing import Any

import torch

from ratchetlm.sampling_params import SamplingParams

NEG_INF = float("-inf")


class LogitsControls:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 stop_ids: tuple[int, ...], bad_words: list[list[int]], grammar: Any = None,
                 jump_forward: bool = True) -> None:
        self.params = params
        self.jump_forward = jump_forward
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.bad_words = bad_words  # token sequences; the last token is banned after the others
        self.grammar = grammar  # structured.grammar.GrammarMatcher | None
        self.output: list[int] = []  # committed output tokens
        self._forced: tuple[int, list[int]] | None = None  # (len(output), forced tokens there)
        p = params
        self.disallowed = None
        if p.allowed_token_ids is not None:
            self.disallowed = torch.ones(vocab_size, dtype=torch.bool)
            self.disallowed[list(p.allowed_token_ids)] = False
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)
        if p.logit_bias:
            self.bias = (torch.tensor(list(p.logit_bias), dtype=torch.long),
                         torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
        self.penalised = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] output token counts
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)  # [V] repetition penalty's prompt part
        if p.repetition_penalty != 1.0:
            self.in_prompt[torch.tensor(prompt_ids, dtype=torch.long)] = True

    # ------------------------------------------------------------------ state

    def accept(self, tokens: list[int]) -> None:
        """``tokens`` were committed to the request's output."""
        if not tokens:
            return
        self.output += tokens
        if self.penalised:
            self.counts.index_add_(0, torch.tensor(tokens, dtype=torch.long), torch.ones(len(tokens)))
        if self.grammar is not None:
            self.grammar.accept(tokens)

    @property
    def reads_context(self) -> bool:
        """A row's controls depend on which tokens come before it, not only on how many
        (penalties, a bad word of several tokens, a grammar): WeDLM then fills its window in order."""
        return self.penalised or self.grammar is not None or any(len(w) > 1 for w in self.bad_words)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the request can stop now."""
        return self.grammar is not None and self.grammar.done

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward); [] without a grammar or with it off."""
        if self.grammar is None or not self.jump_forward:
            return []
        if self._forced is None or self._forced[0] != len(self.output):
            self._forced = (len(self.output), self.grammar.forced_tokens())
        return self._forced[1]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading draft ``tokens`` the grammar allows (all of them without a grammar)."""
        return self.grammar.valid_prefix(tokens) if self.grammar is not None else len(tokens)

    # ------------------------------------------------------------------ the chain

    def process(self, logits: torch.Tensor, paths: list[list[int]] | None = None) -> torch.Tensor:
        """``[n, V]`` raw logits -> ``[n, V]`` fp32 controlled logits; ``paths[i]``: the tentative
        tokens between the committed output and row ``i`` (default: none for every row)."""
        n = logits.shape[0]
        paths = paths if paths is not None else [[] for _ in range(n)]
        assert len(paths) == n, (len(paths), n)
        raw = logits.float()
        x = raw.clone()
        p = self.params
        if self.disallowed is not None:
            x[:, self.disallowed] = NEG_INF
        for i, path in enumerate(paths):
            ctx_len = len(self.output) + len(path)
            if self.bad_words:
                recent = (self.output + path)[-max(len(w) for w in self.bad_words):]
                for w in self.bad_words:
                    if len(w) == 1 or (len(recent) >= len(w) - 1 and recent[len(recent) - len(w) + 1:] == w[:-1]):
                        x[i, w[-1]] = NEG_INF
            if ctx_len < p.min_tokens and self.stop_ids:
                x[i, self.stop_ids] = NEG_INF
        if self.bias is not None:
            x[:, self.bias[0]] += self.bias[1]
        if self.penalised:
            x = self._penalise(x, paths)
        allowed = self.grammar.allowed(paths) if self.grammar is not None else None
        if allowed is not None:
            x = x.masked_fill(~allowed, NEG_INF)
        dead = torch.isneginf(x).all(dim=-1)  # [n]
        if bool(dead.any()):
            x[dead] = raw[dead] if allowed is None else raw[dead].masked_fill(~allowed[dead], NEG_INF)
        return x

    def _penalise(self, x: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        p = self.params
        n = x.shape[0]
        counts = self.counts.expand(n, -1).clone()  # [n, V] output counts at each row
        for i, path in enumerate(paths):
            if path:
                counts[i].index_add_(0, torch.tensor(path, dtype=torch.long), torch.ones(len(path)))
        if p.repetition_penalty != 1.0:
            seen = self.in_prompt | (counts > 0)  # [n, V]
            # in fp32: a penalty below fp32's smallest normal rounds to 0, and a banned (-inf) seen token's
            # -inf * 0 would be NaN; at the smallest normal it stays -inf (found by the server fuzz test)
            rp = max(p.repetition_penalty, torch.finfo(torch.float32).tiny)
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (counts > 0).float()
        # a tiny repetition penalty can overflow a division: keep every value finite or -inf
        return x.clamp(max=torch.finfo(torch.float32).max)


def bad_word_ids(tokenizer: Any, words: tuple[str, ...]) -> list[list[int]]:
    """Each bad word as token sequences, with and without a leading space (how it appears mid-text
    and at the start), as vLLM does."""
    out: list[list[int]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


class ControlsFactory:
    """Builds a request's :class:`LogitsControls` (None when it has none). Owns the engine's
    grammar compiler, created on the first structured request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 jump_forward: bool = True) -> None:
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler: Any = None

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer (this engine has none)")
            from ratchetlm.structured.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def build(self, params: SamplingParams, prompt_ids: list[int],
              eos_token_ids: tuple[int, ...]) -> LogitsControls | None:
        v = self.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", list(params.allowed_token_ids or ())),
                          ("stop_token_ids", list(params.stop_token_ids))):  # (a stop id no token has: a typo)
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {v})")
        if not params.has_logits_controls:
            return None
        words: list[list[int]] = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer (this engine has none)")
            words = bad_word_ids(self.tokenizer, params.bad_words)
        grammar = self.compiler.matcher(params.structured) if params.structured is not None else None
        stop_ids = tuple(eos_token_ids) + tuple(params.stop_token_ids)
        return LogitsControls(params, prompt_ids, v, stop_ids, words, grammar, jump_forward=self.jump_forward)
