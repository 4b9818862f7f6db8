"""``skip_special_tokens`` (vLLM's, default true): the special tokens a model writes are left out of the
text, as HF's ``decode(ids, skip_special_tokens=True)`` leaves them out; ``False`` keeps them. The token
ids are the same either way. With ``ignore_eos`` the default model writes ``<|im_end|>`` and starts a new
turn with ``<|im_start|>``: both are special tokens."""

from __future__ import annotations

from ratchetlm import SamplingParams

CHAT = [{"role": "user", "content": "Say hi."}]


def test_the_text_is_hfs_decode_with_and_without_the_special_tokens(llm_fp32):
    base = dict(max_tokens=40, temperature=0, ignore_eos=True)
    skipped = llm_fp32.chat(CHAT, SamplingParams(**base))[0].outputs[0]
    kept = llm_fp32.chat(CHAT, SamplingParams(**base, skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == kept.token_ids and 2 in kept.token_ids  # <|im_end|> was written
    tok = llm_fp32.tokenizer
    assert skipped.text == tok.decode(skipped.token_ids, skip_special_tokens=True)
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert "<|im_end|>" in kept.text and "<|im_end|>" not in skipped.text


def test_every_choice_and_the_stream_follow_it(llm_fp32):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, n=2, ignore_eos=True)
    out = llm_fp32.chat(CHAT, params)[0].outputs
    for o in out:
        assert o.text == llm_fp32.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    prompt = llm_fp32.apply_chat_template(CHAT)
    for skip in (True, False):
        ids: list[int] = []
        text = ""
        for ev in llm_fp32.stream(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                         skip_special_tokens=skip)):
            ids += ev.token_ids
            text += ev.text
        assert text == llm_fp32.tokenizer.decode(ids, skip_special_tokens=skip) and 2 in ids
