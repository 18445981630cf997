"""The model's configuration (YAML section ``model:``): a few small frozen dataclasses, one per concern.

Every default is the recommended recipe, so a config file states only what differs from it::

    model:
      num_classes: 2          # set by `foveate train` from the labels
      geometry:     {patch_size: 64, stride: null, scorer_downsample: 16, tissue_threshold: 0.1}
      scorer:       {channels: 16, num_layers: 4, pool: max}
      selection:    {selector: perturbed, k: 8, nms_radius: 1, ..., perturbed: {...}, sinkhorn: {...}, ...}
      evidence:     {explore_cells: 8, rare_cells: 32, neutral_cells: 8, instance_weight: 0.01, ...}
      augment:      {color_jitter: 0.2}
      features:     {kind: resnet, widths: [16, 32, 64], blocks: [1, 1, 1], feature_dim: 64}  # or torchscript
      aggregator:   {kind: mean, hidden: 64, attention_mil: {...}, transformer: {...}}
      experimental: {...}     # switches kept for study, off by default

``foveate config show [--config C] [--set key=value]`` prints the effective config and where each value came from.
The flat keys of earlier versions (``model.k``, ``model.selector``, ``model.aggregator: mean`` ...) still load, each
with a one-line deprecation naming its new key (:func:`upgrade_flat_keys`); checkpoints written with them load
unchanged. docs/model.md explains the model; benchmarks/RESULTS.md has the measurements behind each default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from operators.errors import ConfigError
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig

__all__ = [
    "SELECTORS",
    "GeometryConfig",
    "PerturbedConfig",
    "SinkhornConfig",
    "LapSumConfig",
    "AttentionConfig",
    "SelectionConfig",
    "EvidenceConfig",
    "AugmentConfig",
    "SYMMETRIES",
    "LABEL_SYMMETRIES",
    "AUGMENT_SYMMETRIES",
    "AUTO_SYMMETRY_FALLBACK",
    "resolve_symmetry",
    "FEATURE_KINDS",
    "FeaturesConfig",
    "is_init_uri",
    "resolved_by_driver",
    "GATE_ENCODER_PRETRAIN",
    "AttentionMILConfig",
    "TransformerConfig",
    "AggregatorConfig",
    "ExperimentalConfig",
    "ModelConfig",
    "SlideGeometry",
    "FLAT_KEYS",
    "REMOVED_KEYS",
    "upgrade_flat_keys",
]

log = logging.getLogger(__name__)

SELECTORS = ("perturbed", "sinkhorn", "lapsum", "attention", "hard")
AGGREGATOR_KINDS = ("mean", "max", "vote", "attention_mil", "transformer")
READOUTS = ("mean", "logit_mean", "cls", "gate")


# ---------------------------------------------------------------------------------------------- checks
def _int(where: str, v: Any, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{where} must be an int >= {minimum}, got {v!r}")


def _file_path(where: str, value: Any) -> None:
    """``value`` is a file path (a non-empty string) or None."""
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{where} must be a file path (a non-empty string) or null, got {value!r}")


def _num(where: str, v: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb, rb = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
        raise ConfigError(f"{where} must be a finite number in {lb}{lo:g}, {hi:g}{rb}, got {v!r}")


def _choice(where: str, v: Any, allowed: tuple) -> None:
    if v not in allowed:
        raise ConfigError(f"{where} must be one of {list(allowed)}, got {v!r}")


def _bool(where: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{where} must be true or false, got {v!r}")


# ---------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class SlideGeometry:
    """The model's geometry on one slide (:meth:`ModelConfig.slide_geometry`), in that slide's level-0 pixels.

    Attributes:
        patch_size: grid cell side in level-0 pixels.
        stride: grid stride in level-0 pixels.
        scorer_downsample: level-0 pixels per pixel of the scorer's view (>= 1).
        patch_input: side of the patches the feature network sees (each ``patch_size`` patch is resampled to
            it when they differ).
        mpp: the slide's level-0 µm per pixel (None: unknown).
    """

    patch_size: int
    stride: int
    scorer_downsample: float
    patch_input: int
    mpp: float | None = None


@dataclass(frozen=True)
class GeometryConfig:
    """The patch grid and the scorer's view. Sizes come in level-0 pixels or in µm (exactly one of each pair:
    ``patch_size``/``patch_size_um``, ``scorer_downsample``/``scorer_mpp``); µm settings are resolved per slide
    from its store's level-0 mpp, so slides scanned at 20x and 40x give the same grid in µm."""

    patch_size: int | None = None
    """Side of a patch (grid cell) in level-0 pixels; None: 64 unless ``patch_size_um`` is set."""
    stride: int | None = None
    """Grid stride in level-0 pixels; None: half of ``patch_size`` (cells overlap by half)."""
    patch_size_um: float | None = None
    """Side of a patch in µm, instead of ``patch_size`` (per slide ``round(patch_size_um / mpp)`` pixels)."""
    stride_um: float | None = None
    """Grid stride in µm (with ``patch_size_um``); None: half of ``patch_size_um``."""
    patch_input: int | None = None
    """Side in pixels of the patches the feature network sees; None: ``patch_size`` (µm: the training mpp's)."""
    scorer_downsample: float | None = None
    """Level-0 pixels per pixel of the scorer's low-res view; None: 16 unless ``scorer_mpp`` is set."""
    scorer_mpp: float | None = None
    """µm per pixel of the scorer's view, instead of ``scorer_downsample`` (must not be finer than level 0)."""
    tissue_threshold: float = 0.1
    """A cell is a candidate when at least this fraction of it is tissue (0: every cell)."""
    recentre: bool = False
    """Move each cell's full-resolution read (up to half a stride per axis) onto the centre of mass of the stained
    structure it holds, found on the low-res view (:mod:`workers.recentre`); the same cell is always read the same
    way, in training, evaluation and scoring."""

    def __post_init__(self) -> None:
        for px, um in (("patch_size", "patch_size_um"), ("scorer_downsample", "scorer_mpp")):
            if getattr(self, px) is not None and getattr(self, um) is not None:
                raise ConfigError(
                    f"model.geometry.{px} and model.geometry.{um}: exactly one may be set (level-0 pixels or µm), "
                    f"got {px}={getattr(self, px)!r} and {um}={getattr(self, um)!r}; set the other to null"
                )
        if self.patch_size is None and self.patch_size_um is None:
            object.__setattr__(self, "patch_size", 64)
        if self.scorer_downsample is None and self.scorer_mpp is None:
            object.__setattr__(self, "scorer_downsample", 16.0)
        if self.patch_size_um is not None:
            _num("model.geometry.patch_size_um", self.patch_size_um, 0, lo_open=True)
            if self.stride is not None:
                raise ConfigError(
                    "model.geometry.stride is in level-0 pixels and goes with patch_size; with patch_size_um set "
                    f"stride_um (µm) instead, got stride={self.stride!r}"
                )
            if self.stride_um is not None:
                _num("model.geometry.stride_um", self.stride_um, 0, lo_open=True)
        else:
            if self.stride_um is not None:
                raise ConfigError(
                    "model.geometry.stride_um goes with patch_size_um; with patch_size set stride (level-0 pixels) "
                    f"instead, got stride_um={self.stride_um!r}"
                )
            _int("model.geometry.patch_size", self.patch_size, 8)
            if self.stride is not None:
                _int("model.geometry.stride", self.stride, 1)
        if self.scorer_mpp is not None:
            _num("model.geometry.scorer_mpp", self.scorer_mpp, 0, lo_open=True)
        if self.scorer_downsample is not None:
            _num("model.geometry.scorer_downsample", self.scorer_downsample, 1)
        if self.patch_input is not None:
            _int("model.geometry.patch_input", self.patch_input, 8)
        _num("model.geometry.tissue_threshold", self.tissue_threshold, 0, 1)
        _bool("model.geometry.recentre", self.recentre)

    @property
    def stride_l0(self) -> int:
        """The grid stride in level-0 pixels; pixel patches only (µm patches have one per slide)."""
        if self.patch_size is None:
            raise ConfigError(
                f"model.geometry.patch_size_um={self.patch_size_um} is resolved per slide: use "
                "ModelConfig.slide_geometry(mpp) (workers.patches.slide_geometry(store, cfg)), not stride_l0"
            )
        return max(1, self.patch_size // 2) if self.stride is None else self.stride

    @property
    def physical(self) -> bool:
        """True when both the patch size and the scorer's resolution are in µm (the model adapts to each slide's
        mpp; scoring does not warn about a store at another mpp than the model's)."""
        return self.patch_size_um is not None and self.scorer_mpp is not None

    @property
    def uses_um(self) -> bool:
        """True when either the patch size or the scorer's resolution is in µm (stores need an mpp)."""
        return self.patch_size_um is not None or self.scorer_mpp is not None


# ---------------------------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class PerturbedConfig:
    """Perturbed top-k (Cordonnier et al. 2021): soft patches from the noisy top-k's indicators."""

    max_support: int = 1
    """Cells kept per slot of a soft patch (1: each slot reads its most frequent cell over the noise samples)."""

    def __post_init__(self) -> None:
        _int("model.selection.perturbed.max_support", self.max_support, 1)


_DRAWS = ("topk", "slot_modes")
_GATES = ("mask", "hard", "certainty")


def _check_soft(where: str, draw: str, gates: str, mask_extra: int) -> None:
    _choice(f"{where}.draw", draw, _DRAWS)
    _choice(f"{where}.gates", gates, _GATES)
    _int(f"{where}.mask_extra", mask_extra, 0)


@dataclass(frozen=True)
class SinkhornConfig:
    """SOFT top-k (Xie et al. 2020), an entropic optimal transport solved by Sinkhorn iterations."""

    epsilon: float = 0.01
    """Entropic regularisation."""
    max_iter: int = 200
    """Sinkhorn iterations."""
    draw: Literal["topk", "slot_modes"] = "slot_modes"
    """Training bag: ``topk`` the k largest scores; ``slot_modes`` the perturbed top-k's bag (per slot its most
    frequent cell over ``selection.num_samples`` noisy top-k draws), the soft mask's gradient straight-through."""
    gates: Literal["mask", "hard", "certainty"] = "certainty"
    """Weights of the read cells: ``mask`` the mask / k; ``hard`` the top-k mean (mask gradient);
    ``certainty`` max(0, 2m - 1) normalised over the bag in training, the hard mean at inference."""
    mask_extra: int = 8
    """Cells ranked just below the top-k also read in training (the mask's tail; evidence losses)."""

    def __post_init__(self) -> None:
        _num("model.selection.sinkhorn.epsilon", self.epsilon, 0, lo_open=True)
        _int("model.selection.sinkhorn.max_iter", self.max_iter, 1)
        _check_soft("model.selection.sinkhorn", self.draw, self.gates, self.mask_extra)


@dataclass(frozen=True)
class LapSumConfig:
    """LapSum soft top-k (Struski et al. 2025)."""

    alpha: float = 0.01
    """Scale of the Laplace CDFs (smaller: closer to the hard top-k)."""
    draw: Literal["topk", "slot_modes"] = "topk"
    """Training bag, as ``selection.sinkhorn.draw``."""
    gates: Literal["mask", "hard", "certainty"] = "certainty"
    """Weights of the read cells, as ``selection.sinkhorn.gates``."""
    mask_extra: int = 8
    """Cells ranked just below the top-k also read in training, as ``selection.sinkhorn.mask_extra``."""

    def __post_init__(self) -> None:
        _num("model.selection.lapsum.alpha", self.alpha, 0, lo_open=True)
        _check_soft("model.selection.lapsum", self.draw, self.gates, self.mask_extra)


@dataclass(frozen=True)
class AttentionConfig:
    """Attention sampling (Katharopoulos & Fleuret 2019): K cells drawn from ``softmax(scores / temperature)``."""

    temperature: float = 0.05
    """Softmax temperature over the min-max normalised scores (0.05: the best cell weighs <= e^20 the worst)."""
    entropy_weight: float = 0.01
    """Weight of the attention-entropy regulariser (``-w * H`` added to the loss)."""
    replace: bool = False
    """Draw with replacement (multinomial) instead of without (Gumbel top-k); with ``draw: sample``."""
    weights: Literal["estimator", "normalised", "uniform", "inclusion"] = "uniform"
    """Bag weights in training: the unbiased ``estimator``'s, the attention ``normalised`` over the drawn cells,
    ``uniform`` 1/K (the with-replacement estimator's gradient), or the ``inclusion`` probabilities."""
    draw: Literal["sample", "slot_modes"] = "slot_modes"
    """``sample``: one draw from the attention; ``slot_modes``: per slot the most frequent cell of
    ``selection.num_samples`` Gumbel-top-k draws (needs ``weights: uniform``)."""

    def __post_init__(self) -> None:
        _num("model.selection.attention.temperature", self.temperature, 0, lo_open=True)
        _num("model.selection.attention.entropy_weight", self.entropy_weight, 0)
        _bool("model.selection.attention.replace", self.replace)
        _choice("model.selection.attention.weights", self.weights, ("estimator", "normalised", "uniform", "inclusion"))
        _choice("model.selection.attention.draw", self.draw, ("sample", "slot_modes"))
        if self.draw == "slot_modes" and self.weights != "uniform":
            raise ConfigError(
                "model.selection.attention.draw: slot_modes gives each bag cell weight 1/K; it needs "
                f"model.selection.attention.weights: uniform, got {self.weights!r}"
            )


@dataclass(frozen=True)
class SelectionConfig:
    """How K cells are chosen from the scores. Every selector takes the hard top-k at inference; the sections
    below configure each selector's training-time behaviour (only the chosen selector's section is used)."""

    selector: Literal["perturbed", "sinkhorn", "lapsum", "attention", "hard"] = "perturbed"
    """``perturbed`` top-k, ``sinkhorn`` (SOFT top-k), ``lapsum``, ``attention`` sampling or ``hard`` (no gradient)."""
    k: int = 8
    """Patches read at full resolution per slide."""
    num_samples: int = 64
    """Noise samples of the perturbed top-k and of the slot-mode draws."""
    sigma: float = 0.05
    """Noise scale of the perturbed top-k and of SOFT's slot-mode draws (``schedule.sigma_*`` may vary it)."""
    nms_radius: int = 1
    """Select only cells that are the maximum of their (2r+1)^2 window of cells (one patch per structure); 0: off."""
    nms_ties: Literal["keep", "first"] = "first"
    """Tied local maxima (overlapping cells of one structure): ``first`` keeps one cell, ``keep`` all."""
    scorer_grad: float = 0.0
    """Multiplier of the classification gradient that reaches the scorer through the selection (0: the scorer
    learns from the evidence rank loss alone; 1: end to end)."""
    perturbed: PerturbedConfig = field(default_factory=PerturbedConfig)
    """Settings of ``selector: perturbed``."""
    sinkhorn: SinkhornConfig = field(default_factory=SinkhornConfig)
    """Settings of ``selector: sinkhorn``."""
    lapsum: LapSumConfig = field(default_factory=LapSumConfig)
    """Settings of ``selector: lapsum``."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Settings of ``selector: attention``."""

    def __post_init__(self) -> None:
        _choice("model.selection.selector", self.selector, SELECTORS)
        _int("model.selection.k", self.k, 1)
        _int("model.selection.num_samples", self.num_samples, 1)
        _num("model.selection.sigma", self.sigma, 0)
        _int("model.selection.nms_radius", self.nms_radius, 0)
        _choice("model.selection.nms_ties", self.nms_ties, ("keep", "first"))
        _num("model.selection.scorer_grad", self.scorer_grad, 0, 1)

    @property
    def soft(self) -> SinkhornConfig | LapSumConfig | None:
        """The active soft top-k's section (``sinkhorn`` or ``lapsum``), None for the other selectors."""
        return {"sinkhorn": self.sinkhorn, "lapsum": self.lapsum}.get(self.selector)


# ---------------------------------------------------------------------------------------------- evidence
@dataclass(frozen=True)
class EvidenceConfig:
    """What training reads beyond the K selected cells, and the evidence losses that teach the scorer where the
    label is (operators/evidence.py, docs/model.md)."""

    explore_cells: int = 8
    """Cells per slide-step drawn at random beside the selection, read for the evidence losses only."""
    explore_strata: int = 8
    """Exploration draws stratified over this many low-res appearance strata (k-means); 0: uniform draws."""
    instance_weight: float = 0.01
    """Weight of the instance loss (a linear head classifies every read patch); 0: no instance head."""
    rank_weight: float = 0.1
    """Weight of the rank loss: the scorer ranks the read cells by their evidence (needs ``instance_weight``)."""
    rank_temperature: float = 0.1
    """Temperature of the rank loss, in normalised score units."""
    target: Literal["confidence", "label"] = "label"
    """Evidence the rank loss orders by: the classifier's probability of the slide's ``label`` for each cell
    alone, or the instance head's label-free ``confidence``."""
    rare_cells: int = 32
    """Cells of the rarest low-res strata read as a second bag with the slide label (``schedule.rare_until``)."""
    rare_strata: int = 64
    """Strata for ``rare_cells`` and the rarity prior."""
    rare_weight: float = 1.0
    """Weight of the rare bag's cross-entropy."""
    neutral_cells: int = 8
    """Random tissue cells whose own prediction is pulled to uniform (filler cannot vote a class); 0: off."""
    neutral_weight: float = 1.0
    """Weight of that loss."""

    def __post_init__(self) -> None:
        for name in ("explore_cells", "explore_strata", "rare_cells", "neutral_cells"):
            _int(f"model.evidence.{name}", getattr(self, name), 0)
        _int("model.evidence.rare_strata", self.rare_strata, 1)
        for name in ("instance_weight", "rank_weight", "rare_weight", "neutral_weight"):
            _num(f"model.evidence.{name}", getattr(self, name), 0)
        _num("model.evidence.rank_temperature", self.rank_temperature, 0, lo_open=True)
        _choice("model.evidence.target", self.target, ("confidence", "label"))
        if self.rare_cells > 0 and self.instance_weight <= 0:
            raise ConfigError(
                "model.evidence.rare_cells > 0 needs model.evidence.instance_weight > 0 (the rare bag is read with "
                f"the evidence losses); got rare_cells={self.rare_cells}, instance_weight={self.instance_weight}"
            )
        if self.rank_weight > 0 and self.instance_weight <= 0:
            raise ConfigError(
                "model.evidence.rank_weight > 0 needs model.evidence.instance_weight > 0 (the instance head the "
                f"rank targets need); got rank_weight={self.rank_weight}, instance_weight={self.instance_weight}"
            )


SYMMETRIES = ("none", "rot180", "flips", "dihedral")
"""The patch symmetries of :class:`AugmentConfig`, each group inside the next (the identity; a half turn; the half
turn and the two axis mirrors; all 8 turns and mirrors of the square)."""
LABEL_SYMMETRIES = ("unknown", *SYMMETRIES)
"""What ``data.label_symmetry`` may state: the largest of :data:`SYMMETRIES` that keeps every label, or
``unknown``."""
AUGMENT_SYMMETRIES = (*SYMMETRIES, "auto")
"""What ``model.augment.symmetry`` may say: one of :data:`SYMMETRIES`, or ``auto`` (:func:`resolve_symmetry`)."""
AUTO_SYMMETRY_FALLBACK = "flips"
"""What ``model.augment.symmetry: auto`` uses where the archive states no label symmetry (``unknown``): the four
symmetries that keep horizontal and vertical apart."""


def resolve_symmetry(symmetry: str, label_symmetry: str) -> str:
    """The patch symmetry training draws from: ``symmetry`` (``model.augment.symmetry``) against what the archive
    states its labels keep (``data.label_symmetry``).

    Args:
        symmetry: one of :data:`SYMMETRIES` or ``auto``.
        label_symmetry: one of :data:`LABEL_SYMMETRIES`.

    Returns:
        ``auto``: ``label_symmetry``, or :data:`AUTO_SYMMETRY_FALLBACK` where it is ``unknown``; otherwise
        ``symmetry`` itself.

    Raises:
        ConfigError: an unknown value, or an explicit ``symmetry`` larger than the stated ``label_symmetry`` (the
            augmentation would turn some patches into another class's).
    """
    if symmetry not in AUGMENT_SYMMETRIES:
        raise ConfigError(f"model.augment.symmetry must be one of {AUGMENT_SYMMETRIES}, got {symmetry!r}")
    if label_symmetry not in LABEL_SYMMETRIES:
        raise ConfigError(f"data.label_symmetry must be one of {LABEL_SYMMETRIES}, got {label_symmetry!r}")
    if symmetry == "auto":
        return AUTO_SYMMETRY_FALLBACK if label_symmetry == "unknown" else label_symmetry
    if label_symmetry != "unknown" and SYMMETRIES.index(symmetry) > SYMMETRIES.index(label_symmetry):
        raise ConfigError(
            f"model.augment.symmetry={symmetry!r} turns patches in ways the labels do not keep: the archive states "
            f"data.label_symmetry={label_symmetry!r}; use a symmetry in {SYMMETRIES[: SYMMETRIES.index(label_symmetry) + 1]} "
            "or 'auto'"
        )
    return symmetry


@dataclass(frozen=True)
class AugmentConfig:
    """Augmentation of the full-resolution patches in training (inference reads them as they are)."""

    color_jitter: float = 0.2
    """Per-patch channel gain ``1 + U(-c, c)`` and offset ``U(-c/2, c/2)``; 0: off."""
    symmetry: str = "none"
    """Each patch turned by a symmetry drawn per patch: ``rot180`` (a half turn or not: keeps every orientation),
    ``flips`` (the half turn and the two mirrors: keeps horizontal and vertical), ``dihedral`` (the 8 flips and
    quarter turns: only where orientation carries no label), ``none``; ``auto``: the archive's stated
    ``data.label_symmetry`` (``flips`` where it states none), resolved when the training config is loaded
    (:func:`resolve_symmetry`; an explicit value larger than the stated one is an error)."""

    def __post_init__(self) -> None:
        _num("model.augment.color_jitter", self.color_jitter, 0, 1)
        if self.symmetry not in AUGMENT_SYMMETRIES:
            raise ValueError(f"model.augment.symmetry must be one of {AUGMENT_SYMMETRIES}, got {self.symmetry!r}")


# ---------------------------------------------------------------------------------------------- features
FEATURE_KINDS = ("resnet", "torchscript")
_RESNET_DEFAULTS: dict[str, Any] = {
    "widths": (16, 32, 64),
    "blocks": (1, 1, 1),
    "norm": "group",
    "standardise": False,
    "init": None,
}
# older names of FeaturesConfig fields (still accepted, one deprecation line each when given a value)
_FEATURES_RENAMED = {"frozen": "freeze", "weights": "init"}
_FEATURES_OLD_DEFAULTS = {"frozen": False, "weights": None}


def is_init_uri(init: str | None) -> bool:
    """``model.features.init`` names an MLflow location (``runs:/...``, ``models:/...``), not a local file."""
    return isinstance(init, str) and init.startswith(("runs:/", "models:/"))


#: ``model.experimental.gate_encoder: pretrain``: ``foveate train`` pretrains the gate's encoder on the training
#: slides first (``foveate pretrain`` with the config's ``pretrain:`` section) and uses that run's encoder
GATE_ENCODER_PRETRAIN = "pretrain"


def resolved_by_driver(init: str | None) -> bool:
    """An encoder setting the training driver turns into weights (an MLflow URI, or ``pretrain``), not a file."""
    return is_init_uri(init) or init == GATE_ENCODER_PRETRAIN


@dataclass(frozen=True)
class FeaturesConfig:
    """The patch feature network: the project's small ResNet (``kind: resnet``, trained with the model), or a frozen
    encoder from a local TorchScript file (``kind: torchscript``, :class:`operators.encoders.TorchScriptEncoder`: a
    pathology foundation model exported elsewhere; nothing is downloaded). Either takes float patches in [0, 1],
    ``[M, 3, s, s]``, and gives ``[M, feature_dim]``. ``input_size`` / ``input_um`` become the geometry's
    ``patch_input`` / ``patch_size_um`` where the geometry leaves those unset (:class:`ModelConfig`). Mappings of
    the earlier ResNet-only shape (widths, blocks, feature_dim, norm, frozen, weights) load unchanged: ``frozen`` and
    ``weights`` are the older names of ``freeze`` and ``init`` (accepted as keys and as keyword arguments, read as
    attributes; giving both names of one field with different values is an error)."""

    kind: Literal["resnet", "torchscript"] = "resnet"
    """``resnet``: the ResNet of the fields below; ``torchscript``: the module in ``path`` (always frozen)."""
    widths: tuple[int, ...] = (16, 32, 64)
    """ResNet channels per stage: the first stage keeps the resolution, each later one halves it (resnet only)."""
    blocks: tuple[int, ...] = (1, 1, 1)
    """ResNet basic blocks per stage, one entry per entry of ``widths`` (resnet only)."""
    feature_dim: int | None = None
    """Size D of a patch's feature vector; None: 64 for resnet, for torchscript the module's own, found by running it
    once on a dummy batch when the model is built (an int given for torchscript is checked against it)."""
    norm: Literal["group", "batch"] = "group"
    """ResNet normalisation, ``group`` (GroupNorm) or ``batch`` (BatchNorm2d) (resnet only)."""
    standardise: bool = False
    """Standardise the encoder's output features with running statistics, the same in training and at inference
    (:class:`operators.resnet.RunningStandardise`, after any encoder: a pretrained or frozen one too; its
    statistics follow training even when the encoder is frozen, taken from the bag's K patches, not the evidence
    reads). Measured in benchmarks/RESULTS.md, "The shape family"."""
    freeze: bool = False
    """No parameter of the network is trained and it stays in eval mode; torchscript encoders are always frozen
    (this is set to true for them, whatever is given). Older name: ``frozen``. A frozen encoder's features are
    cached per cell by ``foveate train`` (``feature_cache``, :mod:`workers.feature_cache`): evaluation always
    uses the cache, training only with ``model.augment.color_jitter`` 0 and one-cell slots (not the perturbed
    selector's soft patches)."""
    init: str | None = None
    """Initial ResNet weights (resnet only): a ``state_dict`` file (``torch.save``), or the encoder of a
    ``foveate pretrain`` run, ``runs:/<run_id>[/encoder]`` or ``models:/<name>/<version|@alias>`` (resolved through
    MLflow by ``foveate train``). The architecture (widths, blocks, feature_dim, norm) must match the file's; the
    weights end up in every checkpoint's state dict, so scoring never needs the file. Older name: ``weights``."""
    path: str | None = None
    """The TorchScript file (``torch.jit.save``; required for torchscript, torchscript only); read when the model is
    built, its bytes embedded in every checkpoint, so a checkpoint is scored on another machine without it."""
    input_size: int | None = None
    """Side in pixels of the patches the encoder takes (each patch is resampled to it): the geometry's
    ``patch_input`` when that is unset; both set must be equal. None: the geometry decides."""
    input_um: float | None = None
    """Side in µm of the patches the encoder was trained on: the geometry's ``patch_size_um`` unless the geometry
    sets its own patch size (``patch_size_um`` must then be equal; a ``patch_size`` or ``stride`` in pixels is an
    error). None: the geometry decides."""
    mean: tuple[float, ...] | None = None
    """Per-channel mean subtracted from the [0, 1] patches before the encoder (ImageNet's: [0.485, 0.456, 0.406]);
    None: none (torchscript only; the ResNet centres its input itself)."""
    std: tuple[float, ...] | None = None
    """Per-channel std the patches are then divided by (ImageNet's: [0.229, 0.224, 0.225]); None: none
    (torchscript only)."""

    @property
    def frozen(self) -> bool:
        """Older name of ``freeze``."""
        return self.freeze

    @property
    def weights(self) -> str | None:
        """Older name of ``init``."""
        return self.init

    @classmethod
    def __config_upgrade__(cls, data: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
        """:func:`operators.config.from_dict`'s hook: the older keys ``frozen`` / ``weights`` -> ``freeze`` / ``init``
        (a note when given a value other than their default; both names of one field: an error)."""
        out, notes = dict(data), []
        where = "model.features" if where in ("", "features") else where
        for old, new in _FEATURES_RENAMED.items():
            if old not in out:
                continue
            value = out.pop(old)
            if new in out:
                if out[new] != value:
                    raise ConfigError(
                        f"{where}.{old}={value!r} and {where}.{new}={out[new]!r}: {old} is the older name of {new}; "
                        f"keep only {where}.{new}"
                    )
                continue
            out[new] = value
            if value != _FEATURES_OLD_DEFAULTS[old]:
                notes.append(f"{where}.{old} is deprecated: use {where}.{new}")
        return out, notes

    @property
    def weights_fixed(self) -> bool:
        """The feature network does not train: ``freeze`` true, or a TorchScript encoder."""
        return bool(self.freeze) or self.kind == "torchscript"

    def __post_init__(self) -> None:
        _choice("model.features.kind", self.kind, FEATURE_KINDS)
        widths, blocks = tuple(self.widths), tuple(self.blocks)
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ConfigError(f"model.features.widths must be a non-empty list of ints >= 1, got {self.widths!r}")
        if len(blocks) != len(widths) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
            raise ConfigError(
                f"model.features.blocks must list one int >= 1 per entry of widths ({len(widths)} stages), "
                f"got {self.blocks!r}"
            )
        object.__setattr__(self, "widths", widths)
        object.__setattr__(self, "blocks", blocks)
        _choice("model.features.norm", self.norm, ("group", "batch"))
        _bool("model.features.standardise", self.standardise)
        _bool("model.features.freeze", self.freeze)
        if self.feature_dim is None and self.kind == "resnet":
            object.__setattr__(self, "feature_dim", 64)
        if self.feature_dim is not None:
            _int("model.features.feature_dim", self.feature_dim, 1)
        for name in ("init", "path"):
            _file_path(f"model.features.{name}", getattr(self, name))
        if self.input_size is not None:
            _int("model.features.input_size", self.input_size, 8)
        if self.input_um is not None:
            _num("model.features.input_um", self.input_um, 0, lo_open=True)
        for name, lo in (("mean", -math.inf), ("std", 0.0)):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (tuple, list)) or len(v) != 3:
                raise ConfigError(f"model.features.{name} must be 3 numbers (one per RGB channel) or null, got {v!r}")
            for i, x in enumerate(v):
                _num(f"model.features.{name}[{i}]", x, lo, lo_open=name == "std")
            object.__setattr__(self, name, tuple(float(x) for x in v))
        if self.kind == "torchscript":
            if self.path is None:
                raise ConfigError(
                    "model.features.path: kind torchscript needs the TorchScript file (saved with torch.jit.save or "
                    "ScriptModule.save), got null"
                )
            for name, default in _RESNET_DEFAULTS.items():
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"model.features.{name} applies to kind resnet only, got {getattr(self, name)!r} with kind "
                        f"torchscript; remove it (the TorchScript module is used as it is)"
                    )
            object.__setattr__(self, "freeze", True)
        else:
            if self.path is not None:
                raise ConfigError(
                    f"model.features.path applies to kind torchscript only, got {self.path!r} with kind resnet; set "
                    "model.features.kind: torchscript, or model.features.init for a ResNet state_dict file"
                )
            for name in ("mean", "std"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"model.features.{name} applies to kind torchscript only (the ResNet centres its input "
                        f"itself), got {getattr(self, name)!r} with kind resnet"
                    )

    def resnet(self) -> ResNetConfig:
        """The ResNet's own config (:class:`operators.resnet.ResNetConfig`); ``kind: resnet`` only."""
        if self.kind != "resnet":
            raise ConfigError(f"model.features.kind is {self.kind!r}: there is no ResNet config")
        return ResNetConfig(
            widths=self.widths,
            blocks=self.blocks,
            feature_dim=int(self.feature_dim),
            norm=self.norm,
            frozen=self.freeze,
            weights=None if is_init_uri(self.init) else self.init,  # MLflow URIs: loaded by the trainer
        )

    @classmethod
    def from_resnet(cls, cfg: ResNetConfig) -> FeaturesConfig:
        """The ``kind: resnet`` section of a :class:`operators.resnet.ResNetConfig` (as earlier versions took it)."""
        return cls(
            widths=tuple(cfg.widths),
            blocks=tuple(cfg.blocks),
            feature_dim=cfg.feature_dim,
            norm=cfg.norm,
            freeze=cfg.frozen,
            init=cfg.weights,
        )


