"""foveate tune: the search space (parsed and checked against the config, no Ray), and one real search.

The real search (in-process Ray Tune, sqlite MLflow, tiny stores) runs four trials of at most two epochs with
ASHA: one trial's value fails in the trial (recorded as failed, the search goes on), one crashes after its first
epoch's checkpoint and resumes from it, and at least one is stopped early by the scheduler; the parent and child
MLflow runs, the registered and aliased model and a ``best.yaml`` that ``foveate train`` takes are checked.
"""

from __future__ import annotations

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.train_config import TrainConfig
from pipeline.tune_space import config_for, load_space, parse_space


# ------------------------------------------------------------------------------------------ the space
def test_space_parses_every_kind_and_nested_sections():
    space = parse_space(
        {
            "model.selection.k": {"choice": [4, 8, 16]},
            "optim": {"lr": {"loguniform": [1e-4, 1e-2]}, "weight_decay": {"uniform": [0, 0.01]}},
            "optim.accumulate": {"randint": [1, 4]},
            "model.selection.selector": {"grid": ["perturbed", "lapsum"]},
        },
        TrainConfig(),
    )
    assert space.keys == [
        "model.selection.k",
        "optim.lr",
        "optim.weight_decay",
        "optim.accumulate",
        "model.selection.selector",
    ]
    assert space.as_dict()["optim.weight_decay"] == {"uniform": [0.0, 0.01]}
    assert space.grid_size() == 2
    from ray import tune

    domains = space.param_space()
    assert isinstance(domains["optim.lr"], tune.search.sample.Float)
    assert domains["model.selection.selector"] == {"grid_search": ["perturbed", "lapsum"]}
    randint = domains["optim.accumulate"]  # both bounds included (Ray Tune's upper bound is exclusive)
    assert (randint.lower, randint.upper) == (1, 5)
    cfg = config_for(TrainConfig, {"optim": {"epochs": 3}}, {"optim.lr": 0.5, "model.selection.k": 4})
    assert (cfg.optim.lr, cfg.optim.epochs, cfg.model.selection.k) == (0.5, 3, 4)


@pytest.mark.parametrize(
    "space, message",
    [
        ({"model.selection.kk": {"choice": [4]}}, r"model.selection.kk: unknown config key 'kk'.*allowed: .*'k'"),
        ({"optim.learning_rate": {"uniform": [0.1, 1]}}, r"optim.learning_rate: unknown .*allowed: .*'lr'"),
        ({"optim.lr": {"uniform": [1, 0.1]}}, r"optim.lr: uniform got \[1, 0.1\], must be .*low < high"),
        ({"optim.lr": {"loguniform": [0, 1]}}, r"optim.lr: loguniform got \[0, 1\], must have 0 < low"),
        ({"optim.lr": {"uniform": ["a", 1]}}, r"optim.lr: uniform got \['a', 1\], must be two numbers"),
        ({"optim.epochs": {"randint": [3, 1]}}, r"optim.epochs: randint got \[3, 1\], must be two integers"),
        ({"optim.epochs": {"uniform": [1, 5]}}, r"optim.epochs: uniform .* takes int; use randint or choice"),
        ({"optim.epochs": {"choice": [0, 2]}}, r"optim.epochs: choice \[0, 2\]: the value 0 is rejected: .*>= 1"),
        ({"optim.epochs": {"randint": [0, 2]}}, r"the value 0 is rejected"),
        ({"model.selection.selector": {"grid": ["lapsum", "nope"]}}, r"the value 'nope' is rejected.*'perturbed'"),
        ({"optim.lr": {"choice": []}}, r"optim.lr: choice got \[\], must be a non-empty list"),
        ({"optim.lr": [0.1, 0.2]}, r"optim.lr: got \[0.1, 0.2\], must be one of \{choice"),
        ({"optim.lr": {"normal": [0, 1]}}, r"optim.lr: got \{'normal'.*must be one of"),
        ({"model.selection": {"choice": [1]}}, r"model.selection: is a section"),
        ({"optim.lr.x": {"choice": [1]}}, r"optim.lr is a value, not a section"),
        ({"workdir": {"choice": ["a"]}}, r"workdir: set by foveate tune itself"),
        ({"tracking.experiment": {"choice": ["a"]}}, r"tracking.experiment: set by foveate tune itself"),
        ({}, r"expected a mapping of config keys"),
        ([1, 2], r"expected a mapping of config keys"),
    ],
)
def test_space_errors_name_the_key_what_was_given_and_what_is_allowed(space, message):
    with pytest.raises(ConfigError, match=message):
        parse_space(space, TrainConfig())


def test_space_checks_grid_combinations_and_reports_every_problem():
    base = TrainConfig()
    with pytest.raises(ConfigError) as err:
        parse_space({"optim.lr": {"uniform": [1, 0]}, "model.selection.k": {"choice": [0, 4]}}, base)
    text = str(err.value)
    assert "optim.lr: uniform got [1, 0]" in text and "model.selection.k: choice [0, 4]: the value 0" in text
    # each value alone is valid with the base config, one combination of the grid is not
    base = config_for(TrainConfig, {}, {"model.evidence.rare_cells": 0, "model.evidence.rank_weight": 0.0})
    space = {"model.evidence.instance_weight": {"grid": [0.0, 0.01]}, "model.evidence.rank_weight": {"grid": [0, 0.1]}}
    with pytest.raises(ConfigError, match=r"grid point .*'model.evidence.instance_weight': 0.0, .*rank_weight': 0.1"):
        parse_space(space, base)
    space["model.evidence.rank_weight"] = {"grid": [0.0]}
    assert parse_space(space, base).grid_size() == 2


def test_space_file(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("model.selection.k: {choice: [4, 8]}\noptim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    space = load_space(path, TrainConfig())
    assert space.as_dict() == {"model.selection.k": {"choice": [4, 8]}, "optim.lr": {"loguniform": [1e-4, 1e-2]}}
    path.write_text("optim.lr: {loguniform: [1.0e-4\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_space(path, TrainConfig())
    with pytest.raises(ConfigError, match="search space file not found"):
        load_space(tmp_path / "missing.yaml", TrainConfig())
    assert yaml.safe_load(yaml.safe_dump(space.as_dict())) == space.as_dict()
