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

__all__ = ["ScorerConfig", "ScorerCNN", "cell_pool", "mask_scores", "minmax_normalise", "candidate_mask"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScorerConfig:
    """Scorer CNN settings.

    Attributes:
        channels: width of the hidden conv layers.
        num_layers: number of 3x3 conv layers (>= 2; the papers use 4); a 2x2 max-pool follows the second.
        pool: how the score map is pooled onto a grid cell: ``"mean"`` or ``"max"``.
    """

    channels: int = 32
    num_layers: int = 4
    pool: str = "mean"

    def __post_init__(self) -> None:
        if not isinstance(self.channels, int) or self.channels < 1:
            raise ValueError(f"scorer.channels must be a positive int, got {self.channels!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 2:
            raise ValueError(f"scorer.num_layers must be an int >= 2, got {self.num_layers!r}")
        if self.pool not in ("mean", "max"):
            raise ValueError(f"scorer.pool must be 'mean' or 'max', got {self.pool!r}")


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
        return self.net((lowres - 0.5) / 0.25)


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
