"""Lossless speculative decoding: proposers → prefix-tree packing → one staged verify forward → commit."""

from ratchetlm.decoding.speculative import strategy  # noqa: F401  (registers "speculative")
