"""A closed word-level tokenizer for the generated corpus, built with the ``tokenizers`` library.

Words are split on spaces and carry a leading ``▁`` (Metaspace), so decoding restores the
spaces and incremental detokenization works like for any SentencePiece-style vocabulary.
Special tokens: ``<pad>`` 0, ``<unk>`` 1, ``<eos>`` 2, ``<mask>`` 3 (the WeDLM mask token).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIALS = ("<pad>", "<unk>", "<eos>", "<mask>")
PAD, UNK, EOS, MASK = SPECIALS


def build_tokenizer(words: Iterable[str]) -> Any:
    """Return a ``PreTrainedTokenizerFast`` whose vocabulary is ``SPECIALS`` + ``▁word`` per word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for w in words:
        if " " in w or not w:
            raise ValueError(f"vocabulary words must be non-empty and space-free, got {w!r}")
        vocab.setdefault("\u2581" + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, mask_token=MASK,
        clean_up_tokenization_spaces=False,
    )
