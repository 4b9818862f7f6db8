"""The tokenizer converted from a GGUF: the right special tokens, and a disk copy per converter."""

from __future__ import annotations

import transformers

from ratchetlm.models import tokenizer
from ratchetlm.models.loader import default_model_path


def test_bundled_gguf_tokenizer_ends_turns_with_im_end(hf_tokenizer):
    # transformers 5.16/5.17 read eos as <|im_start|> (id 1): grammars then end at the wrong token
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert hf_tokenizer.bos_token_id == 1


def test_a_converted_copy_is_kept_per_transformers_release(monkeypatch, tmp_path):
    monkeypatch.setenv("RATCHETLM_CACHE", str(tmp_path))
    assert tokenizer.converter_version() == transformers.__version__
    here = tokenizer.converted_path(default_model_path())
    assert here.parent == tmp_path / "tokenizers" and here == tokenizer.converted_path(default_model_path())
    # The module attribute, not `transformers.__version__`: the suite's CI run once saw a second
    # transformers module object, so patching the one imported here did not reach the key.
    monkeypatch.setattr(tokenizer, "converter_version", lambda: "0.0.1")
    assert tokenizer.converted_path(default_model_path()) != here
