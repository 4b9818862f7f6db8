"""Decoding strategies. Importing this package registers the built-in ones."""

from ratchetlm.decoding import (
    autoregressive,  # noqa: F401
    wedlm,  # noqa: F401
)
from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, create_strategy, register
from ratchetlm.decoding.speculative import strategy  # noqa: F401

__all__ = ["Commit", "DecodeStrategy", "Proposal", "create_strategy", "register"]
