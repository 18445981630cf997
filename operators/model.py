"""The foveated model as separable stages: score -> select -> (read patches) -> embed -> aggregate.

Stages (each callable on its own, so batch scoring can run the scorer on GPU actors and patch reading,
features and aggregation on CPU actors)::

    scores = model.score(lowres[B,3,h,w], cell_mask[B,Gh,Gw])            # [B, N], -inf = not a candidate
    sel = model.select(scores, training=..., sigma=..., generator=...)   # Selection (indices/weights [B,K,S])
    # read the distinct cells of sel.indices at full resolution (workers.patches.PatchReader), combine them
    # with sel.weights (operators.soft_patches.combine_patches) -> patches[B,K,3,p,p] float in [0,1]
    feats = model.embed(patches.flatten(0, 1)).view(B, K, -1)           # [B, K, D]
    logits = model.aggregate(feats, positions[B,K,2], sel.slot_weights)  # [B, C]

``workers.slide_forward.forward_slide`` runs the whole chain for one slide. The grid and the low-res input are
defined in ``workers.patches`` (grid cells in level-0 pixels; the low-res input covers the grid extent).

Papers: Cordonnier et al. 2021 (scorer, min–max normalisation, perturbed top-k and soft patches);
Katharopoulos & Fleuret 2019 (attention sampling); Xie et al. 2020 (SOFT top-k); Struski et al. 2025 (LapSum);
Ilse et al. 2018 (attention-MIL).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from operators.aggregators import build_aggregator
from operators.evidence import evidence_rank_loss, instance_confidence, instance_loss
from operators.gate import CellGate
from operators.model_config import ModelConfig, SlideGeometry, resolved_by_driver
from operators.resnet import ResNet, RunningStandardise
from operators.scorer import (
    ScorerCNN,
    candidate_mask,
    cell_pool,
    minmax_normalise,
    score_map,
    sparse_grad_cell_scores,
)
from operators.soft_patches import cap_support

__all__ = ["Selection", "ModelOutput", "FoveateModel"]

# views smaller than this are scored with plain autograd in training: there the crops of the ~60 cells a
# slide-step reads cover about as many pixels as the view (operators.scorer.sparse_grad_cell_scores)
_SPARSE_SCORER_MIN_PIXELS = 256 * 256

log = logging.getLogger(__name__)


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
    """Result of ``workers.slide_forward.forward_slide`` for one slide.

    Attributes:
        logits: ``[1, C]``.
        scores: ``[N]`` scores of all cells (``-inf`` for cells that were not candidates).
        cell_indices: ``[K]`` long, the chosen cell of each slot (:attr:`Selection.primary`).
        coords_l0: ``[K, 2]`` long, level-0 ``(x, y)`` of the top-left corner of each chosen patch (where it was
            read: ``model.geometry.recentre`` moves it off its cell).
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


def _build_features(cfg: ModelConfig, torchscript: bytes | torch.Tensor | None) -> nn.Module:
    """``model.features``: the ResNet, or the frozen TorchScript encoder (from ``torchscript`` bytes or its path)."""
    f = cfg.features
    if f.kind == "resnet":
        if torchscript is not None:
            raise ValueError("torchscript bytes were given for a model whose model.features.kind is resnet")
        return ResNet(f.resnet())
    from operators.encoders import TorchScriptEncoder

    g = cfg.geometry  # the dummy batch that finds the feature size: the patch side the encoder will see
    side = g.patch_input or g.patch_size or (round(g.patch_size_um / cfg.mpp) if cfg.mpp else 224)
    return TorchScriptEncoder(f, data=torchscript, probe_size=max(8, int(side)))


