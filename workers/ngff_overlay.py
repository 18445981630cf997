"""What the model saw, as OME-Zarr that NGFF viewers overlay on the slide (napari-ome-zarr, ome-zarr-py).

``foveate score`` writes, per scored slide and beside its predictions file (``<out stem>_ngff/<slide_id>.zarr``;
the slide store itself is never rewritten), one NGFF 0.5 image:

* ``0``: the scorer's cell scores, float32 ``(1, Gh, Gw)`` (NaN where a cell was not a candidate), one pixel
  per patch-grid cell;
* ``labels/patches/0``: uint16 ``(1, Gh, Gw)``, the rank (1 = highest score) of each of the K chosen cells,
  0 elsewhere, with one colour per rank.

Both carry the coordinate transform that puts them on the slide store's own NGFF frame: a cell is a pixel of
``scale = stride * mpp`` µm (level-0 pixels when the store has no mpp), and the grid starts at the slide's
origin, exactly as the store's levels do (``workers.store.ngff_multiscales``). Opened next to the slide store in
napari, the heatmap and the chosen patches fall on the cells the model scored. For cells larger than their
stride (overlapping grids) the pixel stands for the cell's top-left ``stride x stride`` part.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import zarr

from workers import storage
from workers.store import ngff_multiscales

__all__ = ["write_score_overlay", "PATCHES_LABEL"]

PATCHES_LABEL = "patches"


def write_score_overlay(
    path: str | Path,
    scores_grid: np.ndarray,
    cells: np.ndarray,
    *,
    stride: int,
    mpp: tuple[float, float] | None,
    name: str = "scores",
) -> Path | str:
    """Write the overlay image for one slide at ``path`` (atomically: a temporary folder renamed into place).

    Args:
        path: the ``.zarr`` folder to create (replaced if it exists).
        scores_grid: ``(Gh, Gw)`` cell scores (NaN: not a candidate).
        cells: ``[K]`` chosen cell indices (row-major), in rank order (best first).
        stride: the patch grid's stride in level-0 pixels.
        mpp: the store's level-0 ``(x, y)`` microns per pixel, or None.
        name: the multiscales name.

    Returns:
        ``path``.
    """
    s = np.asarray(scores_grid, dtype=np.float32)
    if s.ndim != 2:
        raise ValueError(f"scores_grid must be (Gh, Gw), got shape {s.shape}")
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise ValueError(f"stride must be a positive int (level-0 pixels), got {stride!r}")
    gh, gw = s.shape
    cells = np.asarray(cells, dtype=np.int64).reshape(-1)
    if cells.size and (cells.min() < 0 or cells.max() >= gh * gw):
        raise ValueError(f"cells must lie in [0, {gh * gw}), got range [{cells.min()}, {cells.max()}]")
    ranks = np.zeros(gh * gw, np.uint16)
    ranks[cells] = np.arange(1, cells.size + 1, dtype=np.uint16)
    if storage.is_url(path):  # object storage: written in place (no rename); the group's attributes come last
        url = storage.normalize(path)
        storage.remove_tree(url)
        group = zarr.open_group(store=storage.open_store(url), mode="w", zarr_format=3)
        _fill_overlay(group, s, ranks, cells, gh, gw, stride=stride, mpp=mpp, name=name)
        return url
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
    _fill_overlay(group, s, ranks, cells, gh, gw, stride=stride, mpp=mpp, name=name)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _fill_overlay(group, s, ranks, cells, gh: int, gw: int, *, stride: int, mpp, name: str) -> None:
    a = group.create_array(
        "0",
        shape=(1, gh, gw),
        chunks=(1, gh, gw),
        dtype="float32",
        fill_value=float("nan"),
        dimension_names=("c", "y", "x"),
    )
    a[...] = s[None]
    finite = s[np.isfinite(s)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    group.attrs["ome"] = {
        "version": "0.5",
        "multiscales": ngff_multiscales(name, [float(stride)], mpp),
        "omero": {
            "channels": [
                {
                    "label": "scorer score",
                    "color": "FFFF00",
                    "active": True,
                    "window": {"start": lo, "end": hi if hi > lo else lo + 1.0, "min": lo, "max": hi},
                }
            ],
            "rdefs": {"model": "greyscale"},
        },
    }
    labels = group.create_group("labels")
    labels.attrs["ome"] = {"version": "0.5", "labels": [PATCHES_LABEL]}
    lg = labels.create_group(PATCHES_LABEL)
    la = lg.create_array(
        "0", shape=(1, gh, gw), chunks=(1, gh, gw), dtype="uint16", fill_value=0, dimension_names=("c", "y", "x")
    )
    la[...] = ranks.reshape(1, gh, gw)
    lg.attrs["ome"] = {
        "version": "0.5",
        "image-label": {
            "version": "0.5",
            "colors": [{"label-value": int(r), "rgba": [0, 229, 255, 255]} for r in range(1, cells.size + 1)],
            "source": {"image": "../../"},
        },
        "multiscales": ngff_multiscales(PATCHES_LABEL, [float(stride)], mpp),
    }
