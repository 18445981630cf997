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


# ------------------------------------------------------------------------------------------ the command
TINY = """
data: {{stores: {stores}, labels: {labels}, val_fraction: 0.34, seed: 0}}
model:
  geometry: {{patch_size: 32, scorer_downsample: 4}}
  selection: {{k: 4, num_samples: 8, perturbed: {{max_support: 2}}}}
  scorer: {{channels: 4, num_layers: 2}}
  features: {{widths: [4, 8], blocks: [1, 1], feature_dim: 8}}
  aggregator: {{kind: mean}}
optim: {{epochs: 2, lr: 0.01, accumulate: 2, warmup: 1}}
schedule: {{sigma_start: 0.1, sigma_end: 0.0}}
early_stopping: {{patience: 0}}
tracking: {{experiment: test-tune, artifact_slides: 0}}
workdir: {workdir}
"""


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    """Six 256x256 stores, two classes (a checkerboard patch or none)."""
    from tiny_stores import checker_stores

    return checker_stores(tmp_path_factory.mktemp("stores"), ["neg", "pos"], [0, 80])


def _config(tmp_path, slides):
    stores, labels = slides
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(stores=stores, labels=labels, workdir=tmp_path / "work"))
    return path


def test_an_invalid_space_stops_the_command_before_anything_starts(tmp_path, slides, caplog):
    from pipeline.cli import main

    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {loguniform: [0.1, 0.01]}\n")
    assert main(["tune", "--config", str(_config(tmp_path, slides)), "--space", str(space)]) == 2
    assert "optim.lr: loguniform got [0.1, 0.01], must be two numbers [low, high] with low < high" in caplog.text
    assert not (tmp_path / "work" / "tune").exists()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.ray
def test_a_real_search(tmp_path, slides):
    import mlflow

    from pipeline.config import load_config
    from pipeline.tune import tune

    marker = tmp_path / "crashed-once"

    def crash_once(values, epoch):  # in the trial: the first good trial crashes once after epoch 1's checkpoint
        if values["optim.lr"] == 0.01 and values["model.selection.k"] == 4 and epoch == 1 and not marker.exists():
            marker.write_text("x")
            raise RuntimeError("simulated crash after epoch 1")

    space = {"model.selection.k": {"grid": [4, 10000]}, "optim.lr": {"grid": [0.01, 3.0]}}
    result = tune(
        load_config(TrainConfig, _config(tmp_path, slides)),
        space,
        trials=1,
        scheduler="asha",
        metric="val_loss",
        mode="min",
        max_concurrent=1,
        out=tmp_path / "search",
        promote="champion",
        after_epoch=crash_once,
    )
    rows = {(r.values["model.selection.k"], r.values["optim.lr"]): r for r in result.rows}
    print(result.summary())
    assert len(rows) == 4
    for lr in (0.01, 3.0):  # k = 10000 cells: more than a 256-px slide has at 32 px: failed with the reason
        assert rows[(10000, lr)].state == "failed" and "model.selection.k: got 10000" in rows[(10000, lr)].detail
    assert rows[(4, 0.01)].state == "completed" and rows[(4, 0.01)].epochs == 2
    assert rows[(4, 3.0)].state == "early-stopped" and rows[(4, 3.0)].epochs == 1
    assert result.best is rows[(4, 0.01)] and marker.exists()

    client = mlflow.MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["space.optim.lr"] == "grid [0.01, 3.0]" and parent.data.params["tune.scheduler"] == "asha"
    assert (
        parent.data.params["best.optim.lr"] == "0.01" and parent.data.tags["foveate.best_run_id"] == result.best.run_id
    )
    assert parent.data.metrics["best_val_loss"] == pytest.approx(result.best.metric)
    assert parent.data.metrics["trials_failed"] == 2
    children = client.search_runs(
        [result.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'"
    )
    by_id = {c.info.run_id: c for c in children}
    assert len(by_id) == 4
    for row in result.rows:
        child = by_id[row.run_id]
        assert child.data.tags["foveate.stop_reason"] == row.state
        assert child.info.status == ("FAILED" if row.state == "failed" else "FINISHED")
    best = by_id[result.best.run_id]
    assert best.data.tags["foveate.resumed"] == "1"  # the crash after epoch 1 resumed from its checkpoint
    assert [m.step for m in client.get_metric_history(best.info.run_id, "val_loss")] == [1, 2]
    assert best.data.params["optim.lr"] == "0.01" and best.data.params["model.selection.k"] == "4"
    stopped = by_id[rows[(4, 3.0)].run_id]
    assert "stopped by the asha scheduler after epoch 1" in stopped.data.tags["foveate.stop_detail"]

    name, version = result.registered
    assert name == "test-tune"
    assert str(client.get_model_version_by_alias(name, "champion").version) == version
    cfg = load_config(TrainConfig, result.best_config)  # what foveate train --config does with it
    assert cfg.optim.lr == 0.01 and cfg.model.selection.k == 4 and cfg.tracking.run_name is None
    assert cfg.data.stores == str(slides[0])


def test_a_seeded_search_samples_the_same_trials(tmp_path, slides):
    """--search-seed: the random search draws the same trials for the same seed (what benchmarks/tune.py relies on
    to run the same trials under ASHA and FIFO), other trials for another seed, each within its range."""
    from pipeline.config import load_config
    from pipeline.tune import sampled_values
    from pipeline.tune_space import parse_space

    config = load_config(TrainConfig, _config(tmp_path, slides))
    space = parse_space(
        {"optim.lr": {"loguniform": [1.0e-4, 1.0e-2]}, "model.selection.k": {"choice": [2, 4, 8]}}, config
    )
    a, b, c = (sampled_values(space, 6, seed) for seed in (7, 7, 8))
    assert a == b and a != c and len(a) == 6
    assert all(1.0e-4 <= v["optim.lr"] <= 1.0e-2 and v["model.selection.k"] in (2, 4, 8) for v in a + c)
    assert len({v["optim.lr"] for v in a}) == 6
    with pytest.raises(ValueError, match="--search-seed: got 'x', must be an integer or None"):
        from pipeline.tune import tune

        tune(config, space, search_seed="x")
