"""``foveate train``: the driver and the CLI of end-to-end training on Ray Train.

Where things are:

* config schemas: :mod:`pipeline.train_config` (``TrainConfig`` and its sections);
* the training core (model, optimiser, schedules, step / evaluate / checkpoint state), usable without Ray
  or MLflow: :class:`workers.trainer.Trainer`;
* the Ray Train worker function wrapping it (all-reduce, rank-0 logging, checkpoint reporting):
  :func:`pipeline.train_loop.train_loop_per_worker`;
* pictures (heatmap, patch gallery), shared with batch scoring: :mod:`workers.reports`;
* metrics: :mod:`workers.metrics`.

The driver (:func:`train`) resolves the config, builds the slide table and its train/validation split
(:mod:`pipeline.data`), sets ``model.num_classes`` from the data (logged), opens (or, with ``resume``,
reopens) one MLflow run with the full resolved config as params, starts Ray (:func:`pipeline.runtime.init_ray`)
and runs a :class:`ray.train.torch.TorchTrainer` with ``workers`` workers (gloo on CPU, nccl when the cluster
has GPUs). Training runs to ``optim.epochs`` or stops earlier by early stopping (``early_stopping``); either way
the last checkpoint holds the best epoch's model. After training it logs that model
(:func:`pipeline.mlflow_model.log_model`) and, for a few validation slides, a heatmap of the scorer over the
thumbnail and a gallery of the chosen patches.

Run directory: ``<workdir>/train/<run_name>/`` holds ``train_state.json`` (MLflow run id, resolved config)
and Ray Train's storage (``ray/checkpoint_*``). Without ``MLFLOW_TRACKING_URI`` the tracking store is
``sqlite:///<workdir>/mlflow.db``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.archive_info import statement_warnings
from pipeline.config import ConfigError, add_config_arguments, config_from_cli, to_dict
from pipeline.data import SlideRecord, build_slide_table, split_train_val
from pipeline.train_config import OptimConfig, ScheduleConfig, TrackingConfig, TrainConfig
from pipeline.train_loop import MODEL_FILE, train_loop_per_worker
from workers import storage
from workers.early_stopping import stop_message
from workers.metrics import classification_metrics, roc_auc
from workers.reports import plot_gallery, plot_heatmap
from workers.trainer import earliest_stop_epoch, lr_factor, sigma_at

__all__ = [
    "OptimConfig",
    "ScheduleConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainResult",
    "sigma_at",
    "lr_factor",
    "roc_auc",
    "classification_metrics",
    "train",
    "stopping_line",
    "train_loop_per_worker",
    "plot_heatmap",
    "plot_gallery",
    "add_arguments",
    "run",
]

log = logging.getLogger(__name__)

STATE_FILE = "train_state.json"


@dataclass
class TrainResult:
    """What :func:`train` returns (and ``foveate train`` prints)."""

    run_id: str
    experiment_id: str
    experiment: str
    tracking_uri: str
    model_uri: str
    run_dir: str
    class_names: list[str]
    metrics: dict[str, float]
    config: TrainConfig
    model: Any = None  # the trained FoveateModel (eval mode, CPU)

    def summary(self) -> str:
        from pipeline.tracking import run_url

        lines = [
            f"MLflow tracking URI: {self.tracking_uri}",
            f"experiment: {self.experiment} (id {self.experiment_id})",
            f"run id: {self.run_id}",
            f"model: {self.model_uri}  (or runs:/{self.run_id})",
            f"run dir: {self.run_dir}",
            f"look at it: {run_url(self.tracking_uri, self.experiment_id, self.run_id)}",
        ]
        shown = {
            k: v
            for k, v in self.metrics.items()
            if k.startswith(("val_", "final_val_", "epoch_train_")) or k == "train_seconds"
        }
        if shown:
            lines.append("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))
        line = stopping_line(self.config, self.metrics)
        if line:
            lines.append(line)
        return "\n".join(lines)


def _stopped_early(cfg: TrainConfig, stopped: float) -> bool:
    """Whether a run that ended after epoch ``stopped`` ended by early stopping: before ``optim.epochs``, or past it
    (``early_stopping.max_epochs``) before ``max_epochs``."""
    cap, most = cfg.optim.epochs, max(cfg.optim.epochs, cfg.early_stopping.max_epochs)
    return int(stopped) < cap or cap < int(stopped) < most


def stopping_line(cfg: TrainConfig, metrics: dict[str, float]) -> str | None:
    """``epochs: 25 of at most 30 (early stop); the model is epoch 20's, best val_loss=0.04301`` (None when the
    metrics do not say)."""
    stopped = metrics.get("stopped_epoch")
    if stopped is None:
        return None
    cap, most = cfg.optim.epochs, max(cfg.optim.epochs, cfg.early_stopping.max_epochs)
    line = f"epochs: {int(stopped)} of at most {most}"
    if most > cap:
        line += f" (optim.epochs {cap}; past it while still learning)"
    if _stopped_early(cfg, stopped):
        line += " (early stop)"
    name = f"best_{cfg.early_stopping.metric}"
    if "best_epoch" in metrics and name in metrics:
        line += f"; the model is epoch {int(metrics['best_epoch'])}'s, {name}={metrics[name]:.4g}"
    return line


# ---------------------------------------------------------------------------------------------- driver
def _check_grids(model_cfg, records, train: set[str] | None = None) -> list[float]:
    """Before Ray or MLflow start: every slide's store opens whole, records an mpp when the model has µm
    settings, and its patch grid (in that slide's pixels) has at least ``model.selection.k`` cells (reads only each
    store's metadata and chunk listing); the error names the slide. Returns the level-0 mpp (x) of the stores
    of the ``train`` slides that record one."""
    from workers.patches import PatchGrid, slide_geometry
    from workers.store import SlideStore

    mpps: list[float] = []
    stores = []
    for rec in records:
        try:
            store = SlideStore(rec.store)
        except Exception as exc:
            raise ValueError(f"slide {rec.slide_id}: cannot open its store {rec.store}: {exc}") from exc
        stores.append(store)
        if (train is None or rec.slide_id in train) and store.meta.mpp:
            mpps.append(float(store.meta.mpp[0]))
    model_cfg = with_training_mpp(model_cfg, mpps)  # µm patches: the network's patch side follows from it
    for rec, store in zip(records, stores):
        try:
            geo = slide_geometry(store, model_cfg)
        except ConfigError as exc:
            raise ConfigError(f"slide {rec.slide_id}: {exc}") from None
        grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
        if grid.num_cells < model_cfg.selection.k:
            size = (
                f"model.geometry.patch_size {geo.patch_size}"
                if model_cfg.geometry.patch_size_um is None
                else f"model.geometry.patch_size_um {model_cfg.geometry.patch_size_um} = {geo.patch_size} px at mpp "
                f"{geo.mpp:g}"
            )
            raise ConfigError(
                f"model.selection.k: got {model_cfg.selection.k}, must be <= the patch grid's cells of every slide; slide "
                f"{rec.slide_id} ({store.dimensions[0]} x {store.dimensions[1]} px at {size}) has {grid.num_cells}"
            )
    return mpps


def with_training_mpp(model_cfg, mpps: list[float]):
    """``model_cfg`` with ``mpp`` set to the median of the training stores' level-0 mpp (rounded to 1e-6) when it
    is unset and some store records one: the resolution the model learns at travels with it (and, for
    ``model.geometry.patch_size_um`` without ``model.geometry.patch_input``, fixes the network's patch side)."""
    if model_cfg.mpp is None and mpps:
        return dataclasses.replace(model_cfg, mpp=round(float(statistics.median(mpps)), 6))
    return model_cfg


def _run_dir(cfg: TrainConfig, resume: bool, stage: str = "train") -> str:
    """The run folder (a local path or an object-storage URL under ``<workdir>/<stage>``)."""
    runs = storage.join(cfg.workdir, stage)
    if cfg.tracking.run_name:
        run_dir = storage.join(runs, cfg.tracking.run_name)
        if resume and not storage.file_exists(storage.join(run_dir, STATE_FILE)):
            raise FileNotFoundError(f"--resume: no run to resume at {run_dir} (no {STATE_FILE})")
        if not resume and storage.file_exists(run_dir):
            raise ValueError(
                f"run directory {run_dir} exists: use --resume to continue it, or another tracking.run_name"
            )
        return run_dir
    if resume:
        candidates = sorted(
            (storage.modified_time(f), loc)
            for _, loc in storage.children(runs)
            for f in [storage.join(loc, STATE_FILE)]
            if storage.file_exists(f)
        )
        if not candidates:
            raise FileNotFoundError(f"--resume: no run to resume under {runs}")
        return candidates[-1][1]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.tracking.experiment).strip(".") or "run"
    run_dir = storage.join(runs, f"{safe[:150]}-{stamp}")  # a plain folder name (tracking.run_name's rule)
    i = 1
    while storage.file_exists(run_dir):
        i += 1
        run_dir = storage.join(runs, f"{safe[:150]}-{stamp}-{i}")
    return run_dir


def _config_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _config_diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _resolve(config: TrainConfig, *, workers: int | None, workdir: str | Path | None) -> TrainConfig:
    if workers is not None:
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        config = dataclasses.replace(config, workers=workers)
    wd = storage.normalize(workdir if workdir is not None else config.workdir)
    labels = config.data.labels
    if labels != "manifest":
        labels = storage.normalize(labels)
    data = dataclasses.replace(config.data, stores=storage.normalize(config.data.stores), labels=labels)
    return dataclasses.replace(config, workdir=wd, data=data)


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    address: str | None = None,
    workers: int | None = None,
    workdir: str | Path | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train a model on Ray Train and track it in MLflow.

    Args:
        config: the training config (see :class:`TrainConfig`).
        resume: continue the run named by ``config.tracking.run_name`` (default: the latest run under
            ``<workdir>/train``) from its latest checkpoint, in the same MLflow run.
        address: Ray cluster to join (``auto``, ``ray://host:10001``, ``host:port``); default: in-process
            Ray, or the cluster in ``$RAY_ADDRESS`` (as under ``ray job submit``).
        workers: overrides ``config.workers``.
        workdir: overrides ``config.workdir``.
        after_epoch: called as ``after_epoch(epoch)`` (1-based) on every Ray Train worker after each epoch's
            checkpoint (shipped to the workers by value; fault-injection tests pass one that raises).

    Returns:
        :class:`TrainResult` with the MLflow run, the logged model's URI and the trained model.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    from operators.checkpoint import model_from_checkpoint
    from pipeline.mlflow_model import log_model
    from pipeline.runtime import init_ray
    from pipeline.tracking import (
        claim_run,
        client_for,
        end_stale_runs,
        get_or_create_experiment,
        log_params,
        resolve_tracking_uri,
        start_run,
    )

    config = _resolve(config, workers=workers, workdir=workdir)
    table = build_slide_table(config.data)
    for line in statement_warnings(config.data.stores, config.data.label_symmetry):
        log.warning("%s", line)
    if config.model.num_classes != table.num_classes:
        log.info(
            "model.num_classes: %d in the config, overridden from the data: %d",
            config.model.num_classes,
            table.num_classes,
        )
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_classes=table.num_classes),
        data=dataclasses.replace(config.data, classes=tuple(table.class_names)),
    )
    log.info("model.num_classes = %d (classes %s)", config.model.num_classes, list(table.class_names))
    train_recs, val_recs = split_train_val(table.records, config.data.val_fraction, config.data.seed)
    if not train_recs:
        raise ValueError(f"no training slides left after the validation split ({len(table.records)} slide(s))")
    log.info(
        "%d slides (%d train, %d val), classes %s",
        len(table.records),
        len(train_recs),
        len(val_recs),
        list(table.class_names),
    )

    train_mpps = _check_grids(config.model, table.records, train=set(r.slide_id for r in train_recs))
    config = dataclasses.replace(config, model=with_training_mpp(config.model, train_mpps))
    _log_early_stopping(config, val_recs)
    run_dir = _run_dir(config, resume)
    if config.tracking.run_name is None:
        config = dataclasses.replace(
            config, tracking=dataclasses.replace(config.tracking, run_name=storage.basename(run_dir))
        )
    uri = resolve_tracking_uri(default_dir=config.workdir)
    client = client_for(uri)
    state = json.loads(storage.read_file(storage.join(run_dir, STATE_FILE)) or b"{}") if resume else None
    config = pretrain_gate_encoder(config, train_recs, address=address, resumed=state, run_dir=run_dir)
    inits = _encoder_inits(config, uri)
    resolved = to_dict(config)
    if resume:
        diff = [k for k in _config_diff(state["config"], resolved) if k not in ("workers",)]
        if diff:
            raise ValueError(f"--resume: the config differs from the run's in {diff}; resume with the same config")
        run_id, experiment_id = state["run_id"], state["experiment_id"]
        uri = state.get("tracking_uri", uri)
        client = client_for(uri)
        end_stale_runs(client, experiment_id)  # this run too, when the command it last ran in was killed
        claim_run(client, run_id)
        client.set_tag(
            run_id, "foveate.resumed", str(int(client.get_run(run_id).data.tags.get("foveate.resumed", "0")) + 1)
        )
    else:
        experiment_id = get_or_create_experiment(client, config.tracking.experiment, uri)
        run_id = start_run(
            client,
            experiment_id,
            run_name=config.tracking.run_name,
            tags={"foveate.stage": "train", "foveate.run_dir": str(run_dir)},
        )
        log_params(client, run_id, resolved)
        client.log_dict(
            run_id,
            {
                "class_names": list(table.class_names),
                "train": [r.slide_id for r in train_recs],
                "val": [r.slide_id for r in val_recs],
            },
            "split.json",
        )
        storage.write_file(
            storage.join(run_dir, STATE_FILE),
            json.dumps(
                {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": uri, "config": resolved}, indent=2
            ).encode(),
        )
    log.info("MLflow run %s in experiment %r at %s", run_id, config.tracking.experiment, uri)

    started = init_ray(address, num_cpus=max(2, config.workers * config.cpus_per_worker))
    try:
        result = _fit(config, run_dir, train_recs, val_recs, table.class_names, uri, run_id, after_epoch, inits)
        ckpt = _load_ckpt(result)
        model, model_cfg, class_names = model_from_checkpoint(ckpt)
        import pandas as pd

        example = (train_recs or val_recs)[0]
        model_uri = log_model(
            model,
            model_cfg,
            class_names,
            run_id=run_id,
            tracking_uri=uri,
            train_config=resolved,
            metadata={"run_id": run_id},
            registered_model_name=config.tracking.registered_model,
            input_example=pd.DataFrame({"store": [str(example.store)], "slide_id": [str(example.slide_id)]}),
        )
        _log_val_artifacts(
            model,
            model_cfg,
            val_recs[: config.tracking.artifact_slides] or train_recs[: config.tracking.artifact_slides],
            class_names,
            client,
            run_id,
        )
        metrics = {k: float(v) for k, v in (result.metrics or {}).items()}
        stopped, best_name = metrics.get("stopped_epoch"), f"best_{config.early_stopping.metric}"
        if stopped is not None and _stopped_early(config, stopped) and best_name in metrics:
            es = config.early_stopping
            log.info(
                "%s",
                stop_message(es.metric, es.min_delta, int(stopped), int(metrics["best_epoch"]), metrics[best_name]),
            )
        client.set_terminated(run_id, status="FINISHED")
    except BaseException:
        try:
            client.set_terminated(run_id, status="FAILED")
        except Exception:  # pragma: no cover - tracking store gone
            pass
        log.error(
            "training failed; continue it with `foveate train --config ... --set tracking.run_name=%s --resume` "
            "(run dir %s)",
            config.tracking.run_name,
            run_dir,
        )
        raise
    finally:
        if started:
            import ray

            ray.shutdown()
    out = TrainResult(
        run_id=run_id,
        experiment_id=experiment_id,
        experiment=config.tracking.experiment,
        tracking_uri=uri,
        model_uri=model_uri,
        run_dir=str(run_dir),
        class_names=list(class_names),
        metrics=metrics,
        config=config,
        model=model,
    )
    return out


def _log_early_stopping(cfg: TrainConfig, val_recs) -> None:
    """One line on what ends the training: early stopping's metric, patience and earliest epoch, or the cap."""
    es = cfg.early_stopping
    if es.patience == 0:
        log.info("early stopping off: %d epochs, the last epoch's model", cfg.optim.epochs)
    elif not val_recs:
        log.warning(
            "early stopping: no validation slides (data.val_fraction %g): %d epochs, the last epoch's model",
            cfg.data.val_fraction,
            cfg.optim.epochs,
        )
    else:
        floor = earliest_stop_epoch(es, cfg.optim.epochs, cfg.schedule, cfg.model)
        log.info(
            "early stopping on %s (patience %d, min_delta %g, not before epoch %d), at most %d epochs%s; the best "
            "epoch's model is kept",
            es.metric,
            es.patience,
            es.min_delta,
            max(floor, 1),
            cfg.optim.epochs,
            f" (to {es.max_epochs} while still learning, early_stopping.max_epochs)"
            if es.max_epochs > cfg.optim.epochs
            else "",
        )


def pretrain_gate_encoder(
    config: TrainConfig,
    train_recs: Sequence[SlideRecord],
    *,
    address: str | None = None,
    resumed: dict[str, Any] | None = None,
    run_dir: str | None = None,
    name: str | None = None,
) -> TrainConfig:
    """``model.experimental.gate_encoder: pretrain``: pretrain the cluster gate's encoder on ``train_recs`` (their
    pixels, not their labels: :func:`pipeline.pretrain.pretrain` with ``config.pretrain``, its own MLflow run in
    the same experiment, named after the training run) and return ``config`` with ``runs:/<that run>`` in its
    place (``name``: the pretraining run's name, default ``<tracking.run_name>-gate-encoder``). Resuming
    (``resumed``: the run's recorded state, :data:`STATE_FILE` of ``run_dir``), the run's own encoder is used
    again, not a new one. Any other value: ``config`` unchanged."""
    from operators.model_config import GATE_ENCODER_PRETRAIN

    ex = config.model.experimental
    if ex.gate_encoder != GATE_ENCODER_PRETRAIN:
        return config
    if resumed is not None:
        uri = resumed.get("config", {}).get("model", {}).get("experimental", {}).get("gate_encoder")
        if not uri or uri == GATE_ENCODER_PRETRAIN:
            raise ValueError(f"--resume: the run at {run_dir} records no pretrained gate encoder")
        log.info("model.experimental.gate_encoder: pretrain -> %s (the resumed run's)", uri)
    else:
        from pipeline.pretrain import pretrain

        name = name or f"{config.tracking.run_name}-gate-encoder"
        log.info("model.experimental.gate_encoder: pretrain: %s on the %d training slides", name, len(train_recs))
        pre_config = dataclasses.replace(
            config,
            tracking=dataclasses.replace(config.tracking, run_name=name),
            pretrain=dataclasses.replace(config.pretrain, registered_model=None),
        )
        result = pretrain(pre_config, address=address, records=list(train_recs))
        uri = f"runs:/{result.run_id}"
        log.info("model.experimental.gate_encoder: pretrain -> %s", uri)
    experimental = dataclasses.replace(ex, gate_encoder=uri)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, experimental=experimental))


