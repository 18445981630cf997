"""Cells grouped by their low-resolution appearance, and what training draws from the groups.

* :func:`cell_strata` — k-means strata of the cells' colour mean and std on the scorer's low-res view (label-free,
  deterministic); :func:`slide_strata` caches them per slide.
* :func:`draw_cells` — exploration draws: ``count`` candidate cells, uniformly or stratum by stratum, so visually
  rare cells are read about as often as the common background.
* :func:`rare_cells` / :func:`cell_rarity` — the cells of the smallest strata (the rare bag) and every cell's
  rarity ``-log(n_s / n)`` (the rank targets' label-free prior).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from workers.patches import SlideInput

__all__ = ["cell_strata", "slide_strata", "draw_cells", "rare_cells", "cell_rarity"]


def cell_strata(
    lowres: torch.Tensor, grid_shape: tuple[int, int], num_strata: int, iterations: int = 10
) -> torch.Tensor:
    """Group the grid cells by their low-resolution appearance (k-means on per-cell colour mean and std).

    Exploration that draws a stratum uniformly, then a cell within it, reads visually rare cells (a few dark
    spots, ink, a lesion) about as often as the common background, instead of in proportion to their area.
    Deterministic (farthest-point initialisation from the cell nearest the mean appearance).

    Args:
        lowres: ``[3, h, w]`` float in [0, 1] or uint8, covering the grid extent (:func:`lowres_input`). Views
            larger than ``_STRATA_WHOLE_PIXELS`` are described in bands of cell rows (memory bounded by the band
            and the ``[N, 6]`` descriptors, not by a float64 copy of the view).
        grid_shape: ``(Gh, Gw)``.
        num_strata: at most this many strata (fewer when the cells have fewer distinct appearances).
        iterations: k-means iterations.

    Returns:
        ``[Gh * Gw]`` long stratum per cell (row-major).
    """
    gh, gw = grid_shape
    desc = _cell_appearance(lowres, gh, gw)  # [N, 6]
    n = desc.shape[0]
    k = max(1, min(int(num_strata), n))
    centres = [int(((desc - desc.mean(0)) ** 2).sum(1).argmin())]
    dist = ((desc - desc[centres[0]]) ** 2).sum(1)
    while len(centres) < k and float(dist.max()) > 1e-12:
        c = int(dist.argmax())
        centres.append(c)
        dist = torch.minimum(dist, ((desc - desc[c]) ** 2).sum(1))
    cen = desc[centres].clone()
    for _ in range(iterations):
        assign = _nearest(desc, cen)
        counts = torch.bincount(assign, minlength=cen.shape[0]).to(desc.dtype)[:, None]
        sums = torch.zeros_like(cen).index_add_(0, assign, desc)
        cen = torch.where(counts > 0, sums / counts.clamp_min(1.0), cen)  # an empty stratum keeps its centre
    return _nearest(desc, cen)


_STRATA_WHOLE_PIXELS = 2048 * 2048  # larger views: per-cell statistics band by band
_NEAREST_ROWS = 262144  # more descriptors: nearest centre in chunks (a [N, k] distance matrix otherwise)


def _as_unit_float64(x: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 / 255 (the training view's values) -> float64; float -> float64."""
    if x.dtype == torch.uint8:
        x = x.to(torch.float32) / 255.0
    return x.to(torch.float64)


