"""vLLM's chat and structured-output names, offline and on the server: ``chat_template_kwargs``
reach the template, ``continue_final_message`` / ``add_generation_prompt``, the chat template's
content format, ``GuidedDecodingParams`` / ``guided_decoding=`` as aliases of the structured-output
parameters, ``GET /v1/models/{id}``, ``--response-role``; and ``ratchet serve`` taking a vLLM
command line (every flag honoured, accepted as a no-op, or refused naming why). A tiny
Llama-3-style GGUF with a template of its own is written here."""

from __future__ import annotations

import httpx
import pytest

from ratchetlm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from ratchetlm.server.config import ServerConfig
from tests.core.gguf_factory import BOS, write_tiny_gguf
from tests.server.conftest import serve_main_in_thread
from tests.server.openai_schema import assert_valid
from tests.server.test_inprocess import serve

TEMPLATE = ("{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
                  "{% endfor %}")
USER = [{"role": "user", "content": "the tea"}]
OPEN = [*USER, {"role": "assistant", "content": "the set"}]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("chat") / "tiny.gguf", "llama", ["F16"], pre="llama-bpe",
                           add_bos=True, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return LLM(str(tiny_path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64)


def test_chat_template_kwargs_reach_the_template(tiny):
    assert tiny.apply_chat_template(USER) == "<bos>user: the tea\nassistant:"
    off = tiny.apply_chat_template(USER, chat_template_kwargs={"enable_thinking": False})
    assert off == "<bos>/no_think\nuser: the tea\nassistant:"
    out = tiny.chat(USER, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt == off and out.prompt_token_ids.count(BOS) == 1
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tiny.apply_chat_template(USER, chat_template_kwargs={"add_generation_prompt": False})


def test_continue_final_message_leaves_the_last_turn_open(tiny):
    text = tiny.apply_chat_template(OPEN, add_generation_prompt=False, continue_final_message=True)
    assert text == "<bos>user: the tea\nassistant: the set"
    closed = tiny.apply_chat_template(OPEN, add_generation_prompt=False)
    assert closed == text + "\n"
    out = tiny.chat(OPEN, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == text
    with pytest.raises(ValueError, match="cannot both be true"):
        tiny.apply_chat_template(OPEN, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant"):
        tiny.apply_chat_template(USER, add_generation_prompt=False, continue_final_message=True)


def test_content_format_follows_the_template(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(msgs, chat_template=PARTS_TEMPLATE) == "user:[hi]"  # auto: it loops over parts
    assert tiny.apply_chat_template(msgs, chat_template=PARTS_TEMPLATE, content_format="openai") == "user:[hi]"
    assert tiny.apply_chat_template(msgs, chat_template=PARTS_TEMPLATE, content_format="string") == "user:[][]"
    assert tiny.apply_chat_template(msgs, content_format="openai") != tiny.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="content_format"):
        tiny.apply_chat_template(msgs, content_format="html")


def test_guided_decoding_is_the_structured_outputs_parameter(tiny):
    gd = GuidedDecodingParams(choice=["tea", "set"], backend="xgrammar", disable_fallback=True)
    sp = SamplingParams(max_tokens=4, temperature=0, guided_decoding=gd)
    assert sp.structured == gd and sp.guided_decoding is None
    so = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["tea", "set"]))
    got = tiny.generate("the", sp)[0].outputs[0].text
    assert got in ("tea", "set") and got == tiny.generate("the", so)[0].outputs[0].text
    assert GuidedDecodingParams(json_object=True, disable_any_whitespace=False).whitespace_flexible
    assert not GuidedDecodingParams(json_object=True).whitespace_flexible  # our compact default
    with pytest.raises(ValueError, match="whitespace_pattern"):
        GuidedDecodingParams(json_object=True, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="not both (structured_outputs|guided_decoding) and another"):
        SamplingParams(guided_decoding=gd, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_server_chat_options_models_card_and_response_role(tiny):
    with serve(tiny, "tiny") as base:
        tok = lambda body: httpx.post(base + "/tokenize", json=body, timeout=60).json()["tokens"]  # noqa: E731
        plain = tok({"messages": USER})
        off = tok({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
        assert off == tiny.tokenize(tiny.apply_chat_template(USER, chat_template_kwargs={"enable_thinking": False}),
                                    add_special_tokens=False) and off != plain
        assert tok({"messages": USER, "add_special_tokens": True}).count(BOS) == 1  # never a second BOS
        assert tok({"prompt": "the tea"})[0] == BOS and BOS not in tok({"prompt": "the tea",
                                                                         "add_special_tokens": False})
        chat = lambda **kw: httpx.post(base + "/v1/chat/completions", json={  # noqa: E731
            "model": "tiny", "max_tokens": 2, "temperature": 0, **kw}, timeout=60)
        r = chat(messages=USER, chat_template_kwargs={"enable_thinking": False})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(off)
        cont = chat(messages=OPEN, add_generation_prompt=False, continue_final_message=True)
        assert cont.json()["usage"]["prompt_tokens"] == len(tiny.tokenize(
            tiny.apply_chat_template(OPEN, add_generation_prompt=False, continue_final_message=True)))
        bad = chat(messages=OPEN, continue_final_message=True)
        assert bad.status_code == 400 and "cannot both be true" in bad.json()["error"]["message"]
        bad = chat(messages=USER, chat_template_kwargs={"tools": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        card = httpx.get(base + "/v1/models/tiny", timeout=60)
        assert card.status_code == 200 and card.json()["id"] == "tiny"
        assert_valid("model", card.json())
        missing = httpx.get(base + "/v1/models/org/other", timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert "org/other" in missing.json()["error"]["message"]
        assert_valid("error", missing.json())
    with serve(tiny, "tiny", ServerConfig(response_role="narrator")) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.json()["choices"][0]["message"]["role"] == "narrator"


VLLM_SERVE = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--no-enable-prefix-caching",
              "--disable-log-requests", "--generation-config", "vllm", "--uvicorn-log-level", "warning",
              "--response-role", "assistant", "--chat-template-content-format", "string",
              "--reasoning-parser", "deepseek_r1"]


def test_vllm_serve_flags_parse_and_map():
    from ratchetlm.cli import engine_kwargs
    from ratchetlm.server.cli import build_parser, check_vllm_serve_flags

    args = build_parser().parse_args(["m.gguf", *VLLM_SERVE])
    assert engine_kwargs(args)["enable_prefix_caching"] is False  # honoured
    assert args.uvicorn_log_level == "warning" and args.enable_auto_tool_choice and args.disable_log_requests
    assert check_vllm_serve_flags(args) is None
    assert build_parser().parse_args(["m.gguf"]).enable_prefix_caching is True


@pytest.mark.parametrize("flags, says", [
    (["--reasoning-parser", "granite"], "unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"),
    (["--generation-config", "/some/folder"], "generation_config must be 'auto', 'vllm' or a folder"),
    (["--tool-call-parser", "pythonic"], "unknown tool call parser 'pythonic'"),
    (["--chat-template-content-format", "html"], "chat_template_content_format"),
])
def test_flags_that_would_change_results_are_refused(tiny_path, capsys, flags, says):
    from ratchetlm.server.cli import main

    assert main([str(tiny_path), *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_vllm_serve_command_line_runs(tiny_path):
    """The command line through serve's main (parser, flag checks, load, app, uvicorn) on a thread here;
    ``python -m ratchetlm serve`` as a process runs in tests/api/test_cli.py and tests/server."""
    with serve_main_in_thread([str(tiny_path), *VLLM_SERVE],
                              base_args=["--served-model-name", "tiny", "--kv-cache-blocks", "64",
                                         "--log-level", "warning"]) as srv:
        body = {"model": "tiny", "prompt": "the tea set " * 12, "max_tokens": 2, "temperature": 0}
        for _ in range(2):  # the same prompt twice: with prefix caching off nothing is reused
            r = httpx.post(srv.v1 + "/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = httpx.post(srv.v1 + "/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
