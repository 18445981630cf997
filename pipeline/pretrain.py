"""``foveate pretrain``: self-supervised pretraining of the patch encoder on Ray Train (no labels).

The driver (:func:`pretrain`) reads the training config (``--config`` / ``--set``, the same file ``foveate train``
takes; its ``pretrain:`` section is :class:`workers.pretrain.PretrainConfig`), takes every complete store under
``data.stores`` (labels are not read), checks their grids as ``foveate train`` does, opens an MLflow run (stage tag
``pretrain``, the resolved config as params) and runs a :class:`ray.train.torch.TorchTrainer` built like training's
(:func:`pipeline.train.torch_trainer`: workers, placement, GPUs when the cluster has them). Each worker
(:func:`pretrain_loop_per_worker`) drives a :class:`workers.pretrain.Pretrainer` on its shard of the slides; rank 0
logs ``loss`` per step and ``epoch_loss`` per epoch and reports a checkpoint each epoch. At the end the encoder is
logged (:func:`pipeline.encoder_init.log_encoder`: ``encoder/encoder.pt`` + ``encoder/features.json``, registered
with ``pretrain.registered_model``), ready for ``foveate train --set model.features.init=runs:/<run_id>``.

Run directory: ``<workdir>/pretrain/<run_name>/`` (Ray Train's storage).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.config import ConfigError, add_config_arguments, config_from_cli, from_dict, to_dict
from pipeline.data import SlideRecord, shard
from pipeline.train import (
    _check_grids,
    _resolve,
    _run_dir,
    _TrainProgress,
    resolve_use_gpu,
    torch_trainer,
    with_training_mpp,
)
from pipeline.train_config import TrainConfig
from workers import storage
from workers.store import is_complete

__all__ = ["PretrainResult", "pretrain", "pretrain_loop_per_worker", "add_arguments", "run"]

log = logging.getLogger(__name__)

STATE_FILE = "pretrain_state.pt"


@dataclass
class PretrainResult:
    """What :func:`pretrain` returns (and ``foveate pretrain`` prints)."""

    run_id: str
    experiment_id: str
    experiment: str
    tracking_uri: str
    encoder_uri: str
    run_dir: str
    metrics: dict[str, float]
    config: TrainConfig
    encoder_state: dict[str, torch.Tensor] | None = None

    def summary(self) -> str:
        from pipeline.tracking import run_url

        lines = [
            f"MLflow tracking URI: {self.tracking_uri}",
            f"experiment: {self.experiment} (id {self.experiment_id})",
            f"run id: {self.run_id}",
            f"encoder: {self.encoder_uri}",
            f"train from it: foveate train --config ... --set model.features.init=runs:/{self.run_id} "
            "[--set model.features.freeze=true]",
            f"run dir: {self.run_dir}",
            f"look at it: {run_url(self.tracking_uri, self.experiment_id, self.run_id)}",
        ]
        shown = {k: v for k, v in self.metrics.items() if k in ("epoch", "epoch_loss", "patches")}
        if shown:
            lines.append("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))
        return "\n".join(lines)


def _stores(stores_dir: str) -> list[SlideRecord]:
    """Every complete store under ``stores_dir`` (no label needed: label ``""``, target -1)."""
    if not storage.is_url(stores_dir) and not Path(stores_dir).is_dir():
        raise FileNotFoundError(f"data.stores: no such directory {str(stores_dir)!r}")
    found = sorted(storage.children(stores_dir, ".zarr"))
    records = [SlideRecord(name.removesuffix(".zarr"), str(loc), "", -1) for name, loc in found if is_complete(loc)]
    if len(records) < len(found):
        log.warning("skipping %d incomplete store(s)", len(found) - len(records))
    if not records:
        raise ValueError(f"no complete store in {str(stores_dir)!r}")
    return records


def pretrain(
    config: TrainConfig,
    *,
    address: str | None = None,
    workers: int | None = None,
    workdir: str | Path | None = None,
    records: list[SlideRecord] | None = None,
) -> PretrainResult:
    """Pretrain ``config.model.features``' ResNet with ``config.pretrain`` on Ray Train and log it to MLflow.

    Args:
        config: the training config (its ``data.stores``, ``model``, ``pretrain``, ``tracking``, workers and
            placement settings are used).
        address: Ray cluster to join (default: in-process Ray, or ``$RAY_ADDRESS``).
        workers: overrides ``config.workers``.
        workdir: overrides ``config.workdir``.
        records: the slides to pretrain on (``foveate train`` passes its training split for
            ``model.experimental.gate_encoder: pretrain``); default every complete store under ``data.stores``.

    Returns:
        :class:`PretrainResult` (the encoder's URI ``runs:/<run_id>/encoder`` and its state dict).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    from pipeline.encoder_init import log_encoder
    from pipeline.runtime import init_ray
    from pipeline.tracking import (
        client_for,
        get_or_create_experiment,
        log_metrics,
        log_params,
        resolve_tracking_uri,
        start_run,
    )

    config = _resolve(config, workers=workers, workdir=workdir)
    f = config.model.features
    if f.kind != "resnet":
        raise ConfigError(f"foveate pretrain trains the ResNet (model.features.kind: resnet), got kind {f.kind!r}")
    if f.init is not None or f.freeze:
        log.info("model.features.init / freeze are for training: pretraining starts from a fresh ResNet")
    if records is None:
        records = _stores(config.data.stores)
    elif not records:
        raise ValueError("records: no slide to pretrain on")
    config = dataclasses.replace(config, model=with_training_mpp(config.model, _check_grids(config.model, records)))
    pc = config.pretrain
    log.info(
        "%d slides, %s, %d epochs, %d patches per slide", len(records), pc.objective, pc.epochs, pc.patches_per_slide
    )
    run_dir = _run_dir(config, False, stage="pretrain")
    if config.tracking.run_name is None:
        config = dataclasses.replace(
            config, tracking=dataclasses.replace(config.tracking, run_name=storage.basename(run_dir))
        )
    uri = resolve_tracking_uri(default_dir=config.workdir)
    client = client_for(uri)
    experiment_id = get_or_create_experiment(client, config.tracking.experiment, uri)
    run_id = start_run(
        client,
        experiment_id,
        run_name=config.tracking.run_name,
        tags={"foveate.stage": "pretrain", "foveate.run_dir": str(run_dir)},
    )
    log_params(client, run_id, to_dict(config))
    log.info("MLflow run %s in experiment %r at %s", run_id, config.tracking.experiment, uri)

    started = init_ray(address, num_cpus=max(2, config.workers * config.cpus_per_worker))
    try:
        loop_config = {
            "config": to_dict(config),
            "slides": [list(dataclasses.astuple(r)) for r in records],
            "tracking_uri": uri,
            "run_id": run_id,
        }
        trainer = torch_trainer(pretrain_loop_per_worker, loop_config, config, run_dir, use_gpu=resolve_use_gpu(config))
        steps = math.ceil(math.ceil(len(records) / config.workers) * pc.patches_per_slide / pc.batch_size)
        with _TrainProgress(uri, run_id, steps, pc.epochs, desc="pretrain"):
            result = trainer.fit()
        if result.checkpoint is None:
            raise RuntimeError("pretraining finished without a checkpoint")
        with result.checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "encoder.pt", map_location="cpu", weights_only=True)
        metrics = {k: float(v) for k, v in (result.metrics or {}).items()}
        encoder_uri = log_encoder(
            client,
            run_id,
            state,
            dataclasses.replace(f, init=None, freeze=False),
            metadata={"run_id": run_id, "objective": pc.objective, "epochs": pc.epochs},
            registered_model=pc.registered_model,
        )
        log_metrics(client, run_id, {"encoder_params": sum(v.numel() for v in state.values())}, step=pc.epochs)
        client.set_terminated(run_id, status="FINISHED")
    except BaseException:
        try:
            client.set_terminated(run_id, status="FAILED")
        except Exception:  # pragma: no cover - tracking store gone
            pass
        raise
    finally:
        if started:
            import ray

            ray.shutdown()
    return PretrainResult(
        run_id=run_id,
        experiment_id=experiment_id,
        experiment=config.tracking.experiment,
        tracking_uri=uri,
        encoder_uri=encoder_uri,
        run_dir=str(run_dir),
        metrics=metrics,
        config=config,
        encoder_state=state,
    )


