"""The rest of the OpenAI/vLLM surface: sampling controls equal the offline engine's, the field
policy (harmless fields ignored, meaning-changing unsupported ones and unknown ones refused, and
docs/serving.md's field table saying so), /tokenize, /detokenize, /tokenizer_info, /version, several served
names, CORS, a chat template file and a tool-call parser from the command line."""

from __future__ import annotations

import httpx
import pytest

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME, serve_main_in_thread

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _complete(server, **kw) -> dict:
    r = httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12,
                                                     "temperature": 0, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_sampling_controls_equal_the_offline_engine(server, oracle):
    first = oracle.tokenize(" jumps")[0]
    controls = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=5,
                    logit_bias={first: -100.0}, bad_words=["lazy"])
    plain = oracle.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].text
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, **controls))[0].text
    assert ref != plain and "lazy" not in ref
    got = _complete(server, **{**controls, "logit_bias": {str(first): -100.0}})
    assert got["text"] == ref


@pytest.mark.parametrize("extra", [{"user": "u1"}, {"metadata": {"k": "v"}}, {"store": False},
                                   {"service_tier": "auto"}, {"modalities": ["text"]}, {"audio": None},
                                   {"add_special_tokens": False}])
def test_harmless_fields_are_ignored(server, extra):
    r = httpx.post(server.v1 + "/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, **extra,
                                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
    ("functions", [{"name": "f"}]), ("best_of", 3), ("chat_template", "{{ 1 }}"), ("frobnicate", 1),
])
def test_meaning_changing_and_unknown_fields_are_refused(server, field, value):
    r = httpx.post(server.v1 + "/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, field: value,
                                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_tokenize_detokenize_and_info(server, oracle):
    r = httpx.post(server.base + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=60).json()
    assert r["tokens"] == oracle.tokenize(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert "".join(r["token_strs"]) == PROMPT
    chat = httpx.post(server.base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.json()["tokens"] == oracle.tokenize(oracle.apply_chat_template([{"role": "user", "content": "hi"}]),
                                                    add_special_tokens=False)
    back = httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert back == {"prompt": PROMPT}
    bad = httpx.post(server.base + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = httpx.get(server.base + "/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert httpx.get(server.base + "/version", timeout=60).json()["version"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_messages_the_template_refuses_are_a_400_on_messages(server, path):
    # continue_final_message with add_generation_prompt: vLLM's and HF's templating refuse the pair
    body = {"model": MODEL_NAME, "continue_final_message": True, "add_generation_prompt": True,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]}
    if path.startswith("/v1"):
        body["max_tokens"] = 2
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "cannot both be true" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_skip_special_tokens_is_honoured(server, oracle, path):
    body = {"model": MODEL_NAME, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Say hi."}]
    else:
        body["prompt"] = oracle.apply_chat_template([{"role": "user", "content": "Say hi."}])
    texts = {}
    for skip in (None, True, False):
        extra = {} if skip is None else {"skip_special_tokens": skip}
        r = httpx.post(server.v1 + path[3:], json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        texts[skip] = choice["message"]["content"] if "message" in choice else choice["text"]
    assert texts[None] == texts[True] and "<|im_end|>" not in texts[True]  # vLLM's default: true
    assert "<|im_end|>" in texts[False] and texts[False].replace("<|im_end|>", "").replace("<|im_start|>", "") \
        == texts[True]


def test_cors_is_off_by_default(server):
    r = httpx.options(server.v1 + "/chat/completions", timeout=60,
                      headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "template.jinja"
    path.write_text(TEMPLATE)
    # serve's main on a thread here (its parser, flag checks, model load with the template file, app and
    # uvicorn): what the flags do is the point, not the process (a subprocess: ~10 CPU-s more)
    with serve_main_in_thread(["--chat-template", str(path), "--served-model-name", MODEL_NAME, "alias-b",
                               "--allowed-origins", "https://app.example", "--tool-call-parser", "hermes"]) as srv:
        yield srv


def test_command_line_surface(flagged):
    names = [m["id"] for m in httpx.get(flagged.v1 + "/models", timeout=60).json()["data"]]
    assert names == [MODEL_NAME, "alias-b"]
    body = {"model": "alias-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(flagged.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL_NAME
    toks = httpx.post(flagged.base + "/tokenize", json={"messages": body["messages"]}, timeout=60).json()["tokens"]
    text = httpx.post(flagged.base + "/detokenize", json={"tokens": toks}, timeout=60).json()["prompt"]
    assert text == "[user] hi\n[assistant] "  # the file's template, not the model's
    ok = httpx.options(flagged.v1 + "/chat/completions", timeout=60,
                       headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert ok.headers.get("access-control-allow-origin") == "https://app.example"
    other = httpx.options(flagged.v1 + "/chat/completions", timeout=60,
                          headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") is None
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    r = httpx.post(flagged.v1 + "/chat/completions", json={**body, "tools": tools, "tool_choice": "required",
                                                            "max_tokens": 40, "temperature": 0}, timeout=120)
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ping"


@pytest.mark.parametrize("args, needle", [(["--tool-call-parser", "nope"], "tool call parser"),
                                          (["--allowed-origins", "example.com"], "allowed_origins"),
                                          (["--chat-template", "/no/such/file"], "chat-template")])
def test_bad_flags_exit_with_a_message(args, needle, capsys, monkeypatch):
    """Refused before the server starts: ``ratchet``'s main in this process, whose return value is the
    process's exit code (ratchetlm/__main__.py; ``python -m ratchetlm`` itself runs in tests/api/test_cli.py).
    A subprocess per bad flag paid a python + torch + transformers start-up, ~5 CPU-s each."""
    import logging

    from ratchetlm.cli import main
    from ratchetlm.server.http import RatchetServer

    def started(self):  # a flag that got through would serve here for ever (no subprocess timeout)
        raise AssertionError(f"the server started with {args}")

    monkeypatch.setattr(RatchetServer, "run", started)
    log = logging.getLogger("ratchetlm")
    saved = list(log.handlers), log.level, log.propagate
    try:
        rc = main(["serve", *args])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    finally:  # the command's logging set-up (a handler on the captured stderr) put back
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_wedlm_refuses_a_grammar_with_a_400():
    from ratchetlm import LLM
    from tests.server.test_inprocess import serve
    from tests.wedlm.conftest import TRAINED

    wedlm = LLM(str(TRAINED), dtype="float32", progress=False, wedlm={"window_size": 8}, kv_cache_blocks=32)
    with serve(wedlm) as base:
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "count", "max_tokens": 4, "guided_regex": "[0-9]+"})
        assert r.status_code == 400 and "decoding='wedlm'" in r.json()["error"]["message"], r.text
        ok = httpx.post(base + "/v1/completions", timeout=60,
                        json={"model": "m", "prompt": "count", "max_tokens": 4, "presence_penalty": 1.0})
        assert ok.status_code == 200, ok.text


def _field_table() -> dict[str, str]:
    """docs/serving.md's request-field table: field name -> its row's verdict."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    start = doc.index("| field | endpoint | here |")
    rows = doc[start:doc.index("\n\n", start)].splitlines()[2:]
    table: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_.]+)`", cells[0]):
            if name not in ("true", "false"):
                table.setdefault(name, cells[2])
    return table


def test_the_field_table_in_the_docs_is_the_servers_policy():
    """Every request field the server declares, ignores or refuses has a row, and a row that says
    refused / ignored is what check_unsupported does."""
    from ratchetlm.server.protocol import IGNORED_FIELDS, REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest

    table = _field_table()
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    listed = set(table) | {n.split(".")[0] for n in table}
    missing = (declared | IGNORED_FIELDS | set(REFUSED_FIELDS)) - listed
    assert not missing, f"fields without a row in docs/serving.md: {sorted(missing)}"
    for name, verdict in table.items():
        if "refused" in verdict and name != "suffix":  # suffix: a declared field, refused when set
            assert name in REFUSED_FIELDS, f"docs/serving.md says {name} is refused; the server does not refuse it"
        elif verdict == "ignored":
            assert name in IGNORED_FIELDS or name in declared, f"docs/serving.md says {name} is ignored"