_features_init = FeaturesConfig.__init__


def _features_init_with_old_names(self: FeaturesConfig, *args: Any, **kwargs: Any) -> None:
    """``FeaturesConfig(frozen=..., weights=...)``: the older keyword names of ``freeze`` / ``init`` (not fields, so
    ``dataclasses.replace`` and :func:`operators.config.to_dict` see only the new ones)."""
    for old, new in _FEATURES_RENAMED.items():
        if old not in kwargs:
            continue
        value = kwargs.pop(old)
        if new in kwargs and kwargs[new] != value:
            raise ConfigError(
                f"model.features.{old}={value!r} and model.features.{new}={kwargs[new]!r}: {old} is the older name "
                f"of {new}; give only {new}"
            )
        kwargs[new] = value
    _features_init(self, *args, **kwargs)


FeaturesConfig.__init__ = _features_init_with_old_names  # type: ignore[method-assign]


def _um_conflict(key: str, value: Any, input_um: float) -> ConfigError:
    return ConfigError(
        f"model.geometry.{key}={value!r} (level-0 pixels) and model.features.input_um={input_um!r} conflict: the "
        f"encoder's patches are {input_um:g} µm, so the grid is in µm; remove model.geometry.{key} (patch_size_um "
        "then follows model.features.input_um, stride_um sets the stride), or set model.features.input_um: null to "
        "keep the grid in pixels"
    )