def _encoder_inits(config: TrainConfig, uri: str) -> dict[str, dict[str, torch.Tensor]]:
    """The pretrained encoders a config names, checked before Ray starts (the file or MLflow encoder exists, its
    architecture is the config's): ``model.features.init`` and ``model.experimental.gate_encoder``. Returns the
    state dicts to ship to the workers, as the Trainer's keyword arguments (``features_init``,
    ``gate_encoder_init``), for those given as MLflow URIs (a local file is read where the model is built)."""
    from operators.model_config import is_init_uri
    from pipeline.encoder_init import resolve_init

    f = config.model.features
    out: dict[str, dict[str, torch.Tensor]] = {}
    if f.kind != "resnet":
        return out
    if f.init is not None:
        state = resolve_init(f, tracking_uri=uri)
        log.info("model.features.init: the encoder of %s%s", f.init, " (frozen)" if f.freeze else "")
        if is_init_uri(f.init):
            out["features_init"] = state
    gate = config.model.experimental.gate_encoder
    if gate is not None:
        key = "model.experimental.gate_encoder"
        state = resolve_init(dataclasses.replace(f, init=gate, freeze=True), tracking_uri=uri, key=key)
        log.info("%s: the cluster gate clusters with the encoder of %s", key, gate)
        if is_init_uri(gate):
            out["gate_encoder_init"] = state
    return out


