"""The training core as a plain class: :class:`Trainer` (no Ray, no MLflow).

One slide per forward (B=1) through ``workers.slide_forward.forward_slide``; gradient accumulation over
``optim.accumulate`` slides; gradient clipping; AdamW with linear warm-up then a cosine schedule
(:func:`lr_factor`); the perturbation scale sigma of the selection decaying linearly from
``schedule.sigma_start`` to ``schedule.sigma_end`` over all optimizer steps (:func:`sigma_at`; 0 at the end:
Cordonnier et al. 2021). The per-slide loss is cross-entropy plus every entry of the model's
``ModelOutput.aux_losses`` added as is (:func:`slide_loss`; e.g. the attention-sampling entropy
regulariser ``-model.selection.attention.entropy_weight * H``).

Several workers cooperate through a :class:`Collective` (identical start, averaged gradients, summed step
statistics, gathered predictions). :class:`LocalCollective` is one process; :class:`TorchDistCollective`
uses an initialised ``torch.distributed`` process group (what Ray Train sets up; the model's stages are called
directly, so DDP's forward hooks do not apply and gradients are all-reduced explicitly).
``pipeline.train_loop.train_loop_per_worker`` wraps a :class:`Trainer` for Ray Train (rank-0 MLflow
logging, checkpoint reporting); a benchmark drives one in-process with the same numerics::

    trainer = Trainer(cfg.model, cfg.optim, cfg.schedule, slides_per_epoch=len(train), seed=cfg.seed,
                      early_stopping=cfg.early_stopping)
    while not trainer.finished:
        metrics = trainer.run_epoch(shard(train, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed), val)

Early stopping (``early_stopping``, :mod:`workers.early_stopping`): after each epoch's validation the rule gets
rank 0's value of the metric (shared with every rank, so all workers stop after the same epoch); the evaluated
weights of the best epoch are kept, and loaded back into :attr:`Trainer.eval_model` when training ends, by
patience or at the cap (``optim.epochs``), so the model checkpointed last and exported is the best epoch's.
"""

from __future__ import annotations

import copy
import logging
import math
import resource
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from operators.errors import ConfigError
from workers.early_stopping import CHANCE_ALPHA, EarlyStopping, EarlyStoppingConfig, chance_p_value
from workers.metrics import classification_metrics

__all__ = [
    "OptimConfig",
    "ScheduleConfig",
    "linear_decay",
    "earliest_stop_epoch",
    "Collective",
    "LocalCollective",
    "TorchDistCollective",
    "EpochResult",
    "EvalResult",
    "Trainer",
    "fit_gate_on_slides",
    "ema_update",
    "clip_groups",
    "clip_gradients",
    "lr_factor",
    "sigma_at",
    "slide_loss",
    "num_patches",
]

log = logging.getLogger(__name__)


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: got {value!r}, must be {allowed}")


