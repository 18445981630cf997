"""The scorer: a small CNN on the low-resolution view giving one score per cell of the full-resolution grid.

Cordonnier et al. 2021 ("Differentiable patch selection for image recognition") score patches with a 4-layer
CNN with a max-pool on a downsampled image, and min–max normalise the scores to [0, 1] per image before the
perturbed top-k. Here the score map is pooled onto the patch grid (which is defined in level-0 pixels by
patch size and stride) with :func:`cell_pool`, cells outside tissue are excluded by :func:`mask_scores`
(score ``-inf``: never a candidate) and the remaining ones are min–max normalised per slide.

Frame convention: the low-res input covers exactly the grid extent
``[0, (Gw-1)*stride + patch_size) x [0, (Gh-1)*stride + patch_size)`` level-0 pixels (white where the grid
overhangs the slide), at any resolution; ``workers.patches.lowres_input`` produces it. All frames are defined
once, in ``workers/frames.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ScorerConfig",
    "ScorerCNN",
    "score_map",
    "scorer_halo",
    "tiled_score_map",
    "cell_pool",
    "sparse_grad_cell_scores",
    "mask_scores",
    "minmax_normalise",
    "candidate_mask",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScorerConfig:
    """Scorer CNN settings.

    Attributes:
        channels: width of the hidden conv layers.
        num_layers: number of 3x3 conv layers (>= 2; the papers use 4); a 2x2 max-pool follows the second.
        pool: how the score map is pooled onto a grid cell: ``"mean"`` or ``"max"``.
        tile: a low-res view whose longer side exceeds this many pixels is scored tile by tile
            (:func:`tiled_score_map`: the same scores, memory bounded by the tile, activations recomputed in
            the backward pass); 0 = always the whole view at once. Even, >= 32.
    """

    channels: int = 16
    num_layers: int = 4
    pool: str = "max"
    tile: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.channels, int) or self.channels < 1:
            raise ValueError(f"scorer.channels must be a positive int, got {self.channels!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 2:
            raise ValueError(f"scorer.num_layers must be an int >= 2, got {self.num_layers!r}")
        if self.pool not in ("mean", "max"):
            raise ValueError(f"scorer.pool must be 'mean' or 'max', got {self.pool!r}")
        if (
            isinstance(self.tile, bool)
            or not isinstance(self.tile, int)
            or not (self.tile == 0 or (self.tile >= 32 and self.tile % 2 == 0))
        ):
            raise ValueError(f"scorer.tile must be 0 (no tiling) or an even int >= 32, got {self.tile!r}")


class ScorerCNN(nn.Module):
    """``forward(lowres[B, 3, h, w] in [0, 1]) -> score_map[B, 1, h', w']`` (``h' = ceil(h / 2)``).

    Layers: conv3x3 -> ReLU -> conv3x3 -> ReLU -> max-pool 2 -> (conv3x3 -> ReLU)* -> conv3x3 to one channel.
    """

    def __init__(self, cfg: ScorerConfig | None = None):
        super().__init__()
        cfg = cfg or ScorerConfig()
        self.cfg = cfg
        c = cfg.channels
        layers: list[nn.Module] = []
        cin = 3
        for i in range(cfg.num_layers - 1):
            layers += [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(inplace=True)]
            cin = c
            if i == 1 or (cfg.num_layers == 2 and i == 0):
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
        layers.append(nn.Conv2d(cin, 1, 3, padding=1))
        self.net = nn.Sequential(*layers)

    def forward(self, lowres: torch.Tensor) -> torch.Tensor:
        # channels-last activations: the same maths, 2-3x faster convolutions and max-pool on a CPU for these
        # few-channel, large-image layers (benchmarks/RESULTS.md, "training" -> "Speed of a training step")
        return self.net(((lowres - 0.5) / 0.25).contiguous(memory_format=torch.channels_last))


def _as_float(lowres: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 0..255 -> ``dtype`` in [0, 1]; a float view is only cast."""
    if lowres.dtype == torch.uint8:
        return lowres.to(dtype) / 255.0
    return lowres.to(dtype)


def scorer_halo(num_layers: int) -> int:
    """Low-res pixels of context a tile of :class:`ScorerCNN` needs on each side so that its core scores equal
    the whole view's: 1 px per 3x3 conv before the 2x2 max-pool, 2 per conv after it, 1 for the pool's
    alignment, rounded up to even (tiles start on even pixels, where the pool's windows start)."""
    before = 1 if num_layers == 2 else 2
    halo = before + 2 * (num_layers - before) + 1
    return halo + halo % 2


def tiled_score_map(
    scorer: ScorerCNN, lowres: torch.Tensor, tile: int, *, checkpoint: bool | None = None
) -> torch.Tensor:
    """``scorer(lowres)`` computed tile by tile: the same score map, with memory bounded by the tile.

    Each ``tile x tile`` block of the view is scored with :func:`scorer_halo` pixels of context on every side
    (cut at the view's border, where the convolutions' zero padding then matches the whole view's) and only its
    core is kept. With ``checkpoint`` (default: when gradients are enabled) each tile runs under
    ``torch.utils.checkpoint``: the forward pass keeps only the tiles' score maps, the backward pass recomputes
    one tile's activations at a time — so peak memory grows with the tile, not with the view. A uint8 view is
    converted to the scorer's dtype tile by tile (a whole float copy of a 6250² view would be 470 MB).

    Args:
        scorer: the :class:`ScorerCNN`.
        lowres: ``[B, 3, h, w]``, float in [0, 1] or uint8.
        tile: tile side in low-res pixels (even, >= 32).
        checkpoint: recompute activations in the backward pass (None: ``torch.is_grad_enabled()``).

    Returns:
        ``[B, 1, ceil(h / 2), ceil(w / 2)]``, equal to ``scorer(lowres)`` up to float rounding.
    """
    if not isinstance(scorer, ScorerCNN):
        raise TypeError(f"scorer must be a ScorerCNN, got {type(scorer).__name__}")
    if lowres.dim() != 4 or lowres.shape[1] != 3:
        raise ValueError(f"lowres must be [B, 3, h, w], got {tuple(lowres.shape)}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 32 or tile % 2:
        raise ValueError(f"tile must be an even int >= 32 (low-res pixels), got {tile!r}")
    from torch.utils.checkpoint import checkpoint as ckpt

    if checkpoint is None:
        checkpoint = torch.is_grad_enabled()
    dtype = next(scorer.parameters()).dtype
    halo = scorer_halo(scorer.cfg.num_layers)
    _, _, h, w = lowres.shape
    rows = []
    for y0 in range(0, h, tile):
        y1 = min(y0 + tile, h)
        ya, yb = max(0, y0 - halo), min(h, y1 + halo)
        row = []
        for x0 in range(0, w, tile):
            x1 = min(x0 + tile, w)
            xa, xb = max(0, x0 - halo), min(w, x1 + halo)
            core = (
                slice((y0 - ya) // 2, (y0 - ya) // 2 + -(-(y1 - y0) // 2)),
                slice((x0 - xa) // 2, (x0 - xa) // 2 + -(-(x1 - x0) // 2)),
            )

            def run(crop: torch.Tensor, core=core) -> torch.Tensor:
                return scorer(_as_float(crop, dtype))[:, :, core[0], core[1]]

            crop = lowres[:, :, ya:yb, xa:xb]
            row.append(ckpt(run, crop, use_reentrant=False) if checkpoint else run(crop))
        rows.append(torch.cat(row, 3))
    return torch.cat(rows, 2)


def score_map(scorer: ScorerCNN, lowres: torch.Tensor) -> torch.Tensor:
    """The scorer's map of a view (``[B, 3, h, w]`` float in [0, 1] or uint8): whole, or with
    :func:`tiled_score_map` when the view's longer side exceeds ``scorer.cfg.tile`` (> 0)."""
    tile = scorer.cfg.tile
    if tile and max(lowres.shape[-2:]) > tile:
        return tiled_score_map(scorer, lowres, tile)
    return scorer(_as_float(lowres, next(scorer.parameters()).dtype))


def cell_pool(
    score_map: torch.Tensor, grid_shape: tuple[int, int], patch_size: int, stride: int, *, mode: str = "mean"
) -> torch.Tensor:
    """Pool a map covering the grid extent onto the grid cells.

    Cell ``(r, c)`` covers level-0 ``x in [c*stride, c*stride + patch_size)``, ``y`` likewise; the map covers
    ``[0, extent_w) x [0, extent_h)`` with ``extent = (G - 1) * stride + patch_size``, so one map pixel is
    ``extent_w / w`` level-0 pixels wide. Each cell takes the mean (integral image, exact and differentiable)
    or the max over the map pixels its box overlaps (at least one pixel).

    Args:
        score_map: ``[B, C, h, w]``.
        grid_shape: ``(Gh, Gw)``.
        patch_size: cell size in level-0 pixels.
        stride: cell stride in level-0 pixels.
        mode: ``"mean"`` or ``"max"``.

    Returns:
        ``[B, C, Gh * Gw]`` (row-major cell index ``r * Gw + c``).
    """
    if score_map.dim() != 4:
        raise ValueError(f"score_map must be [B, C, h, w], got shape {tuple(score_map.shape)}")
    if mode not in ("mean", "max"):
        raise ValueError(f"mode must be 'mean' or 'max', got {mode!r}")
    gh, gw = int(grid_shape[0]), int(grid_shape[1])
    b, ch, h, w = score_map.shape
    y0, y1 = _cell_bounds(gh, patch_size, stride, h, score_map.device)
    x0, x1 = _cell_bounds(gw, patch_size, stride, w, score_map.device)
    if mode == "mean":
        ii = F.pad(score_map.cumsum(2).cumsum(3), (1, 0, 1, 0))  # [B, C, h+1, w+1]
        flat = ii.reshape(b, ch, -1)
        W1 = w + 1

        def at(yy: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
            idx = (yy[:, None] * W1 + xx[None, :]).reshape(-1)
            return flat[:, :, idx]

        s = at(y1, x1) - at(y0, x1) - at(y1, x0) + at(y0, x0)
        area = ((y1 - y0)[:, None] * (x1 - x0)[None, :]).reshape(-1).to(score_map.dtype)
        return s / area
    # max: pool rows then columns over variable windows (max window size is small); padded with -inf
    ky = int((y1 - y0).max())
    kx = int((x1 - x0).max())
    oy = y0[:, None] + torch.arange(ky, device=y0.device)[None, :]  # [Gh, ky]
    ox = x0[:, None] + torch.arange(kx, device=x0.device)[None, :]
    vy = oy < y1[:, None]
    vx = ox < x1[:, None]
    neg = torch.finfo(score_map.dtype).min
    rows = score_map[:, :, oy.clamp(max=h - 1), :]  # [B, C, Gh, ky, w]
    rows = rows.masked_fill(~vy[None, None, :, :, None], neg).amax(3)  # [B, C, Gh, w]
    cols = rows[:, :, :, ox.clamp(max=w - 1)]  # [B, C, Gh, Gw, kx]
    cols = cols.masked_fill(~vx[None, None, None], neg).amax(4)
    return cols.reshape(b, ch, gh * gw)


def sparse_grad_cell_scores(
    scorer: ScorerCNN,
    lowres: torch.Tensor,
    grid_shape: tuple[int, int],
    patch_size: int,
    stride: int,
    *,
    mode: str = "mean",
    dense_fraction: float = 0.5,
) -> torch.Tensor:
    """``cell_pool(score_map(scorer, lowres), ...)[:, 0]`` with a backward pass that only touches the cells
    whose gradient is non-zero.

    The forward pass scores the whole view without keeping activations. The backward pass receives the
    gradient of every cell's raw score; when only a few cells have a non-zero one (a rank loss on the cells
    that were read, the min and max cells of the normalisation: training with ``selection_grad = 0``), it
    re-runs the scorer with gradients on one small crop per such cell — the cell's map pixels plus
    :func:`scorer_halo` low-res pixels of context, cut at the view's border as in :func:`tiled_score_map`, so
    each crop's scores equal the whole view's — crops of one shape batched, and back-propagates the cells'
    gradients through those crops alone. The parameter gradients equal those of the whole-view computation (up
    to float rounding; ties inside a cell's max-pooled box are split as :func:`cell_pool` splits them). When
    the crops would cover more than ``dense_fraction`` of the view, the whole view is re-run instead (one more
    forward pass than plain autograd).

    Args:
        scorer: the :class:`ScorerCNN` (its parameters get the gradients).
        lowres: ``[B, 3, h, w]`` float in [0, 1] or uint8; must not require gradients.
        grid_shape, patch_size, stride, mode: as for :func:`cell_pool`.
        dense_fraction: in (0, 1]; see above.

    Returns:
        ``[B, Gh * Gw]`` raw (not normalised) cell scores.
    """
    if not isinstance(scorer, ScorerCNN):
        raise TypeError(f"scorer must be a ScorerCNN, got {type(scorer).__name__}")
    if not isinstance(lowres, torch.Tensor) or lowres.dim() != 4 or lowres.shape[1] != 3:
        raise ValueError(f"lowres must be [B, 3, h, w], got {getattr(lowres, 'shape', type(lowres))}")
    if lowres.requires_grad:
        raise ValueError("lowres must not require gradients (the sparse backward only reaches the scorer's parameters)")
    if mode not in ("mean", "max"):
        raise ValueError(f"mode must be 'mean' or 'max', got {mode!r}")
    if not (0.0 < float(dense_fraction) <= 1.0):
        raise ValueError(f"dense_fraction must be in (0, 1], got {dense_fraction!r}")
    spec = (scorer, (int(grid_shape[0]), int(grid_shape[1])), int(patch_size), int(stride), mode, float(dense_fraction))
    return _SparseGradCellScores.apply(lowres, spec, *scorer.parameters())


class _SparseGradCellScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lowres: torch.Tensor, spec: tuple, *params: torch.Tensor) -> torch.Tensor:
        scorer, grid_shape, patch_size, stride, mode, _ = spec
        with torch.no_grad():
            smap = score_map(scorer, lowres)
            raw = cell_pool(smap, grid_shape, patch_size, stride, mode=mode)[:, 0]
        ctx.spec = spec
        ctx.map_hw = (int(smap.shape[2]), int(smap.shape[3]))
        ctx.save_for_backward(lowres)
        return raw

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (lowres,) = ctx.saved_tensors
        scorer, grid_shape, patch_size, stride, mode, dense_fraction = ctx.spec
        params = list(scorer.parameters())
        wanted = [p for p in params if p.requires_grad]
        nz = torch.nonzero(grad).tolist()  # [(b, cell)]
        if not wanted or not nz:
            return (None, None, *[None] * len(params))
        gh, gw = grid_shape
        hm, wm = ctx.map_hw
        _, _, h, w = lowres.shape
        y0, y1 = (t.tolist() for t in _cell_bounds(gh, patch_size, stride, hm, torch.device("cpu")))
        x0, x1 = (t.tolist() for t in _cell_bounds(gw, patch_size, stride, wm, torch.device("cpu")))
        halo = scorer_halo(scorer.cfg.num_layers)

        def span(lo: int, hi: int, size: int) -> tuple[int, int]:  # low-res crop of map pixels [lo, hi)
            return max(0, 2 * lo - halo), min(size, 2 * hi + halo)

        groups: dict[tuple, list[tuple[int, int, int, int]]] = {}
        area = 0
        for i, (b, n) in enumerate(nz):
            r, c = divmod(n, gw)
            ya, yb = span(y0[r], y1[r], h)
            xa, xb = span(x0[c], x1[c], w)
            area += (yb - ya) * (xb - xa)
            key = (yb - ya, xb - xa, (2 * y0[r] - ya) // 2, (2 * x0[c] - xa) // 2, y1[r] - y0[r], x1[c] - x0[c])
            groups.setdefault(key, []).append((i, b, ya, xa))
        dtype = params[0].dtype
        with torch.enable_grad():
            if area > dense_fraction * h * w * lowres.shape[0]:
                smap = score_map(scorer, lowres)
                raw = cell_pool(smap, grid_shape, patch_size, stride, mode=mode)[:, 0]
                total = (raw * grad).sum()
            else:
                gvals = grad[tuple(torch.tensor(nz, device=grad.device).T)]
                total = grad.new_zeros(())
                for (ch, cw, cy, cx, ky, kx), members in groups.items():
                    crops = torch.stack([lowres[b, :, ya : ya + ch, xa : xa + cw] for _, b, ya, xa in members])
                    core = scorer(_as_float(crops, dtype))[:, 0, cy : cy + ky, cx : cx + kx]  # [M, ky, kx]
                    # the order of cell_pool's reductions (rows, then columns), so ties split the same way
                    pooled = core.amax(1).amax(1) if mode == "max" else core.mean((1, 2))
                    total = total + (pooled * gvals[[i for i, *_ in members]]).sum()
            got = torch.autograd.grad(total, wanted, allow_unused=True)
        by_param = dict(zip((id(p) for p in wanted), got))
        return (None, None, *[by_param.get(id(p)) for p in params])


def _cell_bounds(
    g: int, patch_size: int, stride: int, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map-pixel bounds ``[lo, hi)`` (hi > lo) of the g cells along one axis of a map of ``size`` pixels."""
    extent = (g - 1) * stride + patch_size
    scale = size / extent
    start = torch.arange(g, device=device, dtype=torch.float64) * stride
    lo = torch.floor(start * scale + 1e-9).long().clamp(0, size - 1)
    hi = torch.ceil((start + patch_size) * scale - 1e-9).long().clamp(max=size)
    hi = torch.maximum(hi, lo + 1)
    return lo, hi


def candidate_mask(cell_mask: torch.Tensor, k: int) -> torch.Tensor:
    """Cells that may be selected: the tissue cells, or every cell for a row with fewer than ``k`` tissue
    cells (faint staining, failed tissue detection) — with a logged warning, never zero candidates.

    Args:
        cell_mask: ``[B, N]`` bool.
        k: the number of patches to select.

    Returns:
        ``[B, N]`` bool.
    """
    count = cell_mask.sum(1)
    low = count < k
    if bool(low.any()):
        rows = torch.nonzero(low).flatten().tolist()
        log.warning(
            "tissue mask has fewer than k=%d cells in batch row(s) %s (counts %s); using all %d cells as candidates",
            k,
            rows,
            count[low].tolist(),
            cell_mask.shape[1],
        )
        cell_mask = cell_mask | low[:, None]
    return cell_mask


def mask_scores(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``scores`` with non-candidates set to ``-inf`` (their gradient is exactly zero)."""
    return scores.masked_fill(~candidates, float("-inf"))


def minmax_normalise(scores: torch.Tensor, candidates: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-row min–max normalisation to [0, 1] over the candidate cells (Cordonnier et al. 2021).

    Non-candidates come back as ``-inf``. A row whose candidate scores are all equal maps to 0.

    Args:
        scores: ``[B, N]`` finite.
        candidates: ``[B, N]`` bool, at least one True per row.
        eps: added to the range in the denominator.

    Returns:
        ``[B, N]``.
    """
    inf = torch.tensor(float("inf"), dtype=scores.dtype, device=scores.device)
    lo = torch.where(candidates, scores, inf).amin(1, keepdim=True)
    hi = torch.where(candidates, scores, -inf).amax(1, keepdim=True)
    # where() (not masked_fill on the result) keeps the gradient of non-candidates exactly zero
    norm = (scores - lo) / (hi - lo + eps)
    return torch.where(candidates, norm, -inf)
