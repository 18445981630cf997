"""Re-centring a grid cell's full-resolution read on what it holds, from the low-res view.

A grid cell holds an object where the grid happens to put it: with a stride of half the patch, an object can sit
up to a quarter of the patch off-centre, and a large one is cut by the patch's edge. Before a cell is read at full
resolution, its read window can be moved by a few level-0 pixels onto the centre of mass of the ink it holds,
found on the low-res view the scorer already has (no extra read): a flat-kernel mean shift (Fukunaga & Hostetler
1975) of the ``p x p`` window over the *content* map ``relu(background - luminance)``, where ``background`` is the
median luminance of the slide's tissue (stained structures are darker than the tissue around them).

The shift is a deterministic function of the cell and the slide, so a cell is always read the same way (training,
evaluation, scoring; a feature cache keyed by cell stays valid), and it is clipped to ``max_shift`` level-0 pixels
per axis, so a cell keeps most of its own area. Coordinates: level-0 pixels, ``(x, y)``; the low-res view's pixel
``(i, j)`` covers level-0 ``[j d, (j + 1) d) x [i d, (i + 1) d)`` (``d`` = its downsample).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["Recentring", "background_luminance", "content_map", "recentre_offsets", "tissue_pixels"]

_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601
_MEDIAN_PIXELS = 1 << 20  # the background median is taken over at most about this many tissue pixels (evenly spaced)


def _luminance(lowres: torch.Tensor) -> torch.Tensor:
    """``[..., 3, h, w]`` RGB (uint8, or float in [0, 1]) -> ``[..., h, w]`` float32 luminance in [0, 1]."""
    x = lowres.to(torch.float32)
    if lowres.dtype == torch.uint8:
        x = x / 255.0
    return _LUMA[0] * x[..., 0, :, :] + _LUMA[1] * x[..., 1, :, :] + _LUMA[2] * x[..., 2, :, :]


def _check_view(lowres: torch.Tensor) -> None:
    if not isinstance(lowres, torch.Tensor) or lowres.dim() != 3 or lowres.shape[0] != 3:
        raise ValueError(f"lowres must be a tensor [3, h, w], got {getattr(lowres, 'shape', type(lowres))}")


def background_luminance(lowres: torch.Tensor, tissue: torch.Tensor | None = None) -> float:
    """The median luminance of the tissue pixels of a low-res view (every pixel when ``tissue`` is None or empty).

    Args:
        lowres: ``[3, h, w]`` RGB, uint8 or float in [0, 1].
        tissue: optional ``[h, w]`` bool.
    """
    _check_view(lowres)
    if tissue is not None and tuple(tissue.shape) != tuple(lowres.shape[1:]):
        raise ValueError(f"tissue must be [h, w] = {tuple(lowres.shape[1:])}, got {tuple(tissue.shape)}")
    where = torch.nonzero(tissue.bool().flatten()).squeeze(1) if tissue is not None else None
    if where is None or where.numel() == 0:
        where = torch.arange(lowres.shape[1] * lowres.shape[2])
    where = where[:: max(1, where.numel() // _MEDIAN_PIXELS)]
    return float(_luminance(lowres.flatten(1)[:, where][:, None, :])[0].median())


def content_map(lowres: torch.Tensor, background: float) -> torch.Tensor:
    """How much darker than ``background`` each pixel of a low-res view ``[3, h, w]`` is: ``[h, w]`` float32
    ``relu(background - luminance)`` (stained structures are darker than the tissue around them; white is none)."""
    _check_view(lowres)
    return (background - _luminance(lowres)).clamp_min_(0.0)


def _overlap(
    start: torch.Tensor, first: torch.Tensor, n: int, patch: int, d: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the low-res pixels ``first + l`` (l < n) of each window ``[start, start + patch)``: ``([M, n] fraction
    of the pixel inside the window, [M, n] level-0 centre of that part)``."""
    lo = (first[:, None] + torch.arange(n, dtype=start.dtype)) * d  # [M, n] pixel starts (level 0)
    a = torch.maximum(start[:, None], lo)
    b = torch.minimum(start[:, None] + patch, lo + d)
    return (b - a).clamp(0.0, d) / d, (a + b) / 2


