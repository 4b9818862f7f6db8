"""The decoding strategies by name. Importing this module imports the built-in ones, which register
themselves (``base.register``); ``create_strategy`` builds the one a config names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ratchetlm.decoding import autoregressive, wedlm  # noqa: F401  (register the built-in strategies)
from ratchetlm.decoding.base import _REGISTRY, DecodeStrategy, StrategyContext
from ratchetlm.decoding.speculative import strategy  # noqa: F401


def create_strategy(name: str, ctx: StrategyContext, options: Mapping[str, Any] | None) -> DecodeStrategy:
    if name not in _REGISTRY:
        raise ValueError(f"unknown decoding strategy {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](ctx, options)


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)
