"""Lossless speculative decoding: proposers → prefix-tree packing → one staged verify forward → commit.

The strategy registers when :mod:`ratchetlm.decoding` imports ``speculative.strategy``; this package
itself imports nothing, so its tree-verification math (``verify``) can be used by other strategies
(grammar-forced tokens, decoding/tentative.py) without a cycle."""
