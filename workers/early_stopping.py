"""Validation-based early stopping: :class:`EarlyStoppingConfig` (the ``early_stopping`` section of ``foveate
train``'s config) and :class:`EarlyStopping`, the stopping rule as a plain class (no torch, Ray or MLflow).

After each epoch the rule gets the epoch's validation metric (:meth:`EarlyStopping.update`). An epoch improves
when its value beats the best so far by more than ``min_delta`` (lower for ``val_loss``, higher for ``val_auc``
and ``val_accuracy``); training stops after ``patience`` epochs in a row without an improvement, but never before
epoch ``min_epochs``, and (``after_chance``, the default) only once the model has beaten chance on the validation
split (:func:`chance_p_value`): a classifier that has not started to learn is not stopped. ``optim.epochs`` stays
the cap. :class:`workers.trainer.Trainer` keeps the evaluated
weights of the best epoch and loads them back when training ends (stopped or at the cap), so the model that is
checkpointed last, exported and logged is the best epoch's; the rule's state and those weights are part of the
trainer's checkpointed state, so ``--resume`` continues the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from operators.errors import ConfigError

__all__ = ["METRICS", "CHANCE_ALPHA", "EarlyStoppingConfig", "EarlyStopping", "chance_p_value", "stop_message"]

#: the validation metrics early stopping can follow, and whether lower or higher is better
METRICS: dict[str, str] = {"val_loss": "min", "val_auc": "max", "val_accuracy": "max"}

#: the significance level at which a validation accuracy has beaten chance (``after_chance``)
CHANCE_ALPHA = 0.05


def chance_p_value(correct: int, n: int, chance: float) -> float:
    """One-sided binomial p-value that ``correct`` of ``n`` validation slides or more are right by chance.

    Args:
        correct: slides classified right (0..n).
        n: validation slides (>= 0; 0 gives 1.0: nothing has been shown).
        chance: the accuracy of the best constant guess, the majority class's share of the validation split (0..1).

    Returns:
        ``P(X >= correct)`` for ``X ~ Binomial(n, chance)``, exact (log-space sum), in [0, 1].
    """
    if isinstance(correct, bool) or isinstance(n, bool) or not (0 <= int(correct) <= int(n)):
        raise ValueError(f"correct: got {correct!r} of n={n!r}, must be an integer in [0, n]")
    if not (0.0 <= float(chance) <= 1.0):
        raise ValueError(f"chance: got {chance!r}, must be a share in [0, 1]")
    correct, n, chance = int(correct), int(n), float(chance)
    if correct == 0:
        return 1.0
    if chance <= 0.0:
        return 0.0
    if chance >= 1.0:
        return 1.0
    lp, lq = math.log(chance), math.log1p(-chance)
    terms = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
        for k in range(correct, n + 1)
    ]
    top = max(terms)
    return float(min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms)))


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """Stop training when the validation metric has stopped improving; export the best epoch's model.

    ``val_loss`` (the default) keeps moving where accuracy and AUC have saturated: on a small validation split
    (the demo's ten slides) ``val_auc`` is 1.0 from the first epoch, and following it would export that epoch.
    The schedules (``schedule.*``, the LR's cosine) stay fractions of ``optim.epochs``, the cap, and training never
    stops while a scheduled exploration term is still on (``schedule.rarity_start`` > 0 until
    ``schedule.rarity_until``; ``schedule.rare_until`` with ``model.evidence.rare_cells``). A classifier restarted at
    the switch of ``schedule.select_until`` (``schedule.select_restart``) is a new model: the rule starts over there
    (no best, no count), so the exported model is the best epoch of the second phase, never a first-phase one.
    With ``after_chance`` the count of epochs without an improvement starts only once the validation accuracy has
    beaten chance (the majority class's share of the validation split, one-sided binomial test at p < 0.05) on
    ``chance_epochs`` epochs in a row (each epoch looks at the same split again, so one epoch past p < 0.05 can be
    luck), and the last of them is the first candidate for export: a classifier still at chance (the first epochs
    of a restarted one, a model before its discovery) is neither stopped nor kept for its (chance-level) validation
    loss.
    On a validation split too small for the test to pass (4 slides or fewer in two classes: 4 of 4 right has
    p = 0.0625) training runs to the cap and exports the best epoch.
    """

    metric: Literal["val_loss", "val_auc", "val_accuracy"] = "val_loss"
    """Validation metric to follow: ``val_loss`` (lower is better), ``val_auc`` or ``val_accuracy`` (higher)."""
    patience: int = 5
    """Epochs in a row without an improvement before training stops; 0: off (train to the cap, export the last)."""
    min_delta: float = 0.0
    """An epoch improves when it beats the best value so far by more than this."""
    min_epochs: int = 0
    """Never stop before this many epochs (nor before the scheduled exploration ends, see above)."""
    after_chance: bool = True
    """Count epochs without an improvement only once the validation accuracy has beaten chance (p < 0.05); the
    epochs before are no candidates for the exported model (unless chance is never beaten)."""
    chance_epochs: int = 2
    """With ``after_chance``: epochs in a row the validation accuracy must beat chance before the count starts."""
    max_epochs: int = 0
    """0 (the default): training ends at ``optim.epochs``. Above ``optim.epochs``: a model still learning at the cap
    trains on past it, one epoch at a time, while the validation curve says so (:meth:`EarlyStopping.learning`: the
    rule counts and has patience left, or the metric reached a new best within the last ``patience`` epochs, chance
    beaten or not); at most to this epoch. A model whose curve has been flat for ``patience`` epochs (stuck at
    chance, or memorising) or whose patience ran out at the cap ends at the cap. The schedules stay fractions of
    ``optim.epochs`` (past it the LR stays at its floor, ``optim.min_lr_ratio``)."""

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"early_stopping.metric: got {self.metric!r}, must be one of {list(METRICS)}")
        if isinstance(self.chance_epochs, bool) or not isinstance(self.chance_epochs, int) or self.chance_epochs < 1:
            raise ConfigError(f"early_stopping.chance_epochs: got {self.chance_epochs!r}, must be an integer >= 1")
        for name in ("patience", "min_epochs", "max_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"early_stopping.{name}: got {v!r}, must be an integer >= 0")
        if not isinstance(self.after_chance, bool):
            raise ConfigError(f"early_stopping.after_chance: got {self.after_chance!r}, must be true or false")
        v = self.min_delta
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"early_stopping.min_delta: got {v!r}, must be a finite number >= 0")


class EarlyStopping:
    """The stopping rule: feed it each epoch's metric with :meth:`update`; it says when to stop.

    Args:
        metric: name of the metric (a key of :data:`METRICS` when ``mode`` is not given).
        patience: epochs in a row without an improvement before :meth:`update` returns True (>= 1).
        min_delta: an improvement beats the best value by more than this.
        min_epochs: :meth:`update` never returns True for an epoch below this.
        mode: ``"min"`` or ``"max"``; default from :data:`METRICS`.
        after_chance: count epochs without an improvement only from the first epoch :meth:`update` is told the
            model beats chance (``beats_chance=True``) for the ``chance_epochs``-th time in a row, and take that
            epoch as the first candidate (the best until then, an epoch at chance, is dropped); before it the best
            is kept (what a run that never beats chance exports) but the count stays 0.
        chance_epochs: see ``after_chance`` (>= 1).

    A NaN value (e.g. the AUC of a validation split with one class) is never an improvement; while no finite value
    has been seen there is no best, and the rule never stops.
    """

    def __init__(
        self,
        metric: str = "val_loss",
        *,
        patience: int = 5,
        min_delta: float = 0.0,
        min_epochs: int = 0,
        mode: str | None = None,
        after_chance: bool = False,
        chance_epochs: int = 1,
    ):
        mode = METRICS.get(metric) if mode is None else mode
        if mode not in ("min", "max"):
            raise ValueError(f"mode: got {mode!r} for metric {metric!r}, must be 'min' or 'max'")
        if patience < 1:
            raise ValueError(f"patience: got {patience!r}, must be >= 1")
        if isinstance(chance_epochs, bool) or not isinstance(chance_epochs, int) or chance_epochs < 1:
            raise ValueError(f"chance_epochs: got {chance_epochs!r}, must be an integer >= 1")
        self.metric, self.mode = metric, mode
        self.patience, self.min_delta, self.min_epochs = int(patience), float(min_delta), int(min_epochs)
        self.best: float | None = None
        self.best_epoch = 0  # 0: none yet
        self.bad_epochs = 0  # epochs since the best
        self.stopped_epoch = 0  # the epoch update() returned True for; 0: not stopped
        self.after_chance = bool(after_chance)
        self.chance_epochs = int(chance_epochs)
        self.chance_epoch = 0  # the epoch the count started at (after_chance); 0: not yet
        self.chance_streak = 0  # epochs in a row told the model beats chance, up to the current one
        # the curve itself, chance or not (learning()): its best value since the start (or restart), that epoch's
        # number and the last epoch seen
        self.curve_best: float | None = None
        self.curve_best_epoch = 0
        self.last_epoch = 0

    @classmethod
    def from_config(cls, config: EarlyStoppingConfig, *, min_epochs: int | None = None) -> EarlyStopping:
        """The rule of ``config`` (``min_epochs`` overrides ``config.min_epochs``)."""
        return cls(
            config.metric,
            patience=config.patience,
            min_delta=config.min_delta,
            min_epochs=config.min_epochs if min_epochs is None else min_epochs,
            after_chance=config.after_chance,
            chance_epochs=config.chance_epochs,
        )

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta`` (any finite value beats none)."""
        return self._beats(value, self.best)

    def _beats(self, value: float | None, best: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    @property
    def counting(self) -> bool:
        """Whether epochs without an improvement count (always, or with ``after_chance`` once chance is beaten)."""
        return not self.after_chance or self.chance_epoch > 0

    def update(self, epoch: int, value: float, *, beats_chance: bool = False) -> bool:
        """Record ``epoch``'s (1-based) metric ``value`` and whether the model beats chance this epoch (read with
        ``after_chance`` only); True when training should stop after this epoch."""
        self.chance_streak = self.chance_streak + 1 if beats_chance else 0
        self.last_epoch = int(epoch)
        if self._beats(value, self.curve_best):
            self.curve_best, self.curve_best_epoch = float(value), int(epoch)
        if self.after_chance and self.chance_streak >= self.chance_epochs and self.chance_epoch == 0:
            # the first epoch past chance (the last of a streak) is the first candidate: an earlier one is never
            # exported
            self.chance_epoch = int(epoch)
            self.best, self.best_epoch, self.bad_epochs = None, 0, 0
        if self.improves(value):
            self.best, self.best_epoch, self.bad_epochs = float(value), int(epoch), 0
        elif self.best is not None and self.counting:
            self.bad_epochs += 1
        stop = self.best is not None and self.bad_epochs >= self.patience and epoch >= self.min_epochs
        if stop:
            self.stopped_epoch = int(epoch)
        return stop

    def learning(self) -> bool:
        """Whether the validation curve says the model is still learning (the test for training on past
        ``optim.epochs``, ``max_epochs``): the rule has not stopped, and either it counts (with ``after_chance``,
        chance has been beaten) and has patience left, or the curve itself (chance beaten or not) reached a new
        best within the last ``patience`` epochs — a model about to leave chance, not one stuck at it."""
        if self.stopped:
            return False
        if self.counting and self.best is not None and self.bad_epochs < self.patience:
            return True
        return self.curve_best_epoch > 0 and self.last_epoch - self.curve_best_epoch < self.patience

    def restart(self) -> None:
        """Start over: no best value and no count, as for a new model (the classifier restarted by
        ``schedule.select_restart``; with ``after_chance`` it has to beat chance again); ``min_epochs`` and a stop
        already decided stay."""
        self.best, self.best_epoch, self.bad_epochs, self.chance_epoch = None, 0, 0, 0
        self.chance_streak = 0
        self.curve_best, self.curve_best_epoch = None, 0

    @property
    def stopped(self) -> bool:
        return self.stopped_epoch > 0

    def message(self) -> str:
        """One line saying why training stopped early (after :meth:`update` returned True)."""
        return stop_message(self.metric, self.min_delta, self.stopped_epoch, self.best_epoch, self.best)

    def state_dict(self) -> dict[str, Any]:
        """Plain values (``torch.load(..., weights_only=True)`` reads them back)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "bad_epochs": self.bad_epochs,
            "stopped_epoch": self.stopped_epoch,
            "chance_epoch": self.chance_epoch,
            "chance_streak": self.chance_streak,
            "curve_best": self.curve_best,
            "curve_best_epoch": self.curve_best_epoch,
            "last_epoch": self.last_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of the same metric."""
        if state.get("metric", self.metric) != self.metric or state.get("mode", self.mode) != self.mode:
            raise ValueError(
                f"early stopping state of {state.get('metric')!r} ({state.get('mode')}), this rule follows "
                f"{self.metric!r} ({self.mode})"
            )
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_epoch = int(state.get("best_epoch", 0))
        self.bad_epochs = int(state.get("bad_epochs", 0))
        self.stopped_epoch = int(state.get("stopped_epoch", 0))
        self.chance_epoch = int(state.get("chance_epoch", 0))
        self.chance_streak = int(state.get("chance_streak", 0))
        curve = state.get("curve_best")  # absent in a state saved before the curve was kept: none yet
        self.curve_best = None if curve is None else float(curve)
        self.curve_best_epoch = int(state.get("curve_best_epoch", 0))
        self.last_epoch = int(state.get("last_epoch", 0))


def stop_message(metric: str, min_delta: float, stopped_epoch: int, best_epoch: int, best: float) -> str:
    """``early stop at epoch E: METRIC has not improved by more than D for N epochs; best epoch E*: METRIC = V,
    restored``."""
    return (
        f"early stop at epoch {stopped_epoch}: {metric} has not improved by more than {min_delta:g} for "
        f"{stopped_epoch - best_epoch} epochs; best epoch {best_epoch}: {metric} = {best:.4g}, restored"
    )
