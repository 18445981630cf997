"""foveate train: real Ray Train (in-process), real MLflow (sqlite), real stores.

One tiny training crashes after its first epoch checkpoint and is resumed to the end (same MLflow run,
epoch/step counters and optimizer state continuing); the logged model must give the trained model's
predictions. A second run uses two workers through the CLI (and both stop early at the same epoch). A third
stops early after a crash and a resume: the count continues, and the exported model is the best epoch's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_stores import checker_stores

from pipeline.config import ConfigError, load_config, to_dict
from pipeline.train import (
    TrainConfig,
    classification_metrics,
    lr_factor,
    roc_auc,
    sigma_at,
    train,
)

CLASSES = ["neg", "pos", "other"]

# val_loss (cross-entropy of 3 classes, about 1.1) never improves by 10: epoch 1 stays the best; the count starts
# at once (a 3-slide validation split can never beat chance at p < 0.05, so with after_chance it never would)
NO_IMPROVEMENT = ["early_stopping.min_delta=10", "early_stopping.after_chance=false"]

TINY = """
data: {{stores: {stores}, labels: {labels}, val_fraction: 0.34, seed: 0}}
model:
  patch_size: 32
  k: 4
  scorer_downsample: 4
  num_samples: 8
  max_support: 2
  scorer: {{channels: 4, num_layers: 2}}
  features: {{widths: [4, 8], blocks: [1, 1], feature_dim: 8}}
  aggregator: transformer
  aggregator_hidden: 8
  transformer_layers: 1
  transformer_heads: 2
optim: {{epochs: 2, lr: 0.01, accumulate: 2, warmup: 1}}
schedule: {{sigma_start: 0.1, sigma_end: 0.0}}
tracking: {{experiment: test-train, artifact_slides: 1}}
workdir: {workdir}
"""


@pytest.fixture(scope="module")
def slides(tmp_path_factory) -> tuple[Path, Path]:
    """Six 256x256 stores, three classes; the class is a 16x16 checkerboard's contrast (none / strong / weak)."""
    return checker_stores(tmp_path_factory.mktemp("stores"), CLASSES, [0, 80, 40])


def _config_file(tmp_path: Path, slides, name: str = "tiny.yaml") -> Path:
    stores, labels = slides
    path = tmp_path / name
    path.write_text(TINY.format(stores=stores, labels=labels, workdir=tmp_path / "work"))
    return path


# ------------------------------------------------------------------------------------------ pure parts
def test_schedules():
    assert sigma_at(0, 10, 0.5, 0.0) == 0.5
    assert sigma_at(9, 10, 0.5, 0.0) == 0.0
    assert sigma_at(3, 7, 0.6, 0.0) == pytest.approx(0.3)
    assert sigma_at(0, 1, 0.2, 0.0) == 0.2
    assert lr_factor(0, 10, 2) == 0.5 and lr_factor(1, 10, 2) == 1.0
    assert lr_factor(2, 10, 2) == pytest.approx(1.0)
    assert lr_factor(6, 10, 2) == pytest.approx(0.5)
    assert lr_factor(10, 10, 2, min_ratio=0.1) == pytest.approx(0.1)


def test_auc_matches_pair_counting():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200).astype(bool)
    s = np.round(rng.normal(size=200) + y, 1)  # rounding makes ties
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a in s[y] for b in s[~y]]
    assert roc_auc(y, s) == pytest.approx(np.mean(pairs), abs=1e-12)
    assert math.isnan(roc_auc(np.ones(3, bool), np.arange(3.0)))
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    m = classification_metrics([0, 1, 2, 2], probs, prefix="val_")
    assert m["val_accuracy"] == 0.75
    per_class = [roc_auc(np.array([0, 1, 2, 2]) == c, probs[:, c]) for c in range(3)]
    assert m["val_auc"] == pytest.approx(np.mean(per_class))