def _inclusion_weights(att: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, K]`` attention of the bag's cells -> ``pi / sum pi`` with ``pi = 1 - (1 - a)^K``, the probability of
    each cell being drawn at least once in K draws (``attention_weights: inclusion``)."""
    pi = -torch.expm1(k * torch.log1p(-att.clamp(max=1.0 - torch.finfo(att.dtype).eps)))
    return pi / pi.sum(1, keepdim=True).clamp_min(torch.finfo(att.dtype).tiny)


def _renamed_feature_norm(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """Load-state-dict pre-hook: checkpoints of an earlier version kept the feature standardisation inside the
    ResNet (``features.standardise.*``); it is ``feature_norm.*`` now."""
    old = f"{prefix}features.standardise."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[f"{prefix}feature_norm.{key[len(old) :]}"] = state_dict.pop(key)


class FoveateModel(nn.Module):
    """Scorer CNN + selection + features (the ResNet or a frozen TorchScript encoder) + aggregator (see the module
    docstring for the stages).

    ``forward(patches[B,K,3,p,p], positions[B,K,2], slot_weights=None) -> logits[B,C]`` is
    :meth:`classify` (embed + aggregate), the part that runs after patch reading.

    Args:
        cfg: :class:`ModelConfig` (default: all defaults).
        torchscript: with ``model.features.kind: torchscript``, the TorchScript file's bytes (a checkpoint's
            ``"torchscript"``) instead of reading ``model.features.path``.
    """

    def __init__(self, cfg: ModelConfig | None = None, *, torchscript: bytes | torch.Tensor | None = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.scorer = ScorerCNN(cfg.scorer)
        self.features = _build_features(cfg, torchscript)
        # after any encoder (its own module, so a pretrained or frozen encoder keeps its weights and these
        # statistics still follow training); the feature cache holds the encoder's raw output
        self.feature_norm = RunningStandardise(self.feature_dim) if cfg.features.standardise else None
        self.register_load_state_dict_pre_hook(_renamed_feature_norm)
        agg = cfg.aggregator
        self.aggregator = build_aggregator(
            agg.kind,
            self.feature_dim,
            cfg.num_classes,
            hidden=agg.hidden,
            gated=agg.attention_mil.gated,
            mil_attention=agg.attention_mil.pooling,
            layers=agg.transformer.layers,
            heads=agg.transformer.heads,
            num_frequencies=agg.transformer.position_frequencies,
            dropout=agg.dropout,
            readout=agg.transformer.readout,
            mean_skip=agg.mean_skip,
        )
        # created only when used, so models without the evidence losses keep their parameters (and seeds)
        ev = cfg.evidence
        self.instance_head = nn.Linear(self.feature_dim, cfg.num_classes) if ev.instance_weight > 0 else None
        # last, so models without it keep their parameters (and seeds); fitted by the trainer when the selection
        # is fixed (schedule.select_until)
        self.gate: CellGate | None = None
        ex = cfg.experimental
        if ex.gate_candidates > 0:
            if ex.gate_encoder is not None:  # its own frozen encoder (pretrained), never refreshed
                weights = None if resolved_by_driver(ex.gate_encoder) else ex.gate_encoder  # else: the trainer's
                own = ResNet(replace(cfg.features.resnet(), weights=weights, frozen=True))
            else:  # a copy of the model's encoder made at each fit, or none: the model's own when that is frozen
                own = None if cfg.features.weights_fixed else _build_features(cfg, torchscript)
            self.gate = CellGate(own, self.feature_dim, ex.gate_clusters, ex.gate_margin, ex.gate_fits, ex.gate_agree)

    def gate_encode(self, patches: torch.Tensor) -> torch.Tensor:
        """``patches[M, 3, p, p]`` float in [0, 1] -> the features the cell gate clusters: its frozen encoder's
        (the model's own encoder when that one is frozen)."""
        if self.gate is None:
            raise ValueError("this model has no cell gate (model.experimental.gate_candidates is 0)")
        enc = self.gate.encoder if self.gate.encoder is not None else self.features
        return enc(patches)

    @property
    def feature_dim(self) -> int:
        """D, the size of a patch's feature vector (``model.features.feature_dim``, or the TorchScript module's)."""
        return int(self.features.feature_dim)

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
                cells); default ``cfg.slide_geometry()``, which only pixel settings allow.

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
        if n < self.cfg.selection.k:
            raise ValueError(
                f"the grid has N={n} cells ({gh}x{gw}), fewer than model.selection.k={self.cfg.selection.k}; use a smaller "
                f"patch_size/stride or k"
            )
        g = self.cfg.slide_geometry() if geometry is None else geometry
        if (
            self.cfg.selection.scorer_grad == 0.0
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
        cand = candidate_mask(cell_mask.reshape(b, n).to(device=raw.device, dtype=torch.bool), self.cfg.selection.k)
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
        r = self.cfg.selection.nms_radius
        if r <= 0:
            return scores
        gh, gw = (int(v) for v in grid_shape)
        if scores.dim() != 2 or scores.shape[1] != gh * gw:
            raise ValueError(f"scores must be [B, {gh * gw}] for grid {gh}x{gw}, got {tuple(scores.shape)}")
        with torch.no_grad():
            grid = scores.detach().view(-1, 1, gh, gw)
            mx = torch.nn.functional.max_pool2d(grid, 2 * r + 1, stride=1, padding=r).view_as(scores)
            keep = torch.isfinite(scores) & (scores.detach() >= mx)
            if self.cfg.selection.nms_ties == "first":
                # kept cells within r of each other are tied; keep the one of smallest index in each window
                idx = torch.arange(gh * gw, device=scores.device, dtype=torch.float64).expand_as(keep)
                prio = torch.where(keep, -idx, torch.full_like(idx, float("-inf"))).reshape(-1, 1, gh, gw)
                best = torch.nn.functional.max_pool2d(prio, 2 * r + 1, stride=1, padding=r).view_as(keep)
                keep = keep & (-idx >= best)
            enough = keep.sum(1, keepdim=True) >= self.cfg.selection.k
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
        cfg = self.cfg.selection
        k = cfg.k
        sigma = cfg.sigma if sigma is None else float(sigma)
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
        cand = torch.isfinite(scores)
        if training and cfg.scorer_grad != 1.0 and scores.requires_grad:
            w = float(cfg.scorer_grad)  # same values, the selection's gradient to the scorer scaled by w
            scores = torch.where(cand, scores * w + scores.detach() * (1.0 - w), scores.detach())
        counts = cand.sum(1)
        if bool((counts < k).any()):
            raise ValueError(
                f"every row needs at least k={k} candidate cells (finite scores), got counts {counts.tolist()}"
            )
        # SOFT/LapSum training reads k + mask_extra cells per row; the same count for every row of the batch
        m = min(k + (cfg.soft.mask_extra if cfg.soft is not None else 0), int(counts.min()))
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
        cfg = self.cfg.selection
        k = cfg.k
        ones = sc.new_ones((1, k, 1))
        if cfg.selector == "attention":
            att_cfg = cfg.attention
            from operators.attention_sampling import attention_entropy, attention_sample, slot_mode_sample

            logits = sc / att_cfg.temperature
            att = torch.softmax(logits, dim=1)  # [1, Nc]
            ent = attention_entropy(att)
            if training:
                if att_cfg.draw == "slot_modes":  # the perturbed top-k's bag; weights: uniform (config check)
                    idx = slot_mode_sample(logits, k, num_samples=cfg.num_samples, generator=generator)
                else:
                    idx, w = attention_sample(att, k, replace=att_cfg.replace, generator=generator)
                if att_cfg.weights == "normalised":  # self-normalised: the drawn cells' attention, summing to 1
                    w = att.gather(1, idx)
                    w = w / w.sum(1, keepdim=True)
                elif att_cfg.weights == "uniform":  # 1/K each; the with-replacement estimator's gradient
                    la = torch.log_softmax(logits, dim=1).gather(1, idx)  # a / sg(a), in logs
                    w = (1.0 + (la - la.detach())) / k
                elif att_cfg.weights == "inclusion":
                    w = _inclusion_weights(att.gather(1, idx), k)
            else:
                idx = topk.hard_topk(sc, k)
                if att_cfg.weights == "uniform":
                    w = sc.new_full((1, k), 1.0 / k)
                elif att_cfg.weights == "inclusion":
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
                control_variate=self.cfg.experimental.control_variate,
            )  # [1,K,Nc]
            idx, w, mass = cap_support(y, cfg.perturbed.max_support)
            return Selection(cidx[idx], w, None, {"kept_mass": mass})
        soft = cfg.soft  # the SOFT / LapSum section, None for the other selectors
        keys = sc.detach()  # what ranks the read cells
        mask = None
        if training and soft is not None and soft.draw == "slot_modes" and sc.shape[1] > k:
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
        if training and soft is not None and sc.shape[1] > k:
            # read num_read = k + mask_extra cells: the largest scores
            idx = topk.hard_topk(keys, num_read)  # [1, num_read], sorted by position
            ones = sc.new_ones((1, num_read, 1))
        else:
            idx = topk.hard_topk(sc, k)  # [1, K], sorted by position
        if soft is not None and sc.shape[1] == k:
            # SOFT and LapSum need k < N; with exactly k candidates all are chosen with mask 1
            return Selection(cidx[idx].unsqueeze(-1), ones, sc.new_full((1, k), 1.0 / k), {})
        if soft is not None:
            if mask is None:
                mask = self._soft_mask(sc)
            m = mask.gather(1, idx)  # [1, num_read]
            gates = m / k
            if soft.gates == "certainty" and training:
                # the certainty of each read cell's inclusion, max(0, 2m - 1), normalised over the bag: the cells
                # the mask holds near 1 carry the bag, those near its threshold (m <= 1/2) are left out
                cert = (2.0 * m - 1.0).clamp_min(0.0)
                if float(cert.detach().sum()) > 0:
                    return Selection(cidx[idx].unsqueeze(-1), ones, cert / cert.sum(1, keepdim=True), {})
            if soft.gates != "mask":
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
        cfg = self.cfg.selection
        if cfg.selector == "sinkhorn":
            from operators.sinkhorn import sinkhorn_topk

            return sinkhorn_topk(sc, cfg.k, epsilon=cfg.sinkhorn.epsilon, max_iter=cfg.sinkhorn.max_iter)
        from operators.lapsum import lapsum_topk

        return lapsum_topk(sc, cfg.k, alpha=cfg.lapsum.alpha)

    # ------------------------------------------------------------------ stage 3: features
    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """``patches[M, 3, p, p]`` float in [0, 1] -> the encoder's own ``features[M, D]`` (the ResNet or the
        TorchScript module; what the feature cache holds)."""
        return self.features(patches)

    def normalise(self, features: torch.Tensor, stats_rows: int | None = None) -> torch.Tensor:
        """The encoder's ``features[M, D]`` -> what the aggregator sees (``model.features.standardise``: running
        standardisation, its statistics updated in training mode — from the first ``stats_rows`` rows only when
        given, e.g. the bag's K patches and not the evidence reads around them; otherwise unchanged)."""
        return features if self.feature_norm is None else self.feature_norm(features, stats_rows)

    def embed(self, patches: torch.Tensor) -> torch.Tensor:
        """``patches[M, 3, p, p]`` float in [0, 1] -> ``features[M, D]``: :meth:`encode`, then :meth:`normalise`."""
        return self.normalise(self.encode(patches))

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
            prior: ``[M]`` a label-free prior in [0, 1] per read cell (e.g. ``workers.strata.cell_rarity``),
                mixed into the rank targets as ``(1 - prior_weight) * evidence + prior_weight * prior``.
            prior_weight: in [0, 1].

        Returns:
            ``(losses, info)``: ``{"instance": w_i * L_inst, "rank": w_r * L_rank}`` (weighted, to be added to
            the loss as they are) and floats for logging (mean confidence of the read patches).
        """
        if self.instance_head is None:
            raise RuntimeError("evidence_losses needs model.evidence.instance_weight > 0 (no instance head)")
        if features.dim() != 2 or cell_scores.shape != features.shape[:1]:
            raise ValueError(
                f"features must be [M, D] and cell_scores [M], got {tuple(features.shape)} and "
                f"{tuple(cell_scores.shape)}"
            )
        logits = self.instance_head(features)
        ev_cfg = self.cfg.evidence
        losses = {"instance": ev_cfg.instance_weight * instance_loss(logits, target)}
        conf = instance_confidence(logits.detach())
        info = {"instance_confidence": float(conf.mean())}
        if ev_cfg.rank_weight > 0:
            if ev_cfg.target == "label":
                with torch.no_grad():
                    single = self.aggregate_each(features.detach(), positions)  # [M, C]
                    ev = torch.softmax(single, dim=1)[:, int(target)]
                    gamma = self.cfg.experimental.evidence_gamma
                    if gamma != 1.0:
                        ev = ev.clamp_min(0.0) ** gamma
                info["label_evidence"] = float(ev.mean())
            else:
                ev = conf
            if prior is not None and prior_weight > 0:
                if prior.shape != ev.shape:
                    raise ValueError(f"prior must be [M] = {tuple(ev.shape)}, got {tuple(prior.shape)}")
                ev = (1.0 - prior_weight) * ev + prior_weight * prior.to(ev.dtype)
            losses["rank"] = ev_cfg.rank_weight * evidence_rank_loss(
                cell_scores, ev, temperature=ev_cfg.rank_temperature
            )
        return losses, info

    def aux_losses(self, selection: Selection) -> dict[str, torch.Tensor]:
        """Terms to add to the loss: ``{"entropy": -entropy_weight * mean H}`` for attention sampling."""
        sel = self.cfg.selection
        if sel.selector == "attention" and "attention_entropy" in selection.aux and sel.attention.entropy_weight > 0:
            return {"entropy": -sel.attention.entropy_weight * selection.aux["attention_entropy"].mean()}
        return {}
