"""Stop strings through the server: one spanning two tokens, and one never completed (its held-back
prefix is released at the end). The multi-token-commit case is in test_inprocess.py."""

from __future__ import annotations

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME

PROMPT = "My favourite animals are"


def _ref(oracle):
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    pieces = [oracle.tokenizer.decode([t]) for t in ref.token_ids]
    assert "".join(pieces) == ref.text  # plain ASCII continuation: per-token text is exact
    return ref, pieces


def _both(client, stop):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    return whole.choices[0], [c.choices[0] for c in chunks]


def test_stop_string_spanning_two_tokens(client, oracle):
    ref, pieces = _ref(oracle)
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = ref.text[: ref.text.index(stop)]
    whole, chunks = _both(client, stop)
    assert whole.text == expected and whole.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    # include_stop_str_in_output keeps the stop string
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_stop_string_never_completed_releases_held_back_text(client, oracle):
    ref, pieces = _ref(oracle)
    tail = pieces[-2][-2:] + pieces[-1]  # the end of the output is a proper prefix of the stop string
    stop = tail + "\u2603"
    whole, chunks = _both(client, [stop, "\u2603\u2603"])
    assert whole.text == ref.text and whole.finish_reason == "length"
    texts = [c.text for c in chunks]
    assert "".join(texts) == ref.text
    assert texts[-1].endswith(tail) and chunks[-1].finish_reason == "length"  # held back until the end
