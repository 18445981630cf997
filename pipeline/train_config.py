"""``foveate train``'s config: :class:`TrainConfig` (YAML sections = fields; unknown keys are errors).

Each section validates itself in ``__post_init__`` and raises ``ConfigError``: ``model``
(``operators.model.ModelConfig``), ``optim`` and ``schedule`` (``workers.trainer``), ``data``
(``pipeline.data``), ``early_stopping`` (``workers.early_stopping``), ``pretrain`` (``workers.pretrain``, read by
``foveate pretrain`` only), ``tracking`` (here).
:class:`TrainConfig` checks only its own fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from operators.errors import ConfigError
from operators.model_config import ModelConfig, resolve_symmetry
from pipeline.data import DataConfig
from workers.early_stopping import EarlyStoppingConfig
from workers.pretrain import PretrainConfig
from workers.trainer import OptimConfig, ScheduleConfig

__all__ = [
    "PLACEMENT_STRATEGIES",
    "EarlyStoppingConfig",
    "OptimConfig",
    "PretrainConfig",
    "ScheduleConfig",
    "TrackingConfig",
    "TrainConfig",
]

#: Ray placement-group strategies for the training workers (``TrainConfig.placement_strategy``).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: got {value!r}, must be {allowed}")


def _is_plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name) <= 200
        and name not in (".", "..")
        and all(c.isalnum() or c in "-_." for c in name)
    )


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow experiment/run names and what to log.

    Attributes:
        experiment: MLflow experiment name.
        run_name: run name (and run directory name); default ``<experiment>-<UTC timestamp>``.
        artifact_slides: validation slides that get a heatmap and a patch gallery.
        log_every: log step metrics every this many optimizer steps.
        registered_model: also register the logged model under this name in the MLflow model registry (a new
            version per run; promote one with ``foveate compare --promote ALIAS --by METRIC``).
    """

    experiment: str = "foveate"
    run_name: str | None = None
    artifact_slides: int = 2
    log_every: int = 1
    registered_model: str | None = None

    def __post_init__(self) -> None:
        _check("tracking.artifact_slides", self.artifact_slides, self.artifact_slides >= 0, ">= 0")
        _check("tracking.log_every", self.log_every, self.log_every >= 1, ">= 1")
        _check(
            "tracking.run_name",
            self.run_name,
            self.run_name is None or _is_plain_name(self.run_name),
            "None or a plain folder name (letters, digits, '.', '-', '_'; no '/' or '..'): the run directory "
            "<workdir>/train/<run_name> stays inside the workdir",
        )
        _check(
            "tracking.registered_model",
            self.registered_model,
            self.registered_model is None
            or (isinstance(self.registered_model, str) and bool(self.registered_model.strip())),
            "None or a non-empty model name",
        )


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``foveate train`` needs.

    Attributes:
        data: slides, labels, split.
        model: the model (``operators.model.ModelConfig``; its number of classes is set from the data, and
            ``foveate train`` logs when that changes the configured value).
        pretrain: self-supervised pretraining of the encoder (``foveate pretrain`` only;
            ``workers.pretrain.PretrainConfig``).
        optim: optimiser, schedule, loss weights; ``optim.epochs`` is the cap on the epochs.
        schedule: selection perturbation schedule.
        early_stopping: stop when the validation metric has stopped improving and export the best epoch's model
            (``workers.early_stopping.EarlyStoppingConfig``; on by default: ``val_loss``, patience 5).
        tracking: MLflow names.
        workers: Ray Train workers.
        use_gpu: None = use GPUs when the cluster has them.
        threads: torch threads per worker (0 = one per CPU Ray gives the worker).
        cpus_per_worker: CPUs each worker reserves.
        placement_strategy: how Ray Train places the workers' bundles (``ScalingConfig.placement_strategy``):
            ``PACK`` (Ray's default: as few nodes as possible), ``SPREAD`` (one per node where it can, else
            packed), ``STRICT_SPREAD`` (each worker on a different node, or the run waits), ``STRICT_PACK``
            (all on one node). Each worker logs its rank and Ray node id (``foveate-train-worker rank R/W
            node ID``) to the job's output.
        seed: model initialisation and selection noise.
        workdir: run directories and (without ``MLFLOW_TRACKING_URI``) the sqlite tracking store.
        max_failures: worker-group restarts Ray Train makes from the latest checkpoint after a crash.
        feature_cache: the frozen-feature cache (``workers.feature_cache``): ``auto`` (default) keeps the features
            of every patch read in ``<run dir>/feature_cache`` when the encoder is frozen (``model.features.freeze``
            or ``kind: torchscript``), so later epochs skip the read and the encoder for cells already seen;
            ``off`` (or false) disables it; any other value is the cache folder (a local path; a run dir on object storage
            gets no cache unless one is given). Never used for a trained encoder. Rule: evaluation always uses it;
            training only with ``model.augment.color_jitter`` 0 (jittered pixels have other features; one log
            line says so), and the selected slots only when each is one cell (the perturbed selector's soft
            patches are encoded as before). Keyed by the encoder's weights, the features config and the patch
            geometry, so a change gets a fresh cache; each worker writes its own sub-folder.
    """

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    workers: int = 1
    use_gpu: bool | None = None
    threads: int = 0
    cpus_per_worker: int = 1
    placement_strategy: str = "PACK"
    seed: int = 0
    workdir: str = "runs"
    max_failures: int = 0
    feature_cache: bool | str = "auto"

    def __post_init__(self) -> None:
        _check("workers", self.workers, self.workers >= 1, ">= 1")
        _check("threads", self.threads, self.threads >= 0, ">= 0")
        _check("cpus_per_worker", self.cpus_per_worker, self.cpus_per_worker >= 1, ">= 1")
        _check(
            "placement_strategy",
            self.placement_strategy,
            self.placement_strategy in PLACEMENT_STRATEGIES,
            " or ".join(PLACEMENT_STRATEGIES),
        )
        _check("max_failures", self.max_failures, self.max_failures >= -1, ">= -1 (-1 = unlimited)")
        es = self.early_stopping
        _check(
            "early_stopping.max_epochs",
            es.max_epochs,
            es.max_epochs == 0 or (es.max_epochs >= self.optim.epochs and es.patience > 0),
            f"0 (end at optim.epochs) or an epoch >= optim.epochs ({self.optim.epochs}) with early_stopping.patience "
            f"> 0 (got patience {es.patience}): training goes past the cap only while the stopping rule says the "
            "model is still learning",
        )
        # model.augment.symmetry against what the archive states its labels keep: `auto` becomes a symmetry here,
        # so every consumer of a loaded config sees one of SYMMETRIES
        symmetry = resolve_symmetry(self.model.augment.symmetry, self.data.label_symmetry)
        if symmetry != self.model.augment.symmetry:
            augment = dataclasses.replace(self.model.augment, symmetry=symmetry)
            object.__setattr__(self, "model", dataclasses.replace(self.model, augment=augment))
        if isinstance(self.feature_cache, bool):  # YAML reads a bare off / on as a bool
            object.__setattr__(self, "feature_cache", "auto" if self.feature_cache else "off")
        _check(
            "feature_cache",
            self.feature_cache,
            isinstance(self.feature_cache, str) and bool(self.feature_cache),
            "'auto', 'off' or a folder",
        )