def _neighbourhood(img: torch.Tensor, first: torch.Tensor, n: int, fill: float) -> torch.Tensor:
    """``[C, M, n, n]``: the ``n x n`` pixels of ``img [C, h, w]`` from row ``first[:, 1]``, column ``first[:, 0]``
    on; pixels beyond the image are ``fill``."""
    h, w = img.shape[-2:]
    rows = first[:, 1, None] + torch.arange(n)  # [M, n]
    cols = first[:, 0, None] + torch.arange(n)
    out = img[:, rows.clamp(0, h - 1)[:, :, None], cols.clamp(0, w - 1)[:, None, :]]
    outside = ((rows < 0) | (rows >= h))[:, :, None] | ((cols < 0) | (cols >= w))[:, None, :]  # [M, n, n]
    return out.masked_fill(outside, fill)


def _check_shift_args(xy_l0, patch, downsample, max_shift, iters) -> None:
    if not isinstance(xy_l0, torch.Tensor) or xy_l0.dim() != 2 or xy_l0.shape[1] != 2 or xy_l0.is_floating_point():
        raise ValueError(f"xy_l0 must be an integer tensor [M, 2], got {getattr(xy_l0, 'shape', type(xy_l0))}")
    for name, v, lo in (("patch", patch, 1), ("max_shift", max_shift, 0), ("iters", iters, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if not (isinstance(downsample, (int, float)) and not isinstance(downsample, bool) and downsample > 0):
        raise ValueError(f"downsample must be a positive number (level-0 pixels per low-res pixel), got {downsample!r}")


def _mean_shift(
    xy_l0: torch.Tensor,
    patch: int,
    d: float,
    max_shift: int,
    iters: int,
    neighbourhood: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """The shifts of :func:`recentre_offsets` (arguments already checked); ``neighbourhood(first, n)`` gives each
    window's ``[M, n, n]`` content from low-res column / row ``first [M, 2]`` on."""
    if xy_l0.shape[0] == 0 or max_shift == 0:
        return torch.zeros((xy_l0.shape[0], 2), dtype=torch.long)
    n = math.ceil((patch + 2 * max_shift) / d) + 2  # low-res pixels any shifted window can touch, per axis
    home = xy_l0.to(torch.float64)
    first = torch.floor((home - max_shift) / d).long() - 1  # [M, 2] first column / row of the neighbourhood
    local = neighbourhood(first, n).to(torch.float64)
    pos = home.clone()
    for _ in range(iters):
        wx, mx = _overlap(pos[:, 0], first[:, 0].to(torch.float64), n, patch, d)  # [M, n] share, centre of it
        wy, my = _overlap(pos[:, 1], first[:, 1].to(torch.float64), n, patch, d)
        mass_cols = torch.einsum("mi,mij->mj", wy, local) * wx  # [M, n]: mass per column inside the window
        mass_rows = torch.einsum("mij,mj->mi", local, wx) * wy  # [M, n]: per row
        mass = mass_cols.sum(1)
        cx = (mass_cols * mx).sum(1) / mass.clamp_min(1e-12)
        cy = (mass_rows * my).sum(1) / mass.clamp_min(1e-12)
        moved = torch.stack([cx, cy], dim=1) - patch / 2.0
        pos = torch.where((mass > 1e-9)[:, None], moved, pos)
        pos = torch.minimum(torch.maximum(pos, home - max_shift), home + max_shift)
    return torch.round(pos - home).long()


def recentre_offsets(
    content: torch.Tensor,
    xy_l0: torch.Tensor,
    patch: int,
    downsample: float,
    max_shift: int,
    iters: int = 3,
) -> torch.Tensor:
    """Level-0 shifts that move each ``patch x patch`` read window onto the centre of mass of ``content``.

    Each window starts at its cell and moves ``iters`` times to the content-weighted centroid of what it covers
    (the exact centroid of the piecewise-constant map over the window), clipped to ``max_shift`` per axis of its
    cell; a window over no content stays where it is.

    Args:
        content: ``[h, w]`` non-negative float, the low-res content map (:func:`content_map`).
        xy_l0: ``[M, 2]`` integer top-left corners of the cells, level-0 ``(x, y)``.
        patch: window side, level-0 pixels.
        downsample: level-0 pixels per low-res pixel.
        max_shift: largest shift per axis, level-0 pixels (0: no shift).
        iters: mean-shift steps.

    Returns:
        ``[M, 2]`` int64 ``(dx, dy)``, ``|dx|, |dy| <= max_shift``.
    """
    if not isinstance(content, torch.Tensor) or content.dim() != 2:
        raise ValueError(f"content must be a tensor [h, w], got {getattr(content, 'shape', type(content))}")
    _check_shift_args(xy_l0, patch, downsample, max_shift, iters)
    return _mean_shift(
        xy_l0,
        patch,
        float(downsample),
        max_shift,
        iters,
        lambda first, n: _neighbourhood(content[None], first, n, 0.0)[0],
    )


def tissue_pixels(cell_mask: torch.Tensor, stride: int, downsample: float, hw: tuple[int, int]) -> torch.Tensor:
    """``[h, w]`` bool: the low-res pixels whose centre lies in a tissue cell's stride block (``cell_mask[Gh, Gw]``
    on a grid of ``stride`` level-0 pixels; pixels beyond the grid take the last row / column)."""
    h, w = hw
    gh, gw = cell_mask.shape
    rows = ((torch.arange(h) + 0.5) * downsample / stride).long().clamp(max=gh - 1)
    cols = ((torch.arange(w) + 0.5) * downsample / stride).long().clamp(max=gw - 1)
    return cell_mask.bool()[rows][:, cols]


class Recentring:
    """The read shifts of one slide: :func:`recentre_offsets` on the :func:`content_map` of its low-res view,
    computed around the requested cells only (the view is kept by reference, not copied).

    Args:
        lowres: ``[3, h, w]`` the slide's low-res view (uint8, or float in [0, 1]).
        background: the tissue's luminance (:func:`background_luminance`).
        patch: the read window's side, level-0 pixels.
        downsample: level-0 pixels per low-res pixel.
        max_shift: largest shift per axis, level-0 pixels.
        iters: mean-shift steps.
    """

    def __init__(
        self, lowres: torch.Tensor, background: float, patch: int, downsample: float, max_shift: int, iters: int = 3
    ):
        _check_view(lowres)
        _check_shift_args(torch.zeros((0, 2), dtype=torch.long), patch, downsample, max_shift, iters)
        self.lowres = lowres
        self.background = float(background)
        self.patch = int(patch)
        self.downsample = float(downsample)
        self.max_shift = int(max_shift)
        self.iters = int(iters)

    @classmethod
    def from_view(
        cls, lowres: torch.Tensor, cell_mask: torch.Tensor, patch: int, stride: int, downsample: float
    ) -> Recentring:
        """From a slide's low-res view ``[3, h, w]`` and tissue cells ``[Gh, Gw]``; shifts up to half a stride
        (the cell nearest an object is never further than that from it)."""
        tissue = tissue_pixels(cell_mask, stride, downsample, tuple(lowres.shape[1:]))
        return cls(lowres, background_luminance(lowres, tissue), patch, downsample, max(0, stride // 2))

    def __call__(self, xy_l0: torch.Tensor) -> torch.Tensor:
        """``[M, 2]`` level-0 top-left corners -> ``[M, 2]`` int64 shifts ``(dx, dy)``."""
        _check_shift_args(xy_l0, self.patch, self.downsample, self.max_shift, self.iters)
        white = 255.0 if self.lowres.dtype == torch.uint8 else 1.0  # beyond the view: no content

        def content(first: torch.Tensor, n: int) -> torch.Tensor:  # the content map around the cells only
            local = _neighbourhood(self.lowres, first, n, white).permute(1, 0, 2, 3)  # [M, 3, n, n]
            return (self.background - _luminance(local)).clamp_min_(0.0)

        return _mean_shift(xy_l0, self.patch, self.downsample, self.max_shift, self.iters, content)
