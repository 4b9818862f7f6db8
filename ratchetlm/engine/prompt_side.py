"""What a model's prompts need without its weights: the tokenizer (the model's own, or vLLM's
``tokenizer=``), the special tokens a text prompt gets, the chat template and the model's default
sampling parameters. :class:`~ratchetlm.engine.llm.LLM` has these on top of its engine; so has the
front process of a data-parallel server (server/front.py), which prepares requests and loads no
weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ratchetlm.engine.prompts import Prompt, PromptTokenizer, render_chat
from ratchetlm.models.loader import ModelSource
from ratchetlm.models.tokenizer import other_tokenizer, special_tokens
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.text.detokenizer import special_token_ids


class PromptSide:
    """``tokenize`` / ``apply_chat_template`` / the default sampling parameters of one model."""

    tokenizer: Any
    special_ids: frozenset[int]
    default_sampling: dict[str, Any]
    _prompts: PromptTokenizer

    def _set_tokenizer(self, tokenizer: Any, source: ModelSource, other: str | None, vocab_size: int) -> None:
        """The model's ``tokenizer`` (loaded from ``source``), or ``other`` (vLLM's ``tokenizer=``,
        a path) when it names another one; its special tokens are read from where it came from."""
        found = None if other is None else other_tokenizer(str(other), source, vocab_size)
        if found is not None:
            tokenizer, source = found
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)  # what skip_special_tokens leaves out of the text
        self._prompts = PromptTokenizer(tokenizer, special_tokens(source, tokenizer))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling parameters of a ``generate`` / ``chat`` call given none: the model's
        defaults (``generation_config``, engine/generation_config.py) over SamplingParams' own."""
        return SamplingParams(**self.default_sampling)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """The token ids a prompt feeds the model: text with the tokenizer's own special tokens (the
        BOS where the model's metadata asks for one) unless ``add_special_tokens=False``; token ids as given."""
        return self._prompts.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            tool_parser: str | None = None, add_generation_prompt: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            chat_template_kwargs: Mapping[str, Any] | None = None,
                            content_format: str = "auto") -> str:
        """The prompt text for ``messages`` (engine/prompts.py:render_chat)."""
        return render_chat(self.tokenizer, messages, tools, tool_parser, add_generation_prompt, chat_template,
                           continue_final_message, chat_template_kwargs, content_format)
