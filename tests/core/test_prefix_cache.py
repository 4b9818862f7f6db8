"""Prefix caching on the real model: outputs with caching == without, token for token (greedy),
exact hit accounting, and that a hit really skips the prefill of the cached tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams
from tests.core.prefix_oracle import expected_hit as oracle_expected_hit

BS = 16
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about opening hours, bread, "
          "cakes, allergens and prices. Opening hours: Monday to Friday 7 to 18, Saturday 8 to 14, closed on "
          "Sunday. Breads: sourdough, rye, spelt, baguette. Cakes need two days notice. Be brief. ")
QUESTIONS = ["Is the shop open on Sunday?", "Which breads do you sell?", "Can I order a cake for tomorrow?"]


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def make(llm, **kw) -> LLMEngine:
    """A fresh engine (own KV cache and prefix cache) on the loaded model."""
    cfg = replace(llm.config, kv_cache_blocks=kw.pop("kv_cache_blocks", 96), block_size=BS, **kw)
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


def drive(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, every: int = 0,
          history: list[list[int]] | None = None) -> list[list[int]]:
    """Add the prompts at once (``every=0``) or one every ``every`` steps; step to the end. Appends
    each request's committed tokens (those with K/V) to ``history``."""
    pending, sids = list(prompts), []
    steps = 0
    while pending or eng.has_unfinished():
        if pending and (every == 0 or steps % every == 0):
            for p in pending if every == 0 else pending[:1]:
                sids.append(eng.add_request(p, params))
            pending = [] if every == 0 else pending[1:]
        eng.step()
        steps += 1
    outs = [eng.seqs[s].output_ids for s in sids]
    for s in sids:
        seq = eng.release(s)
        if history is not None and seq is not None:
            history.append(seq.token_ids[: seq.num_cached])
    return outs


def expected_hit(prompt: list[int], history: list[list[int]]) -> int:
    return oracle_expected_hit(prompt, history, BS)


def settled(eng: LLMEngine) -> dict[str, int]:
    """After all requests: every block is free or cached-unreferenced, and the counts add up."""
    counts = eng.blocks.audit()
    assert counts["referenced"] == 0
    assert counts["free"] + counts["cached_unreferenced"] == eng.blocks.num_blocks == eng.blocks.num_free
    return counts


class Plain:
    """The oracle: a prompt's greedy tokens from the request alone, whole prompt in one prefill, on an
    engine without prefix caching; run once per prompt for the module (greedy with ``ignore_eos``: the
    first ``n`` tokens of a longer run are the run of ``n``). The engines under test batch, chunk,
    preempt and hit the cache, and must give these same tokens (exact mode is batch- and
    chunk-invariant: tests/core/test_generation.py, tests/core/test_step_budget.py)."""

    LONGEST = 24  # the longest any test asks for: one run serves every length

    def __init__(self, llm) -> None:
        self.engine = make(llm, enable_prefix_caching=False)
        self.done: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], n: int = 10, longest: int = LONGEST) -> list[int]:
        """``longest``: how far to run a prompt not run before (a prompt only one test asks for: ``n``)."""
        got = self.done.get(tuple(prompt))
        if got is None or len(got) < n:
            got = self.done[tuple(prompt)] = drive(self.engine, [prompt], greedy(max(n, longest)))[0]
            settled(self.engine)
        return got[:n]


@pytest.fixture(scope="module")
def llm(llm_default):
    """The model in the engine's default numerics (``auto``: int8 on the bundled Q4_1 file, at ~0.4x the exact
    mode's CPU per forward), the mode users run; a prefix hit must give the tokens of a whole-prompt prefill in
    every mode (each row's result is independent of the rows and chunks beside it). The first test below runs in
    the exact (HF-identical) mode too: a hit and the K/V it skips writing are the same code in both."""
    return llm_default


@pytest.fixture(scope="module")
def plain(llm) -> Plain:
    return Plain(llm)


