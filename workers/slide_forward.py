"""One slide through the whole model, with the training losses: the training step's forward pass.

:func:`forward_slide` runs low-res view -> scores -> selection -> patch reading -> features -> logits for one slide
(slides differ in grid size, so B = 1 per call; the trainer accumulates over slides). In training it also reads
the exploration, rare-bag and neutral cells and assembles the evidence losses (:mod:`operators.evidence`) into
``ModelOutput.aux_losses``; :func:`color_jitter_patches` is the augmentation of the full-resolution patches.
Geometry and reading are :mod:`workers.patches`, appearance strata :mod:`workers.strata`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from operators.evidence import neutral_loss
from operators.model import FoveateModel, ModelOutput, Selection
from workers.feature_cache import FeatureCache, features_frozen
from workers.patches import SlideInput, gather_patches, prepare_slide, slide_geometry
from workers.strata import cell_rarity, draw_cells, rare_cells, slide_strata

__all__ = [
    "forward_slide",
    "score_slide",
    "gate_candidates",
    "gate_keep",
    "gate_keep_from",
    "read_gate_candidates",
    "color_jitter_patches",
    "symmetry_patches",
    "augment_patches",
]

log = logging.getLogger(__name__)


def color_jitter_patches(x: torch.Tensor, strength: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random per-patch, per-channel gain ``1 + U(-s, s)`` and offset ``U(-s/2, s/2)`` of float patches
    ``x[..., 3, p, p]`` in [0, 1], clamped to [0, 1] (training-time augmentation against memorising a slide's
    colours; ``s = strength``, 0 returns ``x``)."""
    if strength <= 0:
        return x
    shape = (*x.shape[:-2], 1, 1)
    dev = generator.device if generator is not None else x.device
    gain = 1.0 + (torch.rand(shape, generator=generator, device=dev) * 2 - 1) * strength
    off = (torch.rand(shape, generator=generator, device=dev) - 0.5) * strength
    return (x * gain.to(x) + off.to(x)).clamp_(0.0, 1.0)


@functools.lru_cache(maxsize=8)
def _dihedral_index(p: int, device: torch.device) -> torch.Tensor:
    """``[8, p*p]`` int64: for each symmetry of the square (0..3 quarter turns, then the same after a transpose), the
    flat source pixel of every flat output pixel (``torch.rot90`` of the patch, or of its transpose)."""
    grid = torch.arange(p * p, device=device).view(p, p)
    return torch.stack([torch.rot90(g, r, dims=(0, 1)).reshape(-1) for g in (grid, grid.t()) for r in range(4)])


# the rows of _dihedral_index each symmetry draws from: all 8; the axis-keeping four (no turn, the half turn, and
# 5 / 7: a quarter turn of the transpose, i.e. the up-down and left-right mirrors); no turn or the half turn
_SYMMETRY_CODES = {"dihedral": tuple(range(8)), "flips": (0, 2, 5, 7), "rot180": (0, 2)}


