"""Which special tokens a prompt gets (engine/prompts.py, models/tokenizer.py:special_tokens), as
vLLM and llama.cpp feed them: a text prompt gets the BOS its tokenizer's metadata asks for; a chat
prompt rendered by a template that writes the BOS gets exactly one; token ids are fed as given.
A Llama-3-style GGUF (``tokenizer.ggml.add_bos_token = true``, a template that starts with
``{{ bos_token }}``) is written here; SmolLM2 (``add_bos_token = false``) keeps its prompts as they were."""

from __future__ import annotations

import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.prompts import PromptTokenizer
from ratchetlm.models.loader import resolve
from ratchetlm.models.tokenizer import SpecialTokens, load_tokenizer, probe_special_tokens, special_tokens
from tests.core.gguf_factory import BOS, write_tiny_gguf

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
TEXT = "the tea set"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("l3") / "llama3.gguf", "llama", ["F16"], pre="llama-bpe",
                           add_bos=True, chat_template=LLAMA3_TEMPLATE)
    return LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=32)


def test_text_prompt_gets_one_bos_from_the_gguf_metadata(llama3):
    plain = list(llama3.tokenizer.encode(TEXT, add_special_tokens=False))
    assert BOS not in plain
    assert llama3.tokenize(TEXT) == [BOS] + plain
    assert llama3.tokenize(TEXT, add_special_tokens=False) == plain
    assert llama3.tokenize({"prompt": TEXT}) == [BOS] + plain
    assert llama3.tokenize(plain) == plain  # token ids are fed as given
    out = llama3.generate(TEXT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [BOS] + plain and out.prompt == TEXT


def test_text_that_starts_with_the_bos_gets_no_second_one(llama3):
    assert llama3.tokenize("<bos>" + TEXT) == [BOS] + list(llama3.tokenizer.encode(TEXT, add_special_tokens=False))


def test_chat_prompt_rendered_with_the_bos_gets_exactly_one(llama3):
    msgs = [{"role": "user", "content": TEXT}]
    text = llama3.apply_chat_template(msgs)
    assert text.startswith("<bos>user: ")
    for add in (False, True):  # the template's BOS; adding the tokenizer's would double it
        ids = llama3.tokenize(text, add_special_tokens=add)
        assert ids[0] == BOS and ids.count(BOS) == 1
    out = llama3.chat(msgs, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llama3.tokenize(text, add_special_tokens=False) and out.prompt == text


@pytest.mark.parametrize("pre, add_bos, want", [
    ("llama-bpe", None, (BOS,)),  # llama.cpp's default for Llama 3's pre-tokenizer
    ("default", None, ()),  # a BPE vocabulary without the key: none
    ("llama-bpe", False, ()),  # the key wins
    ("default", True, (BOS,)),
])
def test_gguf_add_bos_token_read_as_llama_cpp_does(tmp_path, pre, add_bos, want):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ["F16"], layers=1, pre=pre, add_bos=add_bos)
    source = resolve(str(path))
    assert special_tokens(source, load_tokenizer(source)) == SpecialTokens(want, ())


def test_smollm2_has_no_bos_and_is_unchanged(llm_fp32):
    tok = llm_fp32.tokenizer
    assert llm_fp32._prompts.specials == SpecialTokens()
    text = "Hello there, general Kenobi"
    assert llm_fp32.tokenize(text) == list(tok.encode(text)) == list(tok.encode(text, add_special_tokens=False))


def test_hf_folder_tokenizer_adds_what_its_post_processor_adds():
    """An HF tokenizer (folder) adds what HF transformers adds: its post-processor's BOS and EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    specials = probe_special_tokens(tok)
    assert specials == SpecialTokens((0,), (1,))
    prompts = PromptTokenizer(tok, specials)
    assert prompts.tokenize("a b") == list(tok.encode("a b")) == [0, 2, 3, 1]
    assert prompts.tokenize("<s> a b </s>") == [0, 2, 3, 1]  # neither doubled
    assert prompts.tokenize("a b", add_special_tokens=False) == [2, 3]

