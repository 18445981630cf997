"""``foveate tune``: hyperparameter search on Ray Tune, every trial in MLflow, the winner registered.

The driver (:func:`tune`) reads the base config (``--config``, ``--set``) and the search space
(:mod:`pipeline.tune_space`, checked before anything starts), builds the slide table and split once (as
``foveate train`` does), opens one MLflow *parent* run for the search and runs a :class:`ray.tune.Tuner` whose
trials each train one config with the same :class:`workers.trainer.Trainer` ``foveate train`` runs, in-process in
the trial (one worker per trial, ``cpus_per_worker`` CPUs and a GPU when the cluster has one). Each trial:

* opens a *child* MLflow run (``mlflow.parentRunId`` = the search's run; tag ``foveate.trial_id``) with the trial's
  full resolved config as params, and logs the step and epoch metrics as a training run does;
* reports the epoch's metrics to Tune after each evaluation, with a checkpoint (``train_state.pt``, ``model.pt``),
  so the scheduler (ASHA, the median rule, or FIFO) can stop it after any epoch and a trial that crashed resumes
  from its last epoch (Tune's ``max_failures``, in the same child run);
* fails on its own when its config is rejected (e.g. a ``model.selection.k`` larger than a slide's patch grid) or
  its training raises: the child run ends FAILED with the reason (tag ``foveate.stop_detail``) and the search goes on.

Each child run's tag ``foveate.stop_reason`` says how it ended: ``completed`` (its epochs or early stopping),
``early-stopped`` (by the scheduler) or ``failed``. At the end the best trial (by the last reported value of
``--metric``, over the trials that did not fail) has its model logged and registered (:func:`pipeline.mlflow_model.
log_model`, under ``tracking.registered_model`` or else the experiment's name), aliased with ``--promote``; its
config is written to ``<out>/best.yaml`` (a complete config ``foveate train --config`` takes as it is) and the parent
run gets the space, the scheduler, the budget and the best trial's values and metric.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import add_config_arguments, config_from_cli, to_dict
from pipeline.train_config import TrainConfig
from pipeline.tune_space import SearchSpace, config_for, load_space

__all__ = ["SCHEDULERS", "TrialRow", "TuneResult", "tune", "add_arguments", "run", "format_trials"]

log = logging.getLogger(__name__)

SCHEDULERS = ("asha", "median", "fifo")
STATE_FILE, MODEL_FILE = "train_state.pt", "model.pt"
TRIAL_TAG = "foveate.trial_id"


@dataclass
class TrialRow:
    """One trial as the search saw it end."""

    number: int
    trial_id: str
    values: dict[str, Any]
    state: str = "pending"  # completed / early-stopped / failed
    epochs: int = 0
    metric: float = math.nan
    detail: str = ""
    run_id: str | None = None


@dataclass
class TuneResult:
    """What :func:`tune` returns (and ``foveate tune`` prints)."""

    parent_run_id: str
    experiment_id: str
    experiment: str
    tracking_uri: str
    metric: str
    mode: str
    rows: list[TrialRow]
    out_dir: str
    best: TrialRow | None = None
    best_config: str | None = None
    model_uri: str | None = None
    registered: tuple[str, str] | None = None  # (name, version)
    alias: str | None = None

    def summary(self) -> str:
        from pipeline.tracking import run_url

        lines = [format_trials(self.rows, self.metric), ""]
        lines += [
            f"MLflow tracking URI: {self.tracking_uri}",
            f"experiment: {self.experiment} (id {self.experiment_id})",
            f"search run: {self.parent_run_id}  ({run_url(self.tracking_uri, self.experiment_id, self.parent_run_id)})",
        ]
        if self.best is None:
            lines.append(f"no trial reported {self.metric}: nothing registered")
            return "\n".join(lines)
        values = ", ".join(f"{k}={_fmt(v)}" for k, v in self.best.values.items())
        lines.append(
            f"best: trial {self.best.number} ({values}), {self.metric}={self.best.metric:.4g}, run {self.best.run_id}"
        )
        if self.registered:
            name, version = self.registered
            at = f", alias models:/{name}@{self.alias}" if self.alias else ""
            lines.append(f"model: models:/{name}/{version}{at}  ({self.model_uri})")
        lines.append(f"best config: {self.best_config}  (foveate train --config {self.best_config})")
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_trials(rows: list[TrialRow], metric: str) -> str:
    """The compact table of a search: trial, the searched values, epochs, metric, state."""
    if not rows:
        return "no trials"
    keys = list(dict.fromkeys(k for r in rows for k in r.values))
    header = ["trial", *keys, "epochs", metric, "state"]
    body = [
        [
            str(r.number),
            *(_fmt(r.values.get(k, "")) for k in keys),
            str(r.epochs),
            "-" if math.isnan(r.metric) else f"{r.metric:.4g}",
            r.state if r.state != "failed" else f"failed: {r.detail}"[:80],
        ]
        for r in sorted(rows, key=lambda r: r.number)
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines)


def _metric_names() -> set[str]:
    """The epoch metrics a trial reports (what ``--metric`` may name)."""
    import numpy as np

    from workers.metrics import classification_metrics

    names = {"val_loss", "epoch_train_loss"}
    for prefix in ("val_", "epoch_train_"):
        names |= set(classification_metrics([0, 1], np.array([[0.6, 0.4], [0.3, 0.7]]), prefix=prefix))
    return names


def _trial_number(trial_id: str) -> int:
    tail = trial_id.rsplit("_", 1)[-1]
    return int(tail) + 1 if tail.isdigit() else 0


def _reason(text: str, limit: int = 300) -> str:
    """The last line that says something of an error text (Ray wraps the trial's exception in its traceback)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    keep = [ln for ln in lines if not ln.startswith(("File ", "^", "~", "Traceback", "During handling"))]
    out = (keep or lines or [""])[-1]
    return out if len(out) <= limit else out[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- the trial
def _child_run(client, setup: dict[str, Any], trial_id: str, values: dict[str, Any]) -> tuple[str, bool]:
    """The trial's child run: the one it already has (a restarted trial), claimed again, else a new one."""
    from pipeline.tracking import claim_run, start_run

    found = client.search_runs(
        [setup["experiment_id"]],
        filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`mlflow.parentRunId` = '{setup['parent_run_id']}'",
    )
    if found:
        run_id = found[0].info.run_id
        claim_run(client, run_id)
        return run_id, True
    run_id = start_run(
        client,
        setup["experiment_id"],
        run_name=f"{setup['parent_name']}-trial-{_trial_number(trial_id):03d}",
        tags={
            "mlflow.parentRunId": setup["parent_run_id"],
            TRIAL_TAG: trial_id,
            "foveate.stage": "tune-trial",
            "foveate.values": ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()),
        },
    )
    return run_id, False


def _trial(values: dict[str, Any], setup: dict[str, Any]) -> None:
    """One trial, inside its Ray Tune actor: build the config, check its grids, train epoch by epoch with
    :class:`workers.trainer.Trainer`, reporting each epoch's metrics and checkpoint to Tune."""
    import ray.tune
    import torch

    from operators.checkpoint import checkpoint_dict
    from pipeline.data import SlideRecord, shard
    from pipeline.tracking import client_for, log_metrics, log_params, logged_steps
    from pipeline.train import _check_grids, feature_cache_dir, with_training_mpp
    from workers import storage
    from workers.trainer import LocalCollective, Trainer

    trial_id = ray.tune.get_context().get_trial_id()
    values = {k: values[k] for k in setup["keys"]}
    client = client_for(setup["tracking_uri"])
    run_id, restarted = _child_run(client, setup, trial_id, values)
    try:
        cfg: TrainConfig = config_for(TrainConfig, setup["base"], values)
        train_recs = [SlideRecord(*r) for r in setup["train"]]
        val_recs = [SlideRecord(*r) for r in setup["val"]]
        mpps = _check_grids(cfg.model, train_recs + val_recs, train={r.slide_id for r in train_recs})
        run_dir = storage.join(setup["out"], "trials", f"trial-{_trial_number(trial_id):03d}")
        cfg = dataclasses.replace(
            cfg,
            model=with_training_mpp(cfg.model, mpps),
            tracking=dataclasses.replace(
                cfg.tracking, run_name=f"{setup['parent_name']}-trial-{_trial_number(trial_id):03d}"
            ),
        )
        if not client.get_run(run_id).data.params:
            log_params(client, run_id, to_dict(cfg))
        torch.set_num_threads(cfg.threads or cfg.cpus_per_worker)
        device = torch.device("cuda" if setup["use_gpu"] and torch.cuda.is_available() else "cpu")
        logged = logged_steps(client, run_id)
        trainer = Trainer(
            cfg.model,
            cfg.optim,
            cfg.schedule,
            slides_per_epoch=len(train_recs),
            seed=cfg.seed,
            device=device,
            collective=LocalCollective(),
            on_step=lambda metrics, step: log_metrics(client, run_id, metrics, step=step, skip=logged),
            log_every=cfg.tracking.log_every,
            early_stopping=cfg.early_stopping,
            features_init=setup.get("features_init"),
            feature_cache=feature_cache_dir(cfg, run_dir),
            gate_encoder_init=setup.get("gate_encoder_init"),
        )
        ckpt = ray.tune.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                trainer.load_state_dict(torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True))
            resumed = int(client.get_run(run_id).data.tags.get("foveate.resumed", "0")) + 1
            client.set_tag(run_id, "foveate.resumed", str(resumed))
        elif restarted:
            client.set_tag(run_id, "foveate.restarted", "1")
        hook: Callable[[dict[str, Any], int], None] | None = setup.get("after_epoch")
        while not trainer.finished:
            metrics = trainer.run_epoch(shard(train_recs, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed), val_recs)
            log_metrics(client, run_id, metrics, step=trainer.epoch, skip=logged)
            if trainer.stop_reason is not None:
                client.set_tag(run_id, "foveate.train_stop", trainer.stop_reason)
            weights_epoch = trainer.epoch
            if trainer.stop_reason is not None and trainer.best_state is not None:
                weights_epoch = trainer.stopper.best_epoch
            report = {k: float(v) for k, v in metrics.items()}
            report.setdefault(setup["metric"], math.nan)
            report["finished"] = float(trainer.finished)
            with tempfile.TemporaryDirectory(prefix="foveate-tune-ckpt-") as tmp:
                torch.save(trainer.state_dict(), Path(tmp) / STATE_FILE)
                torch.save(
                    checkpoint_dict(
                        trainer.eval_model,
                        cfg.model,
                        setup["class_names"],
                        train_config=to_dict(cfg),
                        metadata={"run_id": run_id, "epoch": weights_epoch, "trial_id": trial_id},
                    ),
                    Path(tmp) / MODEL_FILE,
                )
                ray.tune.report(report, checkpoint=ray.tune.Checkpoint.from_directory(tmp))
            if hook is not None:
                hook(values, trainer.epoch)
    except Exception as exc:
        try:
            client.set_tag(run_id, "foveate.stop_detail", f"{type(exc).__name__}: {_reason(str(exc))}"[:5000])
        except Exception:  # pragma: no cover - tracking store gone
            pass
        raise


