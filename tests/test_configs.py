"""Every file in configs/ loads into its dataclass; every config section validates itself; ``--config`` and
``--set`` work for ingest, score and train alike."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from operators.errors import ConfigError
from pipeline.config import config_from_cli, load_config
from pipeline.data import DataConfig
from pipeline.train_config import TrackingConfig, TrainConfig
from workers.tiler import IngestOptions
from workers.trainer import OptimConfig, ScheduleConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Ray runtime environments (for `ray job submit --runtime-env`), not foveate configs
RUNTIME_ENVS = {"runtime_env.yaml"}
RUNTIME_ENV_KEYS = {"env_vars", "excludes", "working_dir", "py_modules", "pip", "uv", "conda", "config"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads_and_validates(path):
    if path.name in RUNTIME_ENVS:
        env = yaml.safe_load(path.read_text())
        assert isinstance(env, dict) and set(env) <= RUNTIME_ENV_KEYS, sorted(env)
        assert all(isinstance(v, str) for v in env.get("env_vars", {}).values())
        return
    cfg = load_config(TrainConfig, path)
    assert isinstance(cfg, TrainConfig)
    from operators.model import FoveateModel

    FoveateModel(cfg.model)  # the model it describes can be built


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (OptimConfig, {"epochs": 0}, "optim.epochs"),
        (OptimConfig, {"min_lr_ratio": 2.0}, "optim.min_lr_ratio"),
        (ScheduleConfig, {"sigma_start": -1.0}, "schedule.sigma_start"),
        (TrackingConfig, {"log_every": 0}, "tracking.log_every"),
        (DataConfig, {"val_fraction": 1.0}, "data.val_fraction"),
        (TrainConfig, {"workers": 0}, "workers"),
        (IngestOptions, {"codec": "png"}, "codec"),
    ],
)
def test_each_config_section_rejects_invalid_values_alone(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(**kwargs)


def _args(parser_setup, argv):
    p = argparse.ArgumentParser()
    parser_setup(p)
    return p.parse_args(argv)


def test_ingest_config_from_yaml_set_and_flags(tmp_path):
    from pipeline.ingest import _FLAGS, IngestConfig, add_arguments

    y = tmp_path / "ingest.yaml"
    y.write_text("inputs: [a.svs]\nout: stores\noptions: {codec: jpeg, tile_size: 512}\n")
    args = _args(add_arguments, ["--config", str(y), "--set", "options.zstd_level=3", "--tile-size", "256"])
    args.inputs = args.inputs or None
    cfg = config_from_cli(IngestConfig, args, _FLAGS)
    assert cfg.inputs == ("a.svs",) and cfg.out == "stores"
    assert cfg.options == IngestOptions(codec="jpeg", tile_size=256, zstd_level=3)  # flag > --set > YAML
    args = _args(add_arguments, ["x.svs", "--out", "o", "--no-passthrough", "--overwrite"])
    cfg = config_from_cli(IngestConfig, args, _FLAGS)
    assert cfg.options.passthrough is False and cfg.overwrite is True and cfg.options.direct is True
    with pytest.raises(ConfigError, match="out"):
        config_from_cli(IngestConfig, _args(add_arguments, ["x.svs"]), _FLAGS)


def test_score_config_from_yaml_set_and_flags(tmp_path):
    from pipeline.score import _FLAGS, ScoreConfig, add_arguments

    y = tmp_path / "score.yaml"
    y.write_text("model: m.pt\nstores: s\nout: p.parquet\nbatch_size: 2\n")
    cfg = config_from_cli(
        ScoreConfig, _args(add_arguments, ["--config", str(y), "--set", "max_in_flight=3", "--no-heatmaps"]), _FLAGS
    )
    assert (cfg.model, cfg.batch_size, cfg.max_in_flight, cfg.heatmaps) == ("m.pt", 2, 3, False)
    with pytest.raises(ConfigError, match="--batch-size"):
        config_from_cli(ScoreConfig, _args(add_arguments, ["--config", str(y), "--batch-size", "0"]), _FLAGS)
    with pytest.raises(ConfigError, match="out"):
        ScoreConfig(model="m.pt", stores="s", out="p.csv")


def test_train_flags_map_onto_the_config():
    from pipeline.train import add_arguments

    cfg = config_from_cli(
        TrainConfig,
        _args(add_arguments, ["--set", "optim.epochs=3", "--workers", "2"]),
        {"workers": "workers", "workdir": "workdir"},
    )
    assert cfg.optim.epochs == 3 and cfg.workers == 2 and cfg.workdir == "runs"
