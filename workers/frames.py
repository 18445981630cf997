"""Coordinate frames: the one glossary (other docstrings point here).

Every frame is a pixel grid with ``x`` to the right and ``y`` down, origin at the top-left corner of the
slide, sizes as ``(width, height)`` like OpenSlide; arrays index ``[y, x]``.

``l0`` — level 0 of the store
    Full resolution of the store (the source's level 0, or its resampling to ``--mpp``). Everything public
    is in level-0 pixels unless its name says otherwise: ``SlideStore.dimensions`` and ``read_region``
    locations, ``PatchGrid`` cells (cell ``(r, c)`` covers ``x in [c*stride, c*stride + patch_size)``,
    ``y`` likewise; the grid may overhang the slide, read as white), ``ModelOutput.coords_l0``, the
    ``patches`` of a prediction row, the heatmap's outlines. Names: ``*_l0``; :class:`Box` when a rectangle
    is passed around.

``lv`` — level ``l`` of the store
    Level 0 downsampled by ``downsamples[l]`` (powers of two; for a JPEG passthrough, the source's own
    factors). A level-``l`` pixel ``(x_lv, y_lv)`` covers level-0 ``[x_lv * ds, (x_lv + 1) * ds)``. Chunks
    are ``tile x tile`` blocks of a level: chunk ``(cy, cx)`` holds ``y_lv in [cy*tile, (cy+1)*tile)``.
    The tiler works in this frame (a ``Region.box`` is in pixels of store level ``Region.level``); where a
    level-0 and a level-``l`` value meet, names carry ``_l0`` / ``_lv``.

``src`` — the source slide's level 0
    OpenSlide's level 0 of the input file; equal to ``l0`` unless ingest resampled to ``--mpp`` (then
    ``x_src = x_l0 * mpp_store / mpp_src``).

``lowres`` / ``cells`` — the scorer's input and the patch grid
    The scorer sees the grid extent at ``scorer_downsample`` level-0 pixels per pixel; its score map is
    pooled onto grid cells (``[Gh, Gw]``, flat index ``r * Gw + c``), see ``operators.scorer.cell_pool``.
    With µm settings (``model.geometry.patch_size_um``, ``model.geometry.scorer_mpp``) the cell size, stride and scorer
    downsample are resolved per slide (``ModelConfig.slide_geometry`` -> ``SlideGeometry``, level-0 pixels of that
    slide); the frames stay the same.

``mask`` — the tissue mask
    Computed at the store's smallest level (``StoreMeta.tissue_downsample`` level-0 pixels per mask pixel).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Box"]


class Box(NamedTuple):
    """A rectangle ``(x, y, width, height)``; level-0 pixels unless the holder says otherwise (e.g.
    ``Region.box`` is in pixels of store level ``Region.level``). Immutable (a tuple, so it unpacks and
    serialises as ``[x, y, width, height]``)."""

    x: int
    y: int
    width: int
    height: int

    @property
    def right(self) -> int:
        return self.x + self.width

    @property
    def bottom(self) -> int:
        return self.y + self.height

    def halved(self) -> Box:
        """The same area one 2x level down (origin floored, size rounded up)."""
        return Box(self.x // 2, self.y // 2, -(-self.width // 2), -(-self.height // 2))

    def as_dict(self) -> dict[str, int]:
        """``{"x", "y", "w", "h"}`` (a prediction row's patch)."""
        return {"x": int(self.x), "y": int(self.y), "w": int(self.width), "h": int(self.height)}
