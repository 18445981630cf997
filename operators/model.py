"""The foveated model as separable stages: score -> select -> (read patches) -> embed -> aggregate.

Stages (each callable on its own, so batch scoring can run the scorer on GPU actors and patch reading,
features and aggregation on CPU actors)::

    scores = model.score(lowres[B,3,h,w], cell_mask[B,Gh,Gw])            # [B, N], -inf = not a candidate
    sel = model.select(scores, training=..., sigma=..., generator=...)   # Selection (indices/weights [B,K,S])
    # read the distinct cells of sel.indices at full resolution (workers.patches.PatchReader), combine them
    # with sel.weights (operators.soft_patches.combine_patches) -> patches[B,K,3,p,p] float in [0,1]
    feats = model.embed(patches.flatten(0, 1)).view(B, K, -1)           # [B, K, D]
    logits = model.aggregate(feats, positions[B,K,2], sel.slot_weights)  # [B, C]

``workers.patches.forward_slide`` runs the whole chain for one slide. The grid and the low-res input are
defined in ``workers.patches`` (grid cells in level-0 pixels; the low-res input covers the grid extent).

Papers: Cordonnier et al. 2021 (scorer, min–max normalisation, perturbed top-k and soft patches);
Katharopoulos & Fleuret 2019 (attention sampling); Xie et al. 2020 (SOFT top-k); Struski et al. 2025 (LapSum);
Ilse et al. 2018 (attention-MIL).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from operators.aggregators import AGGREGATORS, MEAN_SKIP_AGGREGATORS, READOUTS, build_aggregator
from operators.errors import ConfigError
from operators.evidence import evidence_rank_loss, instance_confidence, instance_loss
from operators.resnet import ResNet, ResNetConfig
from operators.scorer import (
    ScorerCNN,
    ScorerConfig,
    candidate_mask,
    cell_pool,
    minmax_normalise,
    score_map,
    sparse_grad_cell_scores,
)
from operators.soft_patches import cap_support

__all__ = ["SELECTORS", "ModelConfig", "SlideGeometry", "Selection", "ModelOutput", "FoveateModel"]

# views smaller than this are scored with plain autograd in training: there the crops of the ~60 cells a
# slide-step reads cover about as many pixels as the view (operators.scorer.sparse_grad_cell_scores)
_SPARSE_SCORER_MIN_PIXELS = 256 * 256

log = logging.getLogger(__name__)

SELECTORS = ("perturbed", "sinkhorn", "lapsum", "attention", "hard")


@dataclass(frozen=True)
class ModelConfig:
    """Model settings (YAML section ``model:``); every default is usable.

    Patch size and scorer resolution come in two units, exactly one of each pair set (``None`` = unset; with
    neither set the pixel default applies): level-0 pixels (``patch_size``/``stride``, ``scorer_downsample``),
    the same on every slide, or physical units (``patch_size_um``/``stride_um``, ``scorer_mpp``), resolved per
    slide from its store's level-0 mpp by :meth:`geometry`, so slides scanned at 20x and 40x give the same grid
    in µm and the scorer the same µm per pixel. Physical patches are read at the slide's resolution and
    resampled to ``patch_input`` pixels, so the feature network always sees one size and one resolution.

    Attributes:
        patch_size: side of a patch (grid cell) in level-0 pixels (default 128 when ``patch_size_um`` is unset).
        stride: grid stride in level-0 pixels; ``None`` means ``patch_size`` (no overlap). Only with ``patch_size``.
        patch_size_um: side of a patch in µm, instead of ``patch_size``; per slide
            ``round(patch_size_um / mpp)`` level-0 pixels. Stores without mpp are refused.
        stride_um: grid stride in µm (only with ``patch_size_um``); ``None`` means ``patch_size_um``.
        patch_input: side in pixels of the patches the feature network sees: every patch is resampled to it
            (area interpolation when shrinking, bilinear when enlarging). ``None``: ``patch_size`` for pixel
            patches (read as they are), ``round(patch_size_um / mpp)`` for µm patches (the patch at the training
            resolution ``mpp``, which ``foveate train`` records).
        scorer_downsample: downsample of the low-res view the scorer sees (the store level is picked with
            ``SlideStore.best_level_for_downsample`` and resampled to this scale); default 16 when
            ``scorer_mpp`` is unset.
        scorer_mpp: µm per pixel of the scorer's view, instead of ``scorer_downsample``; per slide
            ``scorer_downsample = scorer_mpp / mpp`` (must be >= 1: not finer than the slide's level 0).
        tissue_threshold: a cell is a candidate when at least this fraction of it is tissue (0: every cell).
        k: number of patches per slide.
        selector: ``"perturbed"`` (perturbed top-k, Cordonnier et al.), ``"sinkhorn"`` (SOFT top-k),
            ``"lapsum"``, ``"attention"`` (attention sampling) or ``"hard"`` (hard top-k: no gradient to the
            scorer). Every selector uses hard top-k at inference.
        num_samples: noise samples of the perturbed top-k.
        sigma: noise scale of the perturbed top-k (the trainer may pass a decayed value per call).
        control_variate: use the perturbed top-k's control variate in its backward.
        epsilon: entropic regularisation of SOFT top-k.
        sinkhorn_max_iter: Sinkhorn iterations of SOFT top-k.
        alpha: LapSum scale.
        replace: attention sampling with replacement (multinomial) instead of without (Gumbel top-k).
        entropy_weight: weight of the attention-entropy regulariser (``aux_losses["entropy"] = -w * H``).
        attention_temperature: attention sampling's attention is ``softmax(s / T)`` over the candidates, with
            ``s`` the min–max normalised scores in [0, 1] (as for the top-k selectors), so its sharpness does not
            depend on the scale of the scorer's raw output: at T = 0.05 the best candidate weighs at most
            ``e^20`` times the worst. (The raw scorer output spans ~0.1 at initialisation, so a softmax
            over it is uniform (entropy 0.99996 log N) and the scorer's gradient ~100x too small: attention sampling
            never learnt. At T = 0.2 (at most ``e^5``) the attention stayed near uniform over the ~400 tissue cells
            of a slide even after the scorer ranked the informative cells first, so training read random cells
            and one seed in ten ended at chance; ``benchmarks/RESULTS.md``.)
        attention_weights: how attention sampling weighs the K drawn cells in training. ``"estimator"``
            (default): the unbiased estimator's weights of :func:`operators.attention_sampling.attention_sample`
            (the bag's expected value is the attention-weighted mean over *all* cells, so the mass the attention
            leaves on the many filler cells is in it). ``"normalised"``: the drawn cells' attention renormalised
            to sum to one (self-normalised, biased, lower variance): the cells the attention is sure of carry the
            bag, as the renormalised attention does at inference. ``"uniform"``: every drawn cell weighs ``1/K``
            in training (forward value; the gradient to the attention is that of the paper's with-replacement
            estimator, ``a_j / sg(a_j) / K``) and every hard top-k cell ``1/K`` at inference, as the mean
            aggregator weighs the top-k; with ``replace=True`` training is then exactly the paper's
            with-replacement estimator (four-class objects 3 of 5 seeds against 0 of 1 shipped, binary no better;
            without replacement no better than the estimator: ``benchmarks/RESULTS.md``, session 30; what mattered
            was how the bag is drawn, not its weights). ``"inclusion"``: each drawn cell (training)
            or hard top-k cell (inference) weighs its probability of being drawn at least once in K draws from the
            attention, ``pi = 1 - (1 - a)^K``, normalised over the bag: cells the attention is sure of weigh about
            the same (``pi`` saturates at 1), cells drawn by chance little (the certainty gates of SOFT / LapSum,
            ``gates``, for attention sampling).
        attention_draw: how attention sampling draws its K training cells. ``"sample"`` (default): one draw from
            the attention (with or without replacement, ``replace``). ``"slot_modes"``: the slot modes of
            ``num_samples`` Gumbel-top-k draws (:func:`operators.attention_sampling.slot_mode_sample`: per slot
            the cell found there most often; the bag the perturbed top-k reads with ``max_support: 1``), each
            weighing 1/K with the with-replacement estimator's gradient; needs ``attention_weights: uniform``.
            One draw repeats the object the attention is surest of (with replacement) or fills most of the bag
            with filler (without); the slot modes give each confident cell about one slot.
        soft_draw: which k cells SOFT top-k and LapSum read as the training bag. ``"topk"`` (default): the k
            largest scores (plus the ``mask_extra`` cells below them), weighed by ``gates``. ``"slot_modes"``: the
            perturbed top-k's bag (:func:`operators.topk.perturbed_slot_modes`: per slot the cell found there most
            often over ``num_samples`` top-k draws of ``scores + sigma * Z``, ``sigma`` as for the perturbed top-k,
            with its schedule), each slot weighing ``1/k`` in the forward pass with the soft mask's gradient
            (``mask / k`` at the cell, straight-through); the ``mask_extra`` cells below the top-k are still read
            for the evidence losses, at weight 0 in the bag. The certain cells fill the bag (some twice), the
            filler near the threshold seldom gets a slot: a deterministic bag keeps a slide's same filler cells
            every epoch, which the classifier fits (session 27's four-class stall). Inference is unchanged (the
            hard top-k, weighed by ``gates``).
        explore_temperature: SOFT top-k and LapSum in training read the top-k cells of
            ``s / T + Gumbel`` (``T`` this value; K cells drawn without replacement from ``softmax(s / T)``) instead
            of the hard top-k, and gate them with their mask values; 0 (default) reads the hard top-k. Without it
            these selectors read only the cells the scorer already ranks first, so a scorer that starts out
            ranking the informative cells low never sees them (measured: ``benchmarks/selection_hits.py``).
        mask_extra: SOFT top-k and LapSum in training read ``k + mask_extra`` cells (the largest scores, or
            the Gumbel draw of ``explore_temperature``) and weigh each by its mask value / k, so the cells just
            below the top-k threshold, which carry part of the mask, are seen and get a gradient (like the
            capped support of the perturbed top-k's soft patches; the mask beyond those cells is dropped). 0
            (default): the k chosen cells only. Inference always reads the hard top-k.
        mask_sampling: SOFT top-k and LapSum in training read ``k`` cells drawn with inclusion probabilities
            equal to the soft mask (:func:`operators.topk.mask_sample`) instead of the ``k`` largest scores: the
            cells the mask holds at 1 are always read, the cells near the threshold, between which it spreads its
            mass, take turns from step to step (as the perturbed top-k's noisy samples make them do). The
            aggregator then sees the same confident cells with varying filler, not a fixed bag per slide it can
            memorise. Needs ``mask_extra = 0`` and ``explore_temperature = 0``. False (default): the top-k.
        gates: how SOFT top-k and LapSum weigh the read patches' features in the aggregator (``slot_weights``).
            ``"mask"`` (default): the mask values, ``mask / k``, in training and at inference. ``"hard"``: the
            hard top-k mean (``1/k`` on the k cells ranked first, 0 on the ``mask_extra`` cells) in the forward
            pass, in training and at inference, with the mask's gradient in the backward pass (straight-through).
            ``"certainty"``: in training, each read cell weighs ``max(0, 2 m - 1)`` (``m`` its mask value: how
            sure the soft top-k is that the cell belongs to the top k), normalised to sum to one over the bag, so
            the aggregator learns from the cells the selector is sure of and the cells near the threshold
            (filler: background, distractors) are left out; at inference as ``"hard"``. (The perturbed top-k's
            soft slots do the same by construction: with ``max_support`` 1, each slot takes its most frequent
            cell over the noise samples, so the confident cells fill the slots, duplicated, and the cells near
            the threshold rarely appear; measured in ``benchmarks/RESULTS.md``.)
        nms_radius: selection takes only cells whose score is the maximum of their ``(2r+1) x (2r+1)`` window of
            grid cells (:meth:`FoveateModel.local_maxima`), in training and at inference, so the K patches land on
            K different structures instead of several cells of the same one (a slide with fewer than ``k``
            local maxima selects among all its cells). 0 (default): off.
        nms_ties: what :meth:`FoveateModel.local_maxima` does with tied maxima (local maxima within ``r`` of each
            other have equal scores). ``"keep"`` (default): every tied cell is kept. ``"first"``: among kept cells,
            a cell is dropped when a kept cell of smaller index lies in its window, so a structure yields one
            cell. On an overlapping grid (``stride < patch_size``) the scorer's per-cell max-pool gives the cells
            that share the structure's low-resolution maximum the same score, and with ``"keep"`` they fill
            the K slots with one structure.
        patch_jitter: in training, every full-resolution read window (selected, exploration and rare cells)
            is shifted by a random offset of up to this fraction of ``patch_size`` in x and y (random-crop
            augmentation: the same structures, never the same pixels twice, so the classifier cannot memorise
            a slide's patches). 0 (default): off. Inference reads the grid cells as they are.
        color_jitter: in training, every full-resolution patch gets a random per-channel gain ``1 + U(-c, c)``
            and offset ``U(-c/2, c/2)`` (``workers.patches.color_jitter_patches``): the classifier cannot tell the
            training slides apart by their stain colours. 0 (default): off.
        selection_grad: in training, the gradient of the classification loss that reaches the scorer through
            the selection is multiplied by this (the scores' values are unchanged): 1 (default) trains the scorer
            end to end; 0 trains it by the evidence rank loss alone (the perturbed top-k gradient is an
            estimator whose variance grows as ``1/sigma``).
        candidate_dropout: in training, each candidate cell is left out of the selection with this
            probability (a row keeps all its candidates when fewer than k would remain), for every selector: the
            top-k of a random subset reaches cells ranked up to about ``k / (1 - p)``, so the scorer sees cells
            it does not rank first yet, and a slide's patches vary from step to step (harder to memorise).
            0 (default): off. Inference uses every candidate.
        explore_cells: in training, this many candidate cells per slide are drawn uniformly at random (besides
            the selection) and read at full resolution for the evidence losses below; they never enter the
            aggregator. 0 (default): none.
        explore_strata: exploration cells are drawn stratified by low-resolution appearance: the cells are
            grouped into at most this many strata (k-means on per-cell colour mean/std of the scorer's input,
            ``workers.patches.cell_strata``), and each draw takes a stratum uniformly, then a cell in it, so
            visually rare cells are read as often as the common background. 0 (default): uniform draws.
        rare_cells: in training, this many cells of the slide's *rarest* low-resolution appearance strata
            (``rare_strata`` k-means strata of :func:`workers.patches.cell_strata`, smallest stratum first; fixed
            per slide, label-free) are read at full resolution and classified as a second bag through the
            aggregator with the slide label (weight ``rare_weight``); they also join the evidence losses. Small,
            rare structures land in the smallest strata, so this bag shows them to the classifier long before
            the scorer has learnt where they are. 0 (default): off. Needs ``instance_weight > 0``.
        rare_strata: number of strata for ``rare_cells``.
        rare_per_step: each training step uses this many of the ``rare_cells`` (drawn without replacement, a new
            subset every step) as the rare bag: the features of fewer patches are computed, and the bag's make-up
            varies from step to step. 0 (default): all of them.
        rare_weight: weight of the rare bag's cross-entropy.
        neutral_cells: in training, this many candidate cells per slide are drawn uniformly at random and read at
            full resolution, and the classifier's prediction for each of them alone (the aggregator on a bag of
            one) is pulled towards the uniform distribution (``operators.evidence.neutral_loss``, weight
            ``neutral_weight``). Random cells are mostly background and distractors, which occur in every class:
            this keeps such filler from voting a class when it fills the K slots beside the informative
            patches. 0 (default): off.
        neutral_pool: draw the neutral cells from a per-slide pool of this many uniformly drawn tissue cells,
            drawn and read once (kept with the slide like the rare bag), ``neutral_cells`` of them per step, instead
            of reading new random cells at every step. 0 (default): new cells every step.
        neutral_weight: weight of that loss.
        instance_weight: weight of the instance loss (``operators.evidence.instance_loss``): a linear instance
            head classifies every read patch (selected and exploration cells) on its own with the slide label.
            0 (default): no instance head.
        rank_weight: weight of the evidence rank loss (``operators.evidence.evidence_rank_loss``): the scorer's
            scores of the read cells are trained to rank them by the instance head's confidence, so the scorer
            learns where the evidence is from every patch it reads. Needs ``instance_weight > 0``.
        rank_temperature: ``T`` of the rank loss in normalised score units.
        evidence: what the rank loss ranks the read cells by. ``"confidence"`` (default): the instance head's
            label-free confidence (:func:`operators.evidence.instance_confidence`), high on any decisive patch.
            ``"label"``: the classifier's probability of the slide's *own* label for each read cell alone (the
            cell as a bag of one through the aggregator; for the mean aggregator exactly that cell's share of
            the bag's logits), so cells whose content is common to every class (background, distractors of
            random kinds) rank below cells that support the slide's label.
        evidence_gamma: with ``evidence="label"`` the rank targets are ``p ** evidence_gamma``: 1 (default) the
            probability itself; below 1 a concave target, under which a cell type that supports the label on
            some slides and opposes it on the others (a distractor of a random kind) ranks below a cell type that
            is neutral everywhere (background) — with the linear target the two tie in expectation.
        position_frequencies: Fourier frequencies per coordinate of the transformer's position encoding
            (``sin, cos(2^i pi p)``, i < F; high frequencies let the transformer memorise where patches are);
            0: no position encoding (a transformer over the patch features alone).
        max_support: cells kept per slot for soft patches (see ``operators.soft_patches``).
        scorer: :class:`~operators.scorer.ScorerConfig`.
        features: :class:`~operators.resnet.ResNetConfig` (``feature_dim``, widths, ``frozen``).
        aggregator: ``"mean"``, ``"max"``, ``"attention_mil"`` or ``"transformer"``.
        aggregator_hidden: hidden size of attention-MIL / token width of the transformer.
        gated: gated attention-MIL.
        mil_attention: how attention-MIL turns its attention logits ``s_k`` into pooling weights: ``"softmax"``
            (Ilse et al. 2018, default) or ``"sigmoid"`` (``sigmoid(s_k) / sum_j sigmoid(s_j)``: saturating gates,
            so every patch the attention is sure of weighs about the same and a majority of informative patches
            outweighs a minority; with softmax one object's larger logit can take most of the bag — on the
            four-class objects task the misread slides put 0.34-0.45 of the attention on the one object of
            another kind, benchmarks/RESULTS.md).
        transformer_layers, transformer_heads: transformer aggregator size.
        transformer_readout: ``"mean"`` of the encoded patch tokens (default), ``"logit_mean"`` (the mean of
            the encoded tokens' logits: a bag's prediction is the average of its patches' votes, and a bag of one
            is that patch's own vote, as the evidence and neutral losses assume), a ``"cls"`` token, or ``"gate"``:
            the encoded tokens give sigmoid attention gates and a linear head classifies the gated mean of the
            patch features (attention-MIL whose attention sees the other patches).
        mean_skip: attention-MIL and transformer only: the mean aggregator (a linear head on the mean of the
            patch features) plus the aggregator, whose own head is zero-initialised, so training starts from the
            mean aggregator and learns attention / interactions on top of it (four-class objects, RESULTS.md).
        num_classes: C (>= 2).
        dropout: dropout in the aggregator.
        mpp: microns per pixel of store level 0 the model was trained at (``foveate train`` sets it to the median
            of the training stores that record it; None: unknown). With pixel settings scoring warns about a store
            at another resolution (``foveate score --strict-mpp`` refuses it): ``patch_size`` and
            ``scorer_downsample`` are level-0 pixels, so the same model at another mpp sees other structures.
            With ``patch_size_um`` and ``scorer_mpp`` both set the model adapts to each slide's mpp and there is
            no warning; ``mpp`` then only fixes the default ``patch_input``.
    """

    patch_size: int | None = None
    stride: int | None = None
    patch_size_um: float | None = None
    stride_um: float | None = None
    patch_input: int | None = None
    scorer_downsample: float | None = None
    scorer_mpp: float | None = None
    tissue_threshold: float = 0.1
    k: int = 8
    selector: Literal["perturbed", "sinkhorn", "lapsum", "attention", "hard"] = "perturbed"
    num_samples: int = 500
    sigma: float = 0.05
    control_variate: bool = False
    epsilon: float = 0.01
    sinkhorn_max_iter: int = 200
    alpha: float = 0.05
    replace: bool = False
    entropy_weight: float = 0.01
    attention_temperature: float = 0.05
    explore_temperature: float = 0.0
    mask_extra: int = 0
    gates: Literal["mask", "hard", "certainty"] = "mask"
    attention_weights: Literal["estimator", "normalised", "uniform", "inclusion"] = "estimator"
    attention_draw: Literal["sample", "slot_modes"] = "sample"
    soft_draw: Literal["topk", "slot_modes"] = "topk"
    mask_sampling: bool = False
    candidate_dropout: float = 0.0
    selection_grad: float = 1.0
    patch_jitter: float = 0.0
    nms_radius: int = 0
    nms_ties: Literal["keep", "first"] = "keep"
    color_jitter: float = 0.0
    explore_cells: int = 0
    explore_strata: int = 0
    rare_cells: int = 0
    rare_strata: int = 64
    rare_per_step: int = 0
    rare_weight: float = 1.0
    neutral_cells: int = 0
    neutral_pool: int = 0
    neutral_weight: float = 1.0
    instance_weight: float = 0.0
    rank_weight: float = 0.0
    rank_temperature: float = 0.1
    evidence: str = "confidence"
    evidence_gamma: float = 1.0
    max_support: int = 4
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    features: ResNetConfig = field(default_factory=ResNetConfig)
    aggregator: Literal["mean", "max", "vote", "attention_mil", "transformer"] = "mean"
    aggregator_hidden: int = 128
    gated: bool = True
    mil_attention: Literal["softmax", "sigmoid"] = "softmax"
    transformer_layers: int = 2
    transformer_heads: int = 4
    position_frequencies: int = 8
    transformer_readout: Literal["mean", "logit_mean", "cls", "gate"] = "mean"
    mean_skip: bool = False
    num_classes: int = 2
    dropout: float = 0.0
    mpp: float | None = None

    def __post_init__(self) -> None:
        def pos_int(name: str, minimum: int = 1) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"model.{name} must be an int >= {minimum}, got {v!r}")

        def pos_num(name: str) -> None:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ConfigError(f"model.{name} must be None or a finite number > 0 (µm), got {v!r}")

        def num_in(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi):
                raise ConfigError(f"model.{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")

        for px, um in (("patch_size", "patch_size_um"), ("scorer_downsample", "scorer_mpp")):
            if getattr(self, px) is not None and getattr(self, um) is not None:
                raise ConfigError(
                    f"model.{px} and model.{um}: exactly one may be set (level-0 pixels or µm), got "
                    f"{px}={getattr(self, px)!r} and {um}={getattr(self, um)!r}; set the other to null"
                )
        # the pixel defaults apply when neither of a pair is set
        if self.patch_size is None and self.patch_size_um is None:
            object.__setattr__(self, "patch_size", 128)
        if self.scorer_downsample is None and self.scorer_mpp is None:
            object.__setattr__(self, "scorer_downsample", 16.0)
        if self.patch_size_um is not None:
            pos_num("patch_size_um")
            if self.stride is not None:
                raise ConfigError(
                    f"model.stride is in level-0 pixels and goes with model.patch_size; with model.patch_size_um "
                    f"set model.stride_um (µm) instead, got stride={self.stride!r}"
                )
            if self.stride_um is not None:
                pos_num("stride_um")
        elif self.stride_um is not None:
            raise ConfigError(
                f"model.stride_um goes with model.patch_size_um; with model.patch_size set model.stride (level-0 "
                f"pixels) instead, got stride_um={self.stride_um!r}"
            )
        if self.scorer_mpp is not None:
            pos_num("scorer_mpp")
        if self.patch_input is not None:
            pos_int("patch_input", 8)
        if self.patch_size is not None:
            pos_int("patch_size", 8)

        for name in (
            "k",
            "num_samples",
            "sinkhorn_max_iter",
            "max_support",
            "aggregator_hidden",
            "transformer_layers",
            "transformer_heads",
        ):
            pos_int(name)
        pos_int("position_frequencies", 0)
        pos_int("num_classes", 2)
        pos_int("mask_extra", 0)
        for name in ("mask_sampling", "mean_skip"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name} must be true or false, got {getattr(self, name)!r}")
        if self.attention_weights not in ("estimator", "normalised", "uniform", "inclusion"):
            raise ConfigError(
                "model.attention_weights must be 'estimator', 'normalised', 'uniform' or 'inclusion', "
                f"got {self.attention_weights!r}"
            )
        if self.attention_draw not in ("sample", "slot_modes"):
            raise ConfigError(f"model.attention_draw must be 'sample' or 'slot_modes', got {self.attention_draw!r}")
        if self.attention_draw == "slot_modes" and self.attention_weights != "uniform":
            raise ConfigError(
                "model.attention_draw: slot_modes gives each bag cell weight 1/K; it needs model.attention_weights: "
                f"uniform, got {self.attention_weights!r}"
            )
        if self.soft_draw not in ("topk", "slot_modes"):
            raise ConfigError(f"model.soft_draw must be 'topk' or 'slot_modes', got {self.soft_draw!r}")
        if self.soft_draw == "slot_modes" and (self.mask_sampling or self.explore_temperature > 0):
            raise ConfigError(
                "model.soft_draw: slot_modes draws the k cells SOFT/LapSum read in training; it cannot be combined "
                f"with model.mask_sampling (got {self.mask_sampling}) or model.explore_temperature (got "
                f"{self.explore_temperature}): set those to false / 0"
            )
        if self.gates not in ("mask", "hard", "certainty"):
            raise ConfigError(f"model.gates must be one of 'mask', 'hard', 'certainty', got {self.gates!r}")
        if self.mask_sampling and (self.mask_extra > 0 or self.explore_temperature > 0):
            raise ConfigError(
                "model.mask_sampling draws the k cells SOFT/LapSum read in training; it cannot be combined with "
                f"model.mask_extra (got {self.mask_extra}) or model.explore_temperature (got "
                f"{self.explore_temperature}): set those to 0"
            )
        pos_int("explore_cells", 0)
        pos_int("explore_strata", 0)
        pos_int("rare_cells", 0)
        pos_int("rare_strata", 1)
        pos_int("neutral_cells", 0)
        pos_int("rare_per_step", 0)
        pos_int("neutral_pool", 0)
        if self.rare_per_step > self.rare_cells:
            raise ConfigError(
                f"model.rare_per_step must be at most model.rare_cells ({self.rare_cells}), got {self.rare_per_step}"
            )
        if self.neutral_pool and self.neutral_pool < self.neutral_cells:
            raise ConfigError(
                f"model.neutral_pool must be 0 or at least model.neutral_cells ({self.neutral_cells}), got "
                f"{self.neutral_pool}"
            )
        pos_int("nms_radius", 0)
        if self.nms_ties not in ("keep", "first"):
            raise ConfigError(f"model.nms_ties must be 'keep' or 'first', got {self.nms_ties!r}")
        if self.stride is not None:
            pos_int("stride")
        if self.scorer_downsample is not None and not (
            isinstance(self.scorer_downsample, (int, float))
            and math.isfinite(self.scorer_downsample)
            and self.scorer_downsample >= 1
        ):
            raise ConfigError(f"model.scorer_downsample must be a number >= 1, got {self.scorer_downsample!r}")
        if self.mpp is not None and not (
            isinstance(self.mpp, (int, float))
            and not isinstance(self.mpp, bool)
            and math.isfinite(self.mpp)
            and self.mpp > 0
        ):
            raise ConfigError(f"model.mpp must be None or a finite number > 0 (µm per pixel), got {self.mpp!r}")
        if not (0.0 <= self.tissue_threshold <= 1.0):
            raise ConfigError(f"model.tissue_threshold must be in [0, 1], got {self.tissue_threshold!r}")
        if self.selector not in SELECTORS:
            raise ConfigError(f"model.selector must be one of {list(SELECTORS)}, got {self.selector!r}")
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(f"model.aggregator must be one of {list(AGGREGATORS)}, got {self.aggregator!r}")
        for name in ("sigma", "entropy_weight", "explore_temperature"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"model.{name} must be a finite number >= 0, got {v!r}")
        for name in ("epsilon", "alpha", "attention_temperature"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"model.{name} must be a finite number > 0, got {v!r}")
        for name in ("instance_weight", "rank_weight", "rare_weight", "neutral_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"model.{name} must be a finite number >= 0, got {v!r}")
        if not (
            isinstance(self.rank_temperature, (int, float))
            and math.isfinite(self.rank_temperature)
            and self.rank_temperature > 0
        ):
            raise ConfigError(f"model.rank_temperature must be a finite number > 0, got {self.rank_temperature!r}")
        if self.rare_cells > 0 and self.instance_weight <= 0:
            raise ConfigError(
                "model.rare_cells > 0 needs model.instance_weight > 0 (the rare bag is read with the evidence "
                f"losses); got rare_cells={self.rare_cells}, instance_weight={self.instance_weight}"
            )
        if self.rank_weight > 0 and self.instance_weight <= 0:
            raise ConfigError(
                "model.rank_weight > 0 needs model.instance_weight > 0 (the rank targets are the "
                f"instance head's confidence, which only the instance loss trains); got "
                f"rank_weight={self.rank_weight}, instance_weight={self.instance_weight}"
            )
        if self.evidence not in ("confidence", "label"):
            raise ConfigError(f"model.evidence must be 'confidence' or 'label', got {self.evidence!r}")
        if not (
            isinstance(self.evidence_gamma, (int, float))
            and math.isfinite(self.evidence_gamma)
            and 0 < self.evidence_gamma <= 1
        ):
            raise ConfigError(f"model.evidence_gamma must be a number in (0, 1], got {self.evidence_gamma!r}")
        if self.transformer_readout not in READOUTS:
            raise ConfigError(
                f"model.transformer_readout must be one of {list(READOUTS)}, got {self.transformer_readout!r}"
            )
        if self.mean_skip and self.aggregator not in MEAN_SKIP_AGGREGATORS:
            raise ConfigError(
                f"model.mean_skip applies to the {' and '.join(MEAN_SKIP_AGGREGATORS)} aggregators (the others have "
                f"no head of their own to add the mean aggregator to); got aggregator={self.aggregator!r}"
            )
        for name, hi in (("color_jitter", 1.0), ("patch_jitter", 0.5), ("selection_grad", 1.0)):
            num_in(name, 0.0, hi)
        if not (isinstance(self.candidate_dropout, (int, float)) and 0.0 <= self.candidate_dropout < 1.0):
            raise ConfigError(f"model.candidate_dropout must be in [0, 1), got {self.candidate_dropout!r}")
        if not (0.0 <= self.dropout < 1.0):
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        if self.aggregator == "transformer" and self.aggregator_hidden % self.transformer_heads:
            raise ConfigError(
                f"model.aggregator_hidden ({self.aggregator_hidden}) must be a multiple of "
                f"model.transformer_heads ({self.transformer_heads})"
            )

    @property
    def stride_l0(self) -> int:
        """The grid stride in level-0 pixels (``stride`` or ``patch_size``); pixel patches only (µm patches have
        one per slide: :meth:`geometry`)."""
        if self.patch_size is None:
            raise ConfigError(
                f"model.patch_size_um={self.patch_size_um} is resolved per slide: use ModelConfig.geometry(mpp) "
                "(workers.patches.slide_geometry(store, cfg)), not stride_l0"
            )
        return self.patch_size if self.stride is None else self.stride

    @property
    def physical(self) -> bool:
        """True when both the patch size and the scorer's resolution are in µm (the model adapts to each slide's
        mpp; scoring does not warn about a store at another mpp than ``mpp``)."""
        return self.patch_size_um is not None and self.scorer_mpp is not None

    @property
    def uses_um(self) -> bool:
        """True when either the patch size or the scorer's resolution is in µm (stores need an mpp)."""
        return self.patch_size_um is not None or self.scorer_mpp is not None

    def geometry(self, mpp: float | None = None, *, where: str = "the slide") -> SlideGeometry:
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
        if mpp is not None and not (isinstance(mpp, (int, float)) and math.isfinite(mpp) and mpp > 0):
            raise ConfigError(f"{where}: level-0 mpp must be a finite number > 0 (µm per pixel), got {mpp!r}")
        if self.uses_um and mpp is None:
            keys = [k for k in ("patch_size_um", "scorer_mpp") if getattr(self, k) is not None]
            raise ConfigError(
                f"{where} records no mpp (µm per pixel), so model.{' and model.'.join(keys)} cannot be resolved "
                "to its pixels; re-ingest it from a slide with mpp metadata (or with --mpp), or use "
                "model.patch_size / model.scorer_downsample (level-0 pixels)"
            )
        if self.patch_size_um is not None:
            patch = int(round(self.patch_size_um / mpp))
            stride = patch if self.stride_um is None else max(1, int(round(self.stride_um / mpp)))
            if patch < 8:
                raise ConfigError(
                    f"{where}: model.patch_size_um={self.patch_size_um} is {patch} level-0 pixels at mpp {mpp:g}; "
                    "a patch needs >= 8"
                )
            if self.patch_input is not None:
                size = self.patch_input
            elif self.mpp is not None:
                size = max(8, int(round(self.patch_size_um / self.mpp)))
            else:
                raise ConfigError(
                    "model.patch_size_um needs model.patch_input (the network's patch side in pixels) or model.mpp "
                    "(the training resolution, which foveate train records), got neither"
                )
        else:
            patch, stride = int(self.patch_size), int(self.stride_l0)
            size = patch if self.patch_input is None else self.patch_input
        if self.scorer_mpp is not None:
            ds = float(self.scorer_mpp) / float(mpp)
            if ds < 1.0 - 1e-9:
                raise ConfigError(
                    f"{where}: model.scorer_mpp={self.scorer_mpp} is finer than its level-0 mpp {mpp:g}; the "
                    "scorer's view must be at most level-0 resolution"
                )
            ds = max(ds, 1.0)
        else:
            ds = float(self.scorer_downsample)
        return SlideGeometry(patch_size=patch, stride=stride, scorer_downsample=ds, patch_input=size, mpp=mpp)

    def geometry_key(self) -> tuple:
        """The settings :meth:`geometry` depends on (a cache key, with the slide)."""
        return (
            self.patch_size,
            self.stride,
            self.patch_size_um,
            self.stride_um,
            self.patch_input,
            self.scorer_downsample,
            self.scorer_mpp,
            self.mpp,
        )


@dataclass(frozen=True)
class SlideGeometry:
    """The model's geometry on one slide (:meth:`ModelConfig.geometry`); level-0 pixels of that slide.

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


@dataclass
class Selection:
    """What :meth:`FoveateModel.select` chose.

    Attributes:
        indices: ``[B, K, S]`` long, cell indices (row-major ``r * Gw + c``) of the support of each slot,
            sorted by decreasing weight; ``S = 1`` for hard top-k, SOFT/LapSum and attention sampling.
            Slots are in increasing cell order for the top-k selectors, in sampling order for attention
            sampling (which may repeat a cell when sampling with replacement).
        weights: ``[B, K, S]`` differentiable weights of the patch combination of each slot, summing to one
            over S (renormalised over the capped support; see ``operators.soft_patches`` for the bias).
        slot_weights: ``[B, K]`` per-slot weights for the aggregator, or ``None``: the attention-sampling
            estimator weights (training) / attention renormalised over the chosen cells (inference); the SOFT
            or LapSum mask values divided by K (mask gating, differentiable).
        aux: extra tensors: ``"kept_mass"`` ``[B, K]`` (perturbed: indicator mass inside the capped support),
            ``"attention_entropy"`` ``[B]`` (attention: entropy of the attention over the candidates).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    slot_weights: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def primary(self) -> torch.Tensor:
        """``[B, K]`` the highest-weight cell of each slot (the "chosen" cell)."""
        return self.indices[..., 0]


@dataclass
class ModelOutput:
    """Result of ``workers.patches.forward_slide`` for one slide.

    Attributes:
        logits: ``[1, C]``.
        scores: ``[N]`` scores of all cells (``-inf`` for cells that were not candidates).
        cell_indices: ``[K]`` long, the chosen cell of each slot (:attr:`Selection.primary`).
        coords_l0: ``[K, 2]`` long, level-0 ``(x, y)`` of the top-left corner of each chosen patch.
        patch_scores: ``[K]`` the scores of the chosen cells.
        aux_losses: terms to add to the loss as they are (``"entropy"``: ``-entropy_weight * H`` for attention
            sampling); empty otherwise.
        selection: the full :class:`Selection`.
        info: floats for logging (``num_cells``, ``num_candidates``, ``tissue_fallback`` (0/1),
            ``cells_read``, ``kept_mass`` (perturbed)).
    """

    logits: torch.Tensor
    scores: torch.Tensor
    cell_indices: torch.Tensor
    coords_l0: torch.Tensor
    patch_scores: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    selection: Selection | None = None
    info: dict[str, float] = field(default_factory=dict)


def _inclusion_weights(att: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, K]`` attention of the bag's cells -> ``pi / sum pi`` with ``pi = 1 - (1 - a)^K``, the probability of
    each cell being drawn at least once in K draws (``attention_weights: inclusion``)."""
    pi = -torch.expm1(k * torch.log1p(-att.clamp(max=1.0 - torch.finfo(att.dtype).eps)))
    return pi / pi.sum(1, keepdim=True).clamp_min(torch.finfo(att.dtype).tiny)


class FoveateModel(nn.Module):
    """Scorer CNN + selection + ResNet features + aggregator (see the module docstring for the stages).

    ``forward(patches[B,K,3,p,p], positions[B,K,2], slot_weights=None) -> logits[B,C]`` is
    :meth:`classify` (embed + aggregate), the part that runs after patch reading.

    Args:
        cfg: :class:`ModelConfig` (default: all defaults).
    """

    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.scorer = ScorerCNN(cfg.scorer)
        self.features = ResNet(cfg.features)
        self.aggregator = build_aggregator(
            cfg.aggregator,
            cfg.features.feature_dim,
            cfg.num_classes,
            hidden=cfg.aggregator_hidden,
            gated=cfg.gated,
            mil_attention=cfg.mil_attention,
            layers=cfg.transformer_layers,
            heads=cfg.transformer_heads,
            num_frequencies=cfg.position_frequencies,
            dropout=cfg.dropout,
            readout=cfg.transformer_readout,
            mean_skip=cfg.mean_skip,
        )
        # created only when used, so models without the evidence losses keep their parameters (and seeds)
        self.instance_head = nn.Linear(cfg.features.feature_dim, cfg.num_classes) if cfg.instance_weight > 0 else None

    @property
    def uses_evidence(self) -> bool:
        """True when training adds the evidence losses (an instance head exists)."""
        return self.instance_head is not None

    # ------------------------------------------------------------------ stage 1: scores
    def score(
        self, lowres: torch.Tensor, cell_mask: torch.Tensor, geometry: SlideGeometry | None = None
    ) -> torch.Tensor:
        """One score per grid cell.

        Args:
            lowres: ``[B, 3, h, w]`` float in [0, 1] or uint8 (converted tile by tile when the scorer tiles:
                ``ScorerConfig.tile``), covering exactly the grid extent (see ``workers.patches.lowres_input``),
                any resolution.
            cell_mask: ``[B, Gh, Gw]`` bool, tissue cells (the grid shape comes from here).
            geometry: the slides' :class:`SlideGeometry` (the grid's patch size and stride, for pooling onto
                cells); default ``cfg.geometry()``, which only pixel settings allow.

        Returns:
            ``scores[B, N]`` (``N = Gh * Gw``, row-major): min–max normalised to [0, 1] per row over the
            candidate cells, for every selector (attention sampling takes ``softmax(scores / attention_temperature)``
            over the candidates); ``-inf`` for cells that are not candidates (outside tissue). A row with
            fewer than ``k`` tissue cells falls back to all cells (logged warning).

        Raises:
            ValueError: wrong shapes, or a grid with fewer than ``k`` cells.
        """
        if (
            not isinstance(lowres, torch.Tensor)
            or lowres.dim() != 4
            or lowres.shape[1] != 3
            or not (lowres.is_floating_point() or lowres.dtype == torch.uint8)
        ):
            raise ValueError(
                f"lowres must be float (in [0, 1]) or uint8 [B, 3, h, w], got {getattr(lowres, 'shape', type(lowres))} "
                f"{getattr(lowres, 'dtype', '')}"
            )
        if not isinstance(cell_mask, torch.Tensor) or cell_mask.dim() != 3 or cell_mask.shape[0] != lowres.shape[0]:
            raise ValueError(
                f"cell_mask must be bool [B, Gh, Gw] with B={lowres.shape[0]}, got "
                f"{getattr(cell_mask, 'shape', type(cell_mask))}"
            )
        b, gh, gw = cell_mask.shape
        n = gh * gw
        if n < self.cfg.k:
            raise ValueError(
                f"the grid has N={n} cells ({gh}x{gw}), fewer than model.k={self.cfg.k}; use a smaller "
                f"patch_size/stride or k"
            )
        g = self.cfg.geometry() if geometry is None else geometry
        if (
            self.cfg.selection_grad == 0.0
            and lowres.shape[-2] * lowres.shape[-1] >= _SPARSE_SCORER_MIN_PIXELS
            and torch.is_grad_enabled()
            and not lowres.requires_grad
            and any(p.requires_grad for p in self.scorer.parameters())
        ):
            # the scorer learns from the rank loss on the cells that were read (and the normalisation's min and
            # max cells) alone: its backward pass re-runs it on those cells' crops only (same gradients)
            raw = sparse_grad_cell_scores(
                self.scorer, lowres, (gh, gw), g.patch_size, g.stride, mode=self.cfg.scorer.pool
            )
        else:
            smap = score_map(self.scorer, lowres)
            raw = cell_pool(smap, (gh, gw), g.patch_size, g.stride, mode=self.cfg.scorer.pool)[:, 0]
        cand = candidate_mask(cell_mask.reshape(b, n).to(device=raw.device, dtype=torch.bool), self.cfg.k)
        return minmax_normalise(raw, cand)

    # ------------------------------------------------------------------ stage 2: selection
    def local_maxima(self, scores: torch.Tensor, grid_shape: tuple[int, int]) -> torch.Tensor:
        """Keep the cells that are the maximum of their ``(2r+1) x (2r+1)`` window (``r = cfg.nms_radius``).

        Args:
            scores: ``[B, N]`` from :meth:`score` (``-inf`` = not a candidate), ``N = Gh * Gw`` row-major.
            grid_shape: ``(Gh, Gw)``.

        Returns:
            ``[B, N]``: ``scores`` where a cell is a local maximum (ties: ``cfg.nms_ties``), ``-inf``
            elsewhere; a row with fewer than ``k`` local maxima is returned unchanged. ``scores`` itself when
            ``nms_radius == 0``. Differentiable wrt the kept scores.
        """
        r = self.cfg.nms_radius
        if r <= 0:
            return scores
        gh, gw = (int(v) for v in grid_shape)
        if scores.dim() != 2 or scores.shape[1] != gh * gw:
            raise ValueError(f"scores must be [B, {gh * gw}] for grid {gh}x{gw}, got {tuple(scores.shape)}")
        with torch.no_grad():
            grid = scores.detach().view(-1, 1, gh, gw)
            mx = torch.nn.functional.max_pool2d(grid, 2 * r + 1, stride=1, padding=r).view_as(scores)
            keep = torch.isfinite(scores) & (scores.detach() >= mx)
            if self.cfg.nms_ties == "first":
                # kept cells within r of each other are tied; keep the one of smallest index in each window
                idx = torch.arange(gh * gw, device=scores.device, dtype=torch.float64).expand_as(keep)
                prio = torch.where(keep, -idx, torch.full_like(idx, float("-inf"))).reshape(-1, 1, gh, gw)
                best = torch.nn.functional.max_pool2d(prio, 2 * r + 1, stride=1, padding=r).view_as(keep)
                keep = keep & (-idx >= best)
            enough = keep.sum(1, keepdim=True) >= self.cfg.k
            keep = torch.where(enough, keep, torch.isfinite(scores))
        return torch.where(keep, scores, torch.full_like(scores, float("-inf")))

    def select(
        self,
        scores: torch.Tensor,
        *,
        training: bool,
        sigma: float | None = None,
        generator: torch.Generator | None = None,
    ) -> Selection:
        """Choose K cells per row among the candidates (finite scores).

        Args:
            scores: ``[B, N]`` from :meth:`score` (``-inf`` = not a candidate).
            training: soft/stochastic selection (True) or hard top-k (False).
            sigma: perturbed top-k noise for this call (default ``cfg.sigma``; the trainer decays it).
            generator: RNG on the scores' device for the training-time randomness (perturbed noise, attention
                sampling, ``candidate_dropout``, ``explore_temperature``).

        Returns:
            :class:`Selection`. Per selector in training: ``perturbed`` -> soft slots over the capped support
            (``S = max_support``); ``hard`` -> hard top-k (``S = 1``, weights 1); ``sinkhorn``/``lapsum`` ->
            hard top-k cells with ``slot_weights`` = the soft mask at those cells / K (gating features;
            ``K + mask_extra`` cells, drawn with Gumbel noise when ``explore_temperature > 0``);
            ``attention`` -> sampled cells with the estimator weights as ``slot_weights`` and the entropy in
            ``aux``. At inference every selector takes the hard top-k (sinkhorn/lapsum keep their mask
            gates, attention its renormalised attention).
        """
        from operators import topk as _topk

        if not isinstance(training, bool):
            raise TypeError(f"training must be a bool, got {type(training).__name__}")
        if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
            raise ValueError(f"scores must be float [B, N], got {getattr(scores, 'shape', type(scores))}")
        if bool(torch.isnan(scores).any()) or bool((scores == float("inf")).any()):
            raise ValueError("scores must be finite or -inf (not a candidate), got NaN or +inf entries")
        cfg = self.cfg
        k = cfg.k
        sigma = cfg.sigma if sigma is None else float(sigma)
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
        cand = torch.isfinite(scores)
        if training and cfg.selection_grad != 1.0 and scores.requires_grad:
            w = float(cfg.selection_grad)  # same values, the selection's gradient to the scorer scaled by w
            scores = torch.where(cand, scores * w + scores.detach() * (1.0 - w), scores.detach())
        counts = cand.sum(1)
        if bool((counts < k).any()):
            raise ValueError(
                f"every row needs at least k={k} candidate cells (finite scores), got counts {counts.tolist()}"
            )
        if training and cfg.candidate_dropout > 0:
            # drop candidates at random (rows keep at least k): the top-k of a random subset reaches cells the
            # scorer ranks lower, and the patches of a slide change from step to step
            keep = torch.rand(scores.shape, generator=generator, device=scores.device) >= cfg.candidate_dropout
            kept = cand & keep
            short = kept.sum(1) < k
            cand = torch.where(short[:, None], cand, kept)
            counts = cand.sum(1)
        # SOFT/LapSum training reads k + mask_extra cells per row; the same count for every row of the batch
        m = min(k + cfg.mask_extra, int(counts.min()))
        rows = []
        for b in range(scores.shape[0]):  # rows differ in their candidate count: select on the compacted row
            cidx = torch.nonzero(cand[b]).flatten()
            sc = scores[b, cidx].unsqueeze(0)  # [1, Nc], finite
            rows.append(
                self._select_row(sc, cidx, training=training, sigma=sigma, generator=generator, topk=_topk, num_read=m)
            )
        out = Selection(
            indices=torch.cat([r.indices for r in rows]),
            weights=torch.cat([r.weights for r in rows]),
            slot_weights=None if rows[0].slot_weights is None else torch.cat([r.slot_weights for r in rows]),
            aux={key: torch.cat([r.aux[key] for r in rows]) for key in rows[0].aux},
        )
        return out

    def _select_row(
        self,
        sc: torch.Tensor,
        cidx: torch.Tensor,
        *,
        training: bool,
        sigma: float,
        generator: torch.Generator | None,
        topk,
        num_read: int,
    ) -> Selection:
        cfg = self.cfg
        k = cfg.k
        ones = sc.new_ones((1, k, 1))
        if cfg.selector == "attention":
            from operators.attention_sampling import attention_entropy, attention_sample, slot_mode_sample

            logits = sc / cfg.attention_temperature
            att = torch.softmax(logits, dim=1)  # [1, Nc]
            ent = attention_entropy(att)
            if training:
                if cfg.attention_draw == "slot_modes":  # the perturbed top-k's bag; weights: uniform (config check)
                    idx = slot_mode_sample(logits, k, num_samples=cfg.num_samples, generator=generator)
                else:
                    idx, w = attention_sample(att, k, replace=cfg.replace, generator=generator)
                if cfg.attention_weights == "normalised":  # self-normalised: the drawn cells' attention, summing to 1
                    w = att.gather(1, idx)
                    w = w / w.sum(1, keepdim=True)
                elif cfg.attention_weights == "uniform":  # 1/K each; the with-replacement estimator's gradient
                    la = torch.log_softmax(logits, dim=1).gather(1, idx)  # a / sg(a), in logs
                    w = (1.0 + (la - la.detach())) / k
                elif cfg.attention_weights == "inclusion":
                    w = _inclusion_weights(att.gather(1, idx), k)
            else:
                idx = topk.hard_topk(sc, k)
                if cfg.attention_weights == "uniform":
                    w = sc.new_full((1, k), 1.0 / k)
                elif cfg.attention_weights == "inclusion":
                    w = _inclusion_weights(att.gather(1, idx), k)
                else:
                    w = att.gather(1, idx)
                    w = w / w.sum(1, keepdim=True)
            return Selection(cidx[idx].unsqueeze(-1), ones, w, {"attention_entropy": ent})
        if cfg.selector == "perturbed" and training:
            y = topk.perturbed_topk(
                sc,
                k,
                num_samples=cfg.num_samples,
                sigma=sigma,
                generator=generator,
                control_variate=cfg.control_variate,
            )  # [1,K,Nc]
            idx, w, mass = cap_support(y, cfg.max_support)
            return Selection(cidx[idx], w, None, {"kept_mass": mass})
        keys = sc.detach()  # what ranks the read cells (training with explore_temperature: + Gumbel noise)
        mask = None
        if training and cfg.soft_draw == "slot_modes" and cfg.selector in ("sinkhorn", "lapsum") and sc.shape[1] > k:
            # the perturbed top-k's bag (per slot its most frequent cell over the noisy draws), 1/k per slot with
            # the mask's gradient; the num_read - k cells ranked below the top-k are read at weight 0 (evidence)
            mask = self._soft_mask(sc)
            bag = topk.perturbed_slot_modes(sc, k, num_samples=cfg.num_samples, sigma=sigma, generator=generator)
            below = torch.topk(keys, num_read, dim=1).indices[:, k:]
            idx = torch.cat([bag, below], dim=1)
            m = mask.gather(1, idx) / k
            fwd = torch.cat([m.new_full((1, k), 1.0 / k), m.new_zeros((1, num_read - k))], dim=1)
            ones = sc.new_ones((1, num_read, 1))
            return Selection(cidx[idx].unsqueeze(-1), ones, fwd + (m - m.detach()), {})
        if training and cfg.mask_sampling and cfg.selector in ("sinkhorn", "lapsum") and sc.shape[1] > k:
            # read k cells drawn with inclusion probabilities = the soft mask: the cells it holds at 1 always,
            # the mass it spreads near its threshold shared out at random (operators.topk.mask_sample)
            mask = self._soft_mask(sc)
            idx = topk.mask_sample(mask, k, generator=generator)
        elif training and cfg.selector in ("sinkhorn", "lapsum") and sc.shape[1] > k:
            # read num_read = k + mask_extra cells: the largest scores, or a Gumbel-top-k draw from softmax(s / T)
            if cfg.explore_temperature > 0:
                from operators.attention_sampling import gumbel_noise

                keys = keys / cfg.explore_temperature + gumbel_noise(
                    sc.shape, generator=generator, device=sc.device, dtype=sc.dtype
                )
            idx = topk.hard_topk(keys, num_read)  # [1, num_read], sorted by position
            ones = sc.new_ones((1, num_read, 1))
        else:
            idx = topk.hard_topk(sc, k)  # [1, K], sorted by position
        if cfg.selector in ("sinkhorn", "lapsum") and sc.shape[1] == k:
            # SOFT and LapSum need k < N; with exactly k candidates all are chosen with mask 1
            return Selection(cidx[idx].unsqueeze(-1), ones, sc.new_full((1, k), 1.0 / k), {})
        if cfg.selector in ("sinkhorn", "lapsum"):
            if mask is None:
                mask = self._soft_mask(sc)
            m = mask.gather(1, idx)  # [1, num_read]
            gates = m / k
            if cfg.gates == "certainty" and training:
                # the certainty of each read cell's inclusion, max(0, 2m - 1), normalised over the bag: the cells
                # the mask holds near 1 carry the bag, those near its threshold (m <= 1/2) are left out
                cert = (2.0 * m - 1.0).clamp_min(0.0)
                if float(cert.detach().sum()) > 0:
                    return Selection(cidx[idx].unsqueeze(-1), ones, cert / cert.sum(1, keepdim=True), {})
            if cfg.gates != "mask":
                # forward: the hard top-k mean (1/k on the k read cells with the largest keys, 0 on the extra
                # ones), as at inference; backward: the soft mask's gradient (straight-through)
                hard = torch.zeros_like(gates)
                top = keys.gather(1, idx).topk(k, dim=1).indices
                hard.scatter_(1, top, 1.0 / k)
                gates = hard + (gates - gates.detach())
            return Selection(cidx[idx].unsqueeze(-1), ones, gates, {})
        return Selection(cidx[idx].unsqueeze(-1), ones, None, {})

    def _soft_mask(self, sc: torch.Tensor) -> torch.Tensor:
        """The SOFT (``sinkhorn``) or LapSum top-k mask of ``sc[1, Nc]`` (finite, ``Nc > k``): ``[1, Nc]``."""
        cfg = self.cfg
        if cfg.selector == "sinkhorn":
            from operators.sinkhorn import sinkhorn_topk

            return sinkhorn_topk(sc, cfg.k, epsilon=cfg.epsilon, max_iter=cfg.sinkhorn_max_iter)
        from operators.lapsum import lapsum_topk

        return lapsum_topk(sc, cfg.k, alpha=cfg.alpha)

    # ------------------------------------------------------------------ stage 3: features
    def embed(self, patches: torch.Tensor) -> torch.Tensor:
        """``patches[M, 3, p, p]`` float in [0, 1] -> ``features[M, D]`` (the ResNet)."""
        return self.features(patches)

    # ------------------------------------------------------------------ stage 4: aggregation
    def aggregate(
        self, features: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``features[B, K, D]``, ``positions[B, K, 2]`` (patch centres / slide size, in [0, 1]) and optional
        ``weights[B, K]`` (:attr:`Selection.slot_weights`) -> ``logits[B, C]``."""
        return self.aggregator(features, positions, weights)

    def aggregate_each(self, features: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Each patch classified on its own (the aggregator on a bag of one): ``features[M, D]``, optional
        ``positions[M, 2]`` (zeros when None) -> ``logits[M, C]``. The aggregator's ``last_attention`` (the
        latest bag's, for heatmaps) is left as it was."""
        pos = positions if positions is not None else features.new_zeros(features.shape[0], 2)
        kept = getattr(self.aggregator, "last_attention", None)
        logits = self.aggregate(features[:, None], pos[:, None], None)
        if kept is not None:
            self.aggregator.last_attention = kept
        return logits.reshape(features.shape[0], -1)

    def classify(
        self, patches: torch.Tensor, positions: torch.Tensor, slot_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """embed + aggregate: ``patches[B, K, 3, p, p]`` float in [0, 1] -> ``logits[B, C]``."""
        if not isinstance(patches, torch.Tensor) or patches.dim() != 5:
            raise ValueError(f"patches must be [B, K, 3, p, p], got {getattr(patches, 'shape', type(patches))}")
        b, k = patches.shape[:2]
        feats = self.embed(patches.flatten(0, 1)).view(b, k, -1)
        return self.aggregate(feats, positions, slot_weights)

    def forward(
        self, patches: torch.Tensor, positions: torch.Tensor, slot_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.classify(patches, positions, slot_weights)

    def evidence_losses(
        self,
        features: torch.Tensor,
        cell_scores: torch.Tensor,
        target: int,
        positions: torch.Tensor | None = None,
        *,
        prior: torch.Tensor | None = None,
        prior_weight: float = 0.0,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The evidence losses of one slide (see :mod:`operators.evidence`).

        Args:
            features: ``[M, D]`` features of the read patches (selected slots and exploration cells).
            cell_scores: ``[M]`` the scorer's normalised scores of those cells (differentiable).
            target: the slide's class index.
            positions: ``[M, 2]`` the cells' centres in [0, 1] (used by ``evidence="label"``; zeros when None).
            prior: ``[M]`` a label-free prior in [0, 1] per read cell (e.g. ``workers.patches.cell_rarity``),
                mixed into the rank targets as ``(1 - prior_weight) * evidence + prior_weight * prior``.
            prior_weight: in [0, 1].

        Returns:
            ``(losses, info)``: ``{"instance": w_i * L_inst, "rank": w_r * L_rank}`` (weighted, to be added to
            the loss as they are) and floats for logging (mean confidence of the read patches).
        """
        if self.instance_head is None:
            raise RuntimeError("evidence_losses needs model.instance_weight > 0 (no instance head)")
        if features.dim() != 2 or cell_scores.shape != features.shape[:1]:
            raise ValueError(
                f"features must be [M, D] and cell_scores [M], got {tuple(features.shape)} and "
                f"{tuple(cell_scores.shape)}"
            )
        logits = self.instance_head(features)
        losses = {"instance": self.cfg.instance_weight * instance_loss(logits, target)}
        conf = instance_confidence(logits.detach())
        info = {"instance_confidence": float(conf.mean())}
        if self.cfg.rank_weight > 0:
            if self.cfg.evidence == "label":
                with torch.no_grad():
                    single = self.aggregate_each(features.detach(), positions)  # [M, C]
                    ev = torch.softmax(single, dim=1)[:, int(target)]
                    if self.cfg.evidence_gamma != 1.0:
                        ev = ev.clamp_min(0.0) ** self.cfg.evidence_gamma
                info["label_evidence"] = float(ev.mean())
            else:
                ev = conf
            if prior is not None and prior_weight > 0:
                if prior.shape != ev.shape:
                    raise ValueError(f"prior must be [M] = {tuple(ev.shape)}, got {tuple(prior.shape)}")
                ev = (1.0 - prior_weight) * ev + prior_weight * prior.to(ev.dtype)
            losses["rank"] = self.cfg.rank_weight * evidence_rank_loss(
                cell_scores, ev, temperature=self.cfg.rank_temperature
            )
        return losses, info

    def aux_losses(self, selection: Selection) -> dict[str, torch.Tensor]:
        """Terms to add to the loss: ``{"entropy": -entropy_weight * mean H}`` for attention sampling."""
        if self.cfg.selector == "attention" and "attention_entropy" in selection.aux and self.cfg.entropy_weight > 0:
            return {"entropy": -self.cfg.entropy_weight * selection.aux["attention_entropy"].mean()}
        return {}