def pretrain_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs inside each Ray Train worker: a :class:`workers.pretrain.Pretrainer` on this worker's shard of
    ``loop_config["slides"]`` per epoch (resumed from Ray Train's latest checkpoint after a restart); rank 0 logs
    to MLflow and writes the checkpoint (``encoder.pt``, ``pretrain_state.pt``)."""
    import ray.train

    from pipeline.tracking import client_for, log_metrics, logged_steps
    from pipeline.train_loop import worker_context
    from workers.pretrain import Pretrainer

    cfg: TrainConfig = from_dict(TrainConfig, loop_config["config"])
    rank, world, device, collective = worker_context(cfg)
    slides = [SlideRecord(*r) for r in loop_config["slides"]]
    run_id = loop_config["run_id"]
    client = client_for(loop_config["tracking_uri"]) if rank == 0 else None
    logged = logged_steps(client, run_id) if rank == 0 else {}  # a restarted worker logs each step once
    pre = Pretrainer(
        cfg.model,
        cfg.pretrain,
        slides_per_epoch=math.ceil(len(slides) / world),
        device=device,
        collective=collective,
        on_step=(lambda m, step: log_metrics(client, run_id, m, step=step, skip=logged)) if rank == 0 else None,
        log_every=cfg.tracking.log_every,
    )
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            pre.load_state_dict(torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True))
    while pre.epoch < cfg.pretrain.epochs:
        metrics = pre.run_epoch(shard(slides, rank, world, epoch=pre.epoch, seed=cfg.pretrain.seed))
        if rank == 0:
            log_metrics(client, run_id, metrics, step=pre.epoch, skip=logged)
            log.info("pretrain epoch %d: %s", pre.epoch, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        with tempfile.TemporaryDirectory(prefix="foveate-pretrain-") as tmp:
            checkpoint = None
            if rank == 0:
                torch.save(pre.encoder_state(), Path(tmp) / "encoder.pt")
                torch.save(pre.state_dict(), Path(tmp) / STATE_FILE)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({k: float(v) for k, v in metrics.items()}, checkpoint=checkpoint)


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "pretrain.epochs=5 --set pretrain.batch_size=128")
    parser.add_argument("--objective", choices=("simclr", "byol"), default=None, help="config key pretrain.objective")
    parser.add_argument("--epochs", type=int, default=None, help="config key pretrain.epochs")
    parser.add_argument("--workers", type=int, default=None, help="Ray Train workers (config key workers)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: auto, ray://HOST:10001 or HOST:PORT (default: in-process Ray)",
    )
    parser.add_argument("--workdir", default=None, help="run dirs and the default sqlite tracking store")


def run(args: argparse.Namespace) -> int:
    flags = {"pretrain.objective": "objective", "pretrain.epochs": "epochs", "workers": "workers", "workdir": "workdir"}
    config = config_from_cli(TrainConfig, args, flags)
    result = pretrain(config, address=args.address)
    print(result.summary(), file=sys.stdout, flush=True)
    return 0
