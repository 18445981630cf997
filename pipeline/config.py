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

__all__ = [
    "ConfigError",
    "from_dict",
    "to_dict",
    "load_config",
    "apply_overrides",
    "parse_override",
    "add_config_arguments",
    "config_from_cli",
    "shipped_config",
    "shipped_configs",
    "resolve_config_path",
]

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
    return config_from_cli(cls, _Args(path, list(overrides)))


class _Args:
    def __init__(self, config: str | Path | None, overrides: list[str]):
        self.config, self.overrides = config, overrides


# ---------------------------------------------------------------------------------------------- shipped configs
def _checkout_configs() -> Path:
    return Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with foveate, ``{name: path}``: the checkout's ``configs/`` when foveate runs from
    a checkout (``python -m pipeline``, an editable install, ``ray job submit --working-dir .``), else the copy
    installed as package data (``pipeline.configs``, a non-editable ``pip install``)."""
    root = _checkout_configs()
    if not root.is_dir():  # installed: the package data sits in pipeline/configs/ (pyproject.toml)
        root = Path(__file__).resolve().parent / "configs"
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def shipped_config(name: str) -> Path:
    """The path of shipped config ``name`` (``"demo"`` or ``"demo.yaml"``); ValueError listing the names."""
    configs = shipped_configs()
    stem = str(name).removesuffix(".yaml")
    if stem not in configs:
        raise ValueError(f"no shipped config {name!r}; shipped configs: {sorted(configs)}")
    return configs[stem]


def resolve_config_path(path: str | Path) -> Path:
    """``--config`` argument -> file: an existing file as given, else a shipped config of that name (``demo``,
    ``demo.yaml`` or ``configs/demo.yaml``, so the README's commands work without the checkout)."""
    p = Path(path)
    if p.is_file():
        return p
    candidate = p.name if (p.parent == Path(".") or p.parent.name == "configs") else None
    if candidate and candidate.removesuffix(".yaml") in shipped_configs():
        return shipped_config(candidate)
    raise ConfigError(f"config file not found: {p} (shipped configs, usable by name: {sorted(shipped_configs())})")


# ---------------------------------------------------------------------------------------------- command lines
def add_config_arguments(parser: Any, example: str) -> None:
    """``--config FILE.yaml`` and repeatable ``--set key=value`` (every command that has a config dataclass)."""
    parser.add_argument("--config", help="YAML config (keys as in the command's config dataclass; see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )


def config_from_cli(cls: type[T], args: Any, flags: dict[str, str] | None = None) -> T:
    """Build ``cls`` from the command line: the ``--config`` YAML, then ``--set`` overrides, then the flags given
    explicitly (``flags`` maps a config key, dotted for nested sections, to the argparse attribute holding it;
    an attribute that is None was not given and leaves the key alone)."""
    data: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path is not None:
        p = resolve_config_path(path)
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a YAML mapping at the top level, got {type(loaded).__name__}")
        data = loaded
    data = apply_overrides(data, list(getattr(args, "overrides", None) or ()))
    for key, attr in (flags or {}).items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        node = data
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = list(value) if isinstance(value, tuple) else value
    return from_dict(cls, data)
