"""Tissue detection: Otsu threshold on saturation at low resolution, small holes and specks removed."""

from __future__ import annotations

import numpy as np

__all__ = ["tissue_mask"]


def tissue_mask(
    rgb: np.ndarray, *, min_object_fraction: float = 1e-3, min_hole_fraction: float = 1e-3, min_saturation: float = 0.04
) -> np.ndarray:
    """Boolean tissue mask of a low-resolution RGB image.

    Args:
        rgb: (h, w, 3) uint8, white background.
        min_object_fraction: connected tissue components smaller than this fraction of the image are removed.
        min_hole_fraction: holes inside tissue smaller than this fraction of the image are filled.
        min_saturation: the Otsu threshold is never below this (a blank slide gives an empty mask,
            not noise promoted to tissue).

    Returns:
        (h, w) bool.
    """
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise ValueError(f"rgb must have shape (h, w, 3), got {rgb.shape}")
    from skimage import morphology
    from skimage.filters import threshold_otsu

    x = rgb.astype(np.float32) / 255.0
    mx, mn = x.max(-1), x.min(-1)
    sat = np.where(mx > 0, (mx - mn) / np.maximum(mx, 1e-6), 0.0)
    if float(sat.max()) - float(sat.min()) < 1e-6:
        return np.zeros(sat.shape, dtype=bool)
    thr = max(float(threshold_otsu(sat)), min_saturation)
    mask = sat > thr
    area = mask.size
    min_obj = max(1, int(round(min_object_fraction * area)))
    min_hole = max(1, int(round(min_hole_fraction * area)))
    mask = (
        morphology.remove_small_objects(mask, max_size=min_obj)
        if _has_max_size()
        else morphology.remove_small_objects(mask, min_size=min_obj)
    )
    mask = (
        morphology.remove_small_holes(mask, max_size=min_hole)
        if _has_max_size()
        else morphology.remove_small_holes(mask, area_threshold=min_hole)
    )
    return mask


def _has_max_size() -> bool:
    import inspect

    from skimage import morphology

    return "max_size" in inspect.signature(morphology.remove_small_objects).parameters
