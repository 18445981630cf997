"""Pictures of a scored slide, drawn once for training artifacts and batch scoring.

* :func:`heatmap_image` — the scorer's cell scores over the slide's thumbnail with the chosen patches
  outlined (an RGB array; the one heatmap renderer). :func:`write_heatmap` writes it as PNG
  (``ClassifierWorker`` writes one per scored slide); :func:`plot_heatmap` frames it with a title
  (``foveate train``'s validation artifacts).
* :func:`plot_gallery` — the chosen patches read at full resolution, with their scores.

Coordinates are level-0 pixels (see :mod:`workers.frames`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["heatmap_image", "write_heatmap", "score_grid", "slide_heatmap", "plot_heatmap", "plot_gallery"]


def heatmap_image(
    thumb: np.ndarray,
    level0_size: tuple[int, int],
    scores_grid: np.ndarray,
    stride: int,
    patch_size: int,
    coords_l0: np.ndarray,
    *,
    alpha: float = 0.5,
    min_side: int = 256,
) -> np.ndarray:
    """Scores over the thumbnail with the chosen patches outlined.

    Args:
        thumb: ``(h, w, 3)`` uint8 thumbnail covering level-0 ``(0, 0, W, H)``.
        level0_size: ``(W, H)``.
        scores_grid: ``(Gh, Gw)`` float, NaN (or inf) where the cell was not a candidate (no overlay there).
        stride, patch_size: grid geometry in level-0 pixels; cell ``(r, c)`` colours ``[c*stride, (c+1)*stride)``.
        coords_l0: ``(K, 2)`` level-0 ``(x, y)`` of the chosen patches (outlined in cyan).
        alpha: overlay opacity.
        min_side: the image is upscaled (nearest, integer factor) until its shorter side is at least this.

    Returns:
        ``(h', w', 3)`` uint8.
    """
    from matplotlib import colormaps

    if thumb.ndim != 3 or thumb.shape[2] != 3:
        raise ValueError(f"thumb must be (h, w, 3), got {thumb.shape}")
    factor = max(1, int(np.ceil(min_side / max(1, min(thumb.shape[:2])))))
    img = np.repeat(np.repeat(thumb, factor, 0), factor, 1).astype(np.float32)
    h, w = img.shape[:2]
    W, H = level0_size
    sx, sy = W / w, H / h  # level-0 pixels per output pixel
    xs = ((np.arange(w) + 0.5) * sx // stride).astype(np.int64)
    ys = ((np.arange(h) + 0.5) * sy // stride).astype(np.int64)
    gh, gw = scores_grid.shape
    inside = (ys[:, None] < gh) & (xs[None, :] < gw)
    s = scores_grid[np.minimum(ys, gh - 1)][:, np.minimum(xs, gw - 1)].astype(np.float64)
    valid = inside & np.isfinite(s)
    if valid.any():
        lo, hi = float(s[valid].min()), float(s[valid].max())
        norm = (s - lo) / (hi - lo) if hi > lo else np.full_like(s, 0.5)
        rgba = colormaps["inferno"](np.clip(np.nan_to_num(norm), 0, 1))[..., :3] * 255.0
        img[valid] = (1 - alpha) * img[valid] + alpha * rgba[valid]
    out = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    lw = max(1, min(h, w) // 200)
    for x, y in np.asarray(coords_l0, dtype=np.float64).reshape(-1, 2):
        x0, y0 = int(x / sx), int(y / sy)
        x1, y1 = int(np.ceil((x + patch_size) / sx)) - 1, int(np.ceil((y + patch_size) / sy)) - 1
        x0, x1 = np.clip([x0, x1], 0, w - 1)
        y0, y1 = np.clip([y0, y1], 0, h - 1)
        cyan = np.array([0, 255, 255], dtype=np.uint8)
        out[y0 : y0 + lw, x0 : x1 + 1] = cyan
        out[max(y1 - lw + 1, 0) : y1 + 1, x0 : x1 + 1] = cyan
        out[y0 : y1 + 1, x0 : x0 + lw] = cyan
        out[y0 : y1 + 1, max(x1 - lw + 1, 0) : x1 + 1] = cyan
    return out


def write_heatmap(path: str | Path, image: np.ndarray) -> Path | str:
    """Write an RGB uint8 image as PNG (atomically: a renamed temporary file, or one PUT to an object-storage
    URL, which is returned as is)."""
    import io

    from PIL import Image

    from workers import storage

    if storage.is_url(path):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        fs, key = storage.filesystem(str(path))
        fs.pipe_file(key, buf.getvalue())
        return storage.normalize(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    Image.fromarray(image).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def score_grid(scores: Any, grid_shape: tuple[int, int]) -> np.ndarray:
    """Cell scores (a tensor or array of ``Gh*Gw`` values) as a ``(Gh, Gw)`` float64 grid, NaN where a cell
    was not a candidate."""
    if hasattr(scores, "detach"):
        scores = scores.detach().float().cpu().numpy()
    s = np.asarray(scores, dtype=np.float64).reshape(grid_shape).copy()
    s[~np.isfinite(s)] = np.nan
    return s


def slide_heatmap(store, scores_grid: np.ndarray, stride: int, patch_size: int, coords_l0: np.ndarray) -> np.ndarray:
    """:func:`heatmap_image` over ``store``'s thumbnail (its lowest level)."""
    thumb = store.read_level(store.level_count - 1)
    return heatmap_image(thumb, store.dimensions, scores_grid, stride, patch_size, coords_l0)


def plot_heatmap(store, out, model_cfg, path: Path, *, title: str = "") -> Path:
    """:func:`slide_heatmap` of a forward's output ``out`` with a title, as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workers.patches import PatchGrid, slide_geometry

    geo = slide_geometry(store, model_cfg)
    grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
    coords = out.coords_l0.detach().cpu().numpy().reshape(-1, 2)
    img = slide_heatmap(store, score_grid(out.scores, grid.shape), geo.stride, geo.patch_size, coords)
    h, w = img.shape[:2]
    fig, ax = plt.subplots(figsize=(6, 6 * h / max(w, 1) + 0.6))
    ax.imshow(img)
    ax.set_title(title, fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_gallery(store, out, model_cfg, path: Path, *, title: str = "") -> Path:
    """The chosen patches read at full resolution, with their scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workers.patches import slide_geometry

    p = slide_geometry(store, model_cfg).patch_size
    coords = out.coords_l0.detach().cpu().numpy().reshape(-1, 2).astype(int)
    ps = out.patch_scores.detach().float().cpu().numpy().reshape(-1)
    n = max(len(coords), 1)
    cols = min(n, 8)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows + 0.4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < len(coords):
            x, y = coords[i]
            ax.imshow(store.read_region((int(x), int(y)), 0, (p, p)))
            label = f"({x},{y})" + (f"\n{ps[i]:.3f}" if i < len(ps) else "")
            ax.set_title(label, fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
