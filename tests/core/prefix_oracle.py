"""Oracle for the prefix cache: every named block holds the K/V a plain prefill computes for its
prefix. A rejected draft token or a WeDLM mask whose K/V leaked into a block would break it."""

from __future__ import annotations

from dataclasses import replace

import torch

from ratchetlm.engine.layer_groups import GroupedBlocks
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence


def committed(eng: LLMEngine, seq_id: int) -> list[int]:
    """A finished request's tokens that have K/V (read before ``release``)."""
    seq = eng.seqs[seq_id]
    return seq.token_ids[: seq.num_cached]


def expected_hit(prompt: list[int], history: list[list[int]], block_size: int) -> int:
    """Tokens a lookup must find: the longest common prefix with anything committed before, in
    whole blocks, leaving the prompt's last token to compute."""
    best = 0
    for done in history:
        n = 0
        while n < min(len(prompt), len(done)) and prompt[n] == done[n]:
            n += 1
        best = max(best, n)
    return min(best // block_size, (len(prompt) - 1) // block_size) * block_size


def pools(eng: LLMEngine) -> list[tuple[BlockManager, torch.Tensor, torch.Tensor]]:
    """(block manager, K, V) of each layer group's pool (one, unless local layers have their own)."""
    c = eng.cache
    if isinstance(eng.blocks, GroupedBlocks):
        return [(eng.blocks.groups[0], c.k, c.v), (eng.blocks.groups[1], c.stacked["k_local"], c.stacked["v_local"])]
    return [(eng.blocks, c.k, c.v)]


def assert_cached_blocks_match_prefill(eng: LLMEngine, histories: list[list[int]], atol: float = 2e-3) -> int:
    """For each history (a finished request's committed tokens), the blocks of ``eng``'s prefix cache
    named after its prefixes hold what a plain autoregressive prefill of those tokens writes, in every
    layer (and every layer group's pool: a local pool's blocks where the plain run still holds them).
    Returns how many blocks were compared (callers assert it is not zero; with layer groups, each
    group's pool must have had some)."""
    bs = eng.blocks.block_size
    room = max(len(t) for t in histories) // bs + 2
    plain = LLMEngine(replace(eng.cfg, decoding="autoregressive", decoding_options={}, enable_prefix_caching=False,
                              kv_cache_blocks=room), eng.model, eng.model_config)
    checked = [0] * len(pools(eng))
    # a history seen before (a repeated prompt, or a batched rerun that committed the same tokens) names the
    # same blocks and would be compared with the same prefill again: each distinct history once
    for tokens in dict.fromkeys(tuple(t) for t in histories):
        sid = plain.add_request(list(tokens), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while plain.seqs[sid].num_cached < len(tokens):
            plain.step()  # (chunked) prefill: every prompt token's K/V is in its blocks now
        for g, ((bm, k, v), (pm, pk, pv)) in enumerate(zip(pools(eng), pools(plain), strict=True)):
            probe = Sequence(-1, list(tokens), len(tokens), SamplingParams())
            names = bm._hashes(probe, len(tokens) // bs)
            table = getattr(plain.seqs[sid], pm.table)
            for i, h in enumerate(names):
                b = bm.cached.get(h)
                if b is None or i >= len(table) or table[i] < 0:
                    continue
                mine, ref = slice(b * bs, (b + 1) * bs), slice(table[i] * bs, (table[i] + 1) * bs)
                torch.testing.assert_close(k[:, mine], pk[:, ref], atol=atol, rtol=atol)
                torch.testing.assert_close(v[:, mine], pv[:, ref], atol=atol, rtol=atol)
                checked[g] += 1
        plain.abort(sid)
    assert len(checked) == 1 or min(checked) > 0, f"blocks compared per layer group: {checked}"
    return sum(checked)