def test_config_errors_are_clear(tmp_path, slides, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {epochs: 2, learning_rate: 0.1}\n")
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['optim.learning_rate'\].*allowed: .*'lr'"):
        load_config(TrainConfig, bad)
    with pytest.raises(ConfigError, match="optim.epochs: got 0"):
        load_config(TrainConfig, None, ["optim.epochs=0"])
    from pipeline.cli import main

    assert main(["train", "--config", str(bad)]) == 2
    assert main(["train", "--config", str(_config_file(tmp_path, slides)), "--set", "model.bogus=1"]) == 2
    with pytest.raises(FileNotFoundError, match="no run to resume"):
        train(load_config(TrainConfig, _config_file(tmp_path, slides)), resume=True)


# ------------------------------------------------------------------------------------------ real training
@pytest.mark.slow
@pytest.mark.e2e
def test_train_crash_resume_early_stop_and_logged_model(tmp_path, slides, ray_local, caplog):
    """A run crashes after epoch 1, is resumed, and stops early (epochs 2 and 3 do not improve on epoch 1): the
    run, its metrics across the crash, the exported and logged model (epoch 1's), the checkpoints and the rule's
    state, against the training core replayed without Ray or MLflow."""
    import mlflow

    from pipeline.mlflow_model import load_model
    from pipeline.tracking import flatten_params
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore

    def crash_after_first_epoch(epoch: int) -> None:  # runs in every Ray Train worker (shipped by value)
        if epoch == 1:
            raise RuntimeError("simulated crash after checkpointing epoch 1")

    cfg = load_config(
        TrainConfig,
        _config_file(tmp_path, slides),
        [
            "tracking.run_name=crashy",
            "tracking.registered_model=crashy-model",
            "optim.epochs=5",
            "early_stopping.patience=2",
            *NO_IMPROVEMENT,
        ],
    )
    with pytest.raises(Exception, match="simulated crash"):
        train(cfg, after_epoch=crash_after_first_epoch)
    run_dir = tmp_path / "work" / "train" / "crashy"
    (first,) = sorted(p for p in (run_dir / "ray").glob("checkpoint_*") if p.is_dir())
    epoch1 = torch.load(first / "model.pt", weights_only=True)  # the best epoch's checkpoint
    assert epoch1["metadata"]["epoch"] == 1
    state = json.loads((run_dir / "train_state.json").read_text())
    run_id = state["run_id"]
    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = mlflow.MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FAILED"
    steps_per_epoch = 2  # 3 training slides (one per class), accumulate 2 -> 2 optimizer steps
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]

    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        result = train(cfg, resume=True)  # no crash hook this time
    assert result.run_id == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["foveate.resumed"] == "1"
    # the rule's state came back with epoch 1's checkpoint: epochs 2 and 3 did not improve, so it stops after 3
    assert (
        "early stop at epoch 3: val_loss has not improved by more than 10 for 2 epochs; best epoch 1: val_loss = "
        in caplog.text
    )
    val_loss = sorted(client.get_metric_history(run_id, "val_loss"), key=lambda m: m.step)
    assert run.data.tags["foveate.stop_reason"] == "patience"
    assert run.data.metrics["stopped_epoch"] == 3 < cfg.optim.epochs and run.data.metrics["best_epoch"] == 1
    assert run.data.metrics["best_val_loss"] == val_loss[0].value
    assert result.metrics["stopped_epoch"] == 3 and result.metrics["best_epoch"] == 1
    assert "epochs: 3 of at most 5 (early stop); the model is epoch 1's, best_val_loss=" in result.summary()
    # params: the full resolved config, flattened, and the logged model's serve roots (MLflow logs a pyfunc
    # model's model_config as parameters of its run): the training stores' folder
    expected = flatten_params(to_dict(result.config))
    params = dict(run.data.params)
    assert params.pop("serve_roots") == str([str(Path(result.config.data.stores).resolve())])
    assert params == expected
    assert run.data.params["model.num_classes"] == "3" and run.data.params["data.classes"] == json.dumps(
        ["neg", "other", "pos"]
    )
    # metrics: per step continuing across the crash, per epoch for both epochs
    loss_steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert loss_steps == list(range(1, 3 * steps_per_epoch + 1))
    sigmas = [m.value for m in sorted(client.get_metric_history(run_id, "sigma"), key=lambda m: m.step)]
    assert sigmas == pytest.approx([0.1 * (1 - s / 9) for s in range(6)])  # linear to 0 over the cap's 10 steps
    for name in (
        "val_accuracy",
        "val_auc",
        "epoch_train_loss",
        "epoch_train_auc",
        "epoch_patches_per_second",
        "epoch_peak_memory_mb",
        "train_seconds",
    ):
        assert [m.step for m in client.get_metric_history(run_id, name)] == [1, 2, 3], name
    for name in ("seconds_per_step", "patches_per_second", "accuracy", "lr", "peak_memory_mb"):
        assert name in run.data.metrics
    # the last checkpoint continues the first: epoch 3, step 6, Adam's step count 6, the rule's state
    ckpts = sorted(p for p in (run_dir / "ray").glob("checkpoint_*") if p.is_dir())
    last = torch.load(ckpts[-1] / "train_state.pt", weights_only=True)
    assert last["epoch"] == 3 and last["global_step"] == 3 * steps_per_epoch
    adam_steps = {float(s["step"]) for s in last["optimizer"]["state"].values()}
    assert adam_steps == {float(3 * steps_per_epoch)}
    assert last["scheduler"]["last_epoch"] == 3 * steps_per_epoch
    assert last["stop_reason"] == "patience"
    assert {k: last["early_stopping"][k] for k in ("best_epoch", "bad_epochs", "stopped_epoch")} == {
        "best_epoch": 1,
        "bad_epochs": 2,
        "stopped_epoch": 3,
    }
    # artifacts: config, heatmap + gallery of a validation slide, plain checkpoint
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "split.json", "heatmaps", "patches", "checkpoint"} <= arts
    assert [a.path for a in client.list_artifacts(run_id, "heatmaps")][0].endswith("_heatmap.png")
    assert [a.path for a in client.list_artifacts(run_id, "patches")][0].endswith("_patches.png")
    # the logged model predicts exactly what the trained model does
    split = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="split.json", dst_path=str(tmp_path), tracking_uri=uri
            )
        ).read_text()
    )
    assert len(split["val"]) == 3
    # the model records the resolution it was trained at (the training stores' level-0 mpp)
    train_mpps = [SlideStore(Path(slides[0]) / f"{sid}.zarr").meta.mpp[0] for sid in split["train"]]
    assert result.config.model.mpp == pytest.approx(float(np.median(train_mpps)))
    assert run.data.params["model.mpp"] == str(result.config.model.mpp)
    store = SlideStore(Path(slides[0]) / f"{split['val'][0]}.zarr")
    with torch.no_grad():
        expected_logits = forward_slide(result.model, store, training=False).logits
        for u in (result.model_uri, f"runs:/{run_id}", f"runs:/{run_id}/model"):
            model, mcfg, classes = load_model(u, tracking_uri=uri)
            assert classes == ["neg", "other", "pos"] and mcfg.num_classes == 3
            assert torch.equal(forward_slide(model, store, training=False).logits, expected_logits), u
    # ... and so does the logged pyfunc model of the whole pipeline (a store in, a foveate score row out),
    # registered as version 1 of tracking.registered_model
    assert client.get_model_version("crashy-model", "1").run_id == run_id
    row = mlflow.pyfunc.load_model("models:/crashy-model/1").predict(pd.DataFrame({"store": [str(store.path)]}))
    probs = torch.softmax(expected_logits[0].double(), -1).numpy()
    np.testing.assert_allclose([row[f"prob_{c}"][0] for c in ("neg", "other", "pos")], probs, rtol=1e-5, atol=1e-7)
    # the exported, logged model and the last checkpoint's model are epoch 1's, not the last epoch's weights
    final = torch.load(ckpts[-1] / "model.pt", weights_only=True)
    assert final["metadata"]["epoch"] == 1 and final["metadata"]["stopped_epoch"] == 3
    logged, _, _ = load_model(result.model_uri, tracking_uri=uri)
    for k, v in epoch1["state_dict"].items():
        assert torch.equal(result.model.state_dict()[k], v), k
        assert torch.equal(final["state_dict"][k], v), k
        assert torch.equal(logged.state_dict()[k], v), k
    assert "val_accuracy" in result.metrics and result.metrics["epoch"] == 3
    # the training core without Ray or MLflow: same seeds, same numbers (across the crash and resume too)
    from pipeline.data import build_slide_table, shard, split_train_val
    from workers.trainer import Trainer

    c = result.config
    train_recs, val_recs = split_train_val(build_slide_table(c.data).records, c.data.val_fraction, c.data.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(c.threads or c.cpus_per_worker)  # as in the Ray Train worker: same float summation order
    try:
        trainer = Trainer(
            c.model,
            c.optim,
            c.schedule,
            slides_per_epoch=len(train_recs),
            seed=c.seed,
            early_stopping=c.early_stopping,
        )
        while not trainer.finished:
            local = trainer.run_epoch(shard(train_recs, 0, 1, epoch=trainer.epoch, seed=c.data.seed), val_recs)
    finally:
        torch.set_num_threads(threads)
    assert local["val_accuracy"] == result.metrics["val_accuracy"]
    assert local["epoch_train_loss"] == pytest.approx(result.metrics["epoch_train_loss"], rel=1e-9)
    terms = {k: v for k, v in local.items() if k.startswith("epoch_train_loss_")}
    assert "epoch_train_loss_ce" in terms and len(terms) > 1, terms  # the CE and the config's evidence terms
    assert sum(terms.values()) == pytest.approx(local["epoch_train_loss"], rel=1e-6)  # float32 total
    for k, v in terms.items():  # logged to MLflow as the local trainer has them
        assert result.metrics[k] == pytest.approx(v, rel=1e-9), k
    assert local["best_epoch"] == result.metrics["best_epoch"] and trainer.stop_reason == "patience"
    for k, v in result.model.state_dict().items():
        assert torch.equal(v, trainer.eval_model.state_dict()[k].cpu()), k


@pytest.mark.slow
@pytest.mark.e2e
def test_two_workers_through_the_cli(tmp_path, slides, ray_local, capsys):
    import mlflow

    from pipeline.cli import main

    cfg = _config_file(tmp_path, slides)
    rc = main(
        [
            "train",
            "--config",
            str(cfg),
            "--workers",
            "2",
            "--set",
            "optim.epochs=3",
            "--set",
            "tracking.run_name=two",
            "--set",
            "optim.accumulate=1",
            # no epoch improves val_loss by 10 (~1.1 for 3 classes): both workers stop after epoch 2
            "--set",
            "early_stopping.patience=1",
            "--set",
            "early_stopping.min_delta=10",
            "--set",
            "early_stopping.after_chance=false",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    state = json.loads((tmp_path / "work" / "train" / "two" / "train_state.json").read_text())
    assert f"run id: {state['run_id']}" in out and "MLflow tracking URI: sqlite:///" in out
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["workers"] == "2"
    # 3 training slides over 2 workers: 2 slides each (one repeated by padding), 1 per step -> 2 steps per epoch
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert run.data.metrics["epoch"] == 2 and run.data.metrics["stopped_epoch"] == 2
    assert run.data.tags["foveate.stop_reason"] == "patience" and run.data.metrics["best_epoch"] == 1
    assert "epochs: 2 of at most 3 (early stop); the model is epoch 1's, best_val_loss=" in out


def test_weight_average_follows_its_recursion_and_is_what_is_evaluated_and_saved(tmp_path, slides):
    from pipeline.data import build_slide_table, shard, split_train_val
    from workers.slide_forward import forward_slide
    from workers.trainer import Trainer

    with pytest.raises(ConfigError, match="ema_epochs"):
        load_config(TrainConfig, _config_file(tmp_path, slides), ["optim.ema_epochs=-1"])
    c = load_config(
        TrainConfig, _config_file(tmp_path, slides), ["optim.ema_epochs=1.5", "model.features.standardise=true"]
    )
    table = build_slide_table(c.data)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, num_classes=table.num_classes))
    train_recs, val_recs = split_train_val(table.records, c.data.val_fraction, c.data.seed)
    snaps, stats = [], []

    def snapshot(metrics, step):
        snaps.append([p.detach().double().clone() for p in trainer.model.parameters()])
        norm = trainer.model.feature_norm
        stats.append((norm.mean.double().clone(), norm.var.double().clone(), int(norm.count)))

    torch.manual_seed(0)
    trainer = Trainer(c.model, c.optim, c.schedule, slides_per_epoch=len(train_recs), seed=c.seed, on_step=snapshot)
    assert trainer.eval_model is trainer.ema_model and trainer.ema_model is not trainer.model
    decay = 1 - 1 / (1.5 * trainer.steps_per_epoch)
    expected = [p.detach().double().clone() for p in trainer.model.parameters()]  # the average starts at the init
    for epoch in range(c.optim.epochs):
        trainer.train_epoch(shard(train_recs, 0, 1, epoch=epoch, seed=c.data.seed))
    assert len(snaps) == trainer.global_step == c.optim.epochs * trainer.steps_per_epoch >= 4
    for t, params in enumerate(snaps):
        d = min(decay, (1 + t) / (10 + t))
        expected = [d * e + (1 - d) * p for e, p in zip(expected, params)]
    got = [p.double() for p in trainer.ema_model.parameters()]
    assert all(torch.allclose(g, e, rtol=0, atol=1e-6) for g, e in zip(got, expected))
    # the running feature statistics are averaged the same way (the first update copies them: the average's own
    # were never set), the count is copied
    mean, var = stats[0][0], stats[0][1]
    for t, (m, v, _) in enumerate(stats[1:], start=1):
        d = min(decay, (1 + t) / (10 + t))
        mean, var = d * mean + (1 - d) * m, d * var + (1 - d) * v
    ema_norm = trainer.ema_model.feature_norm
    torch.testing.assert_close(ema_norm.mean.double(), mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(ema_norm.var.double(), var, rtol=0, atol=1e-6)
    assert int(ema_norm.count) == stats[-1][2] and not torch.allclose(ema_norm.mean.double(), stats[-1][0])
    assert any(not torch.equal(g, p.double()) for g, p in zip(got, trainer.model.parameters()))
    # evaluation uses the average, not the last weights
    ev = trainer.evaluate(val_recs)
    with torch.no_grad():
        out = forward_slide(trainer.ema_model, trainer._store(val_recs[0].store), training=False)
    assert ev.probs[0] == pytest.approx(torch.softmax(out.logits.reshape(-1).float(), -1).tolist(), abs=1e-7)
    # it is checkpointed and restored with the rest
    state = trainer.state_dict()
    again = Trainer(c.model, c.optim, c.schedule, slides_per_epoch=len(train_recs), seed=c.seed + 1)
    again.load_state_dict(state)
    for a, b in zip(again.ema_model.state_dict().values(), trainer.ema_model.state_dict().values()):
        assert torch.equal(a, b)
    plain = load_config(TrainConfig, _config_file(tmp_path, slides))
    off = Trainer(c.model, plain.optim, plain.schedule, slides_per_epoch=len(train_recs), seed=0)
    assert off.eval_model is off.model and "ema" not in off.state_dict()


def test_training_ends_with_the_feature_statistics_of_the_training_slides(tmp_path, slides):
    """At the end (here the cap), the exported model's standardisation is the exact mean / variance of the
    features it computes for the training slides in eval mode: standardised, they have mean 0 and variance 1 (the
    running statistics of the last slides did not), and the validation is run again with them (final_val_*)."""
    from pipeline.data import build_slide_table, shard, split_train_val
    from workers.trainer import Trainer

    c = load_config(
        TrainConfig, _config_file(tmp_path, slides), ["optim.ema_epochs=1", "model.features.standardise=true"]
    )
    table = build_slide_table(c.data)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, num_classes=table.num_classes))
    train_recs, val_recs = split_train_val(table.records, c.data.val_fraction, c.data.seed)
    torch.manual_seed(0)
    trainer = Trainer(c.model, c.optim, c.schedule, slides_per_epoch=len(train_recs), seed=c.seed)
    model = trainer.eval_model

    def standardised() -> torch.Tensor:
        rows = []
        hook = model.feature_norm.register_forward_hook(lambda _m, _a, out: rows.append(out.double()))
        with torch.no_grad():
            for rec in train_recs:
                forward_slide(model.eval(), trainer._store(rec.store), training=False)
        hook.remove()
        return torch.cat(rows)

    from workers.slide_forward import forward_slide

    metrics = trainer.run_epoch(shard(train_recs, 0, 1, epoch=0, seed=0), val_recs)
    assert trainer.stop_reason is None and "final_val_accuracy" not in metrics
    before = standardised()
    assert before.mean(0).abs().max() > 0.05  # the running statistics are not the training slides' own
    metrics = trainer.run_epoch(shard(train_recs, 0, 1, epoch=1, seed=0), val_recs)
    assert trainer.stop_reason == "cap"
    after = standardised()
    assert after.shape[0] > 2
    torch.testing.assert_close(after.mean(0), torch.zeros(after.shape[1], dtype=torch.float64), rtol=0, atol=1e-4)
    v = model.feature_norm.var.double()  # variance 1 up to the standardisation's eps
    torch.testing.assert_close(after.var(0), v / (v + model.feature_norm.eps), rtol=1e-4, atol=0)
    ev = trainer.evaluate(val_recs)  # final_val_* is the exported model's validation
    assert metrics["final_val_accuracy"] == classification_metrics(ev.targets, np.array(ev.probs))["accuracy"]
    assert metrics["final_val_loss"] == pytest.approx(ev.loss / len(val_recs))
    plain = Trainer(c.model, dataclasses.replace(c.optim, ema_epochs=0), c.schedule, slides_per_epoch=2)
    assert plain.refresh_feature_stats(train_recs) > 2 and plain.eval_model is plain.model
    features = dataclasses.replace(c.model.features, standardise=False)
    no_norm = Trainer(dataclasses.replace(c.model, features=features), c.optim, c.schedule, slides_per_epoch=2)
    assert no_norm.refresh_feature_stats(train_recs) == 0


