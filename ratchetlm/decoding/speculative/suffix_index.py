"""Suffix tries for SuffixDecoding-style drafts (Oliaro et al., 2024): every substring of up to
``depth`` tokens of the indexed text, with how often it occurred.

A node is a substring; its children are the tokens that followed it, each with a count, so the
continuations of a match come out ranked by frequency. Truncating the trie at ``depth`` (a
suffix tree cut at that depth, as SuffixDecoding's ``max_tree_depth``) keeps an append at
``depth`` dictionary steps: the nodes of the text's current suffixes (``active``, one per length
``1..depth``) each step down to the new token. Those same nodes are the request's own match
candidates, so the longest match costs nothing extra: the longest current suffix whose node has
children (a child means an earlier occurrence was followed by something).

* :class:`SequenceIndex` — one request's prompt and output, appended as tokens are committed
  (rebuilt from the tokens after a preemption, which drops strategy state).
* :class:`History` — the outputs of recent finished requests on this engine, bounded by
  ``max_tokens`` (oldest evicted first: their counts are taken back out). Multi-turn chats and
  agent loops repeat what earlier requests wrote.
"""

from __future__ import annotations

from collections import deque


class TrieNode:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, TrieNode] = {}


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        assert depth >= 2
        self.depth = depth
        self.root = TrieNode()

    def append(self, active: list[TrieNode], token: int) -> list[TrieNode]:
        """``active[j]``: the node of the text's suffix of length ``j + 1``. Returns the active list
        after appending ``token`` (every suffix that ends with it, counted once more)."""
        out = []
        for node in [self.root, *active[: self.depth - 1]]:
            child = node.kids.get(token)
            if child is None:
                child = node.kids[token] = TrieNode()
            child.count += 1
            out.append(child)
        return out

    def remove(self, tokens: list[int]) -> None:
        """Take a text added with :meth:`append` back out (nodes whose count drops to 0 go)."""
        active: list[TrieNode] = []
        for token in tokens:
            out = []
            for node in [self.root, *active[: self.depth - 1]]:
                child = node.kids[token]
                child.count -= 1
                if child.count == 0:
                    del node.kids[token]  # its subtree held only this text's substrings
                out.append(child)
            active = out

    def find(self, context: list[int], max_len: int) -> tuple[TrieNode, int] | None:
        """The longest suffix of ``context`` (at most ``max_len`` tokens) that is a node with
        children: (node, its length), or None."""
        for m in range(min(max_len, len(context), self.depth - 1), 0, -1):
            node: TrieNode | None = self.root
            for t in context[len(context) - m:]:
                node = node.kids.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node.kids:
                return node, m
        return None


class SequenceIndex:
    """One request's tokens in a trie of its own, appended as they are committed."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.active: list[TrieNode] = []
        self.length = 0  # tokens indexed

    def sync(self, tokens: list[int]) -> None:
        for t in tokens[self.length:]:
            self.active = self.trie.append(self.active, t)
        self.length = len(tokens)

    def match(self, max_len: int) -> tuple[TrieNode, int] | None:
        """The longest current suffix (at most ``max_len``) seen before with a continuation."""
        for m in range(min(max_len, len(self.active)), 0, -1):
            node = self.active[m - 1]
            if node.kids:
                return node, m
        return None


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
        active: list[TrieNode] = []
        for t in tokens:
            active = self.trie.append(active, t)
        self.texts.append(tokens)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            old = self.texts.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)
