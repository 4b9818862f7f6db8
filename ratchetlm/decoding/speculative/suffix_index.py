"""Suffix tries for SuffixDecoding-style drafts (Oliaro et al., 2024): every substring of up to
``depth`` tokens of the indexed text, with how often it occurred.

A node is a substring; its children are the tokens that followed it, each with a count, so the
continuations of a match come out ranked by frequency. Truncating the trie at ``depth`` (a
suffix tree cut at that depth, as SuffixDecoding's ``max_tree_depth``) keeps an append at
``depth`` dictionary steps: the nodes of the text's current suffixes (``active``, one per length
``1..depth``) each step down to the new token. A match is the longest current suffix whose node
has children (a child means an earlier occurrence was followed by something).

* :class:`SequenceIndex` — one request's prompt and output, appended as tokens are committed
  (rebuilt from the tokens after a preemption, which drops strategy state). Not a dictionary trie:
  its longest match is found by vector comparisons over the tokens each step and its nodes
  (:class:`SpanNode`) are built where a draft looks — the same nodes and counts, without a
  per-token cost on the prompt.
* :class:`History` — the outputs of recent finished requests on this engine, bounded by
  ``max_tokens`` (oldest evicted first: their counts are taken back out). Multi-turn chats and
  agent loops repeat what earlier requests wrote.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class TrieNode:
    """A node of a :class:`SuffixTrie` as a draft reads it (made where the draft looks): how often its
    substring occurred and the tokens that followed it."""

    __slots__ = ("_kids", "node", "trie")

    def __init__(self, trie: SuffixTrie, node: int) -> None:
        self.trie = trie
        self.node = node  # its id in ``trie``
        self._kids: dict[int, TrieNode] | None = None

    @property
    def count(self) -> int:
        return self.trie.counts[self.node]

    @property
    def kids(self) -> dict[int, TrieNode]:
        if self._kids is None:
            k = self.trie.kids[self.node]
            self._kids = {t: TrieNode(self.trie, c) for t, c in k.items()} if k else {}
        return self._kids


class SuffixTrie:
    """Nodes are ids into two lists — ``kids[i]`` the node's children (token -> child id; None: none
    yet) and ``counts[i]`` — not an object each: dicts and lists of ints hold nothing the cyclic
    garbage collector tracks, so a history's trie (up to ``depth`` nodes per token of
    ``history_tokens``) adds nothing to a collection's work. As an object and a dict per node it
    did: every dozen finished requests its new nodes set off a full collection of the process's heap,
    ~0.1-0.2 s of one core each at batch 8 on the default model (docs/benchmarks.md), and a full
    history is over a million nodes. Removed nodes' ids are reused."""

    def __init__(self, depth: int) -> None:
        assert depth >= 2
        self.depth = depth
        self.kids: list[dict[int, int] | None] = [None]  # node 0: the root (the empty substring)
        self.counts: list[int] = [0]
        self.free: list[int] = []  # ids of removed nodes

    @property
    def root(self) -> TrieNode:
        return TrieNode(self, 0)

    def append(self, active: list[int], token: int) -> list[int]:
        """``active[j]``: the node of the text's suffix of length ``j + 1``. Returns the active list
        after appending ``token`` (every suffix that ends with it, counted once more)."""
        kids, counts, free = self.kids, self.counts, self.free
        out = []
        for node in [0, *active[: self.depth - 1]]:
            k = kids[node]
            if k is None:
                k = kids[node] = {}
            child = k.get(token)
            if child is None:
                if free:
                    child = free.pop()
                    kids[child], counts[child] = None, 0
                else:
                    child = len(counts)
                    kids.append(None)
                    counts.append(0)
                k[token] = child
            counts[child] += 1
            out.append(child)
        return out

    def remove(self, tokens: list[int]) -> None:
        """Take a text added with :meth:`append` back out (nodes whose count drops to 0 go; their
        subtrees held only this text's substrings, whose counts drop to 0 as the loop reaches them)."""
        kids, counts = self.kids, self.counts
        active: list[int] = []
        for token in tokens:
            out = []
            for node in [0, *active[: self.depth - 1]]:
                k = kids[node]
                assert k is not None
                child = k[token]
                counts[child] -= 1
                if counts[child] == 0:
                    del k[token]
                    self.free.append(child)  # (not reused before this call returns: it only removes)
                out.append(child)
            active = out

    def find(self, context: list[int], max_len: int) -> tuple[TrieNode, int] | None:
        """The longest suffix of ``context`` (at most ``max_len`` tokens) that is a node with
        children: (node, its length), or None."""
        kids = self.kids
        for m in range(min(max_len, len(context), self.depth - 1), 0, -1):
            node: int | None = 0
            for t in context[len(context) - m:]:
                k = kids[node]  # type: ignore[index]
                node = k.get(t) if k else None
                if node is None:
                    break
            if node is not None and kids[node]:
                return TrieNode(self, node), m
        return None


FEW = 16  # occurrences up to which a SpanNode groups its kids in Python (numpy's unique and masks cost
# ~20 us a node; most nodes a draft expands occur once or twice)