def symmetry_patches(x: torch.Tensor, symmetry: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each square patch of ``x[..., C, p, p]`` turned by a symmetry of the square drawn uniformly per patch from
    ``generator``: ``dihedral``: one of all 8 (0..3 quarter turns of the patch or of its transpose; tissue has no up
    and no handedness); ``flips``: one of the 4 that keep the axes (none, the half turn, the left-right and the
    up-down mirror: a horizontal stripe stays horizontal, a vertical one vertical); ``rot180``: a half turn or not
    (keeps every orientation: stripes stay horizontal, vertical or diagonal). Training-time augmentation; one
    gather, no loop over patches. Returns a new tensor."""
    if symmetry not in _SYMMETRY_CODES:
        raise ValueError(f"symmetry must be 'rot180', 'flips' or 'dihedral', got {symmetry!r}")
    if x.dim() < 3 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"symmetry_patches needs square patches [..., C, p, p], got {tuple(x.shape)}")
    p = x.shape[-1]
    flat = x.reshape(-1, x.shape[-3], p * p)
    dev = generator.device if generator is not None else x.device
    codes = torch.tensor(_SYMMETRY_CODES[symmetry], device=dev)
    code = codes[torch.randint(0, len(codes), (flat.shape[0],), generator=generator, device=dev)].to(x.device)
    index = _dihedral_index(p, x.device)[code]  # [n, p*p]
    out = flat.gather(2, index[:, None, :].expand(-1, flat.shape[1], -1))
    return out.view(x.shape)


def augment_patches(x: torch.Tensor, augment: Any, generator: torch.Generator | None = None) -> torch.Tensor:
    """The training augmentation of float patches ``x[..., 3, p, p]`` in [0, 1] (``augment``: the model's
    :class:`~operators.model_config.AugmentConfig`): the symmetry unless ``none``, then the colour jitter."""
    if augment.symmetry != "none":
        x = symmetry_patches(x, augment.symmetry, generator)
    return color_jitter_patches(x, augment.color_jitter, generator)


def _usable_cache(model: FoveateModel, cache: FeatureCache | None, pixel_aug: bool) -> FeatureCache | None:
    """``cache`` where it gives the features the encoder would: a frozen encoder, no pixel augmentation."""
    if cache is None or not features_frozen(model.cfg):
        return None
    if pixel_aug:
        if not cache.jitter_noted:
            cache.jitter_noted = True
            aug = model.cfg.augment
            log.info(
                "feature cache: not used in training while model.augment changes the patch pixels "
                "(color_jitter=%g, symmetry=%s; used in evaluation only)",
                aug.color_jitter,
                aug.symmetry,
            )
        return None
    return cache


def _embed_cached(
    model: FoveateModel,
    slide: Any,
    groups: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]],
    cache: FeatureCache,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Features of each group: pixel groups (float patches) through the encoder; cell groups ``(cells, uint8
    pixels or None)`` from the cache where filled, the rest read (unless given), encoded in the same batch and
    written to the cache."""
    loc, n_cells = slide.store.location, slide.grid.num_cells
    cell_groups = [g for g in groups if not isinstance(g, torch.Tensor)]
    batch = [g for g in groups if isinstance(g, torch.Tensor)]
    hits = 0
    if cell_groups:  # every distinct cell of the slide-step looked up, read and encoded once
        all_cells = torch.cat([c for c, _ in cell_groups])
        uniq = torch.unique(all_cells, sorted=True)
        hit, cached = cache.lookup(loc, n_cells, uniq)
        miss = uniq[~hit]
        hits = int(hit.sum())
        if miss.numel():
            pix = torch.empty((miss.numel(), 0), dtype=torch.uint8)
            given = torch.zeros(miss.numel(), dtype=torch.bool)
            for cells, pixels in cell_groups:  # reads given (the rare bag) are used, not read again
                if pixels is None:
                    continue
                where = torch.searchsorted(miss, cells)
                ok = (where < miss.numel()) & (miss[where.clamp(max=miss.numel() - 1)] == cells)
                if bool(ok.any()):
                    if pix.shape[1] == 0:
                        pix = pixels.new_empty((miss.numel(), *pixels.shape[1:]))
                    pix[where[ok]] = pixels[ok]
                    given[where[ok]] = True
            if bool(given.all()):
                batch.append(pix.to(device=device, dtype=dtype).div_(255.0))
            else:
                read = slide.reader.read(miss[~given])
                if bool(given.any()):
                    pix[~given] = read
                else:
                    pix = read
                batch.append(pix.to(device=device, dtype=dtype).div_(255.0))
    computed: list[torch.Tensor] = []
    if batch:  # the encoder's own features: the cache holds those, the standardisation comes after (below)
        feats = model.encode(torch.cat(batch) if len(batch) > 1 else batch[0])
        computed = list(feats.split([b.shape[0] for b in batch]))
    if cell_groups:
        table = torch.empty((uniq.numel(), model.feature_dim), device=device, dtype=dtype)
        if cached.shape[0]:
            table[hit.to(device)] = cached.to(device=device, dtype=dtype)
        if miss.numel():
            new = computed[-1].detach()
            table[(~hit).to(device)] = new
            cache.write(loc, n_cells, miss, new)
    parts: list[torch.Tensor] = []
    i = 0
    for g in groups:
        if isinstance(g, torch.Tensor):
            parts.append(computed[i])
            i += 1
        else:
            parts.append(table[torch.searchsorted(uniq, g[0]).to(device)])
    if model.feature_norm is not None:  # one call over the slide-step's features, as without the cache
        sizes = [p.shape[0] for p in parts]
        parts = list(model.normalise(torch.cat(parts), stats_rows=sizes[0]).split(sizes))  # statistics: the bag
    return parts, {"cache_hits": float(hits)}


def forward_slide(
    model: FoveateModel,
    store_or_sample: Any,
    *,
    training: bool,
    sigma: float | None = None,
    generator: torch.Generator | None = None,
    target: int | None = None,
    rarity: float = 0.0,
    rare_scale: float = 1.0,
    feature_cache: FeatureCache | None = None,
    fixed_selection: str | None = None,
) -> ModelOutput:
    """The whole chain for ONE slide: low-res input -> scores -> selection -> patch reading -> features ->
    logits.

    Args:
        model: the :class:`~operators.model.FoveateModel` (its parameters' device is used; patches are read
            on the CPU and moved there).
        store_or_sample: see :func:`prepare_slide`.
        training: soft/stochastic selection (True) or hard top-k (False). Does not switch the module's
            train/eval mode (call ``model.train()`` / ``model.eval()`` yourself).
        sigma: perturbed top-k noise for this call (default ``model.selection.sigma``).
        generator: RNG for the selection noise (on the model's device).
        target: the slide's class index, in training only: with it, a model with an instance head
            (``model.evidence.instance_weight > 0``) also reads ``model.evidence.explore_cells`` uniformly drawn candidate cells
            and adds the evidence losses (``"instance"``, ``"rank"``; :mod:`operators.evidence`) to
            ``aux_losses``. Ignored at inference.
        feature_cache: a :class:`~workers.feature_cache.FeatureCache` of the model's frozen encoder: cells
            already cached skip the read and the encoder, new ones are written. Used at inference, and in
            training only without colour jitter (the selected slots only when each is one cell, ``S = 1``); see
            :mod:`workers.feature_cache`.
        fixed_selection: in training, the second phase of ``schedule.select_until`` (the caller freezes the
            scorer): ``"draw"``, the selector's training draw from the scores, or ``"topk"``, the hard top-k of
            inference; nothing else is read (no exploration, rare-bag or neutral cells, no evidence losses); the
            augmentation and ``model.experimental.neighbour_views`` still apply. None (default): not fixed.

    Returns:
        :class:`~operators.model.ModelOutput` (logits ``[1, C]``; add ``sum(out.aux_losses.values())`` to the
        loss).
    """
    if not isinstance(model, FoveateModel):
        raise TypeError(f"model must be a FoveateModel, got {type(model).__name__}")
    if fixed_selection not in (None, "draw", "topk"):
        raise ValueError(f"fixed_selection must be None, 'draw' or 'topk', got {fixed_selection!r}")
    slide = prepare_slide(store_or_sample, model.cfg)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cell_mask = slide.cell_mask
    fixed = training and fixed_selection is not None
    discovering = training and not fixed  # the terms that train the scorer (evidence, rare bag, neutral cells)
    with torch.no_grad() if fixed else contextlib.nullcontext():
        scores = score_slide(model, slide)
    if model.gate is not None and model.gate.is_fitted and (fixed or not training):
        return _forward_gated(model, slide, scores, training=training, generator=generator)
    sel = model.select(
        model.local_maxima(scores, tuple(cell_mask.shape)),
        training=training and fixed_selection != "topk",
        sigma=sigma,
        generator=generator,
    )
    aug = model.cfg.augment
    cj = aug.color_jitter if training else 0.0
    pixel_aug = training and (cj > 0 or aug.symmetry != "none")
    cache = _usable_cache(model, feature_cache, pixel_aug)
    one_cell = sel.indices.shape[-1] == 1 and not sel.weights.requires_grad and bool((sel.weights == 1).all())
    if cache is not None and one_cell:  # each slot is one cell's patch: its features can come from the cache
        patches, positions = None, slide.grid.cell_centres(sel.primary.cpu()).to(device=device, dtype=dtype)
        cells_read = int(torch.unique(sel.primary).numel())
    else:
        patches, positions, cells_read = gather_patches(slide, sel, device=device, dtype=dtype)
        patches = augment_patches(patches, aug, generator) if pixel_aug else patches

    # Training reads more cells than the K selected ones (exploration, the rare bag, neutral cells): their pixels
    # are prepared first, in the order the generator is drawn from (cells, colour jitter), then
    # every patch of this slide-step goes through the ResNet in one batch (the same features, one call).
    # With a feature cache, a group is the cells themselves (pixels read only for the cells not cached yet).
    groups: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]] = []

    def read_cells(cells: torch.Tensor, pixels: torch.Tensor | None = None) -> int:
        """Queue the pixels of extra training reads (or ``pixels``, uint8 reads given), colour-jittered as the
        selected patches are; returns the position of their features in the batch."""
        if cache is not None:
            groups.append((cells.cpu(), pixels))
            return len(groups) - 1
        if pixels is None:
            pixels = slide.reader.read(cells.cpu())
        pixels = pixels.to(device=device, dtype=dtype).div_(255.0)
        groups.append(augment_patches(pixels, aug, generator) if pixel_aug else pixels)
        return len(groups) - 1

    cells = sel.primary[0]
    aux_losses = model.aux_losses(sel) if discovering else {}
    extra_info: dict[str, float] = {}
    k = sel.indices.shape[1]
    groups.append(patches.flatten(0, 1) if patches is not None else (cells.cpu(), None))
    views = model.cfg.experimental.neighbour_views if training else 0
    g_views = None
    if views:  # each selected cell's grid neighbours: further (shifted) views of what it holds, for the bag
        view_cells = slide.grid.neighbours(cells.cpu(), views).flatten()
        g_views = read_cells(view_cells)
        cells_read += int(torch.unique(view_cells).numel())
    evidence = discovering and target is not None and model.uses_evidence
    explore = rare = neutral = None
    ev_cfg = model.cfg.evidence
    if evidence:
        strata = slide_strata(slide, ev_cfg.explore_strata) if ev_cfg.explore_strata > 0 else None
        explore = draw_cells(scores[0], ev_cfg.explore_cells, generator, strata)
        g_explore = read_cells(explore) if explore.numel() else None
        cells_read += int(explore.numel())
        if ev_cfg.rare_cells > 0 and rare_scale > 0:
            key = (ev_cfg.rare_cells, ev_cfg.rare_strata)
            if slide.rare is None or slide.rare[:2] != key:  # fixed per slide: found (and read) once
                found = rare_cells(slide.lowres_u8, cell_mask, *key, slide_strata(slide, key[1]))
                slide.rare = (*key, found, slide.reader.read(found))
            rare, rare_pix = slide.rare[2], slide.rare[3]
            g_rare = read_cells(rare, rare_pix)
            cells_read += int(rare.numel())
    if discovering and target is not None and ev_cfg.neutral_cells > 0:
        neutral = draw_cells(scores[0], ev_cfg.neutral_cells, generator)  # uniform candidate cells
        g_neutral = read_cells(neutral) if neutral.numel() else None
        cells_read += int(neutral.numel())
    if cache is None:
        # the running standardisation's statistics come from the bag (groups[0]), what the aggregator pools at
        # inference too, not from the evidence reads around it (mostly plain tissue)
        feats_all = model.normalise(
            model.encode(torch.cat(groups) if len(groups) > 1 else groups[0]), stats_rows=groups[0].shape[0]
        )
        parts = list(feats_all.split([g.shape[0] for g in groups]))
    else:
        parts, cache_info = _embed_cached(model, slide, groups, cache, device, dtype)  # info "cache_hits"
    feats = parts[0]  # [K, D], the selected patches
    if g_views is None:
        logits = model.aggregate(feats.view(1, k, -1), positions, sel.slot_weights)
    else:  # the bag: the K cells and their views, equal members (perturbed / hard selection: no slot weights)
        view_pos = slide.grid.cell_centres(view_cells).to(device=device, dtype=dtype)
        bag = torch.cat([feats, parts[g_views]])
        logits = model.aggregate(bag[None], torch.cat([positions.reshape(-1, 2), view_pos])[None], None)
    if evidence:
        read = [cells]
        if g_explore is not None:
            feats = torch.cat([feats, parts[g_explore]])
            read.append(explore.to(cells.device))
        if rare is not None:
            f_rare = parts[g_rare]
            pos = slide.grid.cell_centres(rare).to(device=device, dtype=dtype)
            logits_rare = model.aggregate(f_rare[None], pos[None], None)
            tgt = torch.tensor([int(target)], device=logits_rare.device)
            aux_losses["rare"] = (
                rare_scale * ev_cfg.rare_weight * torch.nn.functional.cross_entropy(logits_rare.reshape(1, -1), tgt)
            )
            feats = torch.cat([feats, f_rare])
            read.append(rare.to(cells.device))
        read_idx = torch.cat(read)
        read_pos = slide.grid.cell_centres(read_idx.cpu()).to(device=device, dtype=dtype)
        prior = None
        if rarity > 0:
            if slide.rarity is None or slide.rarity[0] != ev_cfg.rare_strata:
                n = ev_cfg.rare_strata
                slide.rarity = (n, cell_rarity(slide.lowres_u8, cell_mask, n, slide_strata(slide, n)))
            prior = slide.rarity[1].to(device=device, dtype=dtype)[read_idx]
        ev_losses, extra_info = model.evidence_losses(
            feats, scores[0, read_idx], int(target), read_pos, prior=prior, prior_weight=rarity
        )
        aux_losses.update(ev_losses)
        extra_info["explore_cells"] = float(explore.numel())
    if neutral is not None and neutral.numel():
        pos = slide.grid.cell_centres(neutral.cpu()).to(device=device, dtype=dtype)
        single = model.aggregate_each(parts[g_neutral], pos)  # each cell classified on its own
        aux_losses["neutral"] = ev_cfg.neutral_weight * neutral_loss(single)
    info = {**_slide_info(model, slide, scores), "cells_read": float(cells_read)}
    if "kept_mass" in sel.aux:
        info["kept_mass"] = float(sel.aux["kept_mass"].mean())
    info.update(extra_info)
    if cache is not None:
        info.update(cache_info)
    return ModelOutput(
        logits=logits,
        scores=scores[0],
        cell_indices=cells,
        coords_l0=_read_corners(slide, cells.cpu()),
        patch_scores=scores[0, cells],
        aux_losses=aux_losses,
        selection=sel,
        info=info,
    )


