"""``foveate train``: train scorer + selection + feature network + aggregator end to end on Ray Train.

Driver (:func:`train`): resolves the config, builds the slide table and its train/validation split
(:mod:`pipeline.data`), opens (or, with ``resume``, reopens) one MLflow run with the full resolved config as
params, starts Ray (in-process by default; ``address`` joins a cluster, and under ``ray job submit``
``ray.init()`` finds the cluster by itself), and runs a :class:`ray.train.torch.TorchTrainer` with
``workers`` workers (gloo on CPU, nccl when the cluster has GPUs). After training it logs the model
(:func:`pipeline.model_io.log_model`) and, for a few validation slides, a heatmap of the scorer over the
thumbnail and a gallery of the chosen patches.

Workers (:func:`train_loop_per_worker`): each reads its shard of the slides from the stores (a path every
worker can see), one slide per forward (B=1) with gradient accumulation over ``optim.accumulate`` slides,
gradients averaged across workers with an explicit all-reduce (the model's stages are called directly by
``workers.patches.forward_slide``, so DDP's forward hooks do not apply), gradient clipping, AdamW with
linear warm-up then a cosine schedule, and the perturbation scale sigma of the selection decaying linearly
from ``schedule.sigma_start`` to ``schedule.sigma_end`` (0: Cordonnier et al. 2021) over all optimizer
steps. The attention-sampling entropy regulariser (Katharopoulos & Fleuret 2019) enters the loss as
``- model.entropy_weight * H(attention)`` (returned by the model in ``ModelOutput.aux_losses``). Rank 0 logs metrics per step and per epoch to MLflow and every
epoch ends in a checkpoint through ``ray.train.report``; ``resume`` restarts from the latest one with the
same MLflow run.

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
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from operators.model import ModelConfig
from pipeline.config import ConfigError, from_dict, load_config, to_dict
from pipeline.data import DataConfig, SlideRecord, build_slide_table, shard, split_train_val

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
    "train_loop_per_worker",
    "plot_heatmap",
    "plot_gallery",
    "add_arguments",
    "run",
]

log = logging.getLogger(__name__)

STATE_FILE = "train_state.json"
WORKER_STATE = "train_state.pt"


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and loss.

    Attributes:
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        epochs: passes over the training slides.
        grad_clip: max global gradient norm (0 = no clipping).
        accumulate: slides per optimizer step on each worker (one slide per forward, B=1).
        warmup: linear warm-up optimizer steps before the cosine decay.
        min_lr_ratio: the cosine schedule ends at ``lr * min_lr_ratio``.

    The attention-sampling entropy regulariser's weight is ``model.entropy_weight``: the model returns the
    term (``-entropy_weight * H``) in ``ModelOutput.aux_losses`` and the trainer adds every aux loss as is.
    """

    lr: float = 1e-3
    weight_decay: float = 1e-4
    epochs: int = 10
    grad_clip: float = 1.0
    accumulate: int = 1
    warmup: int = 0
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class ScheduleConfig:
    """Perturbation scale of the selection operator: linear from ``sigma_start`` to ``sigma_end`` over training."""

    sigma_start: float = 0.05
    sigma_end: float = 0.0


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow experiment/run names and what to log.

    Attributes:
        experiment: MLflow experiment name.
        run_name: run name (and run directory name); default ``<experiment>-<UTC timestamp>``.
        artifact_slides: validation slides that get a heatmap and a patch gallery.
        log_every: log step metrics every this many optimizer steps.
    """

    experiment: str = "foveate"
    run_name: str | None = None
    artifact_slides: int = 2
    log_every: int = 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``foveate train`` needs (YAML sections = fields; unknown keys are errors).

    Attributes:
        data: slides, labels, split.
        model: the model (``operators.model.ModelConfig``; its number of classes is set from the data).
        optim: optimiser, schedule, loss weights.
        schedule: selection perturbation schedule.
        tracking: MLflow names.
        workers: Ray Train workers.
        use_gpu: None = use GPUs when the cluster has them.
        threads: torch threads per worker (0 = one per CPU Ray gives the worker).
        cpus_per_worker: CPUs each worker reserves.
        seed: model initialisation and selection noise.
        workdir: run directories and (without ``MLFLOW_TRACKING_URI``) the sqlite tracking store.
        max_failures: worker-group restarts Ray Train makes from the latest checkpoint after a crash.
        fail_after_epoch: testing only: every worker raises right after checkpointing this epoch (1-based).
    """

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    workers: int = 1
    use_gpu: bool | None = None
    threads: int = 0
    cpus_per_worker: int = 1
    seed: int = 0
    workdir: str = "runs"
    max_failures: int = 0
    fail_after_epoch: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("workers", self.workers, self.workers >= 1, ">= 1"),
            ("threads", self.threads, self.threads >= 0, ">= 0"),
            ("cpus_per_worker", self.cpus_per_worker, self.cpus_per_worker >= 1, ">= 1"),
            ("max_failures", self.max_failures, self.max_failures >= -1, ">= -1 (-1 = unlimited)"),
            ("optim.epochs", self.optim.epochs, self.optim.epochs >= 1, ">= 1"),
            ("optim.accumulate", self.optim.accumulate, self.optim.accumulate >= 1, ">= 1"),
            ("optim.lr", self.optim.lr, self.optim.lr > 0, "> 0"),
            ("optim.grad_clip", self.optim.grad_clip, self.optim.grad_clip >= 0, ">= 0 (0 = off)"),
            ("optim.warmup", self.optim.warmup, self.optim.warmup >= 0, ">= 0"),
            ("optim.min_lr_ratio", self.optim.min_lr_ratio, 0 <= self.optim.min_lr_ratio <= 1, "in [0, 1]"),
            ("schedule.sigma_start", self.schedule.sigma_start, self.schedule.sigma_start >= 0, ">= 0"),
            ("schedule.sigma_end", self.schedule.sigma_end, self.schedule.sigma_end >= 0, ">= 0"),
            ("data.val_fraction", self.data.val_fraction, 0 <= self.data.val_fraction < 1, "in [0, 1)"),
            ("tracking.artifact_slides", self.tracking.artifact_slides, self.tracking.artifact_slides >= 0, ">= 0"),
            ("tracking.log_every", self.tracking.log_every, self.tracking.log_every >= 1, ">= 1"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{name}: got {value!r}, must be {allowed}")


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
        shown = {k: v for k, v in self.metrics.items() if k.startswith(("val_", "epoch_train_")) or k == "train_seconds"}
        if shown:
            lines.append("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- schedules and metrics
def sigma_at(step: int, total_steps: int, start: float, end: float) -> float:
    """Linear decay of the perturbation scale: ``start`` at step 0, ``end`` at the last step."""
    if total_steps <= 1:
        return float(start)
    t = min(max(step, 0), total_steps - 1) / (total_steps - 1)
    return float(start + (end - start) * t)


def lr_factor(step: int, total_steps: int, warmup: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR: linear warm-up over ``warmup`` steps, then cosine to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    t = min(max(step - warmup, 0), span) / span
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def roc_auc(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Binary ROC AUC (Mann–Whitney U with mid-ranks for ties); NaN if only one class is present."""
    y_true = np.asarray(y_true).astype(bool)
    y_score = np.asarray(y_score, dtype=np.float64)
    n_pos, n_neg = int(y_true.sum()), int((~y_true).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(y_score, kind="mergesort")
    ranks = np.empty(len(y_score), dtype=np.float64)
    sorted_scores = y_score[order]
    i = 0
    while i < len(sorted_scores):
        j = i
        while j + 1 < len(sorted_scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1.0
        i = j + 1
    return float((ranks[y_true].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def classification_metrics(targets: list[int] | np.ndarray, probs: np.ndarray, prefix: str = "") -> dict[str, float]:
    """Accuracy and AUC (binary: ROC AUC of class 1; multi-class: macro one-vs-rest over the classes present
    with both positives and negatives) from class probabilities ``probs`` (n, C)."""
    targets = np.asarray(targets, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64).reshape(len(targets), -1)
    if len(targets) == 0:
        return {}
    out = {f"{prefix}accuracy": float((probs.argmax(1) == targets).mean())}
    if probs.shape[1] == 2:
        out[f"{prefix}auc"] = roc_auc(targets == 1, probs[:, 1])
    else:
        aucs = [roc_auc(targets == c, probs[:, c]) for c in range(probs.shape[1])]
        aucs = [a for a in aucs if not math.isnan(a)]
        out[f"{prefix}auc"] = float(np.mean(aucs)) if aucs else float("nan")
    return out


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# ---------------------------------------------------------------------------------------------- model glue
def _forward(model, store, *, training: bool, sigma: float, generator, target: int | None = None):
    from workers.patches import forward_slide

    return forward_slide(model, store, training=training, sigma=sigma, generator=generator, target=target)


def _slide_loss(out, target: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy plus the model's auxiliary loss terms (``out.aux_losses``, added as they are) of one
    slide's forward; returns (loss, {"ce": ..., aux name: ...} as floats)."""
    logits = out.logits.reshape(1, -1)
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([target], device=logits.device))
    loss = ce
    parts = {"ce": float(ce.detach())}
    for name, value in (out.aux_losses or {}).items():
        v = value.sum()
        parts[name] = float(v.detach())
        loss = loss + v
    return loss, parts


def _num_patches(out) -> int:
    """Full-resolution patches this forward read (distinct cells; K for hard selection)."""
    return int(out.info.get("cells_read", out.coords_l0.shape[0]))


# ---------------------------------------------------------------------------------------------- worker loop
def _records(rows: list[list[Any]]) -> list[SlideRecord]:
    return [SlideRecord(*r) for r in rows]


def _allreduce_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average gradients over workers in one flat all-reduce (missing grads count as zeros)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def _evaluate(model, records: list[SlideRecord], device, stores: dict) -> tuple[list[int], list[list[float]], float, int]:
    """(targets, probabilities, summed loss, patches) of ``records`` with hard selection."""
    from workers.store import SlideStore

    model.eval()
    targets, probs, loss_sum, patches = [], [], 0.0, 0
    with torch.no_grad():
        for rec in records:
            store = stores.get(rec.store) or stores.setdefault(rec.store, SlideStore(rec.store))
            out = _forward(model, store, training=False, sigma=0.0, generator=None)
            logits = out.logits.reshape(1, -1).float()
            loss_sum += float(torch.nn.functional.cross_entropy(logits, torch.tensor([rec.target], device=logits.device)))
            probs.append(torch.softmax(logits, -1)[0].cpu().tolist())
            targets.append(rec.target)
            patches += _num_patches(out)
    return targets, probs, loss_sum, patches


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """The per-worker training loop (runs inside each Ray Train worker)."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from pipeline.model_io import checkpoint_dict
    from pipeline.tracking import client_for, log_metrics
    from workers.store import SlideStore

    cfg: TrainConfig = from_dict(TrainConfig, loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.threads or cfg.cpus_per_worker)
    device = ray.train.torch.get_device() if cfg.use_gpu is not False else torch.device("cpu")
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    train_records = _records(loop_config["train"])
    val_records = _records(loop_config["val"])
    class_names = list(loop_config["class_names"])

    from operators.model import FoveateModel

    torch.manual_seed(cfg.seed)
    model = FoveateModel(cfg.model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if distributed:  # identical start on every worker
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    per_worker = math.ceil(len(train_records) / world)
    steps_per_epoch = math.ceil(per_worker / cfg.optim.accumulate)
    total_steps = steps_per_epoch * cfg.optim.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg.optim.warmup, cfg.optim.min_lr_ratio))
    generator = torch.Generator(device=device)  # selection noise is drawn on the model's device
    generator.manual_seed(cfg.seed * 1000 + rank)

    start_epoch, global_step, train_seconds = 0, 0, 0.0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / WORKER_STATE, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, global_step = int(state["epoch"]), int(state["global_step"])
        train_seconds = float(state.get("train_seconds", 0.0))
        gen_states = state.get("generators") or []
        if rank < len(gen_states):
            generator.set_state(gen_states[rank])
        log.info("rank %d: resumed from epoch %d, step %d", rank, start_epoch, global_step)

    client = client_for(loop_config["tracking_uri"]) if rank == 0 else None
    run_id = loop_config["run_id"]
    stores: dict[str, SlideStore] = {}

    def store_of(rec: SlideRecord) -> SlideStore:
        if rec.store not in stores:
            stores[rec.store] = SlideStore(rec.store)
        return stores[rec.store]

    for epoch in range(start_epoch, cfg.optim.epochs):
        model.train()
        epoch_t0 = time.perf_counter()
        slides = shard(train_records, rank, world, epoch=epoch, seed=cfg.data.seed)
        ep_targets, ep_probs, ep_loss, ep_n, ep_patches, ep_step_time = [], [], 0.0, 0, 0, 0.0
        for step_in_epoch in range(steps_per_epoch):
            batch = slides[step_in_epoch * cfg.optim.accumulate:(step_in_epoch + 1) * cfg.optim.accumulate]
            t0 = time.perf_counter()
            sigma = sigma_at(global_step, total_steps, cfg.schedule.sigma_start, cfg.schedule.sigma_end)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, correct, patches = 0.0, 0, 0
            aux_sums: dict[str, float] = {}
            for rec in batch:
                out = _forward(model, store_of(rec), training=True, sigma=sigma, generator=generator, target=rec.target)
                loss, parts = _slide_loss(out, rec.target)
                (loss / len(batch)).backward()
                loss_sum += float(loss.detach())
                for k, v in parts.items():
                    aux_sums[k] = aux_sums.get(k, 0.0) + v
                prob = torch.softmax(out.logits.detach().reshape(1, -1).float(), -1)[0].cpu()
                correct += int(int(prob.argmax()) == rec.target)
                ep_targets.append(rec.target)
                ep_probs.append(prob.tolist())
                patches += _num_patches(out)
            if distributed:
                _allreduce_grads(params, world)
            grad_norm = float("nan")
            if cfg.optim.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            global_step += 1
            dt = time.perf_counter() - t0
            stats = torch.tensor([loss_sum, len(batch), correct, patches, dt], dtype=torch.float64,
                                 device=device if distributed else "cpu")  # nccl reduces CUDA tensors only
            if distributed:
                summed = stats.clone()
                dist.all_reduce(summed)
                longest = stats[4:5].clone()
                dist.all_reduce(longest, op=dist.ReduceOp.MAX)
                stats = torch.cat([summed[:4], longest])
            s_loss, s_n, s_correct, s_patches, s_dt = stats.cpu().tolist()
            ep_loss += s_loss
            ep_n += int(s_n)
            ep_patches += int(s_patches)
            ep_step_time += s_dt
            if rank == 0 and (global_step % cfg.tracking.log_every == 0 or step_in_epoch == steps_per_epoch - 1):
                step_metrics = {
                    "loss": s_loss / max(s_n, 1),
                    "accuracy": s_correct / max(s_n, 1),
                    "sigma": sigma,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "seconds_per_step": s_dt,
                    "patches_per_second": s_patches / max(s_dt, 1e-9),
                    "peak_memory_mb": _peak_memory_mb(device),
                }
                step_metrics.update({f"loss_{k}": v / max(len(batch), 1) for k, v in aux_sums.items()})
                log_metrics(client, run_id, step_metrics, step=global_step)
                log.info("epoch %d step %d/%d loss %.4f sigma %.4f %.2fs/step", epoch + 1, step_in_epoch + 1,
                         steps_per_epoch, step_metrics["loss"], sigma, s_dt)
        train_seconds += time.perf_counter() - epoch_t0

        # ---- epoch metrics: gather train predictions and evaluate the validation shard
        v_targets, v_probs, v_loss, v_patches = _evaluate(model, shard(val_records, rank, world), device, stores)
        local = {"train": (ep_targets, ep_probs), "val": (v_targets, v_probs, v_loss, v_patches)}
        gathered = [None] * world
        if distributed:
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        metrics: dict[str, float] = {"epoch": epoch + 1, "global_step": global_step}
        if rank == 0:
            tt = [t for g in gathered for t in g["train"][0]]
            tp = [p for g in gathered for p in g["train"][1]]
            metrics["epoch_train_loss"] = ep_loss / max(ep_n, 1)
            metrics.update(classification_metrics(tt, np.array(tp), prefix="epoch_train_"))
            vt = [t for g in gathered for t in g["val"][0]]
            vp = [p for g in gathered for p in g["val"][1]]
            if vt:
                metrics["val_loss"] = sum(g["val"][2] for g in gathered) / len(vt)
                metrics.update(classification_metrics(vt, np.array(vp), prefix="val_"))
            metrics["epoch_seconds"] = time.perf_counter() - epoch_t0
            metrics["epoch_patches_per_second"] = ep_patches / max(ep_step_time, 1e-9)
            metrics["epoch_seconds_per_step"] = ep_step_time / max(steps_per_epoch, 1)
            metrics["epoch_peak_memory_mb"] = _peak_memory_mb(device)
            metrics["train_seconds"] = train_seconds
            log_metrics(client, run_id, metrics, step=epoch + 1)
            log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

        # ---- checkpoint (rank 0 writes, every rank reports)
        gen_states = [None] * world
        if distributed:
            dist.all_gather_object(gen_states, generator.get_state())
        else:
            gen_states = [generator.get_state()]
        with tempfile.TemporaryDirectory(prefix="foveate-ckpt-") as tmp:
            checkpoint = None
            if rank == 0:
                torch.save({
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch + 1,
                    "global_step": global_step,
                    "train_seconds": train_seconds,
                    "generators": gen_states,
                }, Path(tmp) / WORKER_STATE)
                torch.save(checkpoint_dict(model, cfg.model, class_names, train_config=to_dict(cfg),
                                           metadata={"run_id": run_id, "epoch": epoch + 1, "global_step": global_step}),
                           Path(tmp) / "model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({k: float(v) for k, v in metrics.items()}, checkpoint=checkpoint)
        if cfg.fail_after_epoch is not None and epoch + 1 == cfg.fail_after_epoch:
            raise RuntimeError(f"fail_after_epoch={cfg.fail_after_epoch}: simulated crash after checkpointing epoch {epoch + 1}")


# ---------------------------------------------------------------------------------------------- driver
def _init_ray(address: str | None, cfg: TrainConfig) -> bool:
    """Start or join Ray; returns True when this call started it (so the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=max(2, cfg.workers * cfg.cpus_per_worker), include_dashboard=False,
                 log_to_driver=True, configure_logging=False)
    return True


def _run_dir(cfg: TrainConfig, resume: bool) -> Path:
    runs = Path(cfg.workdir).expanduser().resolve() / "train"
    if cfg.tracking.run_name:
        run_dir = runs / cfg.tracking.run_name
        if resume and not (run_dir / STATE_FILE).is_file():
            raise FileNotFoundError(f"--resume: no run to resume at {run_dir} (no {STATE_FILE})")
        if not resume and run_dir.exists():
            raise ValueError(f"run directory {run_dir} exists: use --resume to continue it, "
                             f"or another tracking.run_name")
        return run_dir
    if resume:
        candidates = sorted((p for p in runs.glob(f"*/{STATE_FILE}")), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"--resume: no run to resume under {runs}")
        return candidates[-1].parent
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = runs / f"{cfg.tracking.experiment}-{stamp}"
    i = 1
    while run_dir.exists():
        i += 1
        run_dir = runs / f"{cfg.tracking.experiment}-{stamp}-{i}"
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
    wd = Path(workdir if workdir is not None else config.workdir).expanduser().resolve()
    stores = Path(config.data.stores).expanduser()
    labels = config.data.labels
    if labels != "manifest":
        labels = str(Path(labels).expanduser().resolve())
    data = dataclasses.replace(config.data, stores=str(stores.resolve()), labels=labels)
    return dataclasses.replace(config, workdir=str(wd), data=data)


def train(config: TrainConfig, *, resume: bool = False, address: str | None = None, workers: int | None = None,
          workdir: str | Path | None = None) -> TrainResult:
    """Train a model on Ray Train and track it in MLflow.

    Args:
        config: the training config (see :class:`TrainConfig`).
        resume: continue the run named by ``config.tracking.run_name`` (default: the latest run under
            ``<workdir>/train``) from its latest checkpoint, in the same MLflow run.
        address: Ray cluster to join (``auto``, ``ray://host:10001``, ``host:port``); default: in-process
            Ray, or the cluster in ``$RAY_ADDRESS`` (as under ``ray job submit``).
        workers: overrides ``config.workers``.
        workdir: overrides ``config.workdir``.

    Returns:
        :class:`TrainResult` with the MLflow run, the logged model's URI and the trained model.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    from pipeline.model_io import log_model, model_from_checkpoint, with_num_classes
    from pipeline.tracking import client_for, get_or_create_experiment, log_params, tracking_uri

    config = _resolve(config, workers=workers, workdir=workdir)
    table = build_slide_table(config.data)
    config = dataclasses.replace(config, model=with_num_classes(config.model, table.num_classes),
                                 data=dataclasses.replace(config.data, classes=tuple(table.class_names)))
    train_recs, val_recs = split_train_val(table.records, config.data.val_fraction, config.data.seed)
    if not train_recs:
        raise ValueError(f"no training slides left after the validation split ({len(table.records)} slide(s))")
    log.info("%d slides (%d train, %d val), classes %s", len(table.records), len(train_recs), len(val_recs),
             list(table.class_names))

    run_dir = _run_dir(config, resume)
    if config.tracking.run_name is None:
        config = dataclasses.replace(config, tracking=dataclasses.replace(config.tracking, run_name=run_dir.name))
    uri = tracking_uri(config.workdir)
    client = client_for(uri)
    resolved = to_dict(config)
    if resume:
        state = json.loads((run_dir / STATE_FILE).read_text())
        diff = [k for k in _config_diff(state["config"], resolved) if k not in ("workers",)]
        if diff:
            raise ValueError(f"--resume: the config differs from the run's in {diff}; resume with the same config")
        run_id, experiment_id = state["run_id"], state["experiment_id"]
        uri = state.get("tracking_uri", uri)
        client = client_for(uri)
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "foveate.resumed", str(int(client.get_run(run_id).data.tags.get("foveate.resumed", "0")) + 1))
    else:
        experiment_id = get_or_create_experiment(client, config.tracking.experiment, uri)
        run = client.create_run(experiment_id, run_name=config.tracking.run_name,
                                tags={"foveate.stage": "train", "foveate.run_dir": str(run_dir)})
        run_id = run.info.run_id
        log_params(client, run_id, resolved)
        client.log_dict(run_id, {"class_names": list(table.class_names),
                                 "train": [r.slide_id for r in train_recs], "val": [r.slide_id for r in val_recs]},
                        "split.json")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / STATE_FILE).write_text(json.dumps({"run_id": run_id, "experiment_id": experiment_id,
                                                      "tracking_uri": uri, "config": resolved}, indent=2))
    log.info("MLflow run %s in experiment %r at %s", run_id, config.tracking.experiment, uri)

    started = _init_ray(address, config)
    try:
        result = _fit(config, run_dir, train_recs, val_recs, table.class_names, uri, run_id)
        ckpt = _load_ckpt(result)
        model, model_cfg, class_names = model_from_checkpoint(ckpt)
        model_uri = log_model(model, model_cfg, class_names, run_id=run_id, tracking_uri=uri,
                              train_config=resolved, metadata={"run_id": run_id})
        _log_val_artifacts(model, model_cfg, val_recs[:config.tracking.artifact_slides] or train_recs[:config.tracking.artifact_slides],
                           class_names, client, run_id)
        metrics = {k: float(v) for k, v in (result.metrics or {}).items()}
        client.set_terminated(run_id, status="FINISHED")
    except BaseException:
        try:
            client.set_terminated(run_id, status="FAILED")
        except Exception:  # pragma: no cover - tracking store gone
            pass
        log.error("training failed; continue it with `foveate train --config ... --set tracking.run_name=%s --resume` "
                  "(run dir %s)", config.tracking.run_name, run_dir)
        raise
    finally:
        if started:
            import ray

            ray.shutdown()
    out = TrainResult(run_id=run_id, experiment_id=experiment_id, experiment=config.tracking.experiment,
                      tracking_uri=uri, model_uri=model_uri, run_dir=str(run_dir), class_names=list(class_names),
                      metrics=metrics, config=config, model=model)
    return out


def _load_ckpt(result) -> dict:
    if result.checkpoint is None:
        raise RuntimeError("training finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        return torch.load(Path(d) / "model.pt", map_location="cpu", weights_only=True)


def _fit(cfg: TrainConfig, run_dir: Path, train_recs, val_recs, class_names, uri: str, run_id: str):
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = cfg.use_gpu
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    loop_config = {
        "config": to_dict(cfg),
        "train": [list(dataclasses.astuple(r)) for r in train_recs],
        "val": [list(dataclasses.astuple(r)) for r in val_recs],
        "class_names": list(class_names),
        "tracking_uri": uri,
        "run_id": run_id,
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=bool(use_gpu),
                                     resources_per_worker={"CPU": cfg.cpus_per_worker}),
        run_config=RunConfig(name="ray", storage_path=str(run_dir),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    log.info("Ray Train: %d worker(s), %s, storage %s", cfg.workers, "GPU/nccl" if use_gpu else "CPU/gloo", run_dir / "ray")
    return trainer.fit()


# ---------------------------------------------------------------------------------------------- artifacts
def _log_val_artifacts(model, model_cfg, records: list[SlideRecord], class_names, client, run_id: str) -> None:
    """Heatmap of the scorer over the thumbnail and a gallery of the chosen patches, per slide."""
    import matplotlib

    matplotlib.use("Agg")
    from workers.store import SlideStore

    with tempfile.TemporaryDirectory(prefix="foveate-art-") as tmp:
        for rec in records:
            try:
                store = SlideStore(rec.store)
                with torch.no_grad():
                    out = _forward(model, store, training=False, sigma=0.0, generator=None)
                prob = torch.softmax(out.logits.reshape(1, -1).float(), -1)[0]
                title = (f"{rec.slide_id}: label {rec.label}, predicted {class_names[int(prob.argmax())]} "
                         f"(p={float(prob.max()):.2f})")
                heat = Path(tmp) / f"{rec.slide_id}_heatmap.png"
                gallery = Path(tmp) / f"{rec.slide_id}_patches.png"
                plot_heatmap(store, out, model_cfg, heat, title=title)
                plot_gallery(store, out, model_cfg, gallery, title=title)
                client.log_artifact(run_id, str(heat), "heatmaps")
                client.log_artifact(run_id, str(gallery), "patches")
            except Exception as exc:  # an artifact must not lose a finished training
                log.warning("could not draw artifacts for %s: %s", rec.slide_id, exc)


def _score_grid(store, out, model_cfg) -> np.ndarray:
    """The cell scores as a ``(Gh, Gw)`` grid, NaN where a cell was not a candidate."""
    from workers.patches import PatchGrid

    grid = PatchGrid.from_store(store, model_cfg.patch_size, model_cfg.stride_l0)
    s = out.scores.detach().float().cpu().numpy().reshape(grid.shape).astype(np.float64)
    s[~np.isfinite(s)] = np.nan
    return s


def plot_heatmap(store, out, model_cfg, path: Path, *, title: str = "") -> Path:
    """Scores over the slide's thumbnail (lowest store level) with the chosen patches outlined."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    thumb = store.read_level(store.level_count - 1)
    W, H = store.dimensions
    fig, ax = plt.subplots(figsize=(6, 6 * H / max(W, 1) + 0.6))
    ax.imshow(thumb, extent=(0, W, H, 0))
    grid = _score_grid(store, out, model_cfg)
    gh, gw = grid.shape
    stride, p = model_cfg.stride_l0, model_cfg.patch_size
    # cell (r, c) is drawn over [c*stride, c*stride + stride) (its own patch where stride == patch_size)
    im = ax.imshow(grid, extent=(0, gw * stride, gh * stride, 0), cmap="inferno", alpha=0.5, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, label="score")
    for x, y in out.coords_l0.detach().cpu().numpy().reshape(-1, 2):
        ax.add_patch(Rectangle((x, y), p, p, fill=False, edgecolor="cyan", linewidth=1.2))
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    ax.set_title(title, fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_gallery(store, out, model_cfg, path: Path, *, title: str = "") -> Path:
    """The chosen patches read at full resolution, with their scores."""
    import matplotlib.pyplot as plt

    p = model_cfg.patch_size
    coords = out.coords_l0.detach().cpu().numpy().reshape(-1, 2).astype(int)
    ps = out.patch_scores.detach().float().cpu().numpy().reshape(-1)
    n = max(len(coords), 1)
    cols = min(n, 8)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows + 0.4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < len(coords):
            x, y = coords[i]
            ax.imshow(store.read_region((int(x), int(y)), 0, (p, p)))
            label = f"({x},{y})" + (f"\n{ps[i]:.3f}" if i < len(ps) else "")
            ax.set_title(label, fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (sections data/model/optim/schedule/tracking; see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.epochs=2 --set model.k=8 (repeatable)")
    parser.add_argument("--workers", type=int, default=None, help="Ray Train workers (overrides config.workers)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run tracking.run_name (default: the latest) from its last checkpoint")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join: auto, ray://HOST:10001 or HOST:PORT (default: in-process Ray)")
    parser.add_argument("--workdir", default=None, help="run dirs and the default sqlite tracking store (config.workdir)")


def run(args: argparse.Namespace) -> int:
    config = load_config(TrainConfig, args.config, args.overrides)
    result = train(config, resume=args.resume, address=args.address, workers=args.workers, workdir=args.workdir)
    print(result.summary(), file=sys.stdout, flush=True)
    return 0