# ---------------------------------------------------------------------------------------------- aggregator
@dataclass(frozen=True)
class AttentionMILConfig:
    """Attention-MIL pooling (Ilse et al. 2018)."""

    gated: bool = True
    """Gated attention (tanh * sigmoid branches)."""
    pooling: Literal["softmax", "sigmoid"] = "sigmoid"
    """Attention logits to weights: ``softmax`` (Ilse et al.) or normalised ``sigmoid`` gates (a majority of
    informative patches outweighs a minority)."""
    mean_skip: bool = True
    """Start from the mean aggregator and learn the attention on top of it (the MIL head starts at zero)."""

    def __post_init__(self) -> None:
        _bool("model.aggregator.attention_mil.gated", self.gated)
        _choice("model.aggregator.attention_mil.pooling", self.pooling, ("softmax", "sigmoid"))
        _bool("model.aggregator.attention_mil.mean_skip", self.mean_skip)


@dataclass(frozen=True)
class TransformerConfig:
    """Transformer aggregator over the K patch tokens."""

    layers: int = 1
    """Encoder layers."""
    heads: int = 2
    """Attention heads (``aggregator.hidden`` must be a multiple)."""
    position_frequencies: int = 0
    """Fourier frequencies per coordinate of the position encoding; 0: none (patch features alone)."""
    readout: Literal["mean", "logit_mean", "cls", "gate"] = "gate"
    """``gate``: encoded tokens gate the patch features, a linear head classifies the gated mean; ``mean`` /
    ``logit_mean`` of the encoded tokens / their logits; a ``cls`` token."""
    mean_skip: bool = True
    """Start from the mean aggregator and learn the interactions on top of it (the head starts at zero)."""

    def __post_init__(self) -> None:
        _int("model.aggregator.transformer.layers", self.layers, 1)
        _int("model.aggregator.transformer.heads", self.heads, 1)
        _int("model.aggregator.transformer.position_frequencies", self.position_frequencies, 0)
        _choice("model.aggregator.transformer.readout", self.readout, READOUTS)
        _bool("model.aggregator.transformer.mean_skip", self.mean_skip)


