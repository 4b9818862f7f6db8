"""The window algorithm on its own, against the seed's worked examples (seed 000)."""

from __future__ import annotations

import math

import pytest
import torch

from ratchetlm.decoding.wedlm_window import (
    WeDLMConfig,
    Window,
    commit_length,
    entropy,
    fill,
    new_window,
    refill,
    select_fills,
)
from ratchetlm.sampling_params import SamplingParams

M = 151665  # the seed's mask id
GREEDY = SamplingParams(temperature=0.0)


def window(flags: str, toks: list[int] | None = None) -> Window:
    """'F' = filled, 'T' = mask; filled slots get ids 1000+k unless given."""
    is_mask = [c == "T" for c in flags]
    it = iter(toks or [])
    tokens = [M if m else (next(it) if toks else 1000 + k) for k, m in enumerate(is_mask)]
    return Window(tokens, is_mask, [None] * len(flags))


def test_seed_example_1_window_evolution():
    # Step 1 filled slots 0, 2, 4 of an 8-mask window ("To" . "do" . "so" . . .)
    w = window("FTFTFTTT", [1084, 311, 374])
    assert w.leading_filled() == 1  # prune count: only "To" is a confirmed prefix
    assert w.order() == [0, 2, 4, 1, 3, 5, 6, 7]  # filled first, then masks, each in window order
    assert refill(w, M, room=4089 - 8) == 1  # refill count = prune count
    assert w.tokens[-1] == M and len(w) == 9
    w.drop_front(1)  # "To" committed
    assert w.tokens == [M, 311, M, 374, M, M, M, M] and w.leading_filled() == 0
    assert refill(w, M, room=4089) == 0  # nothing leading is filled: no refill
    # Step 2 fills slot 0 ("sol"): prune count 2 ("sol", "do")
    w.tokens[0], w.is_mask[0] = 4006, False
    assert w.leading_filled() == 2
    assert w.order()[:3] == [0, 1, 3]
    w.drop_front(2)
    assert w.tokens == [M, 374, M, M, M, M] and w.is_mask == [True, False, True, True, True, True]
    # Step 3 fills slot 0 ("th"): prune count 2 again ("th", "so")
    w.tokens[0], w.is_mask[0] = 420, False
    assert w.leading_filled() == 2


def test_seed_example_2_budget_caps_the_window():
    assert len(new_window(M, 16, room=6)) == 6  # max_model_len - current_seq_len = 6
    assert len(new_window(M, 16, room=4089)) == 16
    assert len(new_window(M, 16, room=0)) == 0
    w = window("FFFTTT")
    assert refill(w, M, room=2) == 2  # 3 leading filled, but only 2 positions left
    assert refill(window("FFFTTT"), M, room=0) == 0  # budget exhausted: the window only drains


def test_fully_filled_window_commits_whole():
    w = window("FFFF")
    assert w.leading_filled() == 4 and w.order() == [0, 1, 2, 3]


def test_entropy_is_in_nats_of_raw_logits():
    v = 300
    assert entropy(torch.zeros(1, v)).item() == pytest.approx(math.log(v), rel=1e-5)
    peaked = torch.full((1, v), -1e4)
    peaked[0, 7] = 0
    assert entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


def peaked_logits(entropies_wanted: list[str]) -> torch.Tensor:
    """Rows: 'lo' (entropy ~0), 'hi' (uniform, log V), or a two-way split (entropy ln 2 = 0.693)."""
    rows = []
    for kind in entropies_wanted:
        r = torch.full((50,), -1e4)
        if kind == "lo":
            r[3] = 0
        elif kind == "hi":
            r[:] = 0
        else:
            r[3] = r[4] = 0
        rows.append(r)
    return torch.stack(rows)


def test_threshold_fills_every_mask_under_tau():
    lg = peaked_logits(["hi", "lo", "half", "lo"])
    assert select_fills(lg, [0, 1, 2, 3], threshold=0.4, penalty=0.0) == [1, 3]
    assert select_fills(lg, [0, 1, 2, 3], threshold=0.8, penalty=0.0) == [1, 2, 3]