@pytest.fixture(scope="module")
def chats(llm) -> list[list[int]]:
    return [llm.tokenize(llm.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.mark.parametrize("mode", ["default", "exact"])
def test_identical_prompts_hit_exactly_and_skip_their_prefill(llm, llm_fp32, chats, plain, mode):
    if mode == "exact":  # its own oracle: a run without caching in the exact mode (the same file's tokens)
        llm, plain = llm_fp32, Plain(llm_fp32)
    on = make(llm)
    p = chats[0]
    want = plain(p, longest=10 if mode == "exact" else Plain.LONGEST)
    assert drive(on, [p], greedy()) == [want]
    s = on.blocks.stats
    assert (s.queries, s.hits) == (len(p), 0)
    written = on.cache.bytes_written
    assert drive(on, [p], greedy()) == [want]
    hit = (len(p) - 1) // BS * BS
    assert (s.queries, s.hits, s.requests, s.requests_hit) == (2 * len(p), hit, 2, 1)
    # K/V written for the second request: the uncached prompt tail, then one token per decode step
    per_token = on.cache.bytes_per_token()
    assert on.cache.bytes_written - written == (len(p) - hit + 10 - 1) * per_token
    settled(on)


def test_a_block_is_shared_only_once_all_its_kv_is_committed(llm, chats, plain):
    """A request ends with its last token committed but not computed. When that token completes a
    block, the block must not be named: a longer prompt through it hits only the blocks before."""
    p = chats[0]
    n = BS - len(p) % BS or BS  # prompt + output fill whole blocks
    on = make(llm)
    history: list[list[int]] = []
    out = drive(on, [p], greedy(n), history=history)[0]
    assert (len(p) + n) % BS == 0 and len(history[0]) == len(p) + n - 1
    longer = p + out + llm.tokenize(" Thanks")
    assert drive(on, [longer], greedy(4)) == [plain(longer, 4, longest=4)]
    assert on.blocks.stats.hits == len(p) + n - BS
    settled(on)


def test_shared_system_prompt_and_prompts_differing_in_the_last_full_block(llm, chats, plain):
    on = make(llm)
    base = chats[1]
    last_full = (len(base) - 1) // BS  # index of the block that holds the last token's predecessor
    variant = list(base)
    variant[last_full * BS - 3] = llm.tokenize(" cheese")[0]  # inside the last full block
    prompts = [*chats, variant]
    want = [plain(p) for p in chats] + [plain(variant, longest=10)]  # (the variant: only this test's)
    history: list[list[int]] = []
    for p, w in zip(prompts, want, strict=True):
        hits_before, hit = on.blocks.stats.hits, expected_hit(p, history)
        assert drive(on, [p], greedy(), history=history) == [w]
        assert on.blocks.stats.hits - hits_before == hit
    assert expected_hit(variant, history[:-1]) == (last_full - 1) * BS  # it missed its last full block only
    assert on.blocks.stats.requests_hit == 3
    settled(on)


def test_multi_turn_chat_replayed_turn_by_turn(llm, plain):
    def converse(eng: LLMEngine | None) -> list[str]:
        """The conversation on ``eng``, or on the oracle where ``eng`` is None."""
        messages = [{"role": "system", "content": SYSTEM}]
        replies: list[str] = []
        history: list[list[int]] = []
        prev: list[int] = []
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            ids = llm.tokenize(llm.apply_chat_template(messages))
            assert ids[: len(prev)] == prev  # the previous turn's prompt starts this one
            hit = expected_hit(ids, history)
            assert hit >= len(prev) // BS * BS
            prev = ids
            if eng is None:
                out = plain(ids, 8, longest=8)
                history.append(ids + out[:-1])  # (the last token has no K/V)
            else:
                hits_before = eng.blocks.stats.hits
                out = drive(eng, [ids], greedy(8), history=history)[0]
                assert eng.blocks.stats.hits - hits_before == hit
            replies.append(llm.tokenizer.decode(out))
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies

    off_replies = converse(None)
    on = make(llm)
    assert converse(on) == off_replies
    assert on.blocks.stats.hits > 0
    settled(on)


def test_concurrent_requests_racing_for_the_same_prefix(llm, chats, plain):
    """Identical and overlapping prompts admitted together and mid-prefill (chunked prefill of 24
    tokens per step), so some hit blocks another request committed a step earlier and some
    commit the same tokens in the same step."""
    prompts = [chats[0], chats[0], chats[1], chats[0], chats[2], chats[1]]
    want = [plain(p) for p in prompts]
    on = make(llm, max_num_batched_tokens=24)
    assert drive(on, prompts, greedy()) == want
    assert drive(on, prompts, greedy(), every=2) == want
    assert on.blocks.stats.hits > 0
    settled(on)


def test_preemption_under_a_small_cache(llm, chats, plain):
    """A pool too small for all requests: preemption releases references (not blocks others hold),
    cached blocks are evicted, a preempted request re-hits its own committed blocks."""
    prompts = [chats[0], chats[1], chats[0], chats[2], chats[1], chats[2]]
    params = greedy(24)
    want = [plain(p, 24) for p in prompts]
    small = make(llm, kv_cache_blocks=16)
    assert drive(small, prompts, params) == want
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.stats.recompute_hits > 0 and small.blocks.stats.evictions > 0
    settled(small)


def test_prompt_logprobs_requests_compute_their_whole_prompt(llm, chats):
    """A cached block has no logits: a request asking for prompt logprobs does not look up, and its
    prompt logprobs equal those of an engine without caching."""
    on = make(llm)
    drive(on, [chats[0]], greedy(2))
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    sid = on.add_request(chats[0], params)
    while on.has_unfinished():
        on.step()
    got = on.seqs[sid].prompt_logprobs
    assert on.seqs[sid].num_prefix_hit_tokens == 0 and on.blocks.stats.requests == 1
    off = make(llm, enable_prefix_caching=False)
    sid = off.add_request(chats[0], params)
    while off.has_unfinished():
        off.step()
    want = off.seqs[sid].prompt_logprobs
    assert len(got) == len(chats[0]) and got == want


def test_cache_salt_isolates_requests(llm, chats):
    on = make(llm)
    for salt, hit in ((None, 0), ("tenant-a", 0), ("tenant-a", (len(chats[0]) - 1) // BS * BS), ("tenant-b", 0)):
        sid = on.add_request(chats[0], greedy(2), cache_salt=salt)
        while on.has_unfinished():
            on.step()
        assert on.seqs[sid].num_prefix_hit_tokens == hit, salt
    with pytest.raises(ValueError, match="cache_salt"):
        on.add_request(chats[0], greedy(2), cache_salt="")


def test_abort_releases_references_not_blocks_others_hold(llm, chats, plain):
    """Two requests share a cached prefix; aborting one mid-decode drops its references only: the
    other keeps reading the shared blocks and finishes exactly as without caching."""
    p = chats[0]
    want = plain(p, 12)
    on = make(llm)
    drive(on, [p], greedy(2))
    shared = (len(p) - 1) // BS
    a, b = on.add_request(p, greedy(12)), on.add_request(p, greedy(12))
    for _ in range(3):
        on.step()
    table = list(on.seqs[b].block_table[:shared])
    assert on.seqs[a].block_table[:shared] == table and all(on.blocks.ref_count[x] == 2 for x in table)
    on.abort(a)
    assert all(on.blocks.ref_count[x] == 1 for x in table)  # still b's
    assert on.blocks.audit()["referenced"] == len(on.seqs[b].block_table)
    while on.has_unfinished():
        on.step()
    assert on.seqs[b].output_ids == want
    assert on.seqs[a].finish_reason == "abort" and on.seqs[b].num_prefix_hit_tokens == shared * BS
    settled(on)
    c = on.add_request(p, greedy(1))  # the prefix survived both releases
    while on.has_unfinished():
        on.step()
    assert on.seqs[c].num_prefix_hit_tokens == shared * BS
    settled(on)
