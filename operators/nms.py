"""Top-k local maxima by non-maximum suppression, and the MIST lifted objective.

Angles, Jin, Kornblith, Tagliasacchi & Yi, "MIST: Multiple Instance Spatial Transformer", CVPR 2021. A
heatmap network ``H`` scores every location; the top-k local maxima of ``H(I)`` (:func:`nms_topk`) select the
patches a task network consumes. Top-k is not differentiable, so MIST *lifts* the problem: the selected
locations become free (slack) variables ``x``, and training alternates

1. **task stage**: initialise ``x = nms_topk(H(I), k, radius=r)`` (as floats), then minimise the task loss
   over the task network and over ``x`` itself (patches resampled differentiably at ``x``), giving ``x*``;
2. **heatmap stage**: train ``H`` to produce the heatmap that those locations imply, i.e. minimise
   :func:`mist_loss` ``= mean (H(I) - K(x*))^2`` with ``K`` rendering a Gaussian bump at each location
   (:func:`render_gaussian_heatmap`), with ``x*`` held fixed.

Coordinates follow the project's convention: the last dimension is ``(x, y)`` = (column, row) of the
``[H, W]`` map, i.e. flat index ``y * W + x``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from operators._checks import check_bool, check_k, check_positive, check_positive_int, check_scores, check_tensor

__all__ = ["nms_topk", "render_gaussian_heatmap", "mist_loss", "MISTLoss"]


def _window_min(values: torch.Tensor, radius: int) -> torch.Tensor:
    """Minimum over the ``(2r+1) x (2r+1)`` window (clipped at the border) of ``values[B, H, W]``."""
    if radius == 0:
        return values
    return -_max_window(-values, radius)


def _max_window(values: torch.Tensor, radius: int) -> torch.Tensor:
    """Separable ``(2r+1) x (2r+1)`` max filter (rows then columns, -inf padding) of ``values[B, H, W]``."""
    size = 2 * radius + 1
    out = F.max_pool2d(values.unsqueeze(1), (1, size), stride=1, padding=(0, radius))
    return F.max_pool2d(out, (size, 1), stride=1, padding=(radius, 0)).squeeze(1)


def _dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    if radius == 0:
        return mask
    return _max_window(mask.to(torch.float32), radius) > 0


def nms_topk(heatmap: torch.Tensor, k: int, *, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k local maxima of each heatmap after non-maximum suppression.

    Pixels are totally ordered by (score descending, flat index ``y * W + x`` ascending), so plateaus and
    ties are broken deterministically in favour of the pixel that comes first in row-major order. A pixel is
    a *local maximum* if it precedes every other pixel of its ``(2r+1) x (2r+1)`` window (Chebyshev distance
    ``<= radius``, window clipped at the border): one max-pool over the rank map, no loop over pixels.
    ``radius=0`` gives the plain top-k pixels.

    Fewer than k local maxima: the remaining slots are filled in rounds. Each round suppresses the windows
    of everything selected so far and takes, in order, the local maxima among the pixels still free (same
    rule, competitors restricted to free pixels), until k are chosen or no free pixel is left; then the
    best not-yet-selected pixels in the total order fill the rest. Rounds <= k, each vectorised over the
    batch. Output order: selection order, i.e. the true local maxima by descending score first, then each
    fill round by descending score.

    Args:
        heatmap: ``[B, H, W]`` finite floating scores.
        k: number of locations per map, ``1 <= k <= H * W``.
        radius: suppression radius, an int ``>= 0`` (pixels).

    Returns:
        ``(coords, scores)``: ``coords`` LongTensor ``[B, k, 2]`` as ``(x, y)``; ``scores`` ``[B, k]`` the
        heatmap values there (differentiable wrt ``heatmap``).
    """
    heatmap = check_scores(heatmap, "heatmap", ndim=3)
    b, h, w = heatmap.shape
    n = h * w
    k = check_k(k, n, "k")
    radius = check_positive_int(radius, "radius", minimum=0)
    dev = heatmap.device

    with torch.no_grad():
        flat = heatmap.detach().reshape(b, n)
        order = torch.sort(flat, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(n, device=dev).expand(b, n))
        fdt = torch.float32 if n < 2**24 else torch.float64  # ranks are exact integers in this dtype
        rank_flat = rank.to(fdt)
        rank_f = rank_flat.view(b, h, w)
        inf = float(n)  # larger than every rank
        never = torch.iinfo(torch.long).max
        sel_key = torch.full((b, n), never, dtype=torch.long, device=dev)  # selection order: round * n + rank
        selected = torch.zeros(b, n, dtype=torch.bool, device=dev)
        count = torch.zeros(b, dtype=torch.long, device=dev)
        free = torch.ones(b, h, w, dtype=torch.bool, device=dev)
        rnd = 0
        while True:
            need = k - count
            active = (need > 0) & free.view(b, n).any(1)
            if not bool(active.any()):
                break
            r_free = torch.where(free, rank_f, torch.full_like(rank_f, inf))
            cand = (free & (rank_f == _window_min(r_free, radius))).view(b, n) & active.unsqueeze(1)
            ckey = torch.where(cand, rank_flat, torch.full((b, n), inf, dtype=fdt, device=dev))
            ckey_sorted, cidx = torch.topk(ckey, int(need.max()), dim=1, largest=False, sorted=True)
            take = (ckey_sorted < inf) & (torch.arange(cidx.shape[1], device=dev) < need.unsqueeze(1))
            newly = torch.zeros_like(selected).scatter_(1, cidx, take)
            selected |= newly
            sel_key = torch.where(newly, rnd * n + rank, sel_key)
            count += newly.sum(1)
            free = free & ~_dilate(selected.view(b, h, w), radius)
            rnd += 1
        # final fill, ignoring suppression: best unselected pixels in the total order
        need = k - count
        if bool((need > 0).any()):
            fkey = torch.where(selected, torch.full((b, n), inf, dtype=fdt, device=dev), rank_flat)
            fsorted, fidx = torch.topk(fkey, int(need.max()), dim=1, largest=False, sorted=True)
            take = (fsorted < inf) & (torch.arange(fidx.shape[1], device=dev) < need.unsqueeze(1))
            newly = torch.zeros_like(selected).scatter_(1, fidx, take)
            sel_key = torch.where(newly, rnd * n + rank, sel_key)
        idx = torch.topk(sel_key, k, dim=1, largest=False, sorted=True).indices  # [B, k]
    coords = torch.stack([idx % w, idx // w], dim=-1)
    return coords, heatmap.reshape(b, n).gather(1, idx)


def _check_locations(locations: object, batch: int) -> torch.Tensor:
    check_tensor(locations, "locations")
    if locations.dim() != 3 or locations.shape[0] != batch or locations.shape[2] != 2:
        raise ValueError(f"locations must have shape [B={batch}, K, 2] as (x, y), got {tuple(locations.shape)}")
    if locations.dtype == torch.bool:
        raise ValueError("locations must be a numeric tensor, got dtype torch.bool")
    if locations.is_floating_point() and locations.numel() and not bool(torch.isfinite(locations).all()):
        raise ValueError("locations must be finite, got NaN or inf entries")
    return locations


def _check_combine(combine: object) -> str:
    if not isinstance(combine, str):
        raise TypeError(f"combine must be a str, got {type(combine).__name__}")
    if combine not in ("max", "sum"):
        raise ValueError(f"combine must be one of ('max', 'sum'), got {combine!r}")
    return combine


def render_gaussian_heatmap(
    locations: torch.Tensor,
    height: int,
    width: int,
    *,
    sigma: float,
    combine: str = "max",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """MIST's keypoint-to-heatmap map ``K(x)``: an isotropic Gaussian bump of peak 1 at each location.

    ``K[b, y, x] = combine_j exp(-((x - x_j)^2 + (y - y_j)^2) / (2 sigma^2))`` over the K locations of row b,
    with ``combine`` ``"max"`` (bumps never exceed 1; the default) or ``"sum"``. Separable in x and y; the
    ``"sum"`` form never materialises ``[B, K, H, W]``.

    Args:
        locations: ``[B, K, 2]`` as ``(x, y)`` in pixels, float (sub-pixel, differentiable) or integer.
        height, width: output size.
        sigma: Gaussian standard deviation in pixels, ``> 0``.
        combine: ``"max"`` or ``"sum"``.
        dtype: output dtype for integer locations (default float32; float locations keep theirs).

    Returns:
        ``[B, height, width]``.
    """
    locations = check_tensor(locations, "locations")
    _check_locations(locations, locations.shape[0] if locations.dim() == 3 else 0)
    height = check_positive_int(height, "height")
    width = check_positive_int(width, "width")
    sigma = check_positive(sigma, "sigma")
    combine = _check_combine(combine)
    loc = locations if locations.is_floating_point() else locations.to(dtype or torch.float32)
    if loc.shape[1] == 0:
        return torch.zeros(loc.shape[0], height, width, dtype=loc.dtype, device=loc.device)
    ys = torch.arange(height, device=loc.device, dtype=loc.dtype)
    xs = torch.arange(width, device=loc.device, dtype=loc.dtype)
    gx = torch.exp(-((xs - loc[..., 0:1]) ** 2) / (2 * sigma**2))  # [B, K, W]
    gy = torch.exp(-((ys - loc[..., 1:2]) ** 2) / (2 * sigma**2))  # [B, K, H]
    if combine == "sum":
        return torch.einsum("bkh,bkw->bhw", gy, gx)
    return (gy.unsqueeze(-1) * gx.unsqueeze(-2)).amax(dim=1)


def mist_loss(
    heatmap: torch.Tensor,
    locations: torch.Tensor,
    *,
    sigma: float,
    combine: str = "max",
    detach_target: bool = True,
    reduction: str = "mean",
) -> torch.Tensor:
    """MIST's heatmap-stage objective: ``|| H - K(x) ||^2`` between the heatmap and the rendered target.

    Args:
        heatmap: ``[B, H, W]`` network heatmap (finite floating).
        locations: ``[B, K, 2]`` ``(x, y)`` the (task-optimised) selected locations ``x*``.
        sigma: Gaussian width of the rendered target, in pixels.
        combine: how overlapping bumps combine, ``"max"`` or ``"sum"`` (see :func:`render_gaussian_heatmap`).
        detach_target: treat the locations as constants (the paper's heatmap stage; default). ``False``
            lets gradients reach the locations too.
        reduction: ``"mean"`` (over all pixels and maps), ``"sum"`` or ``"none"`` (``[B]``, mean per map).

    Returns:
        The loss; 0 exactly when ``heatmap == render_gaussian_heatmap(locations, H, W, ...)``.
    """
    heatmap = check_scores(heatmap, "heatmap", ndim=3)
    b, h, w = heatmap.shape
    locations = _check_locations(locations, b)
    detach_target = check_bool(detach_target, "detach_target")
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, got {type(reduction).__name__}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    loc = locations.detach() if detach_target else locations
    loc = loc.to(heatmap.dtype)
    target = render_gaussian_heatmap(loc, h, w, sigma=sigma, combine=combine)
    sq = (heatmap - target) ** 2
    if reduction == "none":
        return sq.mean(dim=(1, 2))
    return sq.mean() if reduction == "mean" else sq.sum()


class MISTLoss(nn.Module):
    """Module form of :func:`mist_loss` with fixed ``sigma``, ``combine``, ``detach_target``, ``reduction``.

    ``forward(heatmap[B, H, W], locations[B, K, 2]) -> loss``.
    """

    def __init__(
        self, sigma: float, *, combine: str = "max", detach_target: bool = True, reduction: str = "mean"
    ) -> None:
        super().__init__()
        self.sigma = check_positive(sigma, "sigma")
        self.combine = _check_combine(combine)
        self.detach_target = check_bool(detach_target, "detach_target")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
        self.reduction = reduction

    def forward(self, heatmap: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        return mist_loss(
            heatmap,
            locations,
            sigma=self.sigma,
            combine=self.combine,
            detach_target=self.detach_target,
            reduction=self.reduction,
        )

    def extra_repr(self) -> str:
        return f"sigma={self.sigma}, combine={self.combine!r}, detach_target={self.detach_target}"
