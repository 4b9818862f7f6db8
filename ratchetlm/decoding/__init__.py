"""Decoding strategies. Importing this package registers the built-in ones (registry.py)."""

from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, register
from ratchetlm.decoding.registry import available_strategies, create_strategy

__all__ = ["Commit", "DecodeStrategy", "Proposal", "available_strategies", "create_strategy", "register"]