def _cell_appearance(lowres: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """Per-cell colour mean and std of the view (adaptive average pooling onto the grid), ``[N, 6]`` float64."""
    _, h, w = lowres.shape
    if h * w <= _STRATA_WHOLE_PIXELS:
        x = _as_unit_float64(lowres)[None]
        mean = F.adaptive_avg_pool2d(x, (gh, gw))[0]
        sq = F.adaptive_avg_pool2d(x * x, (gh, gw))[0]
    else:  # the same bins (adaptive pooling's floor/ceil bounds), a band of cell rows at a time
        mean = torch.empty(3, gh, gw, dtype=torch.float64)
        sq = torch.empty(3, gh, gw, dtype=torch.float64)
        band = max(1, _STRATA_WHOLE_PIXELS // max(1, w * max(1, -(-h // gh))))
        for r0 in range(0, gh, band):
            r1 = min(gh, r0 + band)
            lo = [(r * h) // gh for r in range(r0, r1)]
            hi = [-(-((r + 1) * h) // gh) for r in range(r0, r1)]
            x = _as_unit_float64(lowres[:, lo[0] : hi[-1]])[None]
            cols_m = F.adaptive_avg_pool2d(x, (x.shape[2], gw))[0]  # column bins, every row of the band
            cols_s = F.adaptive_avg_pool2d(x * x, (x.shape[2], gw))[0]
            for i, (a, b) in enumerate(zip(lo, hi)):
                mean[:, r0 + i] = cols_m[:, a - lo[0] : b - lo[0]].mean(1)
                sq[:, r0 + i] = cols_s[:, a - lo[0] : b - lo[0]].mean(1)
    std = (sq - mean * mean).clamp_min(0).sqrt()
    return torch.cat([mean, std]).reshape(6, -1).T


def _nearest(desc: torch.Tensor, cen: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centre of every descriptor (Euclidean distance from the coordinate differences, not the
    matrix-product expansion), ``_NEAREST_ROWS`` at a time."""
    return torch.cat(
        [torch.cdist(d, cen, compute_mode="donot_use_mm_for_euclid_dist").argmin(1) for d in desc.split(_NEAREST_ROWS)]
    )


def rare_cells(
    lowres: torch.Tensor, cell_mask: torch.Tensor, count: int, num_strata: int, strata: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``count`` tissue cells of the smallest low-resolution appearance strata (:func:`cell_strata`),
    smallest stratum first (ties: stratum order), cells in row-major order within a stratum; all tissue cells
    when fewer. Label-free and deterministic.

    Args:
        lowres: ``[3, h, w]`` the scorer's view (uint8 or float in [0, 1]).
        cell_mask: ``[Gh, Gw]`` bool tissue cells (all cells when none is tissue).
        count: cells wanted (>= 0).
        num_strata: strata for :func:`cell_strata`.
        strata: ``[Gh * Gw]`` the result of ``cell_strata(lowres, cell_mask.shape, num_strata)`` when already
            computed (None: computed here).

    Returns:
        ``[min(count, tissue cells)]`` long cell indices (row-major).
    """
    mask = cell_mask.flatten()
    cand = torch.nonzero(mask).flatten() if bool(mask.any()) else torch.arange(mask.numel())
    if count <= 0:
        return cand[:0]
    if cand.numel() <= count:
        return cand
    if strata is None:
        strata = cell_strata(lowres, tuple(cell_mask.shape), num_strata)
    st = strata[cand]
    sizes = torch.bincount(st)
    order = torch.argsort(sizes[st] * (int(st.max()) + 1) + st, stable=True)
    return cand[order[:count]]


def cell_rarity(
    lowres: torch.Tensor, cell_mask: torch.Tensor, num_strata: int, strata: torch.Tensor | None = None
) -> torch.Tensor:
    """Label-free rarity of every cell: ``-log(n_s / n)`` for a tissue cell of appearance stratum ``s``
    (:func:`cell_strata`, ``n_s`` tissue cells in it, ``n`` tissue cells), divided by the slide's maximum, so
    the cells of the smallest stratum are 1 and a stratum holding every tissue cell is 0; non-tissue cells 0.

    Args:
        lowres: ``[3, h, w]`` the scorer's view (uint8 or float in [0, 1]).
        cell_mask: ``[Gh, Gw]`` bool tissue cells (all cells when none is tissue).
        num_strata: strata for :func:`cell_strata`.
        strata: as for :func:`rare_cells`.

    Returns:
        float32 ``[Gh * Gw]`` in [0, 1].
    """
    mask = cell_mask.flatten()
    if not bool(mask.any()):
        mask = torch.ones_like(mask)
    st = cell_strata(lowres, tuple(cell_mask.shape), num_strata) if strata is None else strata
    sizes = torch.bincount(st[mask], minlength=int(st.max()) + 1).to(torch.float64)
    n = float(mask.sum())
    r = -torch.log(sizes[st].clamp_min(1.0) / n)
    r = torch.where(mask, r, torch.zeros_like(r))
    top = float(r.max())
    return (r / top if top > 0 else r).to(torch.float32)


def slide_strata(slide: SlideInput, num_strata: int) -> torch.Tensor:
    """:func:`cell_strata` of a slide's low-resolution view, computed once per slide and number of strata
    (exploration, the rare bag and the rarity prior share it)."""
    if num_strata not in slide.strata:
        slide.strata[num_strata] = cell_strata(slide.lowres_u8, tuple(slide.cell_mask.shape), num_strata)
    return slide.strata[num_strata]


def draw_cells(
    scores: torch.Tensor, count: int, generator: torch.Generator | None, strata: torch.Tensor | None = None
) -> torch.Tensor:
    """``count`` distinct candidate cells (finite ``scores[N]``), all of them if fewer: uniformly, or with
    ``strata[N]`` a stratum drawn uniformly among those with candidates left, then a cell within it."""
    cand = torch.isfinite(scores)
    if count <= 0:
        return torch.nonzero(cand).flatten()[:0]
    if int(cand.sum()) <= count:
        return torch.nonzero(cand).flatten()
    keys = torch.rand(scores.shape, generator=generator, device=scores.device)
    if strata is None:
        keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
        return keys.topk(count).indices
    # rank within stratum by the random key; round r takes every stratum's r-th cell, in random stratum order
    strata = strata.to(scores.device)
    idx = torch.nonzero(cand).flatten()
    st, kk = strata[idx], keys[idx]
    order = torch.argsort(kk, descending=True)
    idx, st = idx[order], st[order]
    rank = torch.zeros_like(st)
    for j in torch.unique(st).tolist():
        sel = st == j
        rank[sel] = torch.arange(int(sel.sum()), device=st.device)
    skey = torch.rand(int(strata.max()) + 1, generator=generator, device=scores.device)
    prio = rank.to(torch.float64) + skey[st].to(torch.float64) * 0.5  # round first, then random stratum order
    return idx[torch.argsort(prio)[:count]]
