"""The EAGLE trainer's data side: request files, the greedy targets it learns, the held-out sources."""

from __future__ import annotations

import json

import pytest
import torch

from ratchetlm.training.eagle_train import greedy_targets, read_requests

from .bench_script import load_benchmark


def test_read_requests_keeps_every_prompt_and_names_a_bad_line(tmp_path):
    good = tmp_path / "r.jsonl"
    good.write_text(json.dumps({"prompt": "Add two numbers."}) + "\n\n" + json.dumps({"prompt": "Why?", "x": 1}) + "\n")
    assert read_requests(good) == ["Add two numbers.", "Why?"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'prompt'"):
        read_requests(bad)


def test_greedy_targets_are_the_next_answer_token_and_the_prompts_argmax():
    # vocabulary of 6 tokens, hidden 6: feature j is one-hot on the token the target predicts there
    w = torch.eye(6)  # [V, H]
    prompt, answer = [0, 1, 2], [4, 5, 3]
    predicted = [3, 5, 4, 5, 3, 0]  # the target's argmax at positions 0..5 (5: after the last token)
    f = torch.eye(6)[predicted]  # [n, H]
    vocab = torch.tensor([5, 4, 3])  # draft vocabulary: token 0 is outside it
    remap = torch.full((6,), -100, dtype=torch.long)
    remap[vocab] = torch.arange(3)
    got = greedy_targets(prompt, answer, f, w.bfloat16(), remap)
    # prompt positions 0, 1 from the features; positions 2..4 predict the answer tokens 4, 5, 3;
    # the last position predicts nothing the data holds
    expect = [remap[3], remap[5], remap[4], remap[5], remap[3], -100]
    assert got.tolist() == [int(x) for x in expect]


def test_request_builder_keeps_spec_bench_sources_out(tmp_path):
    t0 = tmp_path / "t0"
    t0.mkdir()
    for name in ("xsum_summarize.jsonl", "cnn_dailymail_3_0_0_tldr_summary.jsonl", "kilt_tasks_hotpotqa_final.jsonl"):
        (t0 / name).write_text("".join(json.dumps({"prompt": f"{name} request number {i}"}) + "\n" for i in range(3)))
    gsm = tmp_path / "train.jsonl"
    gsm.write_text(json.dumps({"question": "How many apples are left after eating two of five?", "answer": "3"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert load_benchmark("eagle_requests").main(["--out", str(out), "--t0", str(t0), "--gsm8k", str(gsm)]) == 0
    prompts = read_requests(out)
    assert sorted(p for p in prompts if "request number" in p) == [f"xsum_summarize.jsonl request number {i}"
                                                                   for i in range(3)]
    assert "How many apples are left after eating two of five?" in prompts
