"""foveate pretrain: the worker on real stores, the config section, model.features.init / freeze, and the command
end to end (in-process Ray Train, sqlite MLflow) followed by a training that starts from the pretrained encoder."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from operators.config import from_dict, to_dict
from operators.errors import ConfigError
from operators.model_config import FeaturesConfig, ModelConfig
from operators.resnet import ResNet
from workers.pretrain import PretrainConfig, Pretrainer
from workers.store import write_store_from_array

torch.set_num_threads(1)

MODEL = {
    "geometry": {"patch_size": 32, "scorer_downsample": 4},
    "selection": {"k": 4, "num_samples": 8},
    "scorer": {"channels": 4, "num_layers": 2},
    "features": {"widths": [4, 8], "blocks": [1, 1], "feature_dim": 8},
    "evidence": {"explore_cells": 2, "rare_cells": 4, "rare_strata": 4, "neutral_cells": 2},
}

TINY = """
data: {{stores: {stores}, labels: {labels}, val_fraction: 0.34, seed: 0}}
model: {model}
optim: {{epochs: 1, lr: 0.01}}
tracking: {{experiment: test-pretrain, artifact_slides: 0}}
pretrain: {{epochs: 2, batch_size: 8, patches_per_slide: 4, projection_dim: 8}}
early_stopping: {{patience: 0}}
workdir: {workdir}
"""


@pytest.fixture(scope="module")
def slides(tmp_path_factory) -> tuple[Path, Path]:
    """Four 192x192 stores, two classes (a checkerboard or none), tissue in the middle."""
    root = tmp_path_factory.mktemp("stores")
    rows = []
    for i in range(4):
        rng = np.random.default_rng(i)
        img = np.full((192, 192, 3), 240, np.uint8)
        img[32:160, 32:160] = (200, 120, 180)
        img[32:160, 32:160] += rng.integers(0, 30, (128, 128, 1), dtype=np.uint8)
        if i % 2:
            img[64:80, 64:80] = (np.indices((16, 16)).sum(0) % 2 * 80).astype(np.uint8)[..., None]
        write_store_from_array(root / f"s{i}.zarr", img, tile_size=64, min_size=64)
        rows.append({"slide_id": f"s{i}", "label": ["neg", "pos"][i % 2]})
    pd.DataFrame(rows).to_csv(root / "labels.csv", index=False)
    return root, root / "labels.csv"


def _model(**features) -> ModelConfig:
    return from_dict(ModelConfig, {**MODEL, "features": {**MODEL["features"], **features}})


# ------------------------------------------------------------------------------------------ config
def test_pretrain_section_validates_and_rejects_unknown_keys():
    assert from_dict(PretrainConfig, {"objective": "byol", "epochs": 3}).objective == "byol"
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['pretrain.temp'\].*allowed: .*'temperature'"):
        from_dict(PretrainConfig, {"temp": 0.1}, _where="pretrain")
    with pytest.raises(ConfigError, match=r"pretrain.batch_size: got 1, must be an int >= 2"):
        PretrainConfig(batch_size=1)
    with pytest.raises(ConfigError, match=r"objective: expected one of \['simclr', 'byol'\], got 'moco'"):
        from_dict(PretrainConfig, {"objective": "moco"})
    with pytest.raises(ConfigError, match=r"pretrain.momentum: got 1.5, must be a number in \[0, 1\]"):
        PretrainConfig(momentum=1.5)


def test_features_init_and_freeze_accept_their_older_names(caplog):
    new = FeaturesConfig(init="enc.pt", freeze=True)
    assert FeaturesConfig(weights="enc.pt", frozen=True) == new and new.weights == "enc.pt" and new.frozen
    with caplog.at_level(logging.WARNING):
        old = from_dict(ModelConfig, {"features": {"weights": "enc.pt", "frozen": True}}).features
    assert old == new and "model.features.weights is deprecated: use model.features.init" in caplog.text
    assert set(to_dict(new)) >= {"init", "freeze"} and not {"weights", "frozen"} & set(to_dict(new))
    assert dataclasses.replace(new, freeze=False).freeze is False  # the old names are not fields
    with pytest.raises(ConfigError, match="weights is the older name of init; keep only model.features.init"):
        from_dict(ModelConfig, {"features": {"weights": "a.pt", "init": "b.pt"}})
    with pytest.raises(ConfigError, match="frozen is the older name of freeze; give only freeze"):
        FeaturesConfig(frozen=False, freeze=True)
    assert from_dict(FeaturesConfig, {"frozen": True, "freeze": True}).freeze  # the same value twice is fine


# ------------------------------------------------------------------------------------------ worker
@pytest.mark.parametrize("objective", ["simclr", "byol"])
def test_worker_steps_on_real_stores_and_its_encoder_drops_into_training(tmp_path, slides, objective):
    root, _ = slides
    model_cfg = _model()
    cfg = PretrainConfig(objective=objective, epochs=1, batch_size=4, patches_per_slide=2, projection_dim=8)
    seen = []
    pre = Pretrainer(model_cfg, cfg, slides_per_epoch=2, on_step=lambda m, s: seen.append((s, m["loss"])))
    assert pre.steps_per_epoch == 1
    patches = pre.read_patches(str(root / "s1.zarr"))
    assert patches.shape == (2, 3, 32, 32) and patches.dtype == torch.uint8
    before = {k: v.clone() for k, v in pre.encoder_state().items()}
    metrics = pre.run_epoch([str(root / "s0.zarr"), str(root / "s1.zarr")])
    pre.step(patches.repeat(2, 1, 1, 1))
    assert pre.global_step == 2 and pre.epoch == 1 and [s for s, _ in seen] == [1]
    assert np.isfinite(metrics["epoch_loss"]) and metrics["patches"] == 4
    after = pre.encoder_state()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    # the same seed draws the same cells and views
    again = Pretrainer(model_cfg, cfg, slides_per_epoch=2)
    assert torch.equal(again.read_patches(str(root / "s1.zarr")), patches)

    # the state dict is model.features.init, a local file: the ResNet and the whole model load it
    torch.save(after, tmp_path / "encoder.pt")
    net = ResNet(_model(init=str(tmp_path / "encoder.pt")).features.resnet())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in after.items())
    with pytest.raises(ValueError, match=r"differs from model.features in \['widths'\].*pretrained encoder has widths"):
        ResNet(_model(init=str(tmp_path / "encoder.pt"), widths=[4, 16]).features.resnet())


def test_trainer_starts_from_the_given_encoder_and_checkpoints_stay_self_contained(tmp_path, slides):
    from operators.checkpoint import checkpoint_dict, model_from_checkpoint
    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    enc = ResNet(_model().features.resnet())
    state = {k: v + 0.01 for k, v in enc.state_dict().items()}
    cfg = _model(init="runs:/0123abcd", freeze=True)
    with pytest.raises(ValueError, match="is an MLflow URI: the driver resolves it"):
        Trainer(cfg, OptimConfig(), ScheduleConfig(), slides_per_epoch=1)
    trainer = Trainer(cfg, OptimConfig(), ScheduleConfig(), slides_per_epoch=1, features_init=state)
    assert all(torch.equal(trainer.model.features.state_dict()[k], v) for k, v in state.items())
    assert not any(p.requires_grad for p in trainer.model.features.parameters())
    ckpt = checkpoint_dict(trainer.model, cfg, ["a", "b"])
    assert ckpt["model_config"]["features"]["init"] is None and ckpt["metadata"]["features_init"] == "runs:/0123abcd"
    model, _, _ = model_from_checkpoint(ckpt)  # no MLflow, no file: the weights are in the state dict
    assert all(torch.equal(model.features.state_dict()[k], v) for k, v in state.items())


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.e2e
def test_pretrain_cli_then_train_starts_from_the_encoder(tmp_path, slides, ray_local, capsys):
    import mlflow

    from pipeline.cli import main
    from pipeline.encoder_init import resolve_init
    from pipeline.mlflow_model import load_model

    stores, labels = slides
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(stores=stores, labels=labels, workdir=tmp_path / "work", model=json.dumps(MODEL)))
    argv = ["pretrain", "--config", str(cfg), "--objective", "byol", "--epochs", "2"]
    assert main([*argv, "--set", "pretrain.registered_model=test-encoder"]) == 0
    out = capsys.readouterr().out
    run_id = out.split("run id: ", 1)[1].split()[0]
    assert f"encoder: runs:/{run_id}/encoder" in out and "final: epoch=2" in out
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["foveate.stage"] == "pretrain"
    assert run.data.params["pretrain.objective"] == "byol" and run.data.params["pretrain.epochs"] == "2"
    assert [m.step for m in client.get_metric_history(run_id, "epoch_loss")] == [1, 2]
    # 4 slides x 4 patches / batch 8: 2 steps an epoch
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4]
    features = _model().features
    encoder = resolve_init(dataclasses.replace(features, init=f"runs:/{run_id}"))
    registered = resolve_init(dataclasses.replace(features, init="models:/test-encoder/1"))
    assert all(torch.equal(registered[k], v) for k, v in encoder.items())
    info = json.loads(Path(client.download_artifacts(run_id, "encoder/features.json", str(tmp_path))).read_text())
    assert info["features"]["widths"] == [4, 8] and info["objective"] == "byol"
    with pytest.raises(ConfigError, match=r"differs from model.features in \['feature_dim'\]"):
        resolve_init(dataclasses.replace(features, feature_dim=16, init=f"runs:/{run_id}"))

    # training from it, frozen: the exported model's encoder is the pretrained one (a checkpoint without the URI)
    assert (
        main(
            ["train", "--config", str(cfg), "--set", f"model.features.init=runs:/{run_id}"]
            + ["--set", "model.features.freeze=true", "--set", "tracking.run_name=from-pretrained"]
        )
        == 0
    )
    train_id = capsys.readouterr().out.split("run id: ", 1)[1].split()[0]
    model, model_cfg, _ = load_model(f"runs:/{train_id}")
    assert all(torch.equal(model.features.state_dict()[k], v) for k, v in encoder.items())
    assert model_cfg.features.freeze and model_cfg.features.init is None
    assert client.get_run(train_id).data.params["model.features.init"] == f"runs:/{run_id}"

    # the cluster gate's encoder pretrained by `foveate train` itself (gate_encoder: pretrain): a pretraining run of
    # its own on the training split alone, whose URI the training run records and whose encoder the model carries
    gated = ["--set", "schedule.select_until=0.5", "--set", "model.experimental.gate_candidates=4"]
    gated += ["--set", "model.experimental.gate_clusters=2", "--set", "model.experimental.gate_encoder=pretrain"]
    assert main(["train", "--config", str(cfg), *gated, "--set", "tracking.run_name=gated"]) == 0
    gated_id = capsys.readouterr().out.split("run id: ", 1)[1].split()[0]
    exp = client.get_experiment_by_name("test-pretrain").experiment_id
    (pre,) = client.search_runs([exp], "attributes.run_name = 'gated-gate-encoder'")
    assert pre.info.status == "FINISHED" and pre.data.tags["foveate.stage"] == "pretrain"
    gated_run = client.get_run(gated_id)
    assert gated_run.data.params["model.experimental.gate_encoder"] == f"runs:/{pre.info.run_id}"
    split = json.loads(Path(client.download_artifacts(gated_id, "split.json", str(tmp_path / "g"))).read_text())
    assert 0 < len(split["train"]) < 4
    # 2 epochs over the training slides alone, 4 patches from each
    assert [m.value for m in client.get_metric_history(pre.info.run_id, "patches")] == [4 * len(split["train"])] * 2
    gate_encoder = resolve_init(dataclasses.replace(features, init=f"runs:/{pre.info.run_id}"))
    model, model_cfg, _ = load_model(f"runs:/{gated_id}")
    assert model.gate is not None and model.gate.is_fitted
    assert all(torch.equal(model.gate.encoder.state_dict()[k], v) for k, v in gate_encoder.items())


def test_gate_encoder_pretrain_is_resolved_by_the_driver():
    from pipeline.train import TrainConfig, pretrain_gate_encoder
    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    gated = {"gate_candidates": 4, "gate_clusters": 2, "gate_encoder": "pretrain"}
    model = from_dict(ModelConfig, {**MODEL, "experimental": gated})
    config = from_dict(TrainConfig, {"model": to_dict(model), "schedule": {"select_until": 0.5}})
    plain = from_dict(TrainConfig, {"model": MODEL})
    assert pretrain_gate_encoder(plain, []) is plain  # nothing to pretrain
    # a worker never pretrains: without the driver's state dict the trainer says who resolves it
    with pytest.raises(ValueError, match="pretrain"):
        Trainer(
            dataclasses.replace(model, num_classes=2),
            OptimConfig(epochs=1),
            ScheduleConfig(select_until=0.5),
            slides_per_epoch=1,
        )
    # resuming, the run's own pretrained encoder again (no second pretraining), or a clear error without one
    recorded = dataclasses.replace(
        model, experimental=dataclasses.replace(model.experimental, gate_encoder="runs:/abc")
    )
    again = pretrain_gate_encoder(config, [], resumed={"config": {"model": to_dict(recorded)}}, run_dir="run")
    assert again.model.experimental.gate_encoder == "runs:/abc" and again.model.selection == config.model.selection
    with pytest.raises(ValueError, match="the run at run records no pretrained gate encoder"):
        pretrain_gate_encoder(config, [], resumed={"config": {"model": to_dict(model)}}, run_dir="run")