def score_slide(model: FoveateModel, slide: SlideInput) -> torch.Tensor:
    """``[1, N]`` the model's cell scores of a prepared slide (the slide's geometry, or the config's for its
    store); the low-res view is converted per scorer tile on the model's device."""
    device = next(model.parameters()).device
    geo = slide.geometry if slide.geometry is not None else slide_geometry(slide.store, model.cfg)
    return model.score(slide.lowres_u8[None].to(device), slide.cell_mask[None].to(device), geo)


def _slide_info(model: FoveateModel, slide: SlideInput, scores: torch.Tensor) -> dict[str, float]:
    """What every forward reports about the slide: grid cells, candidates, whether tissue was short of K."""
    return {
        "num_cells": float(slide.grid.num_cells),
        "num_candidates": float(torch.isfinite(scores[0]).sum()),
        "tissue_fallback": float(int(slide.cell_mask.sum()) < model.cfg.selection.k),
    }


def gate_keep_from(model: FoveateModel) -> int:
    """How many of a slide's top local maxima a fitted gate keeps from (``model.experimental.gate_keep_from``, 0:
    ``gate_candidates``, the number its clusters are fitted on)."""
    ex = model.cfg.experimental
    return ex.gate_keep_from or ex.gate_candidates


def gate_candidates(
    model: FoveateModel, scores: torch.Tensor, grid_shape: tuple[int, int], n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell gate's candidates of one slide: the top ``n`` local maxima of ``scores [1, N]`` on the ``(Gh, Gw)``
    grid (fewer where the slide has fewer), best first -> ``(cells [n] long, on the CPU; their scores [n])``. ``n``
    None: :func:`gate_keep_from` (what a fitted gate keeps from); the gate's fit reads
    ``model.experimental.gate_candidates``."""
    lm = model.local_maxima(scores, tuple(grid_shape))[0]
    n = min(gate_keep_from(model) if n is None else n, int(torch.isfinite(lm).sum()))
    top = lm.topk(max(n, 1))
    return top.indices.cpu(), top.values


def read_gate_candidates(
    model: FoveateModel, slide: SlideInput, scores: torch.Tensor, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gate_candidates` (``n`` as there) of a prepared slide and their pixels: ``(cells [n], scores [n],
    float patches [n, 3, p, p] in [0, 1] on the model's device)`` (what the gate is fitted on and what a gated
    forward reads)."""
    param = next(model.parameters())
    cells, values = gate_candidates(model, scores, tuple(slide.cell_mask.shape), n)
    pixels = slide.reader.read(cells).to(device=param.device, dtype=param.dtype).div_(255.0)
    return cells, values, pixels


def gate_keep(model: FoveateModel, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fitted gate's choice among a slide's candidates, from their gate features ``[M, D]``
    (:meth:`FoveateModel.gate_encode`): ``(keep [M] bool, weights)``; ``weights`` is None for equal weights, or
    with ``model.experimental.gate_weights: votes`` ``[M]`` float, each kept cell's vote count
    (:meth:`operators.gate.CellGate.vote_counts`) over the kept cells' total (zero where not kept), what the
    classifier weighs the bag by, in training and at inference alike."""
    votes = model.gate.vote_counts(features)
    keep = model.gate.keep_by_votes(votes)
    if model.cfg.experimental.gate_weights != "votes":
        return keep, None
    v = votes.to(torch.float32).clamp_min(1) * keep  # the fallback's lone cell: one vote
    return keep, v / v.sum()


def _forward_gated(
    model: FoveateModel,
    slide: SlideInput,
    scores: torch.Tensor,
    *,
    training: bool,
    generator: torch.Generator | None,
) -> ModelOutput:
    """The bag of a fitted cell gate (:mod:`operators.gate`): the slide's :func:`gate_candidates` read once, the
    gate keeps those in informative clusters, the classifier sees the kept cells (cell order) with equal weights
    (``model.experimental.gate_weights: votes``: each by the number of the gate's fits that keep it).
    In training (the second phase of ``schedule.select_until``) the kept patches are augmented; nothing else is
    read."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cand, _, pixels = read_gate_candidates(model, slide, scores)
    with torch.no_grad():
        keep, bag_w = gate_keep(model, model.gate_encode(pixels))
    keep = keep.cpu()
    cells, order = cand[keep].sort()
    patches = pixels[keep.to(device)][order.to(device)]
    aug = model.cfg.augment
    if training and (aug.color_jitter > 0 or aug.symmetry != "none"):
        patches = augment_patches(patches, aug, generator)
    feats = model.embed(patches)
    positions = slide.grid.cell_centres(cells).to(device=device, dtype=dtype)
    weights = None if bag_w is None else bag_w[keep.to(bag_w.device)][order.to(bag_w.device)].to(device, dtype)[None]
    logits = model.aggregate(feats[None], positions[None], weights)
    k = int(cells.numel())
    idx = cells.to(scores.device)
    sel = Selection(indices=idx[None, :, None], weights=torch.ones(1, k, 1, device=scores.device, dtype=scores.dtype))
    info = {
        **_slide_info(model, slide, scores),
        "cells_read": float(cand.numel()),
        "gate_candidates": float(cand.numel()),
        "gate_kept": float(k),
    }
    return ModelOutput(
        logits=logits,
        scores=scores[0],
        cell_indices=idx,
        coords_l0=_read_corners(slide, cells),
        patch_scores=scores[0, idx],
        aux_losses={},
        selection=sel,
        info=info,
    )


def _read_corners(slide: SlideInput, cells: torch.Tensor) -> torch.Tensor:
    """Level-0 top-left corners ``[K, 2]`` where the reader reads ``cells`` (the cells' own, or moved by
    ``model.geometry.recentre``)."""
    xy = slide.grid.cell_xy_l0(cells)
    shifts = slide.reader.offsets(cells)
    return xy if shifts is None else xy + shifts