# ---------------------------------------------------------------------------------------------- the driver
class _Trials:
    """A Ray Tune callback in the driver: ends each child run with its stop reason and logs one line per finished
    trial (``trial 2/4: optim.lr=0.003: 2 epochs, val_auc=0.91, completed``)."""

    def __new__(cls, *args, **kwargs):  # a subclass of ray.tune.Callback, made when Ray Tune is imported
        from ray.tune import Callback

        class Trials(_TrialsMixin, Callback):
            pass

        return Trials(*args, **kwargs)


class _TrialsMixin:
    def __init__(self, client, setup: dict[str, Any], total: int, scheduler: str):
        self.client, self.info, self.total, self.scheduler = client, setup, total, scheduler
        self.rows: dict[str, TrialRow] = {}
        self.done = 0

    def _row(self, trial) -> TrialRow:
        row = self.rows.get(trial.trial_id)
        if row is None:
            values = {k: trial.config.get(k) for k in self.info["keys"]}
            row = self.rows[trial.trial_id] = TrialRow(_trial_number(trial.trial_id), trial.trial_id, values)
        return row

    def on_trial_result(self, iteration, trials, trial, result, **info):
        row = self._row(trial)
        row.epochs = int(result.get("epoch", row.epochs))
        row.metric = float(result.get(self.info["metric"], math.nan))

    def _run_id(self, row: TrialRow) -> str | None:
        if row.run_id is None:
            try:
                found = self.client.search_runs(
                    [self.info["experiment_id"]],
                    filter_string=f"tags.`{TRIAL_TAG}` = '{row.trial_id}' and "
                    f"tags.`mlflow.parentRunId` = '{self.info['parent_run_id']}'",
                )
                row.run_id = found[0].info.run_id if found else None
            except Exception as exc:  # pragma: no cover - tracking store busy
                log.debug("trial %s: no child run found: %s", row.trial_id, exc)
        return row.run_id

    def _end(self, row: TrialRow, status: str) -> None:
        run_id = self._run_id(row)
        if run_id is not None:
            try:
                self.client.set_tag(run_id, "foveate.stop_reason", row.state)
                if row.state != "failed":
                    self.client.set_tag(run_id, "foveate.stop_detail", row.detail)
                elif not row.detail:
                    row.detail = self.client.get_run(run_id).data.tags.get("foveate.stop_detail", "")
                self.client.set_terminated(run_id, status=status)
            except Exception as exc:  # pragma: no cover - tracking store gone
                log.warning("trial %d: could not end its MLflow run %s: %s", row.number, run_id, exc)
        self.done += 1
        values = ", ".join(f"{k}={_fmt(v)}" for k, v in row.values.items())
        metric = "" if math.isnan(row.metric) else f", {self.info['metric']}={row.metric:.4g}"
        state = row.state if row.state != "failed" else f"failed: {row.detail}"
        log.info("trial %d/%d (%s): %d epoch(s)%s, %s", self.done, self.total, values, row.epochs, metric, state)

    def on_trial_complete(self, iteration, trials, trial, **info):
        row = self._row(trial)
        last = trial.last_result or {}
        epochs = self.info["max_epochs"]
        if last.get("finished", 0) >= 1:
            row.state, row.detail = "completed", f"{row.epochs} epoch(s)"
        else:
            row.state = "early-stopped"
            row.detail = f"stopped by the {self.scheduler} scheduler after epoch {row.epochs} (of at most {epochs})"
        self._end(row, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info):
        row = self._row(trial)
        row.state = "failed"
        run_id = self._run_id(row)
        if run_id is not None:
            try:
                row.detail = self.client.get_run(run_id).data.tags.get("foveate.stop_detail", "")
            except Exception:  # pragma: no cover
                pass
        if not row.detail and trial.error_file and Path(trial.error_file).is_file():
            row.detail = _reason(Path(trial.error_file).read_text())
        self._end(row, "FAILED")


