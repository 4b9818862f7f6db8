"""Request preparation in a bounded pool: huge or slow requests delay only themselves; a prompt far
past the context is refused on a bounded prefix; a body trickled byte by byte ends at the deadline."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError
from ratchetlm.server.prepare import CHARS_PER_TOKEN, LARGE_BODY, encode_bounded, longest_token_chars
from tests.server.conftest import serve_in_thread


def serve(llm, cfg: ServerConfig):
    return serve_in_thread(llm, "m", cfg)


class SlowTokenizing:
    """``llm`` whose ``encode`` of any text over 10,000 characters blocks until ``gate`` opens (an
    instrumented slow tokenizer); records the length of every text it was asked to encode."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.lengths: list[int] = []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def tokenize(self, prompt, add_special_tokens=True):
        if isinstance(prompt, str):
            self.lengths.append(len(prompt))
            if len(prompt) > 10_000:
                self.entered.release()
                assert self.gate.wait(120)
        return self._llm.tokenize(prompt, add_special_tokens)


def test_two_huge_prompts_in_preparation_do_not_delay_a_one_token_request(oracle):
    llm = SlowTokenizing(oracle)
    # just under the characters that no tokenization could fit (so it is counted on a prefix), and
    # over LARGE_BODY as JSON (each "é" is sent as the six bytes of "\u00e9")
    chars = longest_token_chars(oracle.tokenizer) * oracle.engine.max_model_len - 1000
    huge = ("éé " * (chars // 3 + 1))[:chars]
    assert len(json.dumps({"prompt": huge})) > LARGE_BODY
    results: list[httpx.Response] = []
    with serve(llm, ServerConfig(prep_workers=2)) as port:
        base = f"http://127.0.0.1:{port}/v1/completions"

        def post_huge():
            results.append(httpx.post(base, json={"prompt": huge, "max_tokens": 1}, timeout=120))

        threads = [threading.Thread(target=post_huge) for _ in range(2)]
        for t in threads:
            t.start()
        assert llm.entered.acquire(timeout=60)  # one huge prompt is being tokenized (and stuck)
        # two workers, one of them free: the small request is prepared and served while both huge
        # ones wait (the second for the large-body share, held by the first)
        r = httpx.post(base, json={"prompt": "Hi", "max_tokens": 1, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert not results and all(t.is_alive() for t in threads)
        llm.gate.set()
        for t in threads:
            t.join(120)
    assert [x.status_code for x in results] == [400, 400]
    assert all("max_model_len" in x.json()["error"]["message"] for x in results)
    # refused on a bounded prefix: the whole 1.6 MB text was never tokenized
    limit = CHARS_PER_TOKEN * oracle.engine.max_model_len
    assert max(llm.lengths) <= limit < len(huge)


def test_bounded_tokenization_counts_a_prefix_of_the_whole_texts_tokens(oracle):
    encode = oracle.tokenize
    text = "The quick brown fox, jumping over 12,345 lazy dogs!\n  Then\tit rests. " * 40
    calls: list[int] = []

    def counting(t: str) -> list[int]:
        calls.append(len(t))
        return encode(t)

    whole = encode(text)
    limit = 64  # tokens: the text is far longer than CHARS_PER_TOKEN * 64 characters
    with pytest.raises(APIError, match="max_model_len is 64") as e:
        encode_bounded(counting, text, limit, "prompt")
    assert e.value.status == 400 and calls and max(calls) <= CHARS_PER_TOKEN * limit
    # the counted part's tokens are exactly the first tokens of the whole text (the refusal is sound)
    part = encode(text[: calls[0]])
    assert whole[: len(part)] == part and len(part) >= limit
    # a text longer than the longest token x the context cannot fit whatever it is: nothing is tokenized
    calls.clear()
    with pytest.raises(APIError, match="no token is longer than 5 characters"):
        encode_bounded(counting, "x" * (5 * limit + 1), limit, "prompt", max_token_chars=5)
    assert calls == []
    assert encode_bounded(counting, "x" * (5 * limit), 10 * limit, "prompt", max_token_chars=5)  # (fits)
    # a text that fits is tokenized whole, once
    calls.clear()
    assert encode_bounded(counting, text, len(whole) + 1, "prompt") == whole
    assert calls == [len(text)]


def test_a_body_trickled_a_byte_at_a_time_ends_with_408_at_the_deadline(oracle):
    cfg = ServerConfig(idle_timeout=1.0, body_timeout=2.0)
    with serve(oracle, cfg) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
        s.settimeout(0.3)
        start, sent, data = time.monotonic(), 0, b""
        while time.monotonic() - start < 30:
            try:  # one byte every ~0.3 s: each arrives well within the idle timeout
                s.sendall(b" ")
                sent += 1
            except OSError:
                break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and data.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                break
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(body)["error"]
    assert err["code"] == "408" and "did not complete within 2 s" in err["message"]
    assert sent < 100  # cut by the deadline, not finished by the client


@pytest.mark.parametrize("field", ["body_timeout", "prep_timeout", "prep_workers"])
def test_preparation_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: 0})
