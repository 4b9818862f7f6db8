"""Errors raised in one layer and caught in another, defined below both (docs/architecture.md, "Layers")."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a tensor-parallel rank died): not one request's fault, so
    fault isolation does not apply; every later step raises it too."""


class ModelLoadError(ValueError):
    """A model reference that cannot be loaded (missing path, unsupported format or architecture)."""
