"""Self-supervised pretraining of the patch encoder as a plain class: :class:`Pretrainer` (no Ray, no MLflow).

One worker's share of ``foveate pretrain``: the encoder is the project's ResNet built from ``model.features`` of the
training config (so its ``state_dict`` is what ``model.features.init`` loads), wrapped in a SimCLR or BYOL objective
(:mod:`operators.ssl`). Each epoch, for every slide of the worker's shard, ``pretrain.patches_per_slide`` random
*tissue* cells of the model's grid are drawn (the grid, the tissue cells and the reader of
:func:`workers.patches.prepare_slide`, the same the training reads its patches with) and read at full resolution at
the model's input side (``model.geometry.patch_input``) by :class:`workers.patches.PatchReader`; the epoch's patches
are shuffled, cut into batches of ``pretrain.batch_size`` (the last one filled by wrapping round, so every worker
makes the same number of steps), and each batch gives two augmented views (:func:`operators.ssl.augment`) and one
optimizer step (AdamW, cosine learning rate; gradients averaged over the workers by a
:class:`workers.trainer.Collective`). No label is read. Memory: an epoch's patches are held as uint8,
``slides x patches_per_slide x 3 x s x s`` bytes.

``pipeline.pretrain`` runs one per Ray Train worker; a test or a benchmark drives one in-process::

    pre = Pretrainer(cfg.model, cfg.pretrain, slides_per_epoch=len(stores))
    while pre.epoch < cfg.pretrain.epochs:
        metrics = pre.run_epoch(stores)
    torch.save(pre.encoder_state(), "encoder.pt")    # model.features.init: encoder.pt
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from operators.errors import ConfigError
from operators.resnet import ResNet
from operators.ssl import OBJECTIVES, AugmentSpec, augment, build_objective
from workers.trainer import Collective, LocalCollective, _check, lr_factor

__all__ = ["PretrainConfig", "Pretrainer"]

log = logging.getLogger(__name__)


def _is_int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_num(v: Any, lo: float, hi: float, *, lo_open: bool) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (v > lo if lo_open else v >= lo) and v <= hi


@dataclass(frozen=True)
class PretrainConfig:
    """Self-supervised pretraining of the patch encoder (YAML section ``pretrain:``, ``foveate pretrain``)."""

    objective: Literal["simclr", "byol"] = "simclr"
    """``simclr`` (NT-Xent over the batch; Chen et al. 2020) or ``byol`` (EMA target, no negatives; Grill et al.
    2020)."""
    epochs: int = 10
    """Passes over the slides (each draws new cells)."""
    batch_size: int = 64
    """Patches per optimizer step on each worker (two views each; >= 2)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW (cosine decay to 0 over the run)."""
    temperature: float = 0.2
    """NT-Xent temperature (simclr)."""
    momentum: float = 0.99
    """EMA momentum of BYOL's target network (byol)."""
    patches_per_slide: int = 64
    """Random tissue cells read from each slide per epoch."""
    projection_dim: int = 64
    """Size of the projection (and BYOL prediction) the loss compares."""
    seed: int = 0
    """Initialisation, cell draws and augmentations."""
    registered_model: str | None = None
    """Also register the encoder under this name in the MLflow model registry (``models:/<name>/<version>``)."""

    def __post_init__(self) -> None:
        _check("pretrain.objective", self.objective, self.objective in OBJECTIVES, f"one of {list(OBJECTIVES)}")
        for name, lo in (("epochs", 1), ("batch_size", 2), ("patches_per_slide", 1), ("projection_dim", 1)):
            _check(f"pretrain.{name}", getattr(self, name), _is_int(getattr(self, name), lo), f"an int >= {lo}")
        _check("pretrain.seed", self.seed, _is_int(self.seed, 0), "an int >= 0")
        _check("pretrain.lr", self.lr, _is_num(self.lr, 0, math.inf, lo_open=True), "a finite number > 0")
        _check(
            "pretrain.temperature",
            self.temperature,
            _is_num(self.temperature, 0, math.inf, lo_open=True),
            "a number > 0",
        )
        _check("pretrain.momentum", self.momentum, _is_num(self.momentum, 0, 1, lo_open=False), "a number in [0, 1]")
        name = self.registered_model
        _check(
            "pretrain.registered_model",
            name,
            name is None or (isinstance(name, str) and bool(name.strip())),
            "None or a non-empty model name",
        )


StepCallback = Callable[[dict[str, float], int], None]