def _scheduler(name: str, *, max_t: int, grace_period: int, reduction_factor: float):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    if name == "asha":
        return ASHAScheduler(
            time_attr="training_iteration",
            max_t=max_t,
            grace_period=min(grace_period, max_t),
            reduction_factor=reduction_factor,
        )
    if name == "median":
        return MedianStoppingRule(time_attr="training_iteration", grace_period=grace_period, min_samples_required=2)
    return FIFOScheduler()


def _max_epochs(config: TrainConfig, space: SearchSpace) -> int:
    out = max(config.optim.epochs, config.early_stopping.max_epochs)
    for p in space.params:
        if p.key in ("optim.epochs", "early_stopping.max_epochs"):
            out = max(out, *(int(a) for a in p.args))
    return out


def tune(
    config: TrainConfig,
    space: SearchSpace | dict[str, Any] | str | Path,
    *,
    trials: int = 4,
    scheduler: str = "asha",
    metric: str = "val_auc",
    mode: str = "max",
    max_concurrent: int | None = None,
    grace_period: int = 1,
    reduction_factor: float = 2.0,
    out: str | Path | None = None,
    promote: str | None = None,
    address: str | None = None,
    max_failures: int = 1,
    after_epoch: Callable[[dict[str, Any], int], None] | None = None,
    search_seed: int | None = None,
) -> TuneResult:
    """Search ``space`` around ``config`` on Ray Tune (see the module doc).

    Args:
        config: the base training config (every trial is it with the space's values set).
        space: a :class:`~pipeline.tune_space.SearchSpace`, its mapping or a YAML file (checked here).
        trials: samples drawn from the space (Ray Tune's ``num_samples``; each runs every ``grid`` combination).
        scheduler: ``asha`` (asynchronous successive halving), ``median`` (median stopping rule) or ``fifo`` (none).
        metric, mode: what the scheduler and the choice of the best trial compare (an epoch metric: ``val_auc``,
            ``val_accuracy``, ``val_loss``, ...), ``max`` or ``min``.
        max_concurrent: trials at once (default: as many as the cluster's CPUs allow).
        grace_period, reduction_factor: ASHA's (and the median rule's grace period), in epochs.
        out: the search's folder (``best.yaml``, Ray Tune's storage, the trials' folders); default
            ``<workdir>/tune/<parent run name>``.
        promote: point this registry alias at the best trial's registered model version.
        address: Ray cluster to join (default: in-process Ray, or ``$RAY_ADDRESS``).
        max_failures: restarts of a crashed trial from its last checkpoint.
        after_epoch: called as ``after_epoch(values, epoch)`` in each trial after each epoch's checkpoint (tests
            pass one that raises).
        search_seed: the random search's seed: two searches of the same space with the same seed sample the
            same trials (:func:`sampled_values`; e.g. one with ``asha`` and one with ``fifo``); None: unseeded.
    """
    from pipeline.data import build_slide_table, split_train_val
    from pipeline.runtime import init_ray
    from pipeline.tracking import client_for, get_or_create_experiment, resolve_tracking_uri, start_run
    from pipeline.train import _check_grids, _encoder_inits, _resolve, pretrain_gate_encoder, resolve_use_gpu
    from pipeline.tune_space import parse_space
    from workers import storage

    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler: got {scheduler!r}, must be one of {list(SCHEDULERS)}")
    if mode not in ("max", "min"):
        raise ValueError(f"--mode: got {mode!r}, must be max or min")
    if metric not in _metric_names():
        raise ValueError(f"--metric: got {metric!r}, must be an epoch metric: {sorted(_metric_names())}")
    if not (isinstance(trials, int) and trials >= 1):
        raise ValueError(f"--trials: got {trials!r}, must be an integer >= 1")
    if max_concurrent is not None and not (isinstance(max_concurrent, int) and max_concurrent >= 1):
        raise ValueError(f"--max-concurrent: got {max_concurrent!r}, must be an integer >= 1")
    if not (isinstance(grace_period, int) and grace_period >= 1):
        raise ValueError(f"--grace-period: got {grace_period!r}, must be an integer >= 1")
    if search_seed is not None and (isinstance(search_seed, bool) or not isinstance(search_seed, int)):
        raise ValueError(f"--search-seed: got {search_seed!r}, must be an integer or None")
    config = _resolve(config, workers=None, workdir=None)
    if not isinstance(space, SearchSpace):
        space = load_space(space, config) if isinstance(space, (str, Path)) else parse_space(space, config)
    if config.workers != 1:
        log.info("workers: %d in the config; each trial trains with one worker", config.workers)

    table = build_slide_table(config.data)
    config = dataclasses.replace(
        config,
        workers=1,
        model=dataclasses.replace(config.model, num_classes=table.num_classes),
        data=dataclasses.replace(config.data, classes=tuple(table.class_names)),
    )
    train_recs, val_recs = split_train_val(table.records, config.data.val_fraction, config.data.seed)
    if not train_recs:
        raise ValueError(f"no training slides left after the validation split ({len(table.records)} slide(s))")
    if metric.startswith("val_") and not val_recs:
        raise ValueError(f"--metric {metric} needs validation slides; data.val_fraction is {config.data.val_fraction}")
    _check_grids(config.model, table.records, train={r.slide_id for r in train_recs})  # the base config's
    log.info(
        "%d slides (%d train, %d val), classes %s; search over %s",
        len(table.records),
        len(train_recs),
        len(val_recs),
        list(table.class_names),
        ", ".join(f"{p.key} ({p.describe()})" for p in space.params),
    )

    uri = resolve_tracking_uri(default_dir=config.workdir)
    client = client_for(uri)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    parent_name = config.tracking.run_name or f"tune-{stamp}"
    # gate_encoder: pretrain: one encoder, pretrained before the search, for every trial
    config = pretrain_gate_encoder(config, train_recs, address=address, name=f"{parent_name}-gate-encoder")
    inits = _encoder_inits(config, uri)
    experiment_id = get_or_create_experiment(client, config.tracking.experiment, uri)
    out_dir = storage.normalize(out if out is not None else storage.join(config.workdir, "tune", parent_name))
    if storage.is_url(out_dir):
        raise ValueError(f"--out: a local folder, got {out_dir}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    total = trials * space.grid_size()
    budget = {
        "tune.trials": trials,
        "tune.total_trials": total,
        "tune.scheduler": scheduler,
        "tune.metric": metric,
        "tune.mode": mode,
        "tune.max_concurrent": max_concurrent if max_concurrent is not None else "auto",
        "tune.grace_period": grace_period,
        "tune.reduction_factor": reduction_factor,
        "tune.max_epochs": _max_epochs(config, space),
        "tune.max_failures": max_failures,
        "tune.search_seed": search_seed if search_seed is not None else "none",
    }
    parent_run_id = start_run(
        client,
        experiment_id,
        run_name=parent_name,
        tags={"foveate.stage": "tune", "foveate.out": str(out_dir)},
    )
    from mlflow.entities import Param

    params = {**budget, **{f"space.{p.key}": p.describe() for p in space.params}}
    client.log_batch(parent_run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    client.log_dict(parent_run_id, space.as_dict(), "space.yaml")
    client.log_dict(parent_run_id, to_dict(config), "base_config.yaml")
    log.info(
        "MLflow search run %s in experiment %r at %s; %d trial(s), %s",
        parent_run_id,
        config.tracking.experiment,
        uri,
        total,
        scheduler,
    )

    setup: dict[str, Any] = {
        "base": to_dict(config),
        "keys": space.keys,
        "train": [list(dataclasses.astuple(r)) for r in train_recs],
        "val": [list(dataclasses.astuple(r)) for r in val_recs],
        "class_names": list(table.class_names),
        "tracking_uri": uri,
        "experiment_id": experiment_id,
        "parent_run_id": parent_run_id,
        "parent_name": parent_name,
        "metric": metric,
        "out": str(out_dir),
        "max_epochs": budget["tune.max_epochs"],
    }
    setup.update(inits)  # pretrained encoders named by MLflow URIs
    if after_epoch is not None:
        setup["after_epoch"] = after_epoch

    cpus = max(2, (max_concurrent or os.cpu_count() or 2) * config.cpus_per_worker)
    started = init_ray(address, num_cpus=cpus)
    try:
        setup["use_gpu"] = resolve_use_gpu(config)
        callback = _Trials(client, setup, total, scheduler)
        plan = _SearchPlan(
            trials=trials,
            scheduler=scheduler,
            metric=metric,
            mode=mode,
            max_concurrent=max_concurrent,
            grace_period=grace_period,
            reduction_factor=reduction_factor,
            max_failures=max_failures,
            search_seed=search_seed,
        )
        results = _fit(space, setup, config, callback, plan, out_dir)
        rows = sorted(callback.rows.values(), key=lambda r: r.number)
        result = TuneResult(
            parent_run_id, experiment_id, config.tracking.experiment, uri, metric, mode, rows, str(out_dir)
        )
        _finish(result, results, config, setup, client, promote, table)
        client.set_terminated(parent_run_id, status="FINISHED")
    except BaseException:
        try:
            client.set_terminated(parent_run_id, status="FAILED")
        except Exception:  # pragma: no cover
            pass
        raise
    finally:
        if started:
            import ray

            ray.shutdown()
    return result


@dataclasses.dataclass(frozen=True)
class _SearchPlan:
    """How Ray Tune runs the search (the validated ``tune()`` arguments)."""

    trials: int
    scheduler: str
    metric: str
    mode: str
    max_concurrent: int | None
    grace_period: int
    reduction_factor: float
    max_failures: int
    search_seed: int | None = None


def _search_alg(max_concurrent: int | None, search_seed: int | None):
    """Ray Tune's random search (``BasicVariantGenerator``), seeded with ``search_seed``."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(max_concurrent=max_concurrent or 0, random_state=search_seed)


def sampled_values(space: SearchSpace, trials: int, search_seed: int) -> list[dict[str, Any]]:
    """The trials' values, in trial order, that a search of ``space`` with ``trials`` samples and ``search_seed``
    runs (drawn by the same generator, without running anything)."""
    from ray.tune.experiment import Experiment

    gen = _search_alg(None, search_seed)
    gen.add_configurations(
        [Experiment(name="sample", run=lambda c: None, config=space.param_space(), num_samples=trials)]
    )
    out = []
    while (trial := gen.next_trial()) is not None:
        out.append({k: trial.config[k] for k in space.keys})
    return out


def _fit(space: SearchSpace, setup: dict[str, Any], config, callback, plan: _SearchPlan, out_dir: str):
    """Run the trials on Ray Tune (``plan``), results and checkpoints under ``out_dir``; returns its ResultGrid."""
    from ray import tune as rtune

    resources = {"cpu": config.cpus_per_worker, **({"gpu": 1} if setup["use_gpu"] else {})}
    trainable = rtune.with_resources(rtune.with_parameters(_trial, setup=setup), resources)
    tuner = rtune.Tuner(
        trainable,
        param_space=space.param_space(),
        tune_config=rtune.TuneConfig(
            search_alg=_search_alg(plan.max_concurrent, plan.search_seed),
            metric=plan.metric,
            mode=plan.mode,
            num_samples=plan.trials,
            max_concurrent_trials=None,  # the random search itself holds plan.max_concurrent (_search_alg)
            scheduler=_scheduler(
                plan.scheduler,
                max_t=setup["max_epochs"],
                grace_period=plan.grace_period,
                reduction_factor=plan.reduction_factor,
            ),
            trial_dirname_creator=lambda t: f"trial-{_trial_number(t.trial_id):03d}",
            reuse_actors=False,
        ),
        run_config=rtune.RunConfig(
            name="ray",
            storage_path=str(Path(out_dir).resolve()),
            verbose=0,
            callbacks=[callback],
            failure_config=rtune.FailureConfig(max_failures=plan.max_failures),
            checkpoint_config=rtune.CheckpointConfig(num_to_keep=1),
        ),
    )
    log.info("Ray Tune: %s per trial, storage %s", resources, Path(out_dir) / "ray")
    import contextlib

    # Ray Tune prints its own status blocks to stdout: they go to its logger (the command's log file), not the terminal
    with contextlib.redirect_stdout(_LogLines(logging.getLogger("ray.tune.output"))):
        return tuner.fit()


class _LogLines:
    """A text stream that logs each complete line it is given (at INFO, on ``logger``)."""

    def __init__(self, logger: logging.Logger):
        self.logger, self._buf = logger, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if line.strip():
                self.logger.info("%s", line.rstrip())
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _finish(result: TuneResult, results, config: TrainConfig, setup, client, promote: str | None, table) -> None:
    """The best trial: its model logged and registered (aliased), its config in best.yaml, the parent run's summary."""
    import pandas as pd
    import torch
    import yaml
    from mlflow.entities import Metric, Param

    from operators.checkpoint import model_from_checkpoint
    from pipeline.mlflow_model import log_model

    rows = result.rows
    counts = {s: sum(r.state == s for r in rows) for s in ("completed", "early-stopped", "failed")}
    now = int(time.time() * 1000)
    client.log_batch(
        result.parent_run_id, metrics=[Metric(f"trials_{k.replace('-', '_')}", v, now, 0) for k, v in counts.items()]
    )
    client.log_text(result.parent_run_id, format_trials(rows, result.metric), "trials.txt")
    scored = [r for r in rows if r.state != "failed" and not math.isnan(r.metric)]
    if not scored:
        log.warning("no trial reported %s: no best trial, nothing registered", result.metric)
        return
    sign = 1 if result.mode == "max" else -1
    best = max(scored, key=lambda r: (sign * r.metric, r.state == "completed", -r.number))
    result.best = best
    by_id = {r.metrics.get("trial_id"): r for r in results}
    found = by_id.get(best.trial_id)
    if found is None or found.checkpoint is None:
        raise RuntimeError(f"the best trial {best.trial_id} left no checkpoint")
    with found.checkpoint.as_directory() as d:
        ckpt = torch.load(Path(d) / MODEL_FILE, map_location="cpu", weights_only=True)
    model, model_cfg, class_names = model_from_checkpoint(ckpt)
    trial_cfg = config_for(TrainConfig, setup["base"], best.values)
    name = config.tracking.registered_model or config.tracking.experiment
    example = table.records[0]
    result.model_uri = log_model(
        model,
        model_cfg,
        class_names,
        run_id=best.run_id,
        tracking_uri=result.tracking_uri,
        train_config=to_dict(trial_cfg),
        metadata={"run_id": best.run_id, "tune_run_id": result.parent_run_id},
        registered_model_name=name,
        input_example=pd.DataFrame({"store": [str(example.store)], "slide_id": [str(example.slide_id)]}),
    )
    versions = client.search_model_versions(f"run_id = '{best.run_id}'")
    version = max((v for v in versions if v.name == name), key=lambda v: int(v.version), default=None)
    if version is not None:
        result.registered = (name, str(version.version))
        if promote:
            client.set_registered_model_alias(name, promote, version.version)
            result.alias = promote
            log.info("models:/%s@%s -> version %s (trial %d)", name, promote, version.version, best.number)

    # best.yaml: the trial's config as foveate train takes it (its own run name left to the next training)
    best_cfg = dataclasses.replace(trial_cfg, tracking=dataclasses.replace(trial_cfg.tracking, run_name=None))
    text = yaml.safe_dump(to_dict(best_cfg), sort_keys=False)
    path = Path(result.out_dir) / "best.yaml"
    path.write_text(
        f"# the best trial ({result.metric}={best.metric:.6g}) of foveate tune's search run {result.parent_run_id}\n"
        + text
    )
    from pipeline.config import load_config

    load_config(TrainConfig, path)  # what foveate train --config does with it
    result.best_config = str(path)
    client.log_artifact(result.parent_run_id, str(path))
    client.log_batch(
        result.parent_run_id,
        metrics=[Metric(f"best_{result.metric}", best.metric, now, 0)],
        params=[Param(f"best.{k}", str(v)[:6000]) for k, v in best.values.items()]
        + [Param("best.trial", str(best.number)), Param("best.run_id", str(best.run_id))],
    )
    client.set_tag(result.parent_run_id, "foveate.best_run_id", str(best.run_id))


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "optim.epochs=10")
    parser.add_argument("--space", required=True, help="search space YAML (dotted config keys -> choice, uniform, ...)")
    parser.add_argument("--trials", type=int, default=4, help="samples drawn from the space (default 4; x grid points)")
    parser.add_argument(
        "--scheduler", choices=SCHEDULERS, default="asha", help="early stopping of trials (default asha)"
    )
    parser.add_argument("--metric", default="val_auc", help="epoch metric the scheduler and the best trial compare")
    parser.add_argument("--mode", choices=("max", "min"), default="max", help="max (default) or min --metric")
    parser.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: as CPUs allow)")
    parser.add_argument("--grace-period", type=int, default=1, help="epochs before the scheduler may stop a trial")
    parser.add_argument("--max-failures", type=int, default=1, help="restarts of a crashed trial from its checkpoint")
    parser.add_argument(
        "--search-seed", type=int, default=None, help="seed of the random search (the same seed: the same trials)"
    )
    parser.add_argument("--out", default=None, help="the search's folder (default <workdir>/tune/<run name>)")
    parser.add_argument("--promote", default=None, metavar="ALIAS", help="alias the best trial's registered model")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: auto, ray://HOST:10001 or HOST:PORT (default: in-process Ray)",
    )
    parser.add_argument(
        "--workdir", default=None, help="the default sqlite tracking store and tune/ (config key workdir)"
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_cli(TrainConfig, args, {"workdir": "workdir"})
    result = tune(
        config,
        args.space,
        trials=args.trials,
        scheduler=args.scheduler,
        metric=args.metric,
        mode=args.mode,
        max_concurrent=args.max_concurrent,
        grace_period=args.grace_period,
        out=args.out,
        promote=args.promote,
        address=args.address,
        max_failures=args.max_failures,
        search_seed=args.search_seed,
    )
    print(result.summary(), file=sys.stdout, flush=True)
    return 0 if result.best is not None else 1
