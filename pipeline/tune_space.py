"""``foveate tune``'s search space: YAML over dotted :class:`~pipeline.train_config.TrainConfig` keys, checked
before anything starts.

A space file maps config keys (dotted, ``model.selection.k``, or nested sections) to one distribution each::

    model.selection.k: {choice: [4, 8, 16]}        # one of the values
    optim.lr: {loguniform: [1.0e-4, 1.0e-2]}       # log-uniform between the bounds
    optim.weight_decay: {uniform: [0.0, 0.01]}     # uniform between the bounds
    optim.accumulate: {randint: [1, 4]}            # an integer, both bounds included
    model.selection.selector: {grid: [perturbed, lapsum]}   # every value, each in its own trials

:func:`load_space` reads and checks it against a base config: every key must name a field of the config
dataclasses (and not one ``foveate tune`` sets itself: ``workdir``, ``tracking.*``, ``pretrain.*``), every range
must be well formed and fit the field's type (``uniform`` / ``loguniform`` draw floats, so not for an integer field),
and every value the space can give (each ``choice`` and ``grid`` value, each range's bounds, and every ``grid``
combination) must build a valid config with the base config's other values. A problem raises
:class:`~operators.errors.ConfigError` naming the key, what was given and what is allowed (all problems at once).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from operators.config import from_dict, to_dict
from operators.errors import ConfigError

__all__ = ["KINDS", "Param", "SearchSpace", "load_space", "parse_space", "set_key", "config_for"]

#: The distributions a space may use.
KINDS = ("choice", "uniform", "loguniform", "randint", "grid")
#: Keys (or sections) ``foveate tune`` sets itself.
RESERVED = ("workdir", "tracking", "pretrain")
#: At most this many grid combinations are built one by one when the space is checked.
MAX_GRID_CHECKS = 1000


@dataclass(frozen=True)
class Param:
    """One searched key: ``key`` (dotted), ``kind`` (one of :data:`KINDS`) and its ``args`` (the values for
    ``choice``/``grid``, the bounds ``(low, high)`` for the ranges)."""

    key: str
    kind: str
    args: tuple[Any, ...]

    def describe(self) -> str:
        return f"{self.kind} {list(self.args)}"

    def tune_domain(self) -> Any:
        """The Ray Tune search domain (``randint``'s upper bound is inclusive here, exclusive in Ray Tune)."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        if self.kind == "uniform":
            return tune.uniform(*self.args)
        if self.kind == "loguniform":
            return tune.loguniform(*self.args)
        return tune.randint(self.args[0], self.args[1] + 1)

    def checked_values(self) -> list[Any]:
        """The values each checked on its own: every value of a list, both bounds of a range."""
        return list(self.args)


@dataclass(frozen=True)
class SearchSpace:
    """A checked search space: its parameters (in file order) and the raw mapping it came from."""

    params: tuple[Param, ...]
    source: dict[str, Any]

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def param_space(self) -> dict[str, Any]:
        """Ray Tune's ``param_space``: ``{dotted key: domain}``."""
        return {p.key: p.tune_domain() for p in self.params}

    def grid_size(self) -> int:
        return math.prod(len(p.args) for p in self.params if p.kind == "grid")

    def as_dict(self) -> dict[str, Any]:
        """``{key: {kind: [args]}}`` (what is logged with the search)."""
        return {p.key: {p.kind: list(p.args)} for p in self.params}


# ---------------------------------------------------------------------------------------------- config fields
def _dataclass_of(tp: Any) -> type | None:
    """The dataclass in ``tp`` (itself, or the dataclass member of an Optional/Union), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def field_type(cls: type, key: str) -> Any:
    """The declared type of dotted ``key`` in dataclass ``cls``; ConfigError naming the first unknown part and
    the fields allowed there."""
    parts = key.split(".")
    tp: Any = cls
    for i, part in enumerate(parts):
        sub = _dataclass_of(tp)
        where = ".".join(parts[:i]) or cls.__name__
        if sub is None:
            raise ConfigError(f"{key}: {where} is a value, not a section (no key {part!r} under it)")
        names = [f.name for f in dataclasses.fields(sub)]
        if part not in names:
            raise ConfigError(f"{key}: unknown config key {part!r} in {where}; allowed: {sorted(names)}")
        tp = typing.get_type_hints(sub)[part]
    if _dataclass_of(tp) is not None and not _is_scalar_union(tp):
        raise ConfigError(f"{key}: is a section; search one of its keys ({key}.<key>)")
    return tp


def _is_scalar_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and any(
        not dataclasses.is_dataclass(a) and a is not type(None) for a in typing.get_args(tp)
    )


def _accepts(tp: Any, base: type) -> bool:
    """Whether a field of type ``tp`` takes values of Python type ``base`` (int, float)."""
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(a, base) for a in typing.get_args(tp))
    if base is int:
        return tp in (int, float)
    return tp is float


# ---------------------------------------------------------------------------------------------- parsing
def _is_section(cls: type, key: str) -> bool:
    try:
        field_type(cls, key)
    except ConfigError as exc:
        return "is a section" in str(exc)
    return False


def _flatten(cls: type, data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``{"model": {"selection": {"k": {"choice": [...]}}}}`` -> ``[("model.selection.k", {"choice": [...]})]``: a
    mapping under a key that names a config section is opened, anything else is a leaf."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"search space: keys are dotted config keys, got {key!r}")
        name = f"{prefix}{key.strip()}"
        spec = isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in KINDS
        if isinstance(value, Mapping) and value and not spec and _is_section(cls, name):
            out.extend(_flatten(cls, value, f"{name}."))
        else:
            out.append((name, value))
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _param(key: str, spec: Any, tp: Any) -> Param:
    allowed = f"one of {{{', '.join(f'{k}: ...' for k in KINDS)}}}"
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{key}: got {spec!r}, must be {allowed}")
    kind, args = next(iter(spec.items()))
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{key}: {kind} got {args!r}, must be a non-empty list of values")
        return Param(key, kind, tuple(args))
    if not isinstance(args, list) or len(args) != 2:
        raise ConfigError(f"{key}: {kind} got {args!r}, must be a list [low, high]")
    low, high = args
    if kind == "randint":
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in args) or low > high:
            raise ConfigError(f"{key}: randint got {args!r}, must be two integers [low, high] with low <= high")
        if not _accepts(tp, int):
            raise ConfigError(f"{key}: randint got {args!r}, but {key} takes {_type_text(tp)}, not integers")
        return Param(key, kind, (low, high))
    if not (_number(low) and _number(high)) or low >= high:
        raise ConfigError(f"{key}: {kind} got {args!r}, must be two numbers [low, high] with low < high")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{key}: loguniform got {args!r}, must have 0 < low < high")
    if not _accepts(tp, float):
        hint = "; use randint or choice" if _accepts(tp, int) else ""
        raise ConfigError(f"{key}: {kind} draws numbers with a fraction, but {key} takes {_type_text(tp)}{hint}")
    return Param(key, kind, (float(low), float(high)))


def _type_text(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------------- configs
def set_key(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` (a copy) with dotted ``key`` set to ``value`` (sections created where missing)."""
    out = copy.deepcopy(data)
    node = out
    *parents, last = key.split(".")
    for k in parents:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[last] = value
    return out


def config_for(cls: type, base: Mapping[str, Any], values: Mapping[str, Any]) -> Any:
    """``cls`` built from the mapping ``base`` with the dotted ``values`` set (what a trial trains)."""
    data = dict(base)
    for key, value in values.items():
        data = set_key(data, key, value)
    return from_dict(cls, data)


def parse_space(data: Any, base: Any, *, where: str = "search space") -> SearchSpace:
    """Check the space mapping ``data`` against the config ``base`` (a config dataclass: its type gives the keys, its
    values the rest of each config built); ConfigError listing every problem."""
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{where}: expected a mapping of config keys to distributions, got {data!r}")
    cls = type(base)
    base_dict = to_dict(base)
    errors: list[str] = []
    params: list[Param] = []
    seen: set[str] = set()
    for key, spec in _flatten(cls, data):
        if key in seen:
            errors.append(f"{key}: given twice")
            continue
        seen.add(key)
        if key.split(".")[0] in RESERVED:
            errors.append(f"{key}: set by foveate tune itself, not searchable (reserved: {list(RESERVED)})")
            continue
        try:
            param = _param(key, spec, field_type(cls, key))
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        for value in param.checked_values():
            try:
                config_for(cls, base_dict, {key: value})
            except ConfigError as exc:
                errors.append(f"{key}: {param.describe()}: the value {value!r} is rejected: {exc}")
        params.append(param)
    grids = [p for p in params if p.kind == "grid"]
    if not errors and len(grids) > 1:
        combos = list(itertools.islice(itertools.product(*(p.args for p in grids)), MAX_GRID_CHECKS))
        for combo in combos:
            values = {p.key: v for p, v in zip(grids, combo)}
            try:
                config_for(cls, base_dict, values)
            except ConfigError as exc:
                errors.append(f"grid point {values}: rejected: {exc}")
    if errors:
        raise ConfigError(f"{where}: " + ("\n  ".join(["", *errors]) if len(errors) > 1 else errors[0]))
    return SearchSpace(tuple(params), {p.key: {p.kind: list(p.args)} for p in params})


def load_space(path: str | Path, base: Any) -> SearchSpace:
    """Read the space YAML at ``path`` and check it against ``base`` (:func:`parse_space`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"search space file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_space(data, base, where=str(p))