@dataclass(frozen=True)
class AggregatorConfig:
    """How the K patch features become a slide prediction."""

    kind: Literal["mean", "max", "vote", "attention_mil", "transformer"] = "mean"
    """``mean``, ``max``, ``vote``, ``attention_mil`` or ``transformer``."""
    hidden: int = 64
    """Hidden size of attention-MIL / token width of the transformer."""
    dropout: float = 0.0
    """Dropout in the aggregator."""
    attention_mil: AttentionMILConfig = field(default_factory=AttentionMILConfig)
    """Settings of ``kind: attention_mil``."""
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    """Settings of ``kind: transformer``."""

    def __post_init__(self) -> None:
        _choice("model.aggregator.kind", self.kind, AGGREGATOR_KINDS)
        _int("model.aggregator.hidden", self.hidden, 1)
        _num("model.aggregator.dropout", self.dropout, 0, 1, hi_open=True)
        if self.kind == "transformer" and self.hidden % self.transformer.heads:
            raise ConfigError(
                f"model.aggregator.hidden ({self.hidden}) must be a multiple of model.aggregator.transformer.heads "
                f"({self.transformer.heads})"
            )

    @property
    def mean_skip(self) -> bool:
        """The active kind's ``mean_skip`` (False for kinds without a head of their own)."""
        sec = {"attention_mil": self.attention_mil, "transformer": self.transformer}.get(self.kind)
        return bool(sec is not None and sec.mean_skip)


