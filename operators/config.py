"""Frozen dataclass configs <-> plain mappings, with unknown keys rejected (no YAML, no files).

:func:`from_dict` builds a dataclass from a mapping (recursively, rejecting unknown keys and checking scalar
types); :func:`to_dict` gives it back as plain data. Every config dataclass validates its own fields in
``__post_init__`` and raises :class:`ConfigError`. A dataclass may define a classmethod
``__config_upgrade__(data, where) -> (data, notes)`` that maps keys of earlier versions to today's before
building (each note is logged as a warning). ``pipeline.config`` adds YAML files and ``--set``
overrides on top.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from operators.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "from_dict", "to_dict", "replace_path"]

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected one of {[_type_name(a) for a in args]}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, _where=where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}: {value!r}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        seq = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(seq) if origin is tuple else seq
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, _where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``data``; unknown keys raise :class:`ConfigError`."""
    data = dict(data or {})
    upgrade = getattr(cls, "__config_upgrade__", None)
    if upgrade is not None:  # a config that renamed its keys maps the old ones (and says so, once per key)
        data, notes = upgrade(data, _where)
        for note in notes:
            log.warning("%s", note)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{_where}." if _where else ""
        raise ConfigError(
            f"unknown config key(s) {[prefix + k for k in unknown]} for {cls.__name__}; allowed: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        where = f"{_where}.{name}" if _where else name
        kwargs[name] = _coerce(value, hints[name], where)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise ConfigError(f"{_where or cls.__name__}: {exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain YAML-able data."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v

    return conv(cfg)


def replace_path(cfg: T, key: str, value: Any) -> T:
    """``cfg`` with the field at dotted ``key`` (e.g. ``"selection.k"``) set to ``value``; the sections on the
    way are replaced too (frozen dataclasses), so each is validated again.

    Raises:
        ConfigError: ``key`` names no field.
    """
    head, _, rest = key.partition(".")
    if not dataclasses.is_dataclass(cfg) or head not in {f.name for f in dataclasses.fields(cfg)}:
        raise ConfigError(f"{type(cfg).__name__} has no config key {key!r}")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace_path(getattr(cfg, head), rest, value)})
