"""Frozen dataclass configs loaded from YAML, with unknown keys rejected.

Each component declares a small ``@dataclass(frozen=True)`` that validates itself; a run config nests them.
:func:`from_dict` builds one from a mapping and :func:`to_dict` gives it back (both from
:mod:`operators.config`, re-exported here), :func:`load_config` reads YAML and applies ``--set a.b=value``
overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml

from operators.config import ConfigError, from_dict, to_dict

__all__ = ["ConfigError", "from_dict", "to_dict", "load_config", "apply_overrides", "parse_override"]

T = TypeVar("T")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as YAML (so ``true``, ``0.5``, ``[1,2]`` work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides to a nested mapping (in a copy)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text!r}: {k!r} is not a section")
            node = nxt
        node[keys[-1]] = value
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Read YAML at ``path`` (or start empty), apply overrides, build ``cls``."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a YAML mapping at the top level, got {type(loaded).__name__}")
        data = loaded
    return from_dict(cls, apply_overrides(data, overrides))