# ---------------------------------------------------------------------------------------------- experimental
NEIGHBOUR_VIEWS = (0, 4, 8)


GATE_WEIGHTS = ("equal", "votes")


@dataclass(frozen=True)
class ExperimentalConfig:
    """Switches kept for study: off by default, not part of the recipe, may change or go."""

    control_variate: bool = False
    """The perturbed top-k's control variate in its backward pass (unmeasured since the evidence losses)."""
    evidence_gamma: float = 1.0
    """``evidence.target: label`` rank targets are ``p ** gamma`` (below 1: concave; measured mixed)."""
    neighbour_views: int = 0
    """In training, each selected cell's 4 (or 8) grid neighbours join the bag as further views of what it holds
    (shifted by one stride); 0: off. Inference reads the K cells alone. Under study (RESULTS, "The shape family ...
    bag by bag"); perturbed and hard selection only."""
    gate_candidates: int = 0
    """Cluster gate (:mod:`operators.gate`) for two-phase training (``schedule.select_until``): when the selection
    is fixed, the frozen scorer's top ``gate_candidates`` local maxima per slide are clustered by appearance and a
    slide's bag becomes those in clusters the scorer ranks high on average, in the second phase and at inference;
    0: off (the top ``selection.k``). Under study (RESULTS, "a gate on the frozen scorer's candidates")."""
    gate_clusters: int = 16
    """Appearance clusters of the cluster gate."""
    gate_fits: int = 1
    """Independent k-means fits of the cluster gate (each the best of its seedings, the seedings differing); a
    candidate is kept when any fit keeps it (``gate_agree``: a share of them). One fit's seeding can merge an
    informative appearance with filler (RESULTS, "a union of k-means fits"); 1: one fit."""
    gate_agree: float = 0.0
    """With ``gate_fits`` > 1, the share of the fits that must keep a candidate: ``max(1, ceil(gate_agree *
    gate_fits))`` of them; 0: any fit (the union), 0.5: a majority, 1: every fit."""
    gate_weights: str = "equal"
    """How the classifier weighs a gate's kept cells: ``equal`` (their mean) or ``votes`` (each by how many of the
    ``gate_fits`` fits keep it: cells every fit keeps count most); under study."""
    gate_keep_from: int = 0
    """The gate keeps from a slide's top ``gate_keep_from`` local maxima, while its clusters are fitted on the top
    ``gate_candidates`` (a held-out slide's informative cells can rank just below them); 0: ``gate_candidates``."""
    gate_cut: str = "score"
    """Which clusters the gate keeps: ``score``, the upper two-means group of the clusters' mean scores; ``rank``,
    of their mean within-slide candidate rank (robust to many candidates; under study)."""
    gate_margin: float = 0.0
    """The gate also keeps a candidate whose cosine similarity to the nearest informative centroid is within this of
    that to its nearest centroid (0: its nearest cluster decides; under study)."""
    gate_encoder: str | None = None
    """A frozen encoder for the cluster gate alone, of the model's ResNet architecture: a state_dict file (what
    ``foveate pretrain`` writes as ``encoder.pt``) or the encoder of a ``foveate pretrain`` run,
    ``runs:/<run_id>[/encoder]`` or ``models:/<name>/<version|@alias>`` (resolved through MLflow by ``foveate
    train``, as ``model.features.init``), or ``pretrain``: ``foveate train`` first pretrains one on the training
    slides without their labels (``foveate pretrain`` with the config's ``pretrain:`` section, its own MLflow run,
    whose ``runs:/`` URI then stands here in the logged config); the gate clusters the candidates with it instead
    of with a copy of the model's encoder at the fit, and the model's own encoder trains as before. null: that
    copy."""

    def __post_init__(self) -> None:
        _int("model.experimental.gate_candidates", self.gate_candidates, 0)
        _int("model.experimental.gate_clusters", self.gate_clusters, 2)
        _int("model.experimental.gate_fits", self.gate_fits, 1)
        _int("model.experimental.gate_keep_from", self.gate_keep_from, 0)
        _num("model.experimental.gate_agree", self.gate_agree, 0, 1)
        if self.gate_candidates == 0 and (self.gate_keep_from or self.gate_fits != 1 or self.gate_agree):
            raise ConfigError(
                "model.experimental.gate_keep_from / gate_fits / gate_agree are set but the cluster gate is off: set "
                "model.experimental.gate_candidates (e.g. 16) or leave them at 0 / 1 / 0; got gate_keep_from="
                f"{self.gate_keep_from}, gate_fits={self.gate_fits}, gate_agree={self.gate_agree}"
            )
        if 0 < self.gate_keep_from < self.gate_candidates:
            raise ConfigError(
                "model.experimental.gate_keep_from must be 0 (gate_candidates) or at least gate_candidates="
                f"{self.gate_candidates}, got {self.gate_keep_from}"
            )
        _choice("model.experimental.gate_cut", self.gate_cut, ("score", "rank"))
        _choice("model.experimental.gate_weights", self.gate_weights, GATE_WEIGHTS)
        if self.gate_weights != "equal" and self.gate_fits == 1:
            raise ConfigError(
                "model.experimental.gate_weights: votes needs model.experimental.gate_fits > 1 (with one fit every "
                f"kept cell has one vote); got gate_fits={self.gate_fits}"
            )
        _num("model.experimental.gate_margin", self.gate_margin, 0, 2)
        _file_path("model.experimental.gate_encoder", self.gate_encoder)
        _bool("model.experimental.control_variate", self.control_variate)
        _num("model.experimental.evidence_gamma", self.evidence_gamma, 0, 1, lo_open=True)
        if isinstance(self.neighbour_views, bool) or self.neighbour_views not in NEIGHBOUR_VIEWS:
            raise ConfigError(
                f"model.experimental.neighbour_views must be one of {NEIGHBOUR_VIEWS}, got {self.neighbour_views!r}"
            )


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelConfig:
    """The whole model (YAML section ``model:``); every default is the recommended recipe."""

    geometry: GeometryConfig = field(default_factory=GeometryConfig)
    """The patch grid and the scorer's view."""
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    """The scorer CNN on the low-res view."""
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    """How K cells are chosen; a section per selector."""
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    """Exploration, rare and neutral cells and the evidence losses (training only)."""
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    """Augmentation of the full-resolution patches (training only)."""
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    """The patch feature network (the ResNet or a frozen TorchScript encoder); its ``input_size`` / ``input_um``
    fill the geometry's ``patch_input`` / ``patch_size_um`` where the geometry leaves them unset."""
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    """Patch features to a slide prediction; a section per kind."""
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    """Switches kept for study, off by default."""
    num_classes: int = 2
    """Number of classes C (>= 2); ``foveate train`` sets it from the labels."""
    mpp: float | None = None
    """Level-0 µm per pixel the model was trained at (``foveate train`` records the stores' median; None:
    unknown). Pixel geometry warns about stores at another mpp when scoring."""

    def __post_init__(self) -> None:
        _int("model.num_classes", self.num_classes, 2)
        if self.mpp is not None:
            _num("model.mpp", self.mpp, 0, lo_open=True)
        if isinstance(self.features, ResNetConfig):  # the network's own config, as earlier versions took it
            object.__setattr__(self, "features", FeaturesConfig.from_resnet(self.features))
        if not isinstance(self.features, FeaturesConfig):
            raise ConfigError(f"model.features must be a FeaturesConfig, got {type(self.features).__name__}")
        if self.experimental.neighbour_views and self.selection.selector not in ("perturbed", "hard"):
            raise ConfigError(
                "model.experimental.neighbour_views needs model.selection.selector perturbed or hard (a bag of equal "
                f"slots), got {self.selection.selector!r}"
            )
        ex = self.experimental
        if ex.gate_encoder is not None:
            if ex.gate_candidates == 0:
                raise ConfigError(
                    "model.experimental.gate_encoder is set but the cluster gate is off: set "
                    "model.experimental.gate_candidates (e.g. 16) or remove gate_encoder"
                )
            if self.features.weights_fixed:  # frozen, or a TorchScript encoder
                raise ConfigError(
                    "model.experimental.gate_encoder needs a trained ResNet encoder (model.features.kind resnet, not "
                    "frozen): with a frozen encoder the gate clusters with that encoder; remove gate_encoder"
                )
        self._encoder_geometry()

    def _encoder_geometry(self) -> None:
        """The encoder's ``input_size`` / ``input_um`` -> the geometry's ``patch_input`` / ``patch_size_um`` where
        the geometry leaves them unset (a :class:`GeometryConfig` at its default ``patch_size`` and ``stride`` counts
        as unset; in a mapping, any ``patch_size`` or ``stride`` given counts as set: :meth:`__config_upgrade__`)."""
        f, g = self.features, self.geometry
        changes: dict[str, Any] = {}
        if f.input_size is not None:
            if g.patch_input is None:
                changes["patch_input"] = f.input_size
            elif g.patch_input != f.input_size:
                raise ConfigError(
                    f"model.geometry.patch_input={g.patch_input} and model.features.input_size={f.input_size} "
                    f"conflict: the encoder takes {f.input_size}-px patches; remove model.geometry.patch_input (it "
                    "follows model.features.input_size)"
                )
        if f.input_um is not None:
            if g.patch_size_um is not None:
                if not math.isclose(g.patch_size_um, f.input_um, rel_tol=1e-9):
                    raise ConfigError(
                        f"model.geometry.patch_size_um={g.patch_size_um} and model.features.input_um={f.input_um} "
                        "conflict: the encoder was trained on patches of model.features.input_um; remove "
                        "model.geometry.patch_size_um (it follows model.features.input_um)"
                    )
            elif g.stride is not None:
                raise _um_conflict("stride", g.stride, f.input_um)
            elif g.patch_size != GeometryConfig().patch_size:
                raise _um_conflict("patch_size", g.patch_size, f.input_um)
            else:
                changes.update(patch_size=None, patch_size_um=float(f.input_um))
        if changes:
            object.__setattr__(self, "geometry", dataclasses.replace(g, **changes))

    @classmethod
    def __config_upgrade__(cls, data: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
        """:func:`operators.config.from_dict`'s hook: flat keys of earlier versions -> sections (notes to log); a
        ``geometry.patch_size`` or ``stride`` in pixels given beside ``features.input_um`` is refused."""
        data, notes = upgrade_flat_keys(data, where=where or "model")
        feats, geo = data.get("features"), data.get("geometry")
        if isinstance(feats, Mapping) and feats.get("input_um") is not None and isinstance(geo, Mapping):
            for key in ("patch_size", "stride"):
                if geo.get(key) is not None:
                    raise _um_conflict(key, geo[key], feats["input_um"])
        return data, notes

    def slide_geometry(self, mpp: float | None = None, *, where: str = "the slide") -> SlideGeometry:
        """The grid, scorer scale and network input size on one slide, in that slide's level-0 pixels.

        Args:
            mpp: the slide's level-0 µm per pixel (``StoreMeta.mpp[0]``), or None when unknown.
            where: names the slide in errors (e.g. ``"store /data/s.zarr"``).

        Returns:
            :class:`SlideGeometry`. Pixel settings give the same geometry on every slide (``mpp`` ignored); µm
            settings give ``patch_size = round(patch_size_um / mpp)`` (stride likewise) and
            ``scorer_downsample = scorer_mpp / mpp``.

        Raises:
            ConfigError: a µm setting with ``mpp`` None (the error names ``where``), a patch under 8 pixels,
                a scorer view finer than level 0, or µm patches with neither ``patch_input`` nor ``mpp``.
        """
        g = self.geometry
        if mpp is not None and not (isinstance(mpp, (int, float)) and math.isfinite(mpp) and mpp > 0):
            raise ConfigError(f"{where}: level-0 mpp must be a finite number > 0 (µm per pixel), got {mpp!r}")
        if g.uses_um and mpp is None:
            keys = [k for k in ("patch_size_um", "scorer_mpp") if getattr(g, k) is not None]
            raise ConfigError(
                f"{where} records no mpp (µm per pixel), so model.geometry.{' and model.geometry.'.join(keys)} "
                "cannot be resolved to its pixels; re-ingest it from a slide with mpp metadata (or with --mpp), or "
                "use model.geometry.patch_size / scorer_downsample (level-0 pixels)"
            )
        if g.patch_size_um is not None:
            patch = int(round(g.patch_size_um / mpp))
            stride_um = g.patch_size_um / 2 if g.stride_um is None else g.stride_um
            stride = max(1, int(round(stride_um / mpp)))
            if patch < 8:
                raise ConfigError(
                    f"{where}: model.geometry.patch_size_um={g.patch_size_um} is {patch} level-0 pixels at mpp "
                    f"{mpp:g}; a patch needs >= 8"
                )
            if g.patch_input is not None:
                size = g.patch_input
            elif self.mpp is not None:
                size = max(8, int(round(g.patch_size_um / self.mpp)))
            else:
                raise ConfigError(
                    "model.geometry.patch_size_um needs model.geometry.patch_input (the network's patch side in "
                    "pixels) or model.mpp (the training resolution, which foveate train records), got neither"
                )
        else:
            patch, stride = int(g.patch_size), int(g.stride_l0)
            size = patch if g.patch_input is None else g.patch_input
        if g.scorer_mpp is not None:
            ds = float(g.scorer_mpp) / float(mpp)
            if ds < 1.0 - 1e-9:
                raise ConfigError(
                    f"{where}: model.geometry.scorer_mpp={g.scorer_mpp} is finer than its level-0 mpp {mpp:g}; the "
                    "scorer's view must be at most level-0 resolution"
                )
            ds = max(ds, 1.0)
        else:
            ds = float(g.scorer_downsample)
        return SlideGeometry(patch_size=patch, stride=stride, scorer_downsample=ds, patch_input=size, mpp=mpp)

    def geometry_key(self) -> tuple:
        """The settings :meth:`slide_geometry` depends on (a cache key, with the slide)."""
        g = self.geometry
        return (
            g.patch_size,
            g.stride,
            g.patch_size_um,
            g.stride_um,
            g.patch_input,
            g.scorer_downsample,
            g.scorer_mpp,
            self.mpp,
            g.recentre,
        )


# ---------------------------------------------------------------------------------------------- flat keys
# the flat keys of earlier versions -> their place now (a key may feed several sections)
FLAT_KEYS: dict[str, tuple[str, ...]] = {
    **{k: (f"geometry.{k}",) for k in GeometryConfig.__dataclass_fields__},
    **{k: (f"selection.{k}",) for k in ("selector", "k", "num_samples", "sigma", "nms_radius", "nms_ties")},
    "selection_grad": ("selection.scorer_grad",),
    "max_support": ("selection.perturbed.max_support",),
    "epsilon": ("selection.sinkhorn.epsilon",),
    "sinkhorn_max_iter": ("selection.sinkhorn.max_iter",),
    "alpha": ("selection.lapsum.alpha",),
    "mask_extra": ("selection.sinkhorn.mask_extra", "selection.lapsum.mask_extra"),
    "gates": ("selection.sinkhorn.gates", "selection.lapsum.gates"),
    "soft_draw": ("selection.sinkhorn.draw", "selection.lapsum.draw"),
    "replace": ("selection.attention.replace",),
    "entropy_weight": ("selection.attention.entropy_weight",),
    "attention_temperature": ("selection.attention.temperature",),
    "attention_weights": ("selection.attention.weights",),
    "attention_draw": ("selection.attention.draw",),
    "control_variate": ("experimental.control_variate",),
    "evidence_gamma": ("experimental.evidence_gamma",),
    "color_jitter": ("augment.color_jitter",),
    **{
        k: (f"evidence.{k}",)
        for k in EvidenceConfig.__dataclass_fields__
        if k != "target"  # the flat `evidence: label` is a string, the section a mapping (below)
    },
    "evidence": ("evidence.target",),
    "aggregator": ("aggregator.kind",),
    "aggregator_hidden": ("aggregator.hidden",),
    "dropout": ("aggregator.dropout",),
    "gated": ("aggregator.attention_mil.gated",),
    "mil_attention": ("aggregator.attention_mil.pooling",),
    "mean_skip": ("aggregator.attention_mil.mean_skip", "aggregator.transformer.mean_skip"),
    "transformer_layers": ("aggregator.transformer.layers",),
    "transformer_heads": ("aggregator.transformer.heads",),
    "position_frequencies": ("aggregator.transformer.position_frequencies",),
    "transformer_readout": ("aggregator.transformer.readout",),
}

# switches that measured as not helping and were removed (benchmarks/RESULTS.md has their numbers): old configs
# and checkpoints that hold them at their off value still load; any other value is refused
REMOVED_KEYS: dict[str, Any] = {
    "explore_temperature": 0.0,
    "mask_sampling": False,
    "candidate_dropout": 0.0,
    "patch_jitter": 0.0,
    "rare_per_step": 0,
    "neutral_pool": 0,
}


def _is_flat(key: str, value: Any) -> bool:
    if key in ("evidence", "aggregator"):  # both a flat string key and a section now
        return not isinstance(value, Mapping)
    return key in FLAT_KEYS or key in REMOVED_KEYS


def upgrade_flat_keys(data: Mapping[str, Any], *, where: str = "model") -> tuple[dict[str, Any], list[str]]:
    """Move the flat keys of earlier versions into their sections.

    Args:
        data: a ``model:`` mapping, flat (earlier versions, checkpoints written by them), sectioned, or mixed.
        where: the mapping's dotted name, for the notes and errors.

    Returns:
        ``(sectioned mapping, notes)``: one deprecation note per flat key found (``"model.k is deprecated: use
        model.selection.k"``). A flat ``stride: null`` meant "no overlap" and becomes ``stride = patch_size``
        (``stride_um`` likewise). Keys left unset take today's defaults (the recipe), not earlier ones.

    Raises:
        ConfigError: a removed switch set to anything but its off value, or a key given both flat and in its
            section with different values.
    """
    out: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        (flat if _is_flat(key, value) else out)[key] = value
    if not flat:
        return dict(data), []
    notes = []
    for key, value in flat.items():
        if key in REMOVED_KEYS:
            off = REMOVED_KEYS[key]
            if value != off or isinstance(value, bool) != isinstance(off, bool):
                raise ConfigError(
                    f"{where}.{key} was removed (measured as not helping; benchmarks/RESULTS.md has its numbers); "
                    f"only its off value {off!r} is accepted, got {value!r}"
                )
            continue
        if key == "stride" and value is None and flat.get("patch_size") is not None:
            value = flat["patch_size"]  # earlier: null = no overlap
        if key == "stride_um" and value is None and flat.get("patch_size_um") is not None:
            value = flat["patch_size_um"]
        targets = FLAT_KEYS[key]
        notes.append(f"{where}.{key} is deprecated: use {' and '.join(f'{where}.{t}' for t in targets)}")
        for target in targets:
            *parents, last = target.split(".")
            node = out
            for p in parents:
                nxt = node.get(p)
                if nxt is None:
                    nxt = node[p] = {}
                elif not isinstance(nxt, Mapping):
                    raise ConfigError(f"{where}.{p}: expected a section (mapping), got {nxt!r}")
                else:
                    nxt = node[p] = dict(nxt)
                node = nxt
            if last in node and node[last] != value:
                raise ConfigError(
                    f"{where}.{key}={value!r} and {where}.{target}={node[last]!r} conflict; keep only {where}.{target}"
                )
            node[last] = value
    notes.append(
        f"{where}: keys not given take today's defaults (the recipe), not those of the version that wrote these flat "
        "keys; `foveate config show` prints the effective config"
    )
    if flat.get("stride", 0) is None and flat.get("patch_size") is None and "patch_size_um" not in flat:
        notes.append(f"{where}.stride: null now means half the patch size; set {where}.geometry.stride for another")
    return out, notes
