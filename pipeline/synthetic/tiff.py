"""The slide writer: a synthetic slide as an Aperio SVS or a generic pyramidal tiled TIFF, plus its ground truth.

The pixels come from a task family (:mod:`pipeline.synthetic.tasks` picks its layout and renderer); this module
only tiles, encodes and writes them. Writing is streamed: level-0 tiles are rendered procedurally (vectorised
numpy, independent of the tiling: a family's renderer gives the same pixels for any window), JPEG-encoded, and
handed to tifffile one at a time; each is also box-downsampled 2x into a one-tile-row band buffer of level 1,
and each completed band is encoded and downsampled into level 2, and so on. Encoded lower-level
tiles wait in an anonymous temporary file until their page is written. Memory: about one tile row
of each lower level (``tile_size * width * 3`` bytes in all), whatever the slide's size. Lower
levels are therefore exact 2x box downsamples (round half up, computed before JPEG) of the intended
level-0 image; pyramid levels are TIFF pages, not SubIFDs (OpenSlide ignores SubIFDs).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.synthetic.checker import _check_int
from pipeline.synthetic.tasks import check_task, task_layout
from workers.pyramid import downsample2x  # the one 2x box downsampler (round half up)

__all__ = [
    "FORMATS",
    "EXTENSIONS",
    "level_dimensions",
    "sidecar_path",
    "write_synthetic_slide",
]

FORMATS = ("svs", "tiff")
EXTENSIONS = {"svs": ".svs", "tiff": ".tiff"}
MIN_LEVEL_SIDE = 1024  # keep halving while the larger side of the last level exceeds this


def level_dimensions(width: int, height: int) -> list[tuple[int, int]]:
    """Pyramid sizes: level 0, then halving (ceil) while the larger side of the last level exceeds 1024."""
    dims = [(int(width), int(height))]
    while max(dims[-1]) > MIN_LEVEL_SIDE:
        w, h = dims[-1]
        dims.append(((w + 1) // 2, (h + 1) // 2))
    return dims


def sidecar_path(slide_path: str | os.PathLike) -> Path:
    """Ground-truth JSON beside a slide: ``<slide file name>.json``."""
    p = Path(slide_path)
    return p.with_name(p.name + ".json")


class _PyramidWriter:
    """Streams level-0 tiles and builds the lower levels band by band (see module docstring)."""

    def __init__(
        self,
        layout: Any,
        tile: int,
        quality: int,
        dims: list[tuple[int, int]],
        spool,
        progress: Callable[[int], None] | None,
        render: Callable[..., np.ndarray],
    ):
        import imagecodecs

        self.layout, self.tile, self.quality, self.dims = layout, tile, quality, dims
        self.render = render  # (layout, x, y, w, h) -> (h, w, 3) uint8: the family's renderer
        self.spool = spool  # temporary file holding encoded tiles of levels >= 1
        self.progress = progress
        self.ntiles = [(-(-w // tile), -(-h // tile)) for w, h in dims]
        self.offsets: list[list[tuple[int, int]]] = [[] for _ in dims]
        self.bands = [
            np.full((tile, nx * tile, 3), 255, np.uint8) if lvl else None for lvl, (nx, _) in enumerate(self.ntiles)
        ]
        self._encode = imagecodecs.jpeg8_encode

    def encode(self, tile: np.ndarray) -> bytes:
        return self._encode(tile, level=self.quality, colorspace="RGB", outcolorspace="YCBCR", subsampling=(2, 2))

    def level0_tiles(self) -> Iterator[bytes]:
        t, half = self.tile, self.tile // 2
        nx, ny = self.ntiles[0]
        nlev = len(self.dims)
        for ty in range(ny):
            for tx in range(nx):
                px = self.render(self.layout, tx * t, ty * t, t, t)
                if nlev > 1:
                    r0 = (ty % 2) * half
                    self.bands[1][r0 : r0 + half, tx * half : (tx + 1) * half] = downsample2x(px)
                data = self.encode(px)
                if tx == nx - 1 and nlev > 1 and (ty % 2 == 1 or ty == ny - 1):
                    self._band_done(1, ty // 2)  # before yielding: tifffile may stop pulling after the last tile
                if self.progress is not None:
                    self.progress(1)
                yield data

    def _band_done(self, level: int, band: int) -> None:
        """Band ``band`` of ``level`` is complete: encode its tiles, push it down one level, reset it."""
        t, half = self.tile, self.tile // 2
        buf = self.bands[level]
        nx, ny = self.ntiles[level]
        for tx in range(nx):
            data = self.encode(np.ascontiguousarray(buf[:, tx * t : (tx + 1) * t]))
            self.offsets[level].append((self.spool.tell(), len(data)))
            self.spool.write(data)
        if self.progress is not None:
            self.progress(nx)
        if level + 1 < len(self.dims):
            r0 = (band % 2) * half
            small = downsample2x(buf)
            nxt = self.bands[level + 1]
            nxt[r0 : r0 + half, : small.shape[1]] = small
            if band % 2 == 1 or band == ny - 1:
                self._band_done(level + 1, band // 2)
        buf.fill(255)

    def level_tiles(self, level: int) -> Iterator[bytes]:
        for off, n in self.offsets[level]:
            self.spool.seek(off)
            yield self.spool.read(n)
        self.spool.seek(0, os.SEEK_END)


def _fmt_num(v: float) -> str:
    return f"{v:.6g}"


def write_synthetic_slide(
    path: str | os.PathLike,
    *,
    width: int,
    height: int,
    label: int,
    seed: int,
    fmt: str = "svs",
    tile_size: int = 256,
    mpp: float = 0.25,
    quality: int = 90,
    progress: Callable[[int], None] | None = None,
    sidecar: bool = True,
    task: str = "checker",
    classes: int = 2,
) -> dict[str, Any]:
    """Write one synthetic slide (JPEG tiles, power-of-two pyramid as TIFF pages) and its ground truth.

    Args:
        path: output file; written as ``<path>.partial`` then renamed, so a crash never leaves a
            file that looks complete.
        width, height: level-0 size in pixels, each in [2000, 100000].
        label: 0 (structures flat) or 1 (structures carry a 2-px checkerboard).
        seed: non-negative int; decides everything but the texture (same seed, other label = same layout).
        fmt: ``"svs"`` (Aperio: ImageDescription ``Aperio Image Library ...|AppMag = ..|MPP = ..``) or
            ``"tiff"`` (generic tiled TIFF; mpp as X/YResolution in pixels per centimetre).
        tile_size: tile side, a multiple of 16 in [64, 2048].
        mpp: microns per pixel at level 0, in (0, 100].
        quality: JPEG quality, 1..100.
        progress: called with the number of tiles just written (all levels).
        sidecar: also write ``<path>.json`` with the returned info (minus timing).
        task: ``"checker"`` (default; :mod:`pipeline.synthetic.checker`) or ``"objects"`` (see
            :func:`pipeline.synthetic.objects.make_objects_layout`: ``label`` is then a class index in
            ``[0, classes)``).
        classes: number of classes of the ``objects`` task, in [2, 5]; must be 2 for ``checker``.

    Returns:
        Info dict: path, format, width, height, label, seed, tile_size, mpp, quality, levels
        (list of [w, h]), structures (list of level-0 boxes ``x, y, width, height`` plus ``cx, cy,
        radius, textured``), seconds.
    """
    import tifffile

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    tile_size = _check_int("tile_size", tile_size, 64, 2048)
    if tile_size % 16:
        raise ValueError(f"tile_size must be a multiple of 16 in [64, 2048], got {tile_size}")
    quality = _check_int("quality", quality, 1, 100)
    if (
        isinstance(mpp, bool)
        or not isinstance(mpp, (int, float))
        or not (0 < float(mpp) <= 100)
        or not math.isfinite(float(mpp))
    ):
        raise ValueError(f"mpp must be a number in (0, 100], got {mpp!r}")
    mpp = float(mpp)
    task, classes = check_task(task, classes)
    layout, render = task_layout(task, width, height, label, seed, classes)
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder does not exist: {path.parent}")
    t0 = time.perf_counter()
    dims = level_dimensions(layout.width, layout.height)
    raw = sum(w * h * 3 for w, h in dims)
    bigtiff = raw > 2**32 - 2**26  # JPEG never exceeds the raw size in practice
    mag = 10.0 / mpp
    partial = path.with_name(path.name + ".partial")
    try:
        with (
            tempfile.TemporaryFile(dir=path.parent, prefix=".synth-spool-") as spool,
            tifffile.TiffWriter(partial, bigtiff=bigtiff) as tw,
        ):
            pw = _PyramidWriter(layout, tile_size, quality, dims, spool, progress, render)
            for lvl, (w, h) in enumerate(dims):
                kw: dict[str, Any] = {}
                if fmt == "svs":
                    if lvl == 0:
                        head = f"{w}x{h} [0,0 {w}x{h}] ({tile_size}x{tile_size}) JPEG/RGB Q={quality}"
                    else:
                        head = f"{dims[0][0]}x{dims[0][1]} -> {w}x{h} - "
                    kw["description"] = (
                        f"Aperio Image Library v12.0.15 \r\n{head}|AppMag = {_fmt_num(mag)}"
                        f"|MPP = {_fmt_num(mpp)}|Filename = {path.stem}|Title = foveate synthetic slide"
                        f"|foveate.seed = {layout.seed}"
                    )  # no label: the pixels alone must decide it
                else:
                    res = 1e4 / (mpp * 2**lvl)
                    kw["resolution"] = (res, res)
                    kw["resolutionunit"] = "CENTIMETER"
                    kw["subfiletype"] = 1 if lvl else 0
                tiles = pw.level0_tiles() if lvl == 0 else pw.level_tiles(lvl)
                tw.write(
                    tiles,
                    shape=(h, w, 3),
                    dtype=np.uint8,
                    tile=(tile_size, tile_size),
                    photometric="rgb",
                    compression="jpeg",
                    metadata=None,
                    software=False,
                    **kw,
                )
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    info: dict[str, Any] = {
        "path": str(path.resolve()),
        "format": fmt,
        "width": layout.width,
        "height": layout.height,
        "label": layout.label,
        "seed": layout.seed,
        "tile_size": tile_size,
        "mpp": mpp,
        "quality": quality,
        "levels": [list(d) for d in dims],
        "structures": layout.structure_boxes(),
    }
    if hasattr(layout, "sidecar_info"):  # a family's further ground truth (objects: classes, distractors)
        info.update(layout.sidecar_info())
    if sidecar:
        sidecar_path(path).write_text(json.dumps(info, indent=1) + "\n")
    info["seconds"] = time.perf_counter() - t0
    return info