def _check_finite(name: str, value: Any, *, positive: bool = False, note: str = "") -> None:
    """``value`` is a finite number ``> 0`` (``positive``) or ``>= 0``."""
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    _check(name, value, ok, f"a finite number {'> 0' if positive else '>= 0'}{note}")


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and loss.

    Attributes:
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        epochs: passes over the training slides.
        grad_clip: max gradient norm (0 = no clipping).
        clip: ``"global"`` (default): one norm over all parameters; ``"per_module"``: the scorer, feature
            network, aggregator and instance head are clipped each to ``grad_clip`` on their own, so a large
            scorer gradient (the perturbed top-k estimator grows as ``1 / sigma``) cannot shrink the
            classifier's update.
        accumulate: slides per optimizer step on each worker (one slide per forward, B=1).
        warmup: linear warm-up optimizer steps before the cosine decay.
        min_lr_ratio: the cosine schedule ends at ``lr * min_lr_ratio``.
        ema_epochs: evaluate, checkpoint and export an exponential moving average of the weights over about the
            last this many epochs (decay per optimizer step ``1 - 1 / (ema_epochs * steps_per_epoch)``, with
            the usual warm-up ``min(decay, (1 + t) / (10 + t))`` at step t), instead of the last weights; the
            training itself is unchanged. A model whose held-out accuracy swings from epoch to epoch (a
            learning rate that stays high to the end, ``min_lr_ratio``) ends at the average, not at the last
            swing. 0 (default): off.

    The attention-sampling entropy regulariser's weight is ``model.selection.attention.entropy_weight``: the model returns the
    term (``-entropy_weight * H``) in ``ModelOutput.aux_losses`` and the trainer adds every aux loss as is.
    """

    lr: float = 1e-3
    weight_decay: float = 1e-4
    epochs: int = 10
    grad_clip: float = 1.0
    clip: str = "global"
    accumulate: int = 1
    warmup: int = 0
    min_lr_ratio: float = 0.0
    ema_epochs: float = 0.0

    def __post_init__(self) -> None:
        _check("optim.epochs", self.epochs, self.epochs >= 1, ">= 1")
        _check("optim.accumulate", self.accumulate, self.accumulate >= 1, ">= 1")
        _check_finite("optim.lr", self.lr, positive=True)
        _check_finite("optim.weight_decay", self.weight_decay)
        _check_finite("optim.grad_clip", self.grad_clip, note=" (0 = off)")
        _check("optim.clip", self.clip, self.clip in ("global", "per_module"), "'global' or 'per_module'")
        _check("optim.warmup", self.warmup, self.warmup >= 0, ">= 0")
        _check("optim.min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        _check_finite("optim.ema_epochs", self.ema_epochs, note=" (0 = off)")


@dataclass(frozen=True)
class ScheduleConfig:
    """Perturbation scale of the selection operator: linear from ``sigma_start`` to ``sigma_end`` over training.

    ``rarity_start``: the share of the label-free rarity prior in the evidence rank targets at the first step
    (``model.evidence.target`` targets mixed with each read cell's low-resolution rarity, see
    ``workers.strata.cell_rarity``), decaying linearly to ``rarity_end`` at the fraction ``rarity_until`` of
    training and staying there: exploration towards rare-looking cells that is scheduled and then removed
    (``rarity_end`` 0, the default) or kept as a floor. ``rarity_start`` 0 (default): off.

    ``rare_until``: with ``model.evidence.rare_cells``, the rare bag's weight decays linearly from ``model.evidence.rare_weight``
    to 0 at this fraction of training (its fixed cells are needed until the scorer finds the structures, and
    are memorised after); None (default): constant.

    ``select_until``: two-phase training. From this fraction of training on the selection is fixed: the scorer
    (the moving average of its weights with ``optim.ema_epochs``, the one evaluated) gets no more updates and the
    terms that only serve finding the structures stop (evidence instance and rank losses, exploration reads, the
    rare bag, the neutral cells); the feature network and aggregator train on the bags the fixed scorer picks:
    ``select_bag`` ``topk`` (default), the hard top-k of inference, or ``draw``, the selector's training draw (for
    the perturbed top-k the per-slot modes under the scheduled sigma). Augmentation and
    ``model.experimental.neighbour_views`` still apply. None (default): one phase, the scorer trains throughout.

    ``select_restart``: at the switch of ``select_until`` the classifier (feature network, its standardisation,
    aggregator) starts again from a fresh initialisation (its optimizer state and moving average too) and the
    learning rate runs its warm-up and cosine again over the remaining steps; the fixed scorer and a cell gate
    (fitted before the restart, on the encoder as it was) stay. Under study; False (default): the classifier goes on.

    ``select_restart_features``: where the restarted feature network starts: ``fresh``, a new initialisation (or
    ``model.features.init`` when set); ``gate_encoder``, the cluster gate's own frozen encoder
    (``model.experimental.gate_encoder``, e.g. pretrained on the training slides without labels), copied and then
    fine-tuned. Under study; ``fresh`` (default).

    ``select_weight_decay``: the AdamW weight decay of the second phase of ``select_until`` (from its first step;
    a checkpoint's optimizer state carries it on a resume). Under study; None (default): ``optim.weight_decay``
    throughout.

    ``select_drop_skip``: at the restart of ``select_restart`` the aggregator's mean skip
    (``model.aggregator.attention_mil.mean_skip`` / ``model.aggregator.transformer.mean_skip``) is set to zero and
    frozen, so the second phase's classifier is the attention path alone: a bag with filler is not read through
    its mean (the first phase keeps the skip, which starts the attention path as the mean aggregator). Under study;
    False (default).

    ``select_restart_seed``: the seed of the restarted classifier's initialisation (the same on every worker).
    Which draw of the classifier learns the shape family's glyphs and which memorises its training slides is
    a lottery (benchmarks/RESULTS.md, "The second phase's classifier is a lottery"); a replay of one run's second
    phase under other seeds measures it. None (default): a seed of the run's own, ``seed * 7919 + 1``.

    ``select_draws``: at the restart of ``select_restart``, this many classifiers (each from its own
    initialisation: the seed of ``select_restart_seed`` plus 0, 1, ...) train side by side on the same slides for
    ``select_draws_epochs`` epochs, each with its own optimizer state, moving average and early-stopping rule; then
    the one with the lowest validation loss seen so far is kept and the others are dropped. Which draw learns the
    glyphs of the shape family and which memorises its training slides is a lottery, and the validation loss
    tells them apart (benchmarks/RESULTS.md, "The second phase's classifier is a lottery"). Early stopping does not
    stop training before the choice. Under study: at 3 draws no draw learnt on three first phases, the chance of
    one is what is short ("Several draws of the second phase's classifier side by side"); 1 (default): one
    classifier.

    ``select_draws_epochs``: the epochs of the second phase (the switch's epoch the first) after which
    ``select_draws`` keeps one draw (at most until ``optim.epochs``).

    ``gate_refits``: with a cell gate (``model.experimental.gate_candidates``), fit it again this many times, evenly
    spaced through the second phase, on the encoder as it is then (its bags and the encoder can improve each other).
    Under study; 0 (default): fitted once, at the switch.
    """

    sigma_start: float = 0.05
    sigma_end: float = 0.0
    rarity_start: float = 0.0
    rarity_until: float = 0.5
    rarity_end: float = 0.0
    rare_until: float | None = None
    select_until: float | None = None
    select_bag: str = "topk"
    select_restart: bool = False
    select_restart_features: str = "fresh"
    select_weight_decay: float | None = None
    select_drop_skip: bool = False
    select_restart_seed: int | None = None
    select_draws: int = 1
    select_draws_epochs: int = 20
    gate_refits: int = 0

    def __post_init__(self) -> None:
        _check_finite("schedule.sigma_start", self.sigma_start)
        _check_finite("schedule.sigma_end", self.sigma_end)
        for name in ("rarity_start", "rarity_until", "rarity_end"):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1
            _check(f"schedule.{name}", v, ok, "a number in [0, 1]")
        _check(
            "schedule.rarity_end",
            self.rarity_end,
            self.rarity_end <= self.rarity_start,
            f"at most rarity_start ({self.rarity_start})",
        )
        for name in ("rare_until", "select_until"):
            v = getattr(self, name)
            ok = v is None or (
                not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 1
            )
            _check(f"schedule.{name}", v, ok, "None or a number in (0, 1]")
        _check("schedule.select_bag", self.select_bag, self.select_bag in ("draw", "topk"), "'draw' or 'topk'")
        _check("schedule.select_restart", self.select_restart, isinstance(self.select_restart, bool), "true or false")
        _check(
            "schedule.select_restart",
            self.select_restart,
            not self.select_restart or self.select_until is not None,
            "false without schedule.select_until (the restart is at its switch)",
        )
        _check(
            "schedule.select_restart_features",
            self.select_restart_features,
            self.select_restart_features in ("fresh", "gate_encoder"),
            "'fresh' or 'gate_encoder'",
        )
        _check(
            "schedule.select_restart_features",
            self.select_restart_features,
            self.select_restart_features == "fresh" or self.select_restart,
            "'fresh' without schedule.select_restart (the features restart there)",
        )
        v = self.select_weight_decay
        _check(
            "schedule.select_weight_decay",
            v,
            v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0),
            "None or a number >= 0",
        )
        _check(
            "schedule.select_weight_decay",
            v,
            v is None or self.select_until is not None,
            "None without schedule.select_until (it is the second phase's)",
        )
        _check(
            "schedule.select_drop_skip", self.select_drop_skip, isinstance(self.select_drop_skip, bool), "true or false"
        )
        _check(
            "schedule.select_drop_skip",
            self.select_drop_skip,
            not self.select_drop_skip or self.select_restart,
            "false without schedule.select_restart (the skip is dropped where the classifier restarts)",
        )
        v = self.select_restart_seed
        _check(
            "schedule.select_restart_seed",
            v,
            v is None or (not isinstance(v, bool) and isinstance(v, int) and v >= 0),
            "None or an int >= 0",
        )
        _check(
            "schedule.select_restart_seed",
            v,
            v is None or self.select_restart,
            "None without schedule.select_restart (it seeds the restart)",
        )
        for name in ("select_draws", "select_draws_epochs"):
            v = getattr(self, name)
            _check(f"schedule.{name}", v, not isinstance(v, bool) and isinstance(v, int) and v >= 1, "an int >= 1")
        _check(
            "schedule.select_draws",
            self.select_draws,
            self.select_draws == 1 or self.select_restart,
            "1 without schedule.select_restart (the draws are restarts)",
        )
        _check(
            "schedule.gate_refits",
            self.gate_refits,
            not isinstance(self.gate_refits, bool) and isinstance(self.gate_refits, int) and self.gate_refits >= 0,
            "an int >= 0",
        )

    def gate_refit_steps(self, total_steps: int) -> list[int]:
        """The optimizer steps (0-based) at which ``gate_refits`` fits the cell gate again, evenly spaced through
        the second phase (empty without ``select_until``)."""
        first = self.select_step(total_steps)
        if first is None or self.gate_refits <= 0:
            return []
        n = self.gate_refits
        return sorted({first + round((i + 1) * (total_steps - first) / (n + 1)) for i in range(n)} - {first})

    def select_step(self, total_steps: int) -> int | None:
        """The first optimizer step (0-based) of the second phase of ``select_until``; None without it."""
        return None if self.select_until is None else math.ceil(self.select_until * total_steps - 1e-9)

    def selection_fixed(self, step: int, total_steps: int) -> bool:
        """Whether optimizer step ``step`` (0-based) of ``total_steps`` is in the second phase of
        ``select_until`` (the selection fixed)."""
        first = self.select_step(total_steps)
        return first is not None and step >= first


def linear_decay(step: int, total_steps: int, start: float, until: float, end: float = 0.0) -> float:
    """``start`` at step 0, linearly to ``end`` (default 0) at ``until * total_steps`` and after (the rarity
    prior's share, ``schedule.rarity_*``, and the rare bag's weight, ``schedule.rare_until``)."""
    if start <= 0 or until <= 0:
        return 0.0
    t = max(step, 0) / max(total_steps, 1)
    return float(end + (start - end) * max(0.0, 1.0 - t / until))


def earliest_stop_epoch(
    early_stopping: EarlyStoppingConfig, epochs: int, schedule: ScheduleConfig, model_config=None
) -> int:
    """The first epoch early stopping may stop after: ``early_stopping.min_epochs``, and no earlier than the
    scheduled exploration terms end (``schedule.rarity_until`` of ``epochs`` when ``schedule.rarity_start`` > 0, the
    end of its decay also when ``schedule.rarity_end`` keeps a floor after it;
    ``schedule.rare_until`` of ``epochs`` when the model reads a rare bag, ``model.evidence.rare_cells`` > 0; one
    epoch after ``schedule.select_until`` of ``epochs``, so the second phase is evaluated at least once)."""
    floor = int(early_stopping.min_epochs)
    if schedule.select_until is not None:
        floor = max(floor, min(epochs, math.ceil(schedule.select_until * epochs - 1e-9) + 1))
    if schedule.rarity_start > 0:
        floor = max(floor, math.ceil(schedule.rarity_until * epochs - 1e-9))
    rare_cells = getattr(getattr(model_config, "evidence", None), "rare_cells", 0)
    if schedule.rare_until is not None and rare_cells > 0:
        floor = max(floor, math.ceil(schedule.rare_until * epochs - 1e-9))
    return floor


# ---------------------------------------------------------------------------------------------- schedules
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


@torch.no_grad()
def ema_update(ema_model: torch.nn.Module, model: torch.nn.Module, step: int, decay: float) -> None:
    """``ema = d * ema + (1 - d) * weights`` after an optimizer step (``step``: the steps done before it; ``d =
    min(decay, (1 + step) / (10 + step))``), and the same for floating-point buffers (the running feature
    statistics of ``model.features.standardise`` follow the last ~20 slides; the averaged weights get them averaged
    over the same steps, as timm's ModelEmaV2 averages BatchNorm's); integer and bool buffers are copied, and so are
    the statistics of a standardisation the average has not seen yet (fresh after a restart)."""
    from operators.resnet import RunningStandardise

    d = min(decay, (1.0 + step) / (10.0 + step))
    for e, p in zip(ema_model.parameters(), model.parameters()):
        e.lerp_(p.detach(), 1.0 - d)
    for mod_e, mod in zip(ema_model.modules(), model.modules()):
        fresh = isinstance(mod_e, RunningStandardise) and int(mod_e.count) == 0
        for e, b in zip(mod_e.buffers(recurse=False), mod.buffers(recurse=False)):
            if e.is_floating_point() and not fresh:
                e.lerp_(b, 1.0 - d)
            else:
                e.copy_(b)


def clip_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of each child module of ``model`` (the groups of ``optim.clip: per_module``)."""
    groups = [[q for q in child.parameters() if q.requires_grad] for child in model.children()]
    return [g for g in groups if g]


def clip_gradients(params, groups, max_norm: float) -> float:
    """Clip the gradients to ``max_norm``: each of ``groups`` on its own (``optim.clip: per_module``), or ``params``
    as one when ``groups`` is None; returns the norm before clipping (per module: the root of the groups' squares)."""
    if groups is None:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    squares = 0.0
    for group in groups:
        squares += float(torch.nn.utils.clip_grad_norm_(group, max_norm)) ** 2
    return squares**0.5


# ---------------------------------------------------------------------------------------------- loss
def slide_loss(out, target: int) -> tuple[torch.Tensor, dict[str, float]]:
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


def num_patches(out) -> int:
    """Full-resolution patches this forward read (distinct cells; K for hard selection)."""
    return int(out.info.get("cells_read", out.coords_l0.shape[0]))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# ---------------------------------------------------------------------------------------------- collectives
class Collective(Protocol):
    """How the workers of one training cooperate (rank ``rank`` of ``world``)."""

    rank: int
    world: int

    def broadcast_module(self, module: torch.nn.Module) -> None: ...
    def allreduce_grads(self, params: list[torch.nn.Parameter]) -> None: ...
    def reduce_step_stats(self, stats: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, obj: Any) -> list[Any]: ...
    def stats_device(self, device: torch.device) -> torch.device | str: ...


@dataclass
class LocalCollective:
    """No communication (one process; ``rank``/``world`` only choose the shard)."""

    rank: int = 0
    world: int = 1

    def broadcast_module(self, module: torch.nn.Module) -> None:
        pass

    def allreduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def reduce_step_stats(self, stats: torch.Tensor) -> torch.Tensor:
        return stats

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def stats_device(self, device: torch.device) -> torch.device | str:
        return "cpu"


@dataclass
class TorchDistCollective:
    """An initialised ``torch.distributed`` process group (gloo on CPU, nccl on CUDA)."""

    rank: int
    world: int

    def broadcast_module(self, module: torch.nn.Module) -> None:
        import torch.distributed as dist

        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)

    def allreduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Average gradients over workers in one flat all-reduce (missing grads count as zeros)."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def reduce_step_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """``[loss, n, correct, patches, seconds]``: the first four summed, the seconds the slowest worker's."""
        import torch.distributed as dist

        summed = stats.clone()
        dist.all_reduce(summed)
        longest = stats[4:5].clone()
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return torch.cat([summed[:4], longest])

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def stats_device(self, device: torch.device) -> torch.device | str:
        return device  # nccl reduces CUDA tensors only


# ---------------------------------------------------------------------------------------------- trainer
@dataclass
class EpochResult:
    """One training epoch on this worker (loss/n/patches/step time summed over all workers)."""

    targets: list[int] = field(default_factory=list)
    probs: list[list[float]] = field(default_factory=list)
    loss: float = 0.0
    n: int = 0
    patches: int = 0
    step_seconds: float = 0.0
    started: float = 0.0  # time.perf_counter() at the start
    parts: dict[str, float] = field(default_factory=dict)  # this worker's loss terms ("ce", aux names), summed


@dataclass
class EvalResult:
    """Hard-selection predictions of some slides: targets, class probabilities, summed CE loss, patches read."""

    targets: list[int]
    probs: list[list[float]]
    loss: float
    patches: int


StepCallback = Callable[[dict[str, float], int], None]


def _load_resolved(
    net: torch.nn.Module | None, state: dict[str, torch.Tensor] | None, key: str, value: str | None, kwarg: str
) -> None:
    """An encoder's ``state`` dict (the Trainer's argument ``kwarg``) that the driver resolved from ``value`` of
    config ``key`` (an MLflow URI: :mod:`pipeline.encoder_init`; ``pretrain``:
    :func:`pipeline.train.pretrain_gate_encoder`) into ``net``, its architecture checked; without one, ``value``
    must be neither (a local file is read when the model is built)."""
    from operators.model_config import is_init_uri, resolved_by_driver

    if state is not None:
        from operators.resnet import check_architecture

        check_architecture(net.cfg, state, where=f"{key} {value!r}")
        net.load_state_dict(state)
    elif resolved_by_driver(value):
        how = (
            "is an MLflow URI: the driver resolves it (pipeline.encoder_init.resolve_init)"
            if is_init_uri(value)
            else "is not a file: the driver pretrains the encoder (pipeline.train.pretrain_gate_encoder)"
        )
        raise ValueError(f"{key}={value!r} {how} and passes the state dict as {kwarg}")


def fit_gate_on_slides(
    gate: Any, slides: Sequence[tuple[str, torch.Tensor, torch.Tensor]], seed: int, rank_cut: bool = False
) -> dict:
    """Fit a cell gate (:class:`operators.gate.CellGate`) on the candidates of ``slides``, each ``(store, features
    [n, D], scores [n])`` with its candidates best first, as the trainer does when the selection is fixed: the
    slides in store order, whatever the epoch's shuffle and the number of workers (k-means++ seeds by position, so
    the same slides give the same fit), the k-means seeded by ``seed``; ``rank_cut``: each candidate's place in its
    slide's ranking goes to the fit. Returns the fit (:func:`operators.gate.fit_cluster_gate`)."""
    slides = sorted(slides, key=lambda s: s[0])
    if not slides:
        raise ValueError("the cell gate has no training slides to fit on (model.experimental.gate_candidates)")
    f_all, s_all = torch.cat([s[1] for s in slides]), torch.cat([s[2] for s in slides])
    r_all = torch.cat([torch.arange(s[2].numel(), dtype=torch.float64) for s in slides]) if rank_cut else None
    return gate.fit(f_all, s_all, torch.Generator().manual_seed(int(seed)), ranks=r_all)


#: the parts of :class:`~operators.model.FoveateModel` that ``schedule.select_restart`` starts again
CLASSIFIER = ("features", "feature_norm", "aggregator")


class _Draw:
    """One more second-phase classifier of ``schedule.select_draws`` (see :meth:`Trainer._new_draw`)."""

    def __init__(self, seed, model, ema, optimizer, params, groups, stopper):
        self.seed, self.model, self.ema, self.optimizer = int(seed), model, ema, optimizer
        self.params, self.groups, self.stopper = params, groups, stopper
        self.best_state: dict[str, torch.Tensor] | None = None

    @property
    def eval_model(self) -> torch.nn.Module:
        return self.ema if self.ema is not None else self.model

    def state_dict(self) -> dict[str, Any]:
        parts = {name: getattr(self.model, name) for name in CLASSIFIER if getattr(self.model, name) is not None}
        return {
            "seed": self.seed,
            "model": {name: m.state_dict() for name, m in parts.items()},
            **({"ema": {name: getattr(self.ema, name).state_dict() for name in parts}} if self.ema is not None else {}),
            "optimizer": self.optimizer.state_dict(),
            **({"early_stopping": self.stopper.state_dict()} if self.stopper is not None else {}),
            "best_model": self.best_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, sd in state["model"].items():
            getattr(self.model, name).load_state_dict(sd)
            if self.ema is not None:
                getattr(self.ema, name).load_state_dict(state.get("ema", state["model"])[name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.stopper is not None and state.get("early_stopping") is not None:
            self.stopper.load_state_dict(state["early_stopping"])
        self.best_state = state.get("best_model")


class Trainer:
    """Model, optimiser, LR and sigma schedules and the selection-noise generator of one training worker.

    Args:
        model_config: ``operators.model.ModelConfig`` (``num_classes`` already set from the data).
        optim, schedule: see :class:`OptimConfig`, :class:`ScheduleConfig`.
        slides_per_epoch: slides this worker trains on per epoch (its shard's length); fixes the steps per
            epoch and so the schedules.
        seed: model initialisation (``torch.manual_seed``) and selection noise (``seed * 1000 + rank``).
        device: where the model runs.
        collective: how workers cooperate (default :class:`LocalCollective`).
        on_step: called as ``on_step(metrics, global_step)`` every ``log_every`` optimizer steps and at the end
            of each epoch (pass it on one rank only to log once).
        log_every: see ``on_step``.
        early_stopping: :class:`~workers.early_stopping.EarlyStoppingConfig`; None or ``patience`` 0: off
            (:attr:`finished` at ``optim.epochs``, the last weights kept).
        features_init: the ResNet's initial ``state_dict`` when ``model.features.init`` is an MLflow URI (the
            driver resolves it: ``pipeline.encoder_init.resolve_init``); a local ``init`` file is read when the
            model is built. Loaded before the workers' start is made identical.
        gate_encoder_init: the cluster gate's own encoder (``state_dict``) when ``model.experimental.gate_encoder``
            is an MLflow URI (resolved by the driver as ``features_init``); a local file is read when the model is
            built.
        feature_cache: a folder for the frozen-feature cache (:class:`~workers.feature_cache.FeatureCache`, in
            its ``worker<rank>`` sub-folder): with a frozen encoder the features of every cell read are kept there
            and later reads of the same cell skip the read and the encoder (in evaluation always, in training only
            while ``model.augment.color_jitter`` is 0). None: off; ignored (one log line) for an encoder that
            is trained.
    """

    def __init__(
        self,
        model_config: Any,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        *,
        slides_per_epoch: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
        collective: Collective | None = None,
        on_step: StepCallback | None = None,
        log_every: int = 1,
        early_stopping: EarlyStoppingConfig | None = None,
        features_init: dict[str, torch.Tensor] | None = None,
        feature_cache: str | Any | None = None,
        gate_encoder_init: dict[str, torch.Tensor] | None = None,
    ):
        from operators.model import FoveateModel

        self.optim_cfg, self.schedule = optim, schedule
        self.collective = collective if collective is not None else LocalCollective()
        self.rank, self.world = self.collective.rank, self.collective.world
        self.device = torch.device(device)
        self.on_step, self.log_every = on_step, int(log_every)

        torch.manual_seed(seed)
        self.seed = seed
        if model_config.experimental.gate_candidates > 0 and schedule.select_until is None:
            raise ValueError(
                "model.experimental.gate_candidates > 0 needs schedule.select_until (the gate is fitted when the "
                f"selection is fixed); got gate_candidates={model_config.experimental.gate_candidates} and "
                "schedule.select_until=None: set schedule.select_until (e.g. 0.5) or gate_candidates: 0"
            )
        if schedule.select_restart_features == "gate_encoder" and (
            model_config.experimental.gate_candidates <= 0 or model_config.experimental.gate_encoder is None
        ):
            raise ValueError(
                "schedule.select_restart_features='gate_encoder' starts the second phase's feature network from the "
                "cluster gate's own encoder; it needs model.experimental.gate_candidates > 0 and "
                "model.experimental.gate_encoder (a file, an MLflow URI or 'pretrain'); got gate_candidates="
                f"{model_config.experimental.gate_candidates}, gate_encoder={model_config.experimental.gate_encoder!r}"
            )
        agg = model_config.aggregator
        if schedule.select_drop_skip and not (
            (agg.kind == "attention_mil" and agg.attention_mil.mean_skip)
            or (agg.kind == "transformer" and agg.transformer.mean_skip)
        ):
            raise ValueError(
                "schedule.select_drop_skip drops the aggregator's mean skip in the second phase; it needs "
                "model.aggregator.kind 'attention_mil' or 'transformer' with its mean_skip true; got "
                f"kind={agg.kind!r}" + (", mean_skip false" if agg.kind in ("attention_mil", "transformer") else "")
            )
        self.model = FoveateModel(model_config)
        _load_resolved(
            self.model.features, features_init, "model.features.init", model_config.features.init, "features_init"
        )
        self._features_init = features_init
        gate_init = model_config.experimental.gate_encoder
        if gate_encoder_init is not None and (
            self.model.gate is None or self.model.gate.encoder is None or gate_init is None
        ):
            raise ValueError("gate_encoder_init was given but model.experimental.gate_encoder is not set")
        gate_net = self.model.gate.encoder if gate_encoder_init is not None else None
        _load_resolved(gate_net, gate_encoder_init, "model.experimental.gate_encoder", gate_init, "gate_encoder_init")
        self.model = self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._clip_groups = clip_groups(self.model)
        self.collective.broadcast_module(self.model)  # identical start on every worker
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, weight_decay=optim.weight_decay)
        self.steps_per_epoch = math.ceil(slides_per_epoch / optim.accumulate)
        self.total_steps = self.steps_per_epoch * optim.epochs
        restart = schedule.select_step(self.total_steps) if schedule.select_restart else None

        def factor(s: int) -> float:
            if restart is not None and s >= restart:  # select_restart: warm-up and cosine again after the switch
                return lr_factor(s - restart, self.total_steps - restart, optim.warmup, optim.min_lr_ratio)
            return lr_factor(s, self.total_steps, optim.warmup, optim.min_lr_ratio)

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.generator = torch.Generator(device=self.device)  # selection noise is drawn on the model's device
        self.generator.manual_seed(seed * 1000 + self.rank)
        self.epoch, self.global_step, self.train_seconds = 0, 0, 0.0
        self._selection_fixed = False  # in the second phase of schedule.select_until
        self._train_records: Sequence[Any] = ()
        self._stores: dict[str, Any] = {}
        self._stores_lock = threading.Lock()
        self._reader_pool: ThreadPoolExecutor | None = None
        self.ema_model: torch.nn.Module | None = None
        if optim.ema_epochs > 0:
            self.ema_decay = 1.0 - 1.0 / max(optim.ema_epochs * self.steps_per_epoch, 1.0)
            self.ema_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.draws: list[_Draw] = []  # schedule.select_draws: the classifiers beside self.model's, until the choice
        self._draw_losses: list[float] = []  # per draw (self.model's first): its lowest validation loss so far
        self._draws_end: int | None = None  # the epoch after which one draw is kept
        if schedule.select_draws > 1:
            first_epoch = schedule.select_step(self.total_steps) // self.steps_per_epoch
            self._draws_end = min(optim.epochs, first_epoch + schedule.select_draws_epochs)
        self.stopper: EarlyStopping | None = None
        self._stopping = early_stopping
        if early_stopping is not None and early_stopping.patience > 0:
            floor = earliest_stop_epoch(early_stopping, optim.epochs, schedule, model_config)
            self._stop_floor = max(floor, self._draws_end or 0)  # no stop before the draws' choice
            self.stopper = EarlyStopping.from_config(early_stopping, min_epochs=self._stop_floor)
        # early_stopping.max_epochs: past optim.epochs while the rule says the model is still learning
        self.max_epochs = int(optim.epochs)
        if early_stopping is not None and early_stopping.max_epochs > 0:
            if early_stopping.max_epochs < optim.epochs:
                raise ValueError(
                    f"early_stopping.max_epochs: got {early_stopping.max_epochs}, must be 0 or >= optim.epochs "
                    f"({optim.epochs})"
                )
            if self.stopper is None:  # patience 0: no rule to say the model is still learning
                raise ValueError(
                    f"early_stopping.max_epochs: got {early_stopping.max_epochs} with early_stopping.patience 0; "
                    "training past optim.epochs needs the stopping rule: set patience >= 1, or max_epochs 0"
                )
            self.max_epochs = int(early_stopping.max_epochs)
        self.best_state: dict[str, torch.Tensor] | None = None  # eval_model's weights at stopper.best_epoch (CPU)
        self.stop_reason: str | None = None  # "patience" or "cap" once training has ended
        self.feature_cache = None
        if feature_cache is not None:
            from workers.feature_cache import FeatureCache, features_frozen

            if features_frozen(model_config):
                self.feature_cache = FeatureCache(feature_cache, self.model, worker=self.rank)
                log.info("feature cache: %s", self.feature_cache.dir)
            else:
                log.info("feature cache: off (model.features is trained, so its features change every step)")

    @property
    def finished(self) -> bool:
        """Training has ended: stopped early (``stop_reason`` ``"patience"``), at ``optim.epochs`` (``"cap"``) or,
        trained past it (``early_stopping.max_epochs``), at its patience or ``max_epochs`` (``"max_epochs"``)."""
        return self.stop_reason is not None or self.epoch >= self.max_epochs

    @property
    def eval_model(self) -> torch.nn.Module:
        """The model to evaluate, checkpoint and export: the moving average of the weights with
        ``optim.ema_epochs`` > 0, else the trained model itself."""
        return self.ema_model if self.ema_model is not None else self.model

    def _update_ema(self) -> None:
        """:func:`ema_update` of :attr:`ema_model` towards the model after an optimizer step."""
        ema_update(self.ema_model, self.model, self.global_step, self.ema_decay)

    # ------------------------------------------------------------------ slides
    def _store(self, path: str):
        from workers.store import SlideStore

        with self._stores_lock:
            if path not in self._stores:
                self._stores[path] = SlideStore(path)
            return self._stores[path]

    def _reader(self) -> ThreadPoolExecutor:
        """The one reader thread that prepares the next step's slides (their store, grid, low-res view and tissue
        cells: ``workers.patches.prepare_slide``, cached per process) while the current step computes."""
        if self._reader_pool is None:
            self._reader_pool = ThreadPoolExecutor(1, thread_name_prefix="slide-prefetch")
        return self._reader_pool

    def _prepare_ahead(self, records: Sequence[Any]) -> None:
        """Prepare ``records``' slides for a later step; a failure is left for that step to raise."""
        from workers.patches import prepare_slide

        for rec in records:
            try:
                prepare_slide(self._store(rec.store), self.model.cfg)
            except Exception as exc:  # the step that reads this slide raises it with its context
                log.debug("prefetching %s failed: %s", rec.store, exc)

    def _forward(
        self,
        store,
        *,
        training: bool,
        sigma: float,
        target: int | None = None,
        rarity: float = 0.0,
        rare: float = 1.0,
        model: torch.nn.Module | None = None,
        fixed_selection: str | None = None,
        cache: bool = True,
    ):
        from workers.slide_forward import forward_slide

        return forward_slide(
            self.model if model is None else model,
            store,
            training=training,
            sigma=sigma,
            generator=self.generator if training else None,
            target=target,
            rarity=rarity,
            rare_scale=rare,
            feature_cache=self.feature_cache if cache else None,
            fixed_selection=fixed_selection,
        )

    # ------------------------------------------------------------------ step
    def step(self, batch: Sequence[Any], result: EpochResult) -> dict[str, float]:
        """One optimizer step on ``batch`` (records with ``.store`` and ``.target``); returns the step's
        metrics (loss and accuracy over all workers, sigma, lr, grad norm, timings, aux losses)."""
        t0 = time.perf_counter()
        sigma = sigma_at(self.global_step, self.total_steps, self.schedule.sigma_start, self.schedule.sigma_end)
        rarity = linear_decay(
            self.global_step,
            self.total_steps,
            self.schedule.rarity_start,
            self.schedule.rarity_until,
            self.schedule.rarity_end,
        )
        rare = 1.0
        if self.schedule.rare_until is not None:
            rare = linear_decay(self.global_step, self.total_steps, 1.0, self.schedule.rare_until)
        fixed = self.schedule.selection_fixed(self.global_step, self.total_steps)
        gate = self.model.gate
        if fixed != self._selection_fixed:  # the second phase of schedule.select_until: the scorer frozen
            self._selection_fixed = fixed
            self.model.scorer.requires_grad_(not fixed)
            if fixed and self.ema_model is not None and self.global_step == self.schedule.select_step(self.total_steps):
                # the scorer that is frozen is the evaluated one, the moving average (a resume after the switch
                # finds it there already)
                self.model.scorer.load_state_dict(self.ema_model.scorer.state_dict())
            if fixed:
                log.info("selection fixed from step %d (schedule.select_until): the scorer is frozen", self.global_step)
                if gate is not None and not gate.is_fitted:  # a resume after the switch finds it fitted already
                    self._fit_gate()
                switch = self.global_step == self.schedule.select_step(self.total_steps)
                if self.schedule.select_restart and switch:
                    self._restart_classifier()
                if self.schedule.select_drop_skip:  # on a resume after the switch too: the zeros stay frozen
                    self._drop_skip()
                if self.schedule.select_weight_decay is not None and switch:
                    for group in self.optimizer.param_groups:  # a resume loads it with the optimizer state
                        group["weight_decay"] = float(self.schedule.select_weight_decay)
        if fixed and gate is not None and self.global_step in self.schedule.gate_refit_steps(self.total_steps):
            self._fit_gate()  # schedule.gate_refits: on the encoder as it is now
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, correct, patches = 0.0, 0, 0
        aux_sums: dict[str, float] = {}
        for rec in batch:
            out = self._forward(
                self._store(rec.store),
                training=True,
                sigma=sigma,
                target=rec.target,
                rarity=rarity,
                rare=rare,
                fixed_selection=self.schedule.select_bag if fixed else None,
            )
            loss, parts = slide_loss(out, rec.target)
            (loss / len(batch)).backward()
            loss_sum += float(loss.detach())
            for k, v in parts.items():
                aux_sums[k] = aux_sums.get(k, 0.0) + v
                result.parts[k] = result.parts.get(k, 0.0) + v
            prob = torch.softmax(out.logits.detach().reshape(1, -1).float(), -1)[0].cpu()
            correct += int(int(prob.argmax()) == rec.target)
            result.targets.append(rec.target)
            result.probs.append(prob.tolist())
            patches += num_patches(out)
        self.collective.allreduce_grads(self.params)
        if fixed:  # no update at all (an all-reduce fills missing grads with zeros: AdamW would still move them)
            for p in self.model.scorer.parameters():
                p.grad = None
        grad_norm = float("nan")
        if self.optim_cfg.grad_clip > 0:
            groups = self._clip_groups if self.optim_cfg.clip == "per_module" else None
            grad_norm = clip_gradients(self.params, groups, self.optim_cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        if self.ema_model is not None:
            self._update_ema()
        if fixed and self.draws:
            self._step_draws(batch, sigma, lr)
        self.global_step += 1
        dt = time.perf_counter() - t0
        stats = torch.tensor(
            [loss_sum, len(batch), correct, patches, dt],
            dtype=torch.float64,
            device=self.collective.stats_device(self.device),
        )
        s_loss, s_n, s_correct, s_patches, s_dt = self.collective.reduce_step_stats(stats).cpu().tolist()
        result.loss += s_loss
        result.n += int(s_n)
        result.patches += int(s_patches)
        result.step_seconds += s_dt
        metrics = {
            "loss": s_loss / max(s_n, 1),
            "accuracy": s_correct / max(s_n, 1),
            "sigma": sigma,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds_per_step": s_dt,
            "patches_per_second": s_patches / max(s_dt, 1e-9),
        }
        metrics.update({f"loss_{k}": v / max(len(batch), 1) for k, v in aux_sums.items()})
        return metrics

    @torch.no_grad()
    def _fit_gate(self) -> None:
        """Fit the cell gate (:mod:`operators.gate`) when the selection is fixed: the frozen scorer's candidates of
        every worker's training slides, embedded by a frozen copy of the encoder as it is now; the same fit on every
        worker (all candidates gathered, one seed), copied into the moving average."""
        from workers.patches import prepare_slide
        from workers.slide_forward import read_gate_candidates, score_slide

        model, gate = self.model, self.model.gate
        if gate.encoder is not None and model.cfg.experimental.gate_encoder is None:  # else its own pretrained one
            gate.encoder.load_state_dict(model.features.state_dict())
        was_training = model.training
        model.eval()
        rank_cut = model.cfg.experimental.gate_cut == "rank"
        mine = []  # per slide: (store, features, scores)
        for rec in self._train_records:
            slide = prepare_slide(self._store(rec.store), model.cfg)
            n = model.cfg.experimental.gate_candidates  # fitted on these; it keeps from gate_keep_from
            _, values, pixels = read_gate_candidates(model, slide, score_slide(model, slide), n)
            mine.append((str(rec.store), model.gate_encode(pixels).cpu(), values.cpu()))
        model.train(was_training)
        slides = [s for p in self.collective.all_gather(mine) for s in p]
        fit = fit_gate_on_slides(gate, slides, self.seed, rank_cut)
        if self.ema_model is not None:
            self.ema_model.gate.load_state_dict(gate.state_dict())
        kept = fit["kept"].double().mean()
        log.info(
            "cell gate fitted on %d candidates of %d training slides: %d of %d clusters informative (the first of "
            "%d fits), %.0f%% of the candidates kept",
            fit["assignment"].numel(),
            len(slides),
            int(fit["informative"].sum()),
            fit["centroids"].shape[0],
            gate.fits,
            100 * float(kept),
        )

    def _fresh_classifier(
        self, model: torch.nn.Module, seed: int, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """``model``'s feature network, standardisation and aggregator from a fresh initialisation under ``seed``
        (the gate's encoder or ``model.features.init`` where ``schedule.select_restart_features`` /
        ``features_init`` say so); their state in ``optimizer`` dropped."""
        from operators.model import FoveateModel

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fresh = FoveateModel(model.cfg)
        for name in CLASSIFIER:
            mine = getattr(model, name)
            if mine is None:
                continue
            state = getattr(fresh, name).state_dict()
            if name == "features" and self.schedule.select_restart_features == "gate_encoder":
                state = self.model.gate.encoder.state_dict()  # the gate's own copy stays frozen
            elif name == "features" and self._features_init is not None:  # a pretrained start stays the start
                state = self._features_init
            mine.load_state_dict(state)
            if optimizer is not None:
                for p in mine.parameters():
                    optimizer.state.pop(p, None)

    def _restart_classifier(self) -> None:
        """``schedule.select_restart``: the feature network, its standardisation and the aggregator from a fresh
        initialisation (the same on every worker: a seed of their own), their optimizer state dropped; the moving
        average restarts from the weights as they now are, and early stopping starts over (no best epoch). With
        ``schedule.select_draws`` the other draws start here (:meth:`_new_draw`)."""
        seed = self.schedule.select_restart_seed
        base = self.seed * 7919 + 1 if seed is None else seed
        self._fresh_classifier(self.model, base, self.optimizer)
        if self.ema_model is not None:
            self.ema_model.load_state_dict(self.model.state_dict())
        if self.stopper is not None:  # a new model: the first phase's best epoch is no candidate for export
            self.stopper.restart()
            self.best_state = None
        n = self.schedule.select_draws
        self.draws = [self._new_draw(base + i) for i in range(1, n)]
        self._draw_losses = [math.inf] * n if n > 1 else []
        log.info(
            "classifier restarted at step %d (schedule.select_restart)%s",
            self.global_step,
            f", {n} draws until epoch {self._draws_end}" if n > 1 else "",
        )

    # ------------------------------------------------------------------ select_draws
    def _new_draw(self, seed: int) -> _Draw:
        """One more classifier of ``schedule.select_draws``: a copy of :attr:`model` sharing its frozen scorer
        and cell gate (their moving averages too), the classifier freshly initialised under ``seed``, its own
        AdamW, moving average and early-stopping rule."""
        model = copy.deepcopy(self.model)
        model.scorer = self.model.scorer
        if self.model.gate is not None:
            model.gate = self.model.gate
        self._fresh_classifier(model, seed)
        ema = None
        if self.ema_model is not None:
            ema = copy.deepcopy(model).eval().requires_grad_(False)
            ema.scorer = self.ema_model.scorer
            if self.ema_model.gate is not None:
                ema.gate = self.ema_model.gate
        parts = [getattr(model, name) for name in CLASSIFIER if getattr(model, name) is not None]
        groups = [g for g in ([p for p in m.parameters() if p.requires_grad] for m in parts) if g]
        params = [p for g in groups for p in g]
        group = self.optimizer.param_groups[0]
        optimizer = torch.optim.AdamW(params, lr=group["lr"], weight_decay=group["weight_decay"])
        stopper = None
        if self.stopper is not None:
            stopper = EarlyStopping.from_config(self._stopping, min_epochs=self._stop_floor)
        return _Draw(seed, model, ema, optimizer, params, groups, stopper)

    def _step_draws(self, batch: Sequence[Any], sigma: float, lr: float) -> None:
        """The optimizer step of every other draw of ``schedule.select_draws`` on ``batch``, the slides
        :attr:`model` has just stepped on, at its learning rate and weight decay."""
        wd = self.optimizer.param_groups[0]["weight_decay"]
        for d in self.draws:
            d.optimizer.zero_grad(set_to_none=True)
            for rec in batch:
                out = self._forward(
                    self._store(rec.store),
                    training=True,
                    sigma=sigma,
                    target=rec.target,
                    model=d.model,
                    fixed_selection=self.schedule.select_bag,
                    cache=False,
                )
                loss, _ = slide_loss(out, rec.target)
                (loss / len(batch)).backward()
            self.collective.allreduce_grads(d.params)
            if self.optim_cfg.grad_clip > 0:
                groups = d.groups if self.optim_cfg.clip == "per_module" else None
                clip_gradients(d.params, groups, self.optim_cfg.grad_clip)
            for g in d.optimizer.param_groups:
                g["lr"], g["weight_decay"] = lr, wd
            d.optimizer.step()
            if d.ema is not None:
                for name in CLASSIFIER:
                    if getattr(d.model, name) is not None:
                        ema_update(getattr(d.ema, name), getattr(d.model, name), self.global_step, self.ema_decay)

    def _screen_draws(self, metrics: dict[str, float], val_records: Sequence[Any]) -> None:
        """After an epoch of ``schedule.select_draws``: validate every other draw (``draw<i>_val_loss`` /
        ``draw<i>_val_accuracy`` in rank 0's ``metrics``), follow each one's lowest validation loss, and at the
        epoch of the choice keep the draw with the lowest (``select_draw``: its index, 0 the run's own), its
        validation metrics replacing ``metrics``' ``val_*``. Before the choice each draw's early-stopping rule
        sees its own epochs (a kept draw goes on with its own count and best epoch)."""
        end = self.epoch >= self._draws_end
        vals = []
        for d in self.draws:
            val = self.evaluate(val_records, model=d.eval_model)
            m = self._val_metrics(self.collective.all_gather((val.targets, val.probs, val.loss, val.patches)))
            vals.append(m)
            if not end and d.stopper is not None:  # at the choice the kept one's rule sees the epoch as the run's
                self._update_stopper(d.stopper, m)
                if d.stopper.best_epoch == self.epoch:
                    d.best_state = {k: v.detach().to("cpu", copy=True) for k, v in d.eval_model.state_dict().items()}
        mine = [metrics.get("val_loss")] + [m.get("val_loss") for m in vals] if self.rank == 0 else None
        for i, v in enumerate(self.collective.all_gather(mine)[0]):  # rank 0's values: one choice on every rank
            if v is not None and math.isfinite(v):
                self._draw_losses[i] = min(self._draw_losses[i], float(v))
        if self.rank == 0:
            for i, m in enumerate(vals, 1):
                metrics.update({f"draw{i}_{k}": m[k] for k in ("val_loss", "val_accuracy") if k in m})
        if not end:
            return
        kept = min(range(len(self._draw_losses)), key=lambda i: (self._draw_losses[i], i))
        log.info(
            "select_draws: draw %d of %d kept at epoch %d (lowest validation losses %s)",
            kept,
            len(self._draw_losses),
            self.epoch,
            ", ".join(f"{v:.4f}" for v in self._draw_losses),
        )
        if self.rank == 0:
            metrics["select_draw"] = kept
            if kept:
                metrics.update(vals[kept - 1])
        if kept:
            self._take_draw(self.draws[kept - 1])
        self.draws = []

    def _take_draw(self, d: _Draw) -> None:
        """:attr:`model` (and its moving average, optimizer state, early-stopping rule and best epoch's weights)
        becomes draw ``d``."""
        for name in CLASSIFIER:
            if getattr(self.model, name) is None:
                continue
            getattr(self.model, name).load_state_dict(getattr(d.model, name).state_dict())
            if self.ema_model is not None:
                getattr(self.ema_model, name).load_state_dict(getattr(d.ema, name).state_dict())
        mine = dict(self.model.named_parameters())
        for name, p in d.model.named_parameters():
            if name.split(".", 1)[0] not in CLASSIFIER:
                continue
            q = mine[name]
            state = d.optimizer.state.get(p)
            self.optimizer.state.pop(q, None)
            if state:
                self.optimizer.state[q] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        if self.stopper is not None and d.stopper is not None:
            self.stopper.load_state_dict(d.stopper.state_dict())
            self.best_state = d.best_state

    def _drop_skip(self) -> None:
        """``schedule.select_drop_skip``: the aggregator's mean skip (and the moving average's) set to zero and
        frozen; the attention path alone classifies from here on."""
        pairs = [(self.model, self.optimizer), (self.ema_model, None)]
        pairs += [pair for d in self.draws for pair in ((d.model, d.optimizer), (d.ema, None))]
        for model, optimizer in pairs:
            skip = None if model is None else getattr(model.aggregator, "skip", None)
            if skip is None:
                continue
            with torch.no_grad():
                for p in skip.parameters():
                    p.zero_()
            skip.requires_grad_(False)
            if optimizer is not None:
                for p in skip.parameters():
                    optimizer.state.pop(p, None)

    def train_epoch(self, records: Sequence[Any]) -> EpochResult:
        """One epoch over this worker's ``records`` (already sharded and shuffled), ``optim.accumulate``
        slides per optimizer step."""
        self._train_records = records  # the cell gate is fitted on them when the selection is fixed
        self.model.train()
        for d in self.draws:
            d.model.train()
        result = EpochResult(started=time.perf_counter())
        acc = self.optim_cfg.accumulate
        ahead = None  # the next step's slides, prepared by a reader thread while this step runs
        for i in range(self.steps_per_epoch):
            if ahead is not None:
                ahead.result()
            upcoming = records[(i + 1) * acc : (i + 2) * acc]
            ahead = self._reader().submit(self._prepare_ahead, upcoming) if upcoming else None
            metrics = self.step(records[i * acc : (i + 1) * acc], result)
            last = i == self.steps_per_epoch - 1
            if self.on_step is not None and (self.global_step % self.log_every == 0 or last):
                metrics["peak_memory_mb"] = peak_memory_mb(self.device)
                self.on_step(metrics, self.global_step)
                log.info(
                    "epoch %d step %d/%d loss %.4f sigma %.4f %.2fs/step",
                    self.epoch + 1,
                    i + 1,
                    self.steps_per_epoch,
                    metrics["loss"],
                    metrics["sigma"],
                    metrics["seconds_per_step"],
                )
        self.train_seconds += time.perf_counter() - result.started
        self.epoch += 1
        return result

    # ------------------------------------------------------------------ evaluate
    def evaluate(self, records: Sequence[Any], model: torch.nn.Module | None = None) -> EvalResult:
        """Hard-selection predictions of ``records`` by ``model`` (default :attr:`eval_model`; eval mode, no
        gradients)."""
        model = self.eval_model if model is None else model
        model.eval()
        targets, probs, loss_sum, patches = [], [], 0.0, 0
        with torch.no_grad():
            for rec in records:
                out = self._forward(
                    self._store(rec.store), training=False, sigma=0.0, model=model, cache=model is self.eval_model
                )
                logits = out.logits.reshape(1, -1).float()
                loss_sum += float(
                    torch.nn.functional.cross_entropy(logits, torch.tensor([rec.target], device=logits.device))
                )
                probs.append(torch.softmax(logits, -1)[0].cpu().tolist())
                targets.append(rec.target)
                patches += num_patches(out)
        return EvalResult(targets, probs, loss_sum, patches)

    @torch.no_grad()
    def refresh_feature_stats(self, records: Sequence[Any]) -> int:
        """Set :attr:`eval_model`'s feature standardisation (``model.features.standardise``) to the exact mean and
        variance of the features it computes for ``records`` (this worker's training slides; summed over all
        workers) with hard selection in eval mode, as it will see slides at inference — what SWA's ``update_bn``
        does for BatchNorm. The running statistics follow the last ~20 training slides, so a linear head on top
        sees a mean that moves with the classes of those slides: its held-out accuracy swung by 10–20 points
        between epochs at a steady AUC (benchmarks/RESULTS.md, "The feature statistics at the end of training").
        Returns the number of feature rows over all workers (0: nothing to refresh)."""
        from operators.resnet import feature_moments, set_exact_statistics

        model = self.eval_model
        norm = getattr(model, "feature_norm", None)
        if norm is None:
            return 0
        was_training = model.training
        model.eval()
        try:
            with feature_moments(norm) as moments:
                for rec in records:
                    self._forward(self._store(rec.store), training=False, sigma=0.0, model=model)
        finally:
            model.train(was_training)
        return set_exact_statistics(norm, sum(self.collective.all_gather(moments)))

    def run_epoch(self, train_records: Sequence[Any], val_records: Sequence[Any]) -> dict[str, float]:
        """:meth:`train_epoch` then :meth:`evaluate` on this worker's validation shard; the epoch's metrics
        over all workers (full on rank 0; only ``epoch`` and ``global_step`` on the others). When training ends
        here (early stopping or the cap), the exported model's feature statistics are refreshed over the training
        slides (:meth:`refresh_feature_stats`) and it is validated again: ``final_val_*``."""
        ep = self.train_epoch(train_records)
        val = self.evaluate(val_records)
        gathered = self.collective.all_gather(
            {
                "train": (ep.targets, ep.probs),
                "parts": ep.parts,
                "val": (val.targets, val.probs, val.loss, val.patches),
            }
        )
        metrics: dict[str, float] = {"epoch": self.epoch, "global_step": self.global_step}
        if self.rank == 0:
            tt = [t for g in gathered for t in g["train"][0]]
            tp = [p for g in gathered for p in g["train"][1]]
            metrics["epoch_train_loss"] = ep.loss / max(ep.n, 1)
            metrics.update(classification_metrics(tt, np.array(tp), prefix="epoch_train_"))
            for name in sorted({k for g in gathered for k in g["parts"]}):  # each loss term's mean over the slides
                total = sum(g["parts"].get(name, 0.0) for g in gathered)
                metrics[f"epoch_train_loss_{name}"] = total / max(len(tt), 1)
            metrics.update(self._val_metrics([g["val"] for g in gathered]))
            metrics["epoch_seconds"] = time.perf_counter() - ep.started
            metrics["epoch_patches_per_second"] = ep.patches / max(ep.step_seconds, 1e-9)
            metrics["epoch_seconds_per_step"] = ep.step_seconds / max(self.steps_per_epoch, 1)
            metrics["epoch_peak_memory_mb"] = peak_memory_mb(self.device)
            metrics["train_seconds"] = self.train_seconds
        if self.draws:
            self._screen_draws(metrics, val_records)
        self._early_stopping(metrics)
        if self.stop_reason is not None and self.refresh_feature_stats(train_records) > 1:
            val = self.evaluate(val_records)
            gathered = self.collective.all_gather((val.targets, val.probs, val.loss))
            vt = [t for g in gathered for t in g[0]]
            if self.rank == 0 and vt:
                metrics["final_val_loss"] = sum(g[2] for g in gathered) / len(vt)
                metrics.update(
                    classification_metrics(vt, np.array([p for g in gathered for p in g[1]]), prefix="final_val_")
                )
        return metrics

    def _val_metrics(self, gathered: Sequence[tuple]) -> dict[str, float]:
        """``val_loss``, the classification metrics (``val_*``) and ``val_chance_p`` of every worker's
        ``(targets, probs, loss sum, patches)`` (empty on ranks other than 0 and without validation slides)."""
        vt = [t for g in gathered for t in g[0]]
        if self.rank != 0 or not vt:
            return {}
        vp = [p for g in gathered for p in g[1]]
        metrics = {"val_loss": sum(g[2] for g in gathered) / len(vt)}
        metrics.update(classification_metrics(vt, np.array(vp), prefix="val_"))
        correct = int(sum(int(np.argmax(p)) == t for t, p in zip(vt, vp)))
        chance = max(np.bincount(np.asarray(vt, dtype=np.int64)).tolist()) / len(vt)
        metrics["val_chance_p"] = chance_p_value(correct, len(vt), chance)
        return metrics

    def _update_stopper(self, stopper: EarlyStopping, metrics: dict[str, float]) -> bool:
        """Feed rank 0's value of ``stopper``'s metric (and whether it beats chance) to ``stopper`` on every rank;
        returns its decision."""
        value, p = self.collective.all_gather(
            (metrics.get(stopper.metric), metrics.get("val_chance_p")) if self.rank == 0 else None
        )[0]
        beats = p is not None and p < CHANCE_ALPHA
        return stopper.update(self.epoch, math.nan if value is None else float(value), beats_chance=beats)

    def _early_stopping(self, metrics: dict[str, float]) -> None:
        """After an epoch's validation: feed rank 0's metric to the stopping rule on every rank (the same value,
        so every worker decides the same), keep the weights of a new best epoch, and when training ends here
        (patience or the cap) load the best epoch's weights back into :attr:`eval_model`. Adds ``best_epoch``,
        ``best_<metric>`` and, at the end, ``stopped_epoch`` to rank 0's ``metrics``."""
        cap = self.optim_cfg.epochs
        stop = False
        if self.stopper is not None:
            name = self.stopper.metric
            stop = self._update_stopper(self.stopper, metrics)
            if self.stopper.best_epoch == self.epoch:
                self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.eval_model.state_dict().items()}
            if self.rank == 0 and self.stopper.best is not None:
                metrics["best_epoch"] = self.stopper.best_epoch
                metrics[f"best_{name}"] = self.stopper.best
        if stop and self.epoch != cap:  # at the cap itself the cap ends it
            self.stop_reason = "patience"
            if self.rank == 0:
                log.info("%s", self.stopper.message())
        elif self.epoch >= self.max_epochs > cap:
            self.stop_reason = "max_epochs"
        elif self.epoch >= cap:
            if self.epoch < self.max_epochs and self.stopper is not None and self.stopper.learning():
                if self.rank == 0 and self.epoch == cap:
                    log.info(
                        "epoch %d is optim.epochs, but %s still improves (last new best at epoch %d, patience %d): "
                        "training on, at most to epoch %d (early_stopping.max_epochs)",
                        cap,
                        self.stopper.metric,
                        max(self.stopper.best_epoch, self.stopper.curve_best_epoch),
                        self.stopper.patience,
                        self.max_epochs,
                    )
            elif self.epoch == cap:
                self.stop_reason = "cap"
            else:  # past the cap, the curve has been flat for patience epochs
                self.stop_reason = "patience"
                if self.rank == 0:
                    log.info(
                        "epoch %d (past optim.epochs %d): %s has not reached a new best for %d epochs; best epoch %d "
                        "restored",
                        self.epoch,
                        cap,
                        self.stopper.metric,
                        self.stopper.patience,
                        self.stopper.best_epoch,
                    )
        if self.stop_reason is None:
            return
        if self.best_state is not None and self.stopper.best_epoch != self.epoch:
            self.eval_model.load_state_dict(self.best_state)
        if self.rank == 0:
            metrics["stopped_epoch"] = self.epoch

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue training: model, optimiser, scheduler, counters and every worker's generator
        state (``generators[rank]``; gathered, so every rank must call this)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "train_seconds": self.train_seconds,
            "generators": self.collective.all_gather(self.generator.get_state()),
            **({"ema": self.ema_model.state_dict()} if self.ema_model is not None else {}),
            "stop_reason": self.stop_reason,
            **(
                {"early_stopping": self.stopper.state_dict(), "best_model": self.best_state}
                if self.stopper is not None
                else {}
            ),
            **({"draws": [d.state_dict() for d in self.draws], "draw_losses": self._draw_losses} if self.draws else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (this rank's generator state where it was saved)."""
        self.model.load_state_dict(state["model"])
        if self.ema_model is not None:
            self.ema_model.load_state_dict(state.get("ema", state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        gen_states = state.get("generators") or []
        if self.rank < len(gen_states):
            self.generator.set_state(gen_states[self.rank])
        self.stop_reason = state.get("stop_reason")
        if self.stopper is not None and state.get("early_stopping") is not None:
            self.stopper.load_state_dict(state["early_stopping"])
            self.best_state = state.get("best_model")
        self.draws = []
        for d_state in state.get("draws") or []:  # a checkpoint before the choice of schedule.select_draws
            d = self._new_draw(int(d_state["seed"]))
            d.load_state_dict(d_state)
            self.draws.append(d)
        self._draw_losses = [float(v) for v in state.get("draw_losses") or []]