def test_distance_penalty_is_relative_to_the_first_remaining_mask():
    lg = peaked_logits(["lo", "lo", "lo"])
    # slots 5, 9, 30: adjusted = 0, 0.08, 0.5 with λ = 0.02
    assert select_fills(lg, [5, 9, 30], threshold=0.4, penalty=0.02) == [0, 1]


def test_no_mask_under_tau_fills_the_single_argmin():
    lg = peaked_logits(["hi", "half", "hi"])
    assert select_fills(lg, [0, 1, 2], threshold=0.4, penalty=0.02) == [1]
    # τ = None: one-by-one decoding, always the argmin
    assert select_fills(peaked_logits(["lo", "lo"]), [0, 1], threshold=None, penalty=0.02) == [0]


def test_commit_length_stops_at_stop_token_and_room():
    assert commit_length([5, 6, 7, 8], stop_ids={7}, room_tokens=10) == 3  # stop inside, inclusive
    assert commit_length([5, 6, 7, 8], stop_ids=set(), room_tokens=2) == 2  # max_tokens / max_model_len
    assert commit_length([], stop_ids={7}, room_tokens=2) == 0


@pytest.mark.parametrize("bad, field", [(dict(window_size=0), "window_size"), (dict(entropy_threshold=-1), "entropy"),
                                        (dict(position_penalty=-0.1), "position_penalty"),
                                        (dict(mask_token_id=-3), "mask_token_id"), (dict(windowsize=4), "windowsize")])
def test_bad_options_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        WeDLMConfig.from_options(bad)


def test_in_order_filling_starts_at_the_first_mask():
    """Free: every confident mask (slots 1, 2); in order: the first mask, then the confident run after it."""
    lg = peaked_logits(["hi", "lo", "lo", "hi", "lo"])
    cfg = WeDLMConfig(entropy_threshold=0.4, position_penalty=0.0)
    free, ordered = window("TTTTT"), window("TTTTT")
    assert fill(free, [0, 1, 2, 3, 4], lg, cfg, GREEDY, None) == 3
    assert free.is_mask == [True, False, False, True, False]
    assert fill(ordered, [0, 1, 2, 3, 4], lg, cfg, GREEDY, None, in_order=True) == 3
    assert ordered.is_mask == [False, False, False, True, True]


def test_in_order_filling_judges_each_mask_after_the_fills_before_it():
    """A presence-like control: tokens already in the window before a slot lose 5. Both masks
    prefer token 3; the second is judged after the first took it."""
    lg = torch.full((2, 50), -1e4)
    lg[:, 3], lg[:, 4] = 0.0, -2.0
    w = window("TT")

    def judge(rows, slots):
        out = rows.clone()
        for i, k in enumerate(slots):
            out[i, [w.tokens[j] for j in range(k) if not w.is_mask[j]]] -= 5.0
        return out

    cfg = WeDLMConfig(entropy_threshold=0.8, position_penalty=0.0)
    assert fill(w, [0, 1], lg, cfg, GREEDY, None, judge, in_order=True) == 2
    assert w.tokens == [3, 4]


@pytest.mark.parametrize("in_order", [False, True])
def test_controls_shape_the_draw_but_logprobs_stay_the_models(in_order):
    """As in plain decoding: the controlled distribution picks the token, the reported logprob
    (and rank) is the model's own."""
    lg = torch.full((2, 50), -1e4)
    lg[:, 3], lg[:, 4] = 0.0, -1.0

    def ban_3(rows, slots):
        out = rows.clone()
        out[:, 3] = float("-inf")
        return out

    w = window("TT")
    cfg = WeDLMConfig(entropy_threshold=0.8, position_penalty=0.0)
    assert fill(w, [0, 1], lg, cfg, SamplingParams(temperature=0.0, logprobs=0), None, ban_3, in_order) == 2
    raw = torch.log_softmax(lg[0], -1)
    for lp in w.logprobs:
        assert lp is not None and list(lp) == [4]
        assert lp[4] == pytest.approx(float(raw[4])) and lp[4].rank == 2
