"""``foveate config show [--config C] [--set key=value ...]``: the effective training config, each value with
where it came from.

Every value of the config ``foveate train`` would run with (``pipeline.train_config.TrainConfig``: ``data``,
``model``, ``optim``, ``schedule``, ``tracking``, ...) is printed as YAML with a comment naming its source:
``default`` (the dataclass default: for ``model`` the recommended recipe), ``file`` (the ``--config`` YAML) or
``--set``. Flat ``model.*`` keys of earlier versions are shown at their new place (and named in a deprecation
line on stderr). The output is itself a valid config file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from pipeline.config import add_config_arguments, apply_overrides, resolve_config_path, to_dict

__all__ = ["provenance", "render", "add_arguments", "run"]


def _leaves(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of ``data``'s values; an empty section (``model: {}``) sets nothing."""
    out: set[str] = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _leaves(value, path + ".")
        else:
            out.add(path)
    return out


def _given(data: Mapping[str, Any]) -> set[str]:
    """The dotted keys ``data`` (a raw TrainConfig mapping) sets, flat model keys moved to their sections."""
    from operators.model_config import upgrade_flat_keys

    data = dict(data)
    if isinstance(data.get("model"), Mapping):
        data["model"] = upgrade_flat_keys(data["model"])[0]
    return _leaves(data)


def provenance(config: str | None, overrides: list[str]) -> tuple[Any, dict[str, str]]:
    """``(TrainConfig, {dotted key: "default" | "file" | "--set"})`` for a ``--config`` path and ``--set``
    overrides (the same resolution ``foveate train`` does)."""
    from pipeline.config import load_config
    from pipeline.train_config import TrainConfig

    file_data: dict[str, Any] = {}
    if config is not None:
        file_data = yaml.safe_load(resolve_config_path(config).read_text()) or {}
    cfg = load_config(TrainConfig, config, overrides)
    from_file, from_set = _given(file_data), _given(apply_overrides({}, overrides))

    def within(key: str, given: set[str]) -> bool:
        return any(key == g or key.startswith(g + ".") for g in given)

    sources = {}
    for key in _leaves(to_dict(cfg)):
        sources[key] = "--set" if within(key, from_set) else "file" if within(key, from_file) else "default"
    # `auto` is resolved when the config loads: say so where it was given
    raw = apply_overrides(file_data, overrides)
    if ((raw.get("model") or {}).get("augment") or {}).get("symmetry") == "auto":
        sources["model.augment.symmetry"] += f" (auto: data.label_symmetry={cfg.data.label_symmetry})"
    return cfg, sources


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def render(data: Mapping[str, Any], sources: Mapping[str, str], *, prefix: str = "", indent: int = 0) -> list[str]:
    """YAML lines of ``data`` with ``# source`` comments on the leaves (aligned at column 48)."""
    lines = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        pad = "  " * indent
        if isinstance(value, Mapping) and value:
            lines.append(f"{pad}{key}:")
            lines += render(value, sources, prefix=path + ".", indent=indent + 1)
        else:
            text = f"{pad}{key}: {_scalar(value)}"
            lines.append(f"{text:<47} # {sources.get(path, 'default')}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser(
        "show",
        help="print the effective training config, each value with its source (default / file / --set)",
        description=__doc__.split("\n\n")[0],
    )
    add_config_arguments(show, "model.selection.k=16")
    show.add_argument("--section", default=None, help="print only this top-level section (e.g. model)")


def run(args: argparse.Namespace) -> int:
    cfg, sources = provenance(args.config, list(args.overrides or ()))
    data = to_dict(cfg)
    if args.section is not None:
        if args.section not in data:
            raise ValueError(f"--section: expected one of {sorted(data)}, got {args.section!r}")
        data = {args.section: data[args.section]}
    sys.stdout.write("\n".join(render(data, sources)) + "\n")
    return 0
