"""Names for full, committed KV blocks: a hash chained over the prefix.

A block's K/V depend on every token before and inside it and on whatever else shapes the
computation (the model's weights, dtype and kernels, an adapter, a tenant's salt). So block ``i``
of a sequence is named ``H(name of block i-1, its token ids)`` and block 0's parent is a *root*
that folds in those other inputs. Two blocks with the same name hold the same K/V, whichever
request computed them.

SHA-256, not Python's ``hash``: a prompt an attacker chooses must not be able to collide with
another user's prefix and read its K/V (vLLM moved to SHA-256 for the same reason).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping

BlockHash = bytes  # 32-byte SHA-256 digest

_VERSION = b"ratchetlm-kv-block-v1"


def root_hash(parts: Mapping[str, str], salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block. ``parts``: engine-wide inputs that change K/V
    (model identity, dtype, numerics mode, adapter), as ``name -> value`` strings; ``salt``: a
    per-request key (a tenant, a per-request adapter) that isolates its blocks from everyone else's."""
    h = hashlib.sha256(_VERSION)
    for name in sorted(parts):
        h.update(f"\0{name}={parts[name]}".encode())
    if salt is not None:
        h.update(b"\0salt=" + salt.encode())
    return h.digest()


def chain_hash(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """The name of a full block holding ``token_ids`` after the prefix named ``parent``."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