class Pretrainer:
    """Encoder, objective, optimiser and generators of one pretraining worker.

    Args:
        model_config: ``operators.model_config.ModelConfig`` (its ``features`` must be ``kind: resnet``; ``freeze``
            and ``init`` are ignored: pretraining starts from a fresh ResNet and trains it).
        cfg: :class:`PretrainConfig`.
        slides_per_epoch: slides this worker reads per epoch (its shard's length); fixes the steps per epoch.
        device: where the encoder runs (augmentations too).
        collective: how workers cooperate (default :class:`workers.trainer.LocalCollective`).
        on_step: called as ``on_step({"loss": ..., "lr": ...}, global_step)`` every ``log_every`` steps.
        augment_spec: :class:`operators.ssl.AugmentSpec` (default: its defaults).

    Raises:
        ConfigError: ``model.features.kind`` is not ``resnet``.
    """

    def __init__(
        self,
        model_config: Any,
        cfg: PretrainConfig,
        *,
        slides_per_epoch: int,
        device: str | torch.device = "cpu",
        collective: Collective | None = None,
        on_step: StepCallback | None = None,
        log_every: int = 1,
        augment_spec: AugmentSpec | None = None,
    ):
        if not isinstance(cfg, PretrainConfig):
            raise TypeError(f"cfg must be a PretrainConfig, got {type(cfg).__name__}")
        if not _is_int(slides_per_epoch, 1):
            raise ValueError(f"slides_per_epoch must be an int >= 1, got {slides_per_epoch!r}")
        features = model_config.features
        if features.kind != "resnet":
            raise ConfigError(
                f"foveate pretrain trains the ResNet (model.features.kind: resnet), got kind {features.kind!r}"
            )
        self.model_config, self.cfg = model_config, cfg
        self.collective = collective if collective is not None else LocalCollective()
        self.rank = self.collective.rank
        self.device = torch.device(device)
        self.on_step, self.log_every = on_step, max(1, int(log_every))
        self.spec = augment_spec or AugmentSpec()

        torch.manual_seed(cfg.seed)
        self.features = dataclasses.replace(features, freeze=False, init=None)
        self.encoder = ResNet(self.features.resnet())
        self.objective = build_objective(
            cfg.objective,
            self.encoder,
            int(self.features.feature_dim),
            projection_dim=cfg.projection_dim,
            temperature=cfg.temperature,
            momentum=cfg.momentum,
        ).to(self.device)
        self.collective.broadcast_module(self.objective)  # identical start on every worker
        self.params = [p for p in self.objective.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=1e-4)
        self.steps_per_epoch = max(1, math.ceil(slides_per_epoch * cfg.patches_per_slide / cfg.batch_size))
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, self.total_steps, 0))
        self.cells = torch.Generator().manual_seed(cfg.seed * 1000 + self.rank)  # cell draws, shuffles (CPU)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed * 1000 + self.rank + 1)
        self.epoch, self.global_step = 0, 0
        self._stores: dict[str, Any] = {}

    # ------------------------------------------------------------------ slides
    def _store(self, path: str):
        from workers.store import SlideStore

        if path not in self._stores:
            self._stores[path] = SlideStore(path)
        return self._stores[path]

    def read_patches(self, store_path: str) -> torch.Tensor:
        """``patches_per_slide`` random tissue cells of one slide (without replacement while there are enough; every
        cell when the slide has no tissue cell) -> uint8 ``[n, 3, s, s]`` (``s = geometry.patch_input``)."""
        from workers.patches import prepare_slide

        slide = prepare_slide(self._store(str(store_path)), self.model_config)
        cells = slide.cell_mask.flatten().nonzero().flatten()
        if cells.numel() == 0:
            log.warning("%s: no tissue cell at the model's tissue_threshold; drawing from every cell", store_path)
            cells = torch.arange(slide.grid.num_cells)
        n = self.cfg.patches_per_slide
        if cells.numel() >= n:
            pick = cells[torch.randperm(cells.numel(), generator=self.cells)[:n]]
        else:
            pick = cells[torch.randint(0, cells.numel(), (n,), generator=self.cells)]
        return slide.reader.read(pick)

    # ------------------------------------------------------------------ steps
    def step(self, patches: torch.Tensor) -> float:
        """One optimizer step on a batch of uint8 patches ``[B, 3, s, s]``: two views each, the objective's loss,
        gradients averaged over the workers. Returns the loss."""
        self.objective.train()
        x = patches.to(self.device, torch.float32).div_(255.0)
        v1 = augment(x, self.generator, self.spec)
        v2 = augment(x, self.generator, self.spec)
        loss = self.objective(v1, v2)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.collective.allreduce_grads(self.params)
        torch.nn.utils.clip_grad_norm_(self.params, 5.0)
        self.optimizer.step()
        self.scheduler.step()
        self.objective.after_step()
        self.global_step += 1
        return float(loss.detach())

    def run_epoch(self, records: Sequence[Any]) -> dict[str, float]:
        """One epoch over this worker's slides (``records``: store paths, or objects with a ``store`` attribute such as
        ``pipeline.data.SlideRecord``).

        Returns:
            ``{"epoch_loss", "epoch", "patches", "epoch_seconds"}``: the loss averaged over every worker's steps.
        """
        started = time.perf_counter()
        paths = [str(getattr(r, "store", r)) for r in records]
        if not paths:
            raise ValueError("run_epoch needs at least one slide")
        pool = torch.cat([self.read_patches(p) for p in paths])
        order = torch.randperm(pool.shape[0], generator=self.cells)
        bs = self.cfg.batch_size
        order = order[torch.arange(self.steps_per_epoch * bs) % order.numel()]  # wrap round: full batches
        total = 0.0
        for i in range(self.steps_per_epoch):
            loss = self.step(pool[order[i * bs : (i + 1) * bs]])
            total += loss
            if self.on_step is not None and self.global_step % self.log_every == 0:
                self.on_step({"loss": loss, "lr": float(self.scheduler.get_last_lr()[0])}, self.global_step)
        gathered = self.collective.all_gather((total, self.steps_per_epoch, int(pool.shape[0])))
        self.epoch += 1
        return {
            "epoch_loss": sum(g[0] for g in gathered) / max(1, sum(g[1] for g in gathered)),
            "epoch": float(self.epoch),
            "patches": float(sum(g[2] for g in gathered)),
            "epoch_seconds": time.perf_counter() - started,
        }

    def encoder_state(self) -> dict[str, torch.Tensor]:
        """The encoder's ``state_dict`` on the CPU: what ``model.features.init`` loads (the online encoder for BYOL)."""
        return {k: v.detach().cpu().clone() for k, v in self.encoder.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue: objective, optimiser, scheduler, counters and generator states."""
        return {
            "objective": self.objective.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "cells": self.cells.get_state(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.objective.load_state_dict(state["objective"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.cells.set_state(state["cells"])
        self.generator.set_state(state["generator"])