class SpanNode:
    """A node of a request's own suffix trie, built only where a draft looks: the occurrences of its
    substring (as the positions of the token after each) in the request's tokens ``arr``, ``left``
    more levels below it. ``kids`` groups the next tokens of those positions on first use, so a
    step costs a few vector comparisons over the tokens and a node per continuation it expands,
    not ``depth`` dictionary nodes per committed token (indexing a 1,000-token prompt that way cost
    ~0.4 s of Python, a fifth of its prefill on one core)."""

    __slots__ = ("_kids", "arr", "count", "left", "starts")

    def __init__(self, arr: np.ndarray, starts: np.ndarray | list[int], left: int) -> None:
        self.arr = arr  # [t] int64, the tokens the node was found in
        # [count] positions < t of the token after each occurrence, ascending: an int64 array, or a list
        # where they are few (a node a draft expands mostly occurs once or twice: no array made for it)
        self.starts = starts
        self.count = len(starts)
        self.left = left  # levels below this node the truncated trie holds
        self._kids: dict[int, SpanNode] | None = None

    @property
    def kids(self) -> dict[int, SpanNode]:
        if self._kids is None:
            self._kids = {}
            if self.left > 0 and self.count <= FEW:  # grouped in Python: the same kids, ~5x quicker
                n = len(self.arr)
                groups: dict[int, list[int]] = {}  # token -> the positions after its occurrences, in order
                for s in (self.starts if isinstance(self.starts, list) else self.starts.tolist()):
                    if s < n:
                        groups.setdefault(int(self.arr[s]), []).append(s + 1)
                for tok in sorted(groups):
                    self._kids[tok] = SpanNode(self.arr, groups[tok], self.left - 1)
            elif self.left > 0:
                all_starts = np.asarray(self.starts, dtype=np.int64)
                starts = all_starts[all_starts < len(self.arr)]  # occurrences the text goes on after
                toks = self.arr[starts]
                for tok in np.unique(toks).tolist():
                    self._kids[tok] = SpanNode(self.arr, starts[toks == tok] + 1, self.left - 1)
        return self._kids


class TokenPositions:
    """A growing text's tokens and every token's positions in it, ascending, appended as the text grows:
    a lookup starts from the last token's earlier copies, a dictionary read where scanning the whole
    text with numpy cost a dozen array operations (~0.1 ms a step on one core). Held anew when the
    text given is not the held one plus more (checked where the held one ends: a request's tokens
    only grow)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> its positions, ascending

    def sync(self, tokens: list[int]) -> list[int]:
        """Hold ``tokens``; returns the ones appended (all of them where it started over)."""
        n = len(self.tokens)
        if len(tokens) < n or tokens[n - 1 : n] != self.tokens[n - 1 :]:
            self.tokens, self.where, n = [], {}, 0
        new = tokens[n:]
        for i, tok in enumerate(new, n):
            self.where.setdefault(tok, []).append(i)
        self.tokens += new
        return new

    def earlier(self) -> list[int]:
        """Positions of the last token's earlier copies, most recent first."""
        return self.where[self.tokens[-1]][-2::-1] if self.tokens else []


class SequenceIndex:
    """One request's tokens (its prompt and committed output), matched on demand: the same nodes
    and counts as a :class:`SuffixTrie` of ``depth`` over them, for the nodes a draft visits.
    Occurrences of a match beyond the ``MAX_OCCURRENCES`` most recent are not counted."""

    MAX_OCCURRENCES = 256

    def __init__(self, depth: int) -> None:
        assert depth >= 2
        self.depth = depth
        self.buf = np.zeros(256, dtype=np.int64)
        self.length = 0  # tokens indexed
        self.pos = TokenPositions()  # the same tokens as a list, and each one's positions

    def sync(self, tokens: list[int]) -> None:
        n = len(tokens)
        new = self.pos.sync(tokens)
        start = n - len(new)  # the tokens kept (0: held anew)
        if n > len(self.buf):
            grown = np.zeros(max(n, 2 * len(self.buf)), dtype=np.int64)
            grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start:n] = new
        self.length = n

    def match(self, max_len: int) -> tuple[SpanNode, int] | None:
        """The longest current suffix (at most ``max_len``, at most ``depth - 1``) seen before with a
        continuation: its node and length, or None."""
        t = self.length
        if t < 2:
            return None
        toks = self.pos.tokens
        ends = self.pos.where[toks[t - 1]][:-1]  # earlier copies of the last token, ascending (each followed by one)
        if not ends:
            return None
        m, top = 1, min(max_len, self.depth - 1, t - 1)
        while m < top:  # extend every occurrence backwards while some still match one more token
            want = toks[t - 1 - m]
            ok = [e for e in ends if e >= m and toks[e - m] == want]
            if not ok:
                break
            ends, m = ok, m + 1
        return SpanNode(self.buf[:t], [e + 1 for e in ends[-self.MAX_OCCURRENCES :]], self.depth - m), m


class History:
    """Recent finished outputs of an engine, at most ``max_tokens`` tokens in all."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.texts: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, tokens: list[int]) -> None:
        tokens = list(tokens[-self.max_tokens:]) if self.max_tokens else []
        if len(tokens) < 2:
            return
        active: list[int] = []
        for t in tokens:
            active = self.trie.append(active, t)
        self.texts.append(tokens)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            old = self.texts.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)