def _load_ckpt(result) -> dict:
    if result.checkpoint is None:
        raise RuntimeError("training finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        return torch.load(Path(d) / MODEL_FILE, map_location="cpu", weights_only=True)


def _fit(
    cfg: TrainConfig,
    run_dir: str,
    train_recs,
    val_recs,
    class_names,
    uri: str,
    run_id: str,
    after_epoch: Callable[[int], None] | None = None,
    inits: dict[str, dict[str, torch.Tensor]] | None = None,
):
    use_gpu = resolve_use_gpu(cfg)
    loop_config = {
        "config": to_dict(cfg),
        "train": [list(dataclasses.astuple(r)) for r in train_recs],
        "val": [list(dataclasses.astuple(r)) for r in val_recs],
        "class_names": list(class_names),
        "tracking_uri": uri,
        "run_id": run_id,
    }
    if after_epoch is not None:
        loop_config["after_epoch"] = after_epoch
    loop_config.update(inits or {})  # pretrained encoders named by MLflow URIs (_encoder_inits)
    cache_dir = feature_cache_dir(cfg, run_dir)
    if cache_dir is not None:
        loop_config["feature_cache"] = cache_dir
    trainer = torch_trainer(train_loop_per_worker, loop_config, cfg, run_dir, use_gpu=use_gpu)
    steps_per_epoch = math.ceil(math.ceil(len(train_recs) / cfg.workers) / cfg.optim.accumulate)
    with _TrainProgress(uri, run_id, steps_per_epoch, cfg.optim.epochs):
        return trainer.fit()


def feature_cache_dir(cfg: TrainConfig, run_dir: str) -> str | None:
    """The frozen-feature cache folder of a run (``cfg.feature_cache``): None when off, when the encoder is
    trained, or for ``auto`` with a run dir on object storage (the cache is a local Zarr folder)."""
    from workers.feature_cache import features_frozen

    value = str(cfg.feature_cache)
    if value == "off" or not features_frozen(cfg.model):
        return None
    if value != "auto":
        return value
    if storage.is_url(run_dir):
        log.info("feature cache: off (run dir %s is not local; set feature_cache to a local folder)", run_dir)
        return None
    return storage.join(run_dir, "feature_cache")


def resolve_use_gpu(cfg: TrainConfig) -> bool:
    """``cfg.use_gpu``, or (None) whether the Ray cluster has a GPU."""
    if cfg.use_gpu is not None:
        return bool(cfg.use_gpu)
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


def torch_trainer(
    loop: Callable[[dict], None], loop_config: dict[str, Any], cfg: TrainConfig, run_dir: str, *, use_gpu: bool
):
    """The :class:`ray.train.torch.TorchTrainer` of ``foveate train`` and ``foveate pretrain``: ``cfg.workers``
    workers placed by ``cfg.placement_strategy`` (``cfg.cpus_per_worker`` CPUs each, a GPU each with ``use_gpu``;
    gloo on CPU, nccl on GPUs), Ray Train's storage in ``<run_dir>/ray``, ``cfg.max_failures`` restarts from the
    latest checkpoint."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.workers,
            use_gpu=bool(use_gpu),
            resources_per_worker={"CPU": cfg.cpus_per_worker},
            placement_strategy=cfg.placement_strategy,
        ),
        run_config=RunConfig(
            name="ray",
            **_storage(run_dir),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    log.info(
        "Ray Train: %d worker(s) (%s), %s, storage %s",
        cfg.workers,
        cfg.placement_strategy,
        "GPU/nccl" if use_gpu else "CPU/gloo",
        storage.join(run_dir, "ray"),
    )
    return trainer


class _TrainProgress:
    """The driver's progress bar of a Ray Train run (steps, with the epoch, loss, validation accuracy and ETA).

    The training loop runs in Ray's workers; rank 0 logs ``loss`` to MLflow every ``tracking.log_every`` steps
    (and at each epoch's end) and the epoch metrics after each epoch. A thread reads them back every ``every_s``
    seconds while ``trainer.fit()`` runs; a read that fails (a busy sqlite file) is skipped."""

    def __init__(
        self, uri: str, run_id: str, steps_per_epoch: int, epochs: int, every_s: float = 3.0, desc: str = "train"
    ):
        import threading

        self.uri, self.run_id, self.every_s, self.desc = uri, run_id, every_s, desc
        self.steps_per_epoch, self.epochs = max(1, steps_per_epoch), epochs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="foveate-train-progress", daemon=True)
        self._bar = None

    def __enter__(self) -> _TrainProgress:
        from pipeline.progress import Progress

        self._bar = Progress(self.steps_per_epoch * self.epochs, self.desc, unit="step")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._bar.close()

    def _poll(self) -> None:
        from pipeline.tracking import client_for

        client = client_for(self.uri)
        while not self._stop.wait(self.every_s):
            self._update(client)
        self._update(client)

    def _update(self, client) -> None:
        try:
            history = client.get_metric_history(self.run_id, "loss")
            latest = client.get_run(self.run_id).data.metrics
        except Exception as exc:  # the bar is informative only: never let it fail (or slow down) training
            log.debug("training progress: %s", exc)
            return
        if not history:
            return
        last = max(history, key=lambda m: m.step)
        epoch = math.ceil(last.step / self.steps_per_epoch)
        if epoch > self.epochs:  # early_stopping.max_epochs: past the cap while still learning, one epoch at a time
            self._bar.set_total(self.steps_per_epoch * epoch)
        postfix = f"epoch {epoch}/{self.epochs}" + ("+" if epoch > self.epochs else "") + f", loss {last.value:.3f}"
        if "val_accuracy" in latest:
            postfix += f", val_accuracy {latest['val_accuracy']:.2f}"
        self._bar.update(max(0, last.step - self._bar.n), postfix=postfix)


def _storage(run_dir: str) -> dict[str, Any]:
    """Ray Train's ``storage_path`` (and ``storage_filesystem``) for a run folder: the folder itself, or for an
    object-storage URL the same fsspec filesystem (and credentials, endpoint) the stores use, wrapped for pyarrow,
    so checkpoints go to the bucket and every worker node reads them back from there (no shared disk)."""
    if not storage.is_url(run_dir):
        return {"storage_path": run_dir}
    import pyarrow.fs

    fs, path = storage.filesystem(run_dir)
    return {"storage_path": path, "storage_filesystem": pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))}


# ---------------------------------------------------------------------------------------------- artifacts
def _log_val_artifacts(model, model_cfg, records: list[SlideRecord], class_names, client, run_id: str) -> None:
    """Heatmap of the scorer over the thumbnail and a gallery of the chosen patches, per slide."""
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore

    with tempfile.TemporaryDirectory(prefix="foveate-art-") as tmp:
        for rec in records:
            try:
                store = SlideStore(rec.store)
                with torch.no_grad():
                    out = forward_slide(model, store, training=False, sigma=0.0)
                prob = torch.softmax(out.logits.reshape(1, -1).float(), -1)[0]
                title = (
                    f"{rec.slide_id}: label {rec.label}, predicted {class_names[int(prob.argmax())]} "
                    f"(p={float(prob.max()):.2f})"
                )
                heat = Path(tmp) / f"{rec.slide_id}_heatmap.png"
                gallery = Path(tmp) / f"{rec.slide_id}_patches.png"
                plot_heatmap(store, out, model_cfg, heat, title=title)
                plot_gallery(store, out, model_cfg, gallery, title=title)
                client.log_artifact(run_id, str(heat), "heatmaps")
                client.log_artifact(run_id, str(gallery), "patches")
            except Exception as exc:  # an artifact must not lose a finished training
                log.warning("could not draw artifacts for %s: %s", rec.slide_id, exc)


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "optim.epochs=2 --set model.selection.k=8")
    parser.add_argument("--workers", type=int, default=None, help="Ray Train workers (config key workers)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run tracking.run_name (default: the latest) from its last checkpoint",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: auto, ray://HOST:10001 or HOST:PORT (default: in-process Ray)",
    )
    parser.add_argument(
        "--workdir", default=None, help="run dirs and the default sqlite tracking store (config key workdir)"
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_cli(TrainConfig, args, {"workers": "workers", "workdir": "workdir"})
    result = train(config, resume=args.resume, address=args.address)
    print(result.summary(), file=sys.stdout, flush=True)
    return 0