# ------------------------------------------------------------------------------------------ early stopping


def test_trainer_restores_the_best_epoch_and_resumes_the_count(tmp_path, slides):
    from pipeline.data import build_slide_table, shard, split_train_val
    from workers.trainer import Trainer

    c = load_config(
        TrainConfig,
        _config_file(tmp_path, slides),
        ["optim.epochs=4", "optim.ema_epochs=1", "early_stopping.patience=1", *NO_IMPROVEMENT],
    )
    table = build_slide_table(c.data)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, num_classes=table.num_classes))
    train_recs, val_recs = split_train_val(table.records, c.data.val_fraction, c.data.seed)
    averages = {}  # the weight average after each epoch's last step (before any restore)

    def make(seed: int = c.seed) -> Trainer:
        def on_step(metrics, step):
            averages[step] = weights(tr.ema_model)

        tr = Trainer(
            c.model,
            c.optim,
            c.schedule,
            slides_per_epoch=len(train_recs),
            seed=seed,
            early_stopping=c.early_stopping,
            on_step=on_step,
            log_every=10**6,  # on_step at each epoch's end only
        )
        return tr

    def epoch(tr: Trainer) -> dict[str, float]:
        return tr.run_epoch(shard(train_recs, 0, 1, epoch=tr.epoch, seed=c.data.seed), val_recs)

    def weights(module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def same(a, b) -> bool:
        return all(torch.equal(v, b[k]) for k, v in a.items())

    trainer = make()
    m1 = epoch(trainer)
    best = weights(trainer.eval_model)  # the weight average after epoch 1: what was evaluated
    assert same(best, averages[trainer.global_step])
    assert m1["best_epoch"] == 1 and m1["best_val_loss"] == m1["val_loss"] and "stopped_epoch" not in m1
    # each loss term's epoch mean beside the total: the CE and the evidence terms of the default recipe
    terms = {k[len("epoch_train_loss_") :]: v for k, v in m1.items() if k.startswith("epoch_train_loss_")}
    assert {"ce", "instance", "rank", "rare", "neutral"} <= set(terms), sorted(terms)
    assert sum(terms.values()) == pytest.approx(m1["epoch_train_loss"], rel=1e-6)  # the total is float32
    torch.save(trainer.state_dict(), tmp_path / "epoch1.pt")
    m2 = epoch(trainer)
    assert trainer.finished and trainer.stop_reason == "patience" and trainer.epoch == 2 < c.optim.epochs
    assert m2["stopped_epoch"] == 2 and m2["best_epoch"] == 1 and m2["best_val_loss"] == m1["val_loss"]
    assert not same(averages[trainer.global_step], best)  # epoch 2 moved the average ...
    assert trainer.eval_model is trainer.ema_model and same(weights(trainer.eval_model), best)  # ... it is back
    last_trained = weights(trainer.model)  # the trained weights stay the last ones
    state = trainer.state_dict()
    assert state["stop_reason"] == "patience" and state["early_stopping"]["bad_epochs"] == 1
    assert same(state["best_model"], best)
    torch.save(state, tmp_path / "stopped.pt")

    # resumed from epoch 1's state, the count goes on: epoch 2 is not an improvement, so it stops there
    again = make(seed=c.seed + 1)
    again.load_state_dict(torch.load(tmp_path / "epoch1.pt", weights_only=True))
    assert again.stopper.best_epoch == 1 and not again.finished
    epoch(again)
    assert again.finished and again.stop_reason == "patience" and again.epoch == 2
    assert same(weights(again.eval_model), best)
    assert same(weights(again.model), last_trained)  # the same training: same seeds and generator states
    # a stopped trainer's state: finished, nothing left to train, the best weights are the evaluated ones
    done = make()
    done.load_state_dict(torch.load(tmp_path / "stopped.pt", weights_only=True))
    assert done.finished and done.stop_reason == "patience" and done.stopper.stopped_epoch == 2
    assert same(weights(done.eval_model), best)
    # off: no rule, no copies, the last weights
    es = dataclasses.replace(c.early_stopping, patience=0)
    off = Trainer(c.model, c.optim, c.schedule, slides_per_epoch=len(train_recs), early_stopping=es)
    assert off.stopper is None and "early_stopping" not in off.state_dict() and not off.finished
