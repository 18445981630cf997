"""The Ray Train worker function: a thin wrapper of :class:`workers.trainer.Trainer`.

Per worker: read the rank and world size from Ray Train, build a :class:`~workers.trainer.Trainer` with a
``torch.distributed`` collective (gradients all-reduced, step statistics summed), resume it from Ray Train's
latest checkpoint, and per epoch train on this worker's shard (``pipeline.data.shard``), evaluate its
validation shard, log metrics to MLflow from rank 0, and report a checkpoint (``train_state.pt`` = the
trainer's state, ``model.pt`` = a model checkpoint, ``operators.checkpoint``) with ``ray.train.report``.

Training ends at ``optim.epochs`` or earlier by early stopping (``early_stopping``; every rank gets the same
decision from the trainer); the last checkpoint's ``model.pt`` then holds the best epoch's weights (its metadata
names that ``epoch`` and the ``stopped_epoch``), rank 0 logs ``stopped_epoch`` and the run's tag
``foveate.stop_reason`` (``patience``, ``cap`` or ``max_epochs``), and a ``--resume`` of a finished run trains no further.
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeline.config import from_dict, to_dict
from pipeline.data import SlideRecord, shard
from pipeline.train_config import TrainConfig

__all__ = ["WORKER_STATE", "MODEL_FILE", "train_loop_per_worker", "worker_context"]

log = logging.getLogger(__name__)

WORKER_STATE = "train_state.pt"
MODEL_FILE = "model.pt"


def _records(rows: list[list[Any]]) -> list[SlideRecord]:
    return [SlideRecord(*r) for r in rows]


def worker_context(cfg: TrainConfig) -> tuple[int, int, torch.device, Any]:
    """Inside a Ray Train worker: ``(rank, world size, device, collective)`` for ``cfg`` (torch threads set to
    ``threads`` or ``cpus_per_worker``; the device Ray Train gives unless ``use_gpu`` is false; a
    ``torch.distributed`` collective when the process group is up, else a local one)."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from workers.trainer import LocalCollective, TorchDistCollective

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.threads or cfg.cpus_per_worker)
    device = ray.train.torch.get_device() if cfg.use_gpu is not False else torch.device("cpu")
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    collective = TorchDistCollective(rank, world) if distributed else LocalCollective(rank, world)
    return rank, world, device, collective


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs inside each Ray Train worker. ``loop_config``: ``config`` (the resolved :class:`TrainConfig` as a
    dict), ``train``/``val`` (slide records as rows), ``class_names``, ``tracking_uri``, ``run_id``, and
    optionally ``after_epoch`` (a callable ``f(epoch)`` run on every worker after each epoch's checkpoint:
    fault-injection tests pass one that raises) and ``features_init`` (the encoder's initial state dict when
    ``model.features.init`` is an MLflow URI, resolved by the driver) and ``feature_cache`` (the frozen-feature cache
    folder, ``pipeline.train.feature_cache_dir``)."""
    import ray
    import ray.train

    from operators.checkpoint import checkpoint_dict
    from pipeline.tracking import client_for, log_metrics, logged_steps
    from workers.trainer import Trainer

    cfg: TrainConfig = from_dict(TrainConfig, loop_config["config"])
    rank, world, device, collective = worker_context(cfg)
    # one line per worker in the job's output (placement checks: tests/test_cluster.py)
    print(f"foveate-train-worker rank {rank}/{world} node {ray.get_runtime_context().get_node_id()}", flush=True)
    train_records = _records(loop_config["train"])
    val_records = _records(loop_config["val"])
    class_names = list(loop_config["class_names"])
    run_id = loop_config["run_id"]
    after_epoch = loop_config.get("after_epoch")

    client = client_for(loop_config["tracking_uri"]) if rank == 0 else None
    # a resumed run (or a restarted worker) runs again the steps and epoch after its last checkpoint: what the run
    # already holds is not logged a second time
    logged = logged_steps(client, run_id) if rank == 0 else {}
    on_step = (
        (lambda metrics, step: log_metrics(client, run_id, metrics, step=step, skip=logged)) if rank == 0 else None
    )
    trainer = Trainer(
        cfg.model,
        cfg.optim,
        cfg.schedule,
        slides_per_epoch=math.ceil(len(train_records) / world),
        seed=cfg.seed,
        device=device,
        collective=collective,
        on_step=on_step,
        log_every=cfg.tracking.log_every,
        early_stopping=cfg.early_stopping,
        features_init=loop_config.get("features_init"),
        feature_cache=loop_config.get("feature_cache"),
        gate_encoder_init=loop_config.get("gate_encoder_init"),
    )

    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            trainer.load_state_dict(torch.load(Path(d) / WORKER_STATE, map_location="cpu", weights_only=True))
        log.info("rank %d: resumed from epoch %d, step %d", rank, trainer.epoch, trainer.global_step)

    while not trainer.finished:
        epoch = trainer.epoch
        metrics = trainer.run_epoch(
            shard(train_records, rank, world, epoch=epoch, seed=cfg.data.seed), shard(val_records, rank, world)
        )
        if rank == 0:
            log_metrics(client, run_id, metrics, step=trainer.epoch, skip=logged)
            log.info("epoch %d: %s", trainer.epoch, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if trainer.stop_reason is not None:
                client.set_tag(run_id, "foveate.stop_reason", trainer.stop_reason)
        weights_epoch = trainer.epoch  # the epoch of the weights in model.pt: the best one once training ended
        if trainer.stop_reason is not None and trainer.best_state is not None:
            weights_epoch = trainer.stopper.best_epoch

        # checkpoint: every rank gathers the generator states, rank 0 writes, every rank reports
        state = trainer.state_dict()
        with tempfile.TemporaryDirectory(prefix="foveate-ckpt-") as tmp:
            checkpoint = None
            if rank == 0:
                torch.save(state, Path(tmp) / WORKER_STATE)
                torch.save(
                    checkpoint_dict(
                        trainer.eval_model,
                        cfg.model,
                        class_names,
                        train_config=to_dict(cfg),
                        metadata={
                            "run_id": run_id,
                            "epoch": weights_epoch,
                            "global_step": weights_epoch * trainer.steps_per_epoch,
                            **({"stopped_epoch": trainer.epoch} if trainer.stop_reason is not None else {}),
                        },
                    ),
                    Path(tmp) / MODEL_FILE,
                )
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({k: float(v) for k, v in metrics.items()}, checkpoint=checkpoint)
        if after_epoch is not None:
            after_epoch(trainer.epoch)
