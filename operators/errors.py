"""Errors shared by every layer (the lowest package, so ``workers`` and ``pipeline`` can raise and catch them)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config key or value is not what the dataclass allows (a ``ValueError``, so callers catching that keep working)."""
