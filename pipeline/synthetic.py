"""Synthetic whole-slide images in real WSI formats (Aperio SVS, generic pyramidal tiled TIFF).

Each slide is a white background with pink/purple H&E-like tissue (smooth blobs with soft edges,
colour drift, hashed "nuclei" and per-pixel noise) and ``K`` (3..6) small round *candidate
structures* (diameter 48..96 level-0 pixels) lying well inside the tissue. The candidates are darker
purple spots, visible at every level of the pyramid, and the *same* in both classes except for their
fine texture:

* label 1 (positive): a 2-pixel checkerboard between a dark and a light purple (period 4 px),
* label 0 (negative): flat, the same mean colour.

The texture amplitude tapers to zero over the outer 8 px of each structure. A ``16 x 16`` box (or any
box that is a multiple of 4 px and aligned to 4 px) averages the checkerboard away exactly, so at 1/16
scale (and already at 1/4) a positive and a negative slide with the same seed are identical up to JPEG
noise, while at full resolution (and at 1/2) the checkerboard is obvious. The slide's layout (tissue,
structure positions and sizes, noise) depends only on the seed, never on the label.

What a foveated model must learn: a low-resolution scorer can find the candidates (dark spots of
3..6 px at 1/16 scale); the label is legible only in full-resolution patches that land on them
(patch size ~ structure size, 64..128 px). Every candidate of a positive slide is textured, so one
well-placed patch suffices.

Writing is streamed: level-0 tiles are rendered procedurally (vectorised numpy, independent of the
tiling: :func:`render_region` gives the same pixels for any window), JPEG-encoded, and handed to
tifffile one at a time; each is also box-downsampled 2x into a one-tile-row band buffer of level 1,
and each completed band is encoded and downsampled into level 2, and so on. Encoded lower-level
tiles wait in an anonymous temporary file until their page is written. Memory: about one tile row
of each lower level (``tile_size * width * 3`` bytes in all), whatever the slide's size. Lower
levels are therefore exact 2x box downsamples (round half up, computed before JPEG) of the intended
level-0 image; pyramid levels are TIFF pages, not SubIFDs (OpenSlide ignores SubIFDs).

Coordinates are level-0 pixels, ``(x, y)`` and ``(width, height)`` as OpenSlide uses them.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.pyramid import downsample2x  # the one 2x box downsampler (round half up)

__all__ = [
    "FORMATS",
    "MIN_SIDE",
    "MAX_SIDE",
    "SlideLayout",
    "make_layout",
    "render_region",
    "level_dimensions",
    "parse_size",
    "sidecar_path",
    "write_synthetic_slide",
    "synth_archive",
    "TASKS",
    "OBJECT_KINDS",
    "ObjectsLayout",
    "check_task",
    "object_class_names",
    "make_objects_layout",
    "render_objects_region",
]

log = logging.getLogger(__name__)

FORMATS = ("svs", "tiff")
ARCHIVE_FORMATS = ("svs", "tiff", "mixed")
EXTENSIONS = {"svs": ".svs", "tiff": ".tiff"}
MIN_SIDE = 2000
MAX_SIDE = 100_000
MIN_LEVEL_SIDE = 1024  # keep halving while the larger side of the last level exceeds this

# colours (RGB, 0..255)
_WHITE = 255.0
_EOSIN_LIGHT = np.array([238.0, 166.0, 204.0], np.float32)
_EOSIN_DARK = np.array([222.0, 132.0, 186.0], np.float32)
_NUCLEUS = np.array([98.0, 58.0, 148.0], np.float32)
_NUCLEUS_OPACITY = 0.9
STRUCTURE_MEAN = np.array([135.0, 85.0, 165.0], np.float32)
STRUCTURE_AMPLITUDE = np.array([70.0, 60.0, 50.0], np.float32)  # checkerboard: mean +- amplitude
CHECKER_CELL = 2  # px; period 2 * CHECKER_CELL
TEXTURE_TAPER = 8.0  # px over which the texture amplitude fades to 0 at a structure's rim
_NOISE_AMPLITUDE = 10.0  # triangular noise in [-a, a], same on all channels
_NUCLEUS_CELL = 16  # px; at most one nucleus per cell
_EDGE_RAMP = 1.5  # px; anti-aliasing width of tissue and structure edges

_M32 = np.uint32(0xFFFFFFFF)


# ----------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class SlideLayout:
    """Everything that decides a slide's pixels. Built by :func:`make_layout`; depends on the seed only
    (and the size), except ``label`` which selects the structures' texture.

    Attributes:
        width, height: level-0 size in pixels.
        label: 0 or 1.
        seed: the slide's seed.
        blobs: (n, 5) float64 tissue ellipses ``cx, cy, rx, ry, theta``.
        waves: (m, 4) float64 boundary perturbation ``kx, ky, phase, amplitude`` (sum of sines, px).
        colour_waves: (m, 3) float64 colour drift ``kx, ky, phase``.
        margin: distance (px) the tissue keeps from the slide border.
        lipschitz: bound on the gradient of the tissue field (used to skip background tiles).
        structures: (k, 3) float64 candidate structures ``cx, cy, radius``.
        hash_seed: 32-bit key of the coordinate hashes (noise, nuclei).
    """

    width: int
    height: int
    label: int
    seed: int
    blobs: np.ndarray
    waves: np.ndarray
    colour_waves: np.ndarray
    margin: float
    lipschitz: float
    structures: np.ndarray
    hash_seed: int

    def structure_boxes(self) -> list[dict[str, Any]]:
        """Ground-truth candidate structures as level-0 boxes (integer ``x, y, width, height`` enclosing the disk)."""
        out = []
        for cx, cy, r in self.structures:
            x0, y0 = int(math.floor(cx - r)), int(math.floor(cy - r))
            x1, y1 = int(math.ceil(cx + r)), int(math.ceil(cy + r))
            out.append(
                {
                    "x": x0,
                    "y": y0,
                    "width": x1 - x0,
                    "height": y1 - y0,
                    "cx": float(cx),
                    "cy": float(cy),
                    "radius": float(r),
                    "textured": bool(self.label),
                }
            )
        return out


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int in [{lo}, {hi}], got {value!r} ({type(value).__name__})")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
    return int(value)


def _draw_waves(rng: np.random.Generator, s: float, amplitude: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The tissue boundary's 4 perturbation waves ``(kx, ky, phase, amplitude * s)`` (wavelength 0.12..0.4 s),
    the 3 colour-drift waves ``(kx, ky, phase)`` (wavelength 800..4000 px), and the Lipschitz bound of the
    perturbed boundary function; both task families draw them in this order from ``rng``."""
    waves = np.empty((4, 4))
    for i in range(4):
        wavelength = rng.uniform(0.12, 0.4) * s
        angle = rng.uniform(0, 2 * math.pi)
        k = 2 * math.pi / wavelength
        waves[i] = (k * math.cos(angle), k * math.sin(angle), rng.uniform(0, 2 * math.pi), amplitude * s)
    colour_waves = np.empty((3, 3))
    for i in range(3):
        wavelength = rng.uniform(800.0, 4000.0)
        angle = rng.uniform(0, 2 * math.pi)
        k = 2 * math.pi / wavelength
        colour_waves[i] = (k * math.cos(angle), k * math.sin(angle), rng.uniform(0, 2 * math.pi))
    lipschitz = 1.0 + float(np.sum(np.hypot(waves[:, 0], waves[:, 1]) * waves[:, 3]))
    return waves, colour_waves, lipschitz


def make_layout(width: int, height: int, label: int, seed: int) -> SlideLayout:
    """Draw a slide's tissue and candidate structures from ``seed`` (the label only picks the texture).

    Args:
        width, height: level-0 size, each in [MIN_SIDE, MAX_SIDE].
        label: 0 (flat structures) or 1 (checkerboard structures).
        seed: non-negative int.
    """
    width = _check_int("width", width, MIN_SIDE, MAX_SIDE)
    height = _check_int("height", height, MIN_SIDE, MAX_SIDE)
    label = _check_int("label", label, 0, 1)
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    s = float(min(width, height))
    margin = 0.03 * s + 32.0
    n_blobs = int(rng.integers(2, 5))
    blobs = np.empty((n_blobs, 5))
    for i in range(n_blobs):
        blobs[i] = (
            rng.uniform(0.3, 0.7) * width,
            rng.uniform(0.3, 0.7) * height,
            rng.uniform(0.18, 0.34) * width,
            rng.uniform(0.18, 0.34) * height,
            rng.uniform(0, math.pi),
        )
    waves, colour_waves, lipschitz = _draw_waves(rng, s, 0.025)
    hash_seed = int(rng.integers(1, 2**32 - 1))
    layout = SlideLayout(
        width, height, label, seed, blobs, waves, colour_waves, margin, lipschitz, np.zeros((0, 3)), hash_seed
    )
    # candidate structures: K in 3..6, radius 24..48 px, well inside tissue, apart from each other
    k = int(rng.integers(3, 7))
    placed: list[tuple[float, float, float]] = []
    for _ in range(4000):
        if len(placed) == k:
            break
        r = float(rng.uniform(24.0, 48.0))
        cx, cy = float(rng.uniform(0, width)), float(rng.uniform(0, height))
        if _tissue_field(layout, np.array([cx]), np.array([cy]))[0] < r + 32.0:
            continue
        if any(math.hypot(cx - px, cy - py) < r + pr + 64.0 for px, py, pr in placed):
            continue
        placed.append((cx, cy, r))
    if len(placed) < 3:  # pragma: no cover - the tissue always has room for three
        raise RuntimeError(f"could not place candidate structures for seed {seed}")
    return SlideLayout(
        width,
        height,
        label,
        seed,
        blobs,
        waves,
        colour_waves,
        margin,
        lipschitz,
        np.array(placed, dtype=np.float64),
        hash_seed,
    )


# ------------------------------------------------------------------------------------- rendering


def _separable_sines(xs: np.ndarray, ys: np.ndarray, waves: np.ndarray, amps: np.ndarray) -> np.ndarray:
    """``sum_k amps[k] * sin(kx_k x + ky_k y + phase_k)`` on the grid ``ys (h, 1) x xs (1, w)`` as one matmul.

    sin(a + b) = sin(a) cos(b) + cos(a) sin(b), so the sum is ``A (h, 2m) @ B (2m, w)``.
    """
    x = xs.reshape(-1).astype(np.float64)
    y = ys.reshape(-1).astype(np.float64)
    ax = np.outer(waves[:, 0], x)  # (m, w)
    ay = np.outer(y, waves[:, 1]) + waves[:, 2]  # (h, m)
    a = np.concatenate([np.cos(ay) * amps, np.sin(ay) * amps], axis=1)  # (h, 2m)
    b = np.concatenate([np.sin(ax), np.cos(ax)], axis=0)  # (2m, w)
    return (a @ b).astype(np.float32)


def _tissue_field(layout: SlideLayout, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Approximate signed distance (px, positive inside) to the tissue boundary.

    ``xs`` and ``ys`` are either equal-shape point arrays (float64), or a row ``(1, w)`` and a column
    ``(h, 1)`` of pixel centres (float32 grid; the sines are then evaluated separably).
    """
    grid = xs.ndim == 2 and ys.ndim == 2 and xs.shape[0] == 1 and ys.shape[1] == 1
    dt = np.float32 if grid else np.float64
    field = None
    for cx, cy, rx, ry, th in layout.blobs:
        c, s = math.cos(th), math.sin(th)
        dx, dy = xs - dt(cx), ys - dt(cy)
        u = (dx * dt(c / rx)) + (dy * dt(s / rx))
        v = (dy * dt(c / ry)) - (dx * dt(s / ry))
        u *= u
        v *= v
        u += v
        f = (dt(1.0) - np.sqrt(u, out=u)) * dt(min(rx, ry))
        field = f if field is None else np.maximum(field, f, out=field)
    amps = layout.waves[:, 3] / math.sqrt(len(layout.waves))
    if grid:
        field += _separable_sines(xs, ys, layout.waves, amps)
    else:
        for (kx, ky, ph, _), a in zip(layout.waves, amps):
            field = field + a * np.sin(kx * xs + ky * ys + ph)
    border = np.minimum(np.minimum(xs, dt(layout.width) - xs), np.minimum(ys, dt(layout.height) - ys))
    return np.minimum(field, border - dt(layout.margin))


def _hash32(a: np.ndarray) -> np.ndarray:
    """Integer avalanche hash (lowbias32) on uint32 arrays, vectorised."""
    a = a ^ (a >> np.uint32(16))
    a = a * np.uint32(0x7FEB352D)
    a = a ^ (a >> np.uint32(15))
    a = a * np.uint32(0x846CA68B)
    return a ^ (a >> np.uint32(16))


def _coord_hash(ix: np.ndarray, iy: np.ndarray, key: int) -> np.ndarray:
    """Hash of integer coordinates (row ``(1, w)`` and column ``(h, 1)`` uint32) -> ``(h, w)`` uint32."""
    hx = _hash32(ix * np.uint32(0x9E3779B1) ^ np.uint32(key))
    return _hash32(hx ^ (iy * np.uint32(0x85EBCA77)))


_NOISE_PERIOD = 1024


@functools.lru_cache(maxsize=8)
def _noise_texture(key: int) -> np.ndarray:
    """(1024, 1024) float32 triangular noise in [-a, a] from a hash of the coordinates; tiled periodically."""
    i = np.arange(_NOISE_PERIOD, dtype=np.uint32)
    n = np.empty((_NOISE_PERIOD, _NOISE_PERIOD), np.float32)
    for r0 in range(0, _NOISE_PERIOD, 128):  # in row chunks: small transient memory
        hp = _coord_hash(i[None, :], i[r0 : r0 + 128, None], key)
        n[r0 : r0 + 128] = (hp & np.uint32(0xFF)).astype(np.float32)
        n[r0 : r0 + 128] += ((hp >> np.uint32(8)) & np.uint32(0xFF)).astype(np.float32)
    n *= np.float32(_NOISE_AMPLITUDE / 255.0)
    n -= np.float32(_NOISE_AMPLITUDE)
    n.setflags(write=False)
    return n


def _background(h: int, w: int) -> np.ndarray:
    return np.full((h, w, 3), 255, np.uint8)


def render_region(layout: SlideLayout, x: int, y: int, width: int, height: int) -> np.ndarray:
    """The intended (pre-JPEG) level-0 pixels of a window; independent of how the slide is tiled.

    Pixels outside the slide are white.

    Returns:
        (height, width, 3) uint8 RGB.
    """
    f32 = np.float32
    xs = (np.arange(x, x + width, dtype=np.float64) + 0.5).astype(f32)[None, :]
    ys = (np.arange(y, y + height, dtype=np.float64) + 0.5).astype(f32)[:, None]
    # the tissue field is Lipschitz (constant layout.lipschitz): windows far outside are white, windows
    # deep inside are fully opaque tissue (no per-pixel field needed)
    centre = float(_tissue_field(layout, np.array([x + width / 2.0]), np.array([y + height / 2.0]))[0])
    reach = layout.lipschitz * 0.5 * math.hypot(width, height) + 2 * _EDGE_RAMP
    if centre + reach < 0:
        return _background(height, width)
    alpha = None
    if centre - reach <= 0:
        alpha = _tissue_field(layout, xs, ys)
        alpha *= f32(1.0 / _EDGE_RAMP)
        alpha += f32(0.5)
        np.clip(alpha, 0.0, 1.0, out=alpha)
        if not alpha.any():
            return _background(height, width)

    # colour drift between two eosin shades (separable sines, ~[0, 1])
    m = len(layout.colour_waves)
    cw = np.concatenate([layout.colour_waves, np.ones((m, 1))], axis=1)
    g = _separable_sines(xs, ys, cw, np.full(m, 1.0 / (2 * m)))
    g += f32(0.5)
    col = g[..., None] * (_EOSIN_DARK - _EOSIN_LIGHT)
    col += _EOSIN_LIGHT

    # nuclei: at most one per 16 px cell; presence, radius and position from a hash of the cell
    ix = np.arange(x, x + width, dtype=np.int64)
    iy = np.arange(y, y + height, dtype=np.int64)
    cx0, cy0 = x // _NUCLEUS_CELL, y // _NUCLEUS_CELL
    cxs = np.arange(cx0, (x + width - 1) // _NUCLEUS_CELL + 1, dtype=np.int64).astype(np.uint32)
    cys = np.arange(cy0, (y + height - 1) // _NUCLEUS_CELL + 1, dtype=np.int64).astype(np.uint32)
    hc = _coord_hash(cxs[None, :], cys[:, None], layout.hash_seed ^ 0xA5A5A5A5)  # per cell
    present = ((hc & np.uint32(0xFF)) < np.uint32(120)).astype(f32) * f32(_NUCLEUS_OPACITY)  # ~47 % of cells
    radius = f32(2.5) + ((hc >> np.uint32(8)) & np.uint32(0xFF)).astype(f32) * f32(2.0 / 255)
    span = f32(_NUCLEUS_CELL) - 2 * (radius + f32(0.5))
    ox = radius + f32(0.5) + ((hc >> np.uint32(16)) & np.uint32(0xFF)).astype(f32) * f32(1 / 255) * span
    oy = radius + f32(0.5) + ((hc >> np.uint32(24)) & np.uint32(0xFF)).astype(f32) * f32(1 / 255) * span
    # expand per-cell values to pixels
    jx = (ix // _NUCLEUS_CELL - cx0)[None, :]
    jy = (iy // _NUCLEUS_CELL - cy0)[:, None]
    lx = (ix % _NUCLEUS_CELL).astype(f32)[None, :] + f32(0.5)
    ly = (iy % _NUCLEUS_CELL).astype(f32)[:, None] + f32(0.5)
    dx = lx - ox[jy, jx]
    dy = ly - oy[jy, jx]
    dx *= dx
    dy *= dy
    dx += dy
    nuc = radius[jy, jx] + f32(0.5)
    nuc -= np.sqrt(dx, out=dx)
    np.clip(nuc, 0.0, 1.0, out=nuc)
    nuc *= present[jy, jx]
    col += nuc[..., None] * (_NUCLEUS - col)

    # candidate structures (only those overlapping the window)
    for scx, scy, r in layout.structures:
        x0, x1 = max(int(math.floor(scx - r - 2)), x), min(int(math.ceil(scx + r + 2)), x + width)
        y0, y1 = max(int(math.floor(scy - r - 2)), y), min(int(math.ceil(scy + r + 2)), y + height)
        if x0 >= x1 or y0 >= y1:
            continue
        sx = xs[:, x0 - x : x1 - x]
        sy = ys[y0 - y : y1 - y, :]
        dist = np.sqrt((sx - f32(scx)) ** 2 + (sy - f32(scy)) ** 2)
        a = np.clip(f32(r) - dist + f32(0.5), 0.0, 1.0)[..., None]
        target = np.broadcast_to(STRUCTURE_MEAN, a.shape[:2] + (3,)).astype(f32)
        if layout.label == 1:
            env = np.clip((f32(r) - dist) * f32(1.0 / TEXTURE_TAPER), 0.0, 1.0)
            cx_i = np.arange(x0, x1) // CHECKER_CELL
            cy_i = np.arange(y0, y1) // CHECKER_CELL
            checker = ((cx_i[None, :] + cy_i[:, None]) % 2).astype(f32) * f32(2.0) - f32(1.0)
            target = target + (checker * env)[..., None] * STRUCTURE_AMPLITUDE
        sub = col[y0 - y : y1 - y, x0 - x : x1 - x]
        sub += a * (target - sub)

    # per-pixel luminance noise (triangular; a periodic 1024 px hashed texture)
    tex = _noise_texture(layout.hash_seed)
    px, py = x % _NOISE_PERIOD, y % _NOISE_PERIOD
    if px + width <= _NOISE_PERIOD and py + height <= _NOISE_PERIOD:
        noise = tex[py : py + height, px : px + width]
    else:
        noise = tex[np.ix_(iy % _NOISE_PERIOD, ix % _NOISE_PERIOD)]
    col += noise[..., None]

    if alpha is not None:  # composite over white
        col -= f32(_WHITE)
        col *= alpha[..., None]
        col += f32(_WHITE)
    col += f32(0.5)
    np.clip(col, 0, 255, out=col)
    return col.astype(np.uint8)


# ---------------------------------------------------------------------------------------- writing


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
        layout: SlideLayout,
        tile: int,
        quality: int,
        dims: list[tuple[int, int]],
        spool,
        progress: Callable[[int], None] | None,
        render: Callable[..., np.ndarray] | None = None,
    ):
        import imagecodecs

        self.layout, self.tile, self.quality, self.dims = layout, tile, quality, dims
        self.render = render_region if render is None else render  # (layout, x, y, w, h) -> (h, w, 3) uint8
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
        task: ``"checker"`` (default; the module docstring's task) or ``"objects"`` (see
            :func:`make_objects_layout`: ``label`` is then a class index in ``[0, classes)``).
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
    if task == "objects":
        layout = make_objects_layout(width, height, label, seed, classes)
        render = render_objects_region
    else:
        layout = make_layout(width, height, label, seed)
        render = None
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
    if task == "objects":
        info.update(layout.sidecar_info())
    if sidecar:
        sidecar_path(path).write_text(json.dumps(info, indent=1) + "\n")
    info["seconds"] = time.perf_counter() - t0
    return info


# ---------------------------------------------------------------------------------------- archive


def parse_size(size: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """Size spec -> ``((wmin, wmax), (hmin, hmax))``.

    Accepts an int (square), ``"4096"``, ``"6000x4000"``, a range ``"2048:8192"`` (width and height
    each drawn from it), a ``(lo, hi)`` tuple (range) or the same nested. Sides in [2000, 100000].
    """

    def side(v: Any) -> int:
        try:
            iv = int(str(v).strip()) if not isinstance(v, (int, np.integer)) or isinstance(v, bool) else int(v)
        except ValueError:
            raise ValueError(
                f"size must be N, WxH or LO:HI with integer sides in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}"
            ) from None
        if isinstance(v, bool) or not MIN_SIDE <= iv <= MAX_SIDE:
            raise ValueError(f"size sides must be integers in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}")
        return iv

    if isinstance(size, str):
        s = size.strip().lower()
        if ":" in s:
            lo_s, _, hi_s = s.partition(":")
            lo, hi = side(lo_s), side(hi_s)
            rng = (lo, hi)
        elif "x" in s:
            w_s, _, h_s = s.partition("x")
            w, h = side(w_s), side(h_s)
            return (w, w), (h, h)
        else:
            v = side(s)
            return (v, v), (v, v)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        lo, hi = side(size[0]), side(size[1])
        rng = (lo, hi)
    elif isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        v = side(size)
        return (v, v), (v, v)
    else:
        raise ValueError(f"size must be N, WxH or LO:HI with integer sides in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}")
    if rng[0] > rng[1]:
        raise ValueError(f"size range LO:HI needs LO <= HI, got {size!r}")
    return rng, rng


def synth_archive(
    out_dir: str | os.PathLike,
    *,
    count: int,
    size: Any = 4096,
    fmt: str = "svs",
    seed: int = 0,
    positive_fraction: float = 0.5,
    tile_size: int = 256,
    mpp: float = 0.25,
    quality: int = 90,
    progress: Callable[[int, str], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    task: str = "checker",
    classes: int = 2,
    jobs: int = 1,
):
    """Write ``count`` synthetic slides into ``out_dir`` plus ``labels.csv`` (columns ``path,label``).

    ``path`` holds absolute paths. Exactly ``floor(count * positive_fraction + 0.5)`` slides are positive,
    in an order shuffled by ``seed``. ``fmt="mixed"`` alternates SVS (even index) and TIFF (odd).
    Slide ``i`` is ``synth_{i:05d}.svs|.tiff`` with seed drawn from ``(seed, i)``; files are overwritten.
    Same arguments -> same bytes.

    Args:
        out_dir: created if missing.
        count: number of slides, 1..100000.
        size: see :func:`parse_size`.
        fmt: "svs", "tiff" or "mixed".
        seed: non-negative int.
        positive_fraction: in [0, 1].
        tile_size, mpp, quality: see :func:`write_synthetic_slide`.
        progress: called as ``progress(n_tiles, slide_name)`` as tiles are written.
        on_total: called once with the total number of tiles (all slides, all levels) before writing.
        task: ``"checker"`` (default) or ``"objects"`` (:func:`make_objects_layout`). For ``objects`` the
            classes are balanced (``count // classes`` slides each, the remainder to the first classes, in an
            order shuffled by ``seed``), ``positive_fraction`` is ignored and ``label`` holds the class
            *name* (the majority kind, e.g. ``horizontal``).
        classes: number of classes of the ``objects`` task, in [2, 5] (2 for ``checker``).
        jobs: slides written at once, each in its own process (1..256; default 1: in this process). The bytes
            do not depend on it (every slide has its own seed); with ``jobs > 1`` ``progress`` is called once
            per slide, when it is complete, with all of its tiles.

    Returns:
        pandas.DataFrame with columns ``path`` (absolute, str) and ``label`` (int; the class name for
        ``objects``), as in labels.csv.
    """
    import pandas as pd

    task, classes = check_task(task, classes)
    count = _check_int("count", count, 1, 100_000)
    if fmt not in ARCHIVE_FORMATS:
        raise ValueError(f"fmt must be one of {ARCHIVE_FORMATS}, got {fmt!r}")
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    if (
        isinstance(positive_fraction, bool)
        or not isinstance(positive_fraction, (int, float))
        or not 0.0 <= float(positive_fraction) <= 1.0
    ):
        raise ValueError(f"positive_fraction must be a number in [0, 1], got {positive_fraction!r}")
    (wlo, whi), (hlo, hhi) = parse_size(size)
    tile_size = _check_int("tile_size", tile_size, 64, 2048)
    if tile_size % 16:
        raise ValueError(f"tile_size must be a multiple of 16 in [64, 2048], got {tile_size}")
    quality = _check_int("quality", quality, 1, 100)
    if isinstance(mpp, bool) or not isinstance(mpp, (int, float)) or not (0 < float(mpp) <= 100):
        raise ValueError(f"mpp must be a number in (0, 100], got {mpp!r}")
    jobs = _check_int("jobs", jobs, 1, 256)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if task == "objects":  # balanced classes; labels.csv holds the class names
        names = list(object_class_names(classes))
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x0B1EC7, classes]))
        labels = np.arange(count, dtype=np.int64) % classes
    else:
        names = None
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA4C1]))
        n_pos = int(math.floor(count * float(positive_fraction) + 0.5))  # round half up (not to even)
        labels = np.zeros(count, np.int64)
        labels[:n_pos] = 1
    rng.shuffle(labels)
    widths = rng.integers(wlo, whi + 1, size=count)
    heights = rng.integers(hlo, hhi + 1, size=count)
    slide_seeds = rng.integers(0, 2**62, size=count)
    fmts = [("svs" if i % 2 == 0 else "tiff") if fmt == "mixed" else fmt for i in range(count)]

    def n_tiles(w: int, h: int) -> int:
        return sum(-(-lw // tile_size) * -(-lh // tile_size) for lw, lh in level_dimensions(w, h))

    if on_total is not None:
        on_total(int(sum(n_tiles(int(w), int(h)) for w, h in zip(widths, heights))))

    def slide_kwargs(i: int) -> dict[str, Any]:
        return dict(
            path=out / f"synth_{i:05d}{EXTENSIONS[fmts[i]]}",
            width=int(widths[i]),
            height=int(heights[i]),
            label=int(labels[i]),
            seed=int(slide_seeds[i]),
            fmt=fmts[i],
            tile_size=tile_size,
            mpp=float(mpp),
            quality=quality,
            task=task,
            classes=classes,
        )

    def row(i: int, info: dict[str, Any]) -> dict[str, Any]:
        log.debug(
            "wrote %s (%dx%d, label %s) in %.1fs",
            Path(info["path"]).name,
            info["width"],
            info["height"],
            info["label"],
            info["seconds"],
        )
        return {"path": info["path"], "label": int(labels[i]) if names is None else names[int(labels[i])]}

    rows: list[dict[str, Any]] = []
    if jobs == 1 or count == 1:
        for i in range(count):
            kw = slide_kwargs(i)
            name = kw["path"].name
            cb = (lambda n, _name=name: progress(n, _name)) if progress is not None else None
            rows.append(row(i, write_synthetic_slide(progress=cb, **kw)))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        # spawn: a forked child would inherit the caller's threads' locks (progress bars, loggers)
        with cf.ProcessPoolExecutor(max_workers=min(jobs, count), mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(write_synthetic_slide, **slide_kwargs(i)): i for i in range(count)}
            infos: dict[int, dict[str, Any]] = {}
            try:
                for fut in cf.as_completed(futures):
                    i = futures[fut]
                    infos[i] = fut.result()
                    if progress is not None:
                        progress(n_tiles(int(widths[i]), int(heights[i])), Path(infos[i]["path"]).name)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # slides not yet started are not written
                raise
        rows = [row(i, infos[i]) for i in range(count)]
    df = pd.DataFrame(rows, columns=["path", "label"])
    df.to_csv(out / "labels.csv", index=False)
    return df


# ======================================================================================= objects task
# A second task family (``task="objects"``), unlike the checkerboard in what carries the label:
#
# * tissue covers most of the slide (~80-90 %, so the tissue mask cannot narrow the search), with the same
#   H&E-like background as the checker task (colour drift, nuclei, noise);
# * 3..6 small round *informative objects* (diameter 40..52 px), each of a *kind* = a fine texture of period
#   4 px on the same mean ink colour: horizontal stripes, vertical stripes, checkerboard, diagonal stripes,
#   antidiagonal stripes (``OBJECT_KINDS``; the first ``classes`` are used). The label is the kind of the
#   majority of the informative objects; every slide also holds exactly one object of another kind (so finding
#   one object is not enough: the majority is n - 1 of n);
# * 20..60 *distractors* with the same ink colour and textures of random kinds (drawn from the seed, never
#   from the label): elongated curved strokes (160..480 px long, 10..16 px wide) and rings (outer diameter
#   96..160 px, 10..14 px thick). At 1/16 scale distractors are faint lines and rings, informative objects
#   compact 2.5..3.3 px dots: a low-resolution scorer can learn where to look, but only full-resolution patches
#   tell which kind an object is.
#
# The texture is added on whole aligned 4 x 4 blocks only (a block is textured only when it lies entirely
# inside the shape's opaque part), and every kind sums to zero over an aligned 4 x 4 block; so the 1/4, 1/8,
# 1/16 levels (exact box downsamples) of two slides with the same seed and different labels are identical up
# to rounding and JPEG noise. The layout (tissue, positions, sizes, which objects are in the majority,
# distractor kinds) depends on the seed only; the label only decides which kind the majority has and, via
# a fixed offset, which kinds the minority have.

TASKS = ("checker", "objects")
OBJECT_KINDS = ("horizontal", "vertical", "checker", "diagonal", "antidiagonal")
OBJECTS_MIN_CLASSES, OBJECTS_MAX_CLASSES = 2, len(OBJECT_KINDS)
OBJECTS_DEFAULT_SIZE = 8192
INK_MEAN = np.array([118.0, 74.0, 152.0], np.float32)
INK_AMPLITUDE = np.array([62.0, 52.0, 44.0], np.float32)  # texture: mean +- amplitude
OBJECT_RADIUS = (20.0, 26.0)  # informative objects: diameter 40..52 px
OBJECT_COUNT = (3, 6)
DISTRACTOR_COUNT = (20, 60)
STROKE_LENGTH = (160.0, 480.0)
STROKE_WIDTH = (10.0, 16.0)
RING_RADIUS = (48.0, 80.0)  # outer diameter 96..160 px: at 1/16 a faint ring, not a dot
RING_THICKNESS = (10.0, 14.0)
_TEXTURE_BLOCK = 4  # px; the kinds' common period; texture only on whole aligned blocks
_BLOCK_INSET = 3.5  # px; a block is textured when its centre is this deep inside the shape
_STROKE_POINTS = 17


def check_task(task: Any, classes: Any) -> tuple[str, int]:
    """Validate a task family name and its number of classes; returns ``(task, classes)``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "checker":
        if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or int(classes) != 2:
            raise ValueError(
                f"classes must be 2 for task 'checker' (binary), got {classes!r}; "
                f"task 'objects' takes {OBJECTS_MIN_CLASSES}..{OBJECTS_MAX_CLASSES}"
            )
        return task, 2
    if (
        isinstance(classes, bool)
        or not isinstance(classes, (int, np.integer))
        or not OBJECTS_MIN_CLASSES <= int(classes) <= OBJECTS_MAX_CLASSES
    ):
        raise ValueError(
            f"classes must be an int in [{OBJECTS_MIN_CLASSES}, {OBJECTS_MAX_CLASSES}] for task "
            f"'objects' (kinds {OBJECT_KINDS[:OBJECTS_MAX_CLASSES]}), got {classes!r}"
        )
    return task, int(classes)


def object_class_names(classes: int) -> tuple[str, ...]:
    """Class names of the ``objects`` task with ``classes`` classes (index -> name)."""
    return OBJECT_KINDS[: check_task("objects", classes)[1]]


@dataclass(frozen=True)
class ObjectsLayout:
    """Everything that decides an ``objects`` slide's pixels. Built by :func:`make_objects_layout`.

    Attributes:
        base: the background (tissue, colour drift, nuclei, noise) as a :class:`SlideLayout` without structures.
        label: class index in ``[0, classes)`` (= the majority kind).
        classes: number of classes.
        objects: (n, 4) float64 informative objects ``cx, cy, radius, kind``.
        rings: (m, 5) float64 ring distractors ``cx, cy, r_outer, r_inner, kind``.
        strokes: tuple of ``(points (P, 2) float64, half_width, kind)`` stroke distractors.
    """

    base: SlideLayout
    label: int
    classes: int
    objects: np.ndarray
    rings: np.ndarray
    strokes: tuple

    @property
    def width(self) -> int:
        return self.base.width

    @property
    def height(self) -> int:
        return self.base.height

    @property
    def seed(self) -> int:
        return self.base.seed

    def structure_boxes(self) -> list[dict[str, Any]]:
        """Informative objects as level-0 boxes (``x, y, width, height`` enclosing the disk) plus ``cx, cy,
        radius, kind``."""
        out = []
        for cx, cy, r, kind in self.objects:
            x0, y0 = int(math.floor(cx - r)), int(math.floor(cy - r))
            x1, y1 = int(math.ceil(cx + r)), int(math.ceil(cy + r))
            out.append(
                {
                    "x": x0,
                    "y": y0,
                    "width": x1 - x0,
                    "height": y1 - y0,
                    "cx": float(cx),
                    "cy": float(cy),
                    "radius": float(r),
                    "kind": OBJECT_KINDS[int(kind)],
                    "informative": True,
                }
            )
        return out

    def distractor_boxes(self) -> list[dict[str, Any]]:
        """Distractors as level-0 boxes plus ``shape`` (``ring`` / ``stroke``) and ``kind``."""
        out = []
        for cx, cy, ro, ri, kind in self.rings:
            x0, y0 = int(math.floor(cx - ro)), int(math.floor(cy - ro))
            x1, y1 = int(math.ceil(cx + ro)), int(math.ceil(cy + ro))
            out.append(
                {
                    "x": x0,
                    "y": y0,
                    "width": x1 - x0,
                    "height": y1 - y0,
                    "shape": "ring",
                    "cx": float(cx),
                    "cy": float(cy),
                    "radius": float(ro),
                    "inner_radius": float(ri),
                    "kind": OBJECT_KINDS[int(kind)],
                }
            )
        for pts, hw, kind in self.strokes:
            x0, y0 = int(math.floor(pts[:, 0].min() - hw)), int(math.floor(pts[:, 1].min() - hw))
            x1, y1 = int(math.ceil(pts[:, 0].max() + hw)), int(math.ceil(pts[:, 1].max() + hw))
            out.append(
                {
                    "x": x0,
                    "y": y0,
                    "width": x1 - x0,
                    "height": y1 - y0,
                    "shape": "stroke",
                    "half_width": float(hw),
                    "points": [[float(a), float(b)] for a, b in pts],
                    "kind": OBJECT_KINDS[int(kind)],
                }
            )
        return out

    def sidecar_info(self) -> dict[str, Any]:
        names = OBJECT_KINDS[: self.classes]
        kinds = [int(k) for k in self.objects[:, 3]]
        return {
            "task": "objects",
            "classes": self.classes,
            "class_names": list(names),
            "label": names[self.label],
            "label_index": self.label,
            "kind_counts": {n: kinds.count(i) for i, n in enumerate(names)},
            "distractors": self.distractor_boxes(),
        }


def _objects_base(width: int, height: int, seed: int, rng: np.random.Generator) -> SlideLayout:
    """Background for the objects task: 3 large overlapping ellipses around the centre (tissue ~80-90 %)."""
    s = float(min(width, height))
    margin = 0.02 * s + 32.0
    blobs = np.empty((3, 5))
    for i in range(3):
        blobs[i] = (
            rng.uniform(0.42, 0.58) * width,
            rng.uniform(0.42, 0.58) * height,
            rng.uniform(0.5, 0.62) * width,
            rng.uniform(0.5, 0.62) * height,
            rng.uniform(0, math.pi),
        )
    waves, colour_waves, lipschitz = _draw_waves(rng, s, 0.02)
    hash_seed = int(rng.integers(1, 2**32 - 1))
    return SlideLayout(
        width, height, 0, seed, blobs, waves, colour_waves, margin, lipschitz, np.zeros((0, 3)), hash_seed
    )


def _seg_dist(px: np.ndarray, py: np.ndarray, pts: np.ndarray, reach: float | None = None) -> np.ndarray:
    """Distance from points (broadcast arrays ``px``, ``py``) to the polyline ``pts`` (P, 2).

    With ``reach``, segments farther than ``reach`` from the points' bounding box are skipped (distances
    beyond ``reach`` are then only lower bounds; ``inf`` where no segment is near).
    """
    best = None
    if reach is not None:
        lo_x, hi_x, lo_y, hi_y = float(np.min(px)), float(np.max(px)), float(np.min(py)), float(np.max(py))
    for (ax, ay), (bx, by) in zip(pts[:-1], pts[1:]):
        if reach is not None and (
            min(ax, bx) - reach > hi_x
            or max(ax, bx) + reach < lo_x
            or min(ay, by) - reach > hi_y
            or max(ay, by) + reach < lo_y
        ):
            continue
        dx, dy = bx - ax, by - ay
        ll = dx * dx + dy * dy
        t = np.clip(((px - ax) * dx + (py - ay) * dy) / ll, 0.0, 1.0)
        d = np.hypot(px - (ax + t * dx), py - (ay + t * dy))
        best = d if best is None else np.minimum(best, d)
    if best is None:
        return np.full(np.broadcast_shapes(np.shape(px), np.shape(py)), np.inf)
    return best


def make_objects_layout(width: int, height: int, label: int, seed: int, classes: int = 4) -> ObjectsLayout:
    """Draw an ``objects`` slide from ``seed``; ``label`` (class index) only picks the objects' kinds.

    The informative objects' count ``n`` (3..6), positions, radii and which one of them is the minority come
    from the seed; the ``n - 1`` others (the majority) have kind ``label``, the minority object kind
    ``(label + o) % classes`` with a seed-drawn offset ``o`` in ``1..classes-1``.
    """
    width = _check_int("width", width, MIN_SIDE, MAX_SIDE)
    height = _check_int("height", height, MIN_SIDE, MAX_SIDE)
    _, classes = check_task("objects", classes)
    label = _check_int("label", label, 0, classes - 1)
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x0B1EC7]))
    base = _objects_base(width, height, seed, rng)

    def field(x: float, y: float) -> float:
        return float(_tissue_field(base, np.array([x]), np.array([y]))[0])

    # informative objects
    n = int(rng.integers(OBJECT_COUNT[0], OBJECT_COUNT[1] + 1))
    placed: list[tuple[float, float, float]] = []
    for _ in range(20000):
        if len(placed) == n:
            break
        r = float(rng.uniform(*OBJECT_RADIUS))
        cx, cy = float(rng.uniform(0, width)), float(rng.uniform(0, height))
        if field(cx, cy) < r + 48.0:
            continue
        if any(math.hypot(cx - px, cy - py) < r + pr + 128.0 for px, py, pr in placed):
            continue
        placed.append((cx, cy, r))
    if len(placed) < n:  # pragma: no cover - the tissue always has room
        raise RuntimeError(f"could not place informative objects for seed {seed}")
    m = n - 1  # exactly one minority object of another kind: a strict majority, since n >= 3
    majority = np.zeros(n, bool)
    majority[rng.permutation(n)[:m]] = True
    offsets = rng.integers(1, classes, size=n)  # minority kinds relative to the label
    kinds = np.where(majority, label, (label + offsets) % classes)
    objects = np.array([(cx, cy, r, k) for (cx, cy, r), k in zip(placed, kinds)], dtype=np.float64)

    def clear_of_objects(d_fn, extent: float) -> bool:
        return all(d_fn(cx, cy) > r + extent + 24.0 for cx, cy, r in placed)

    # distractors: ~60 % strokes, ~40 % rings; kinds from the seed only
    nd = int(rng.integers(DISTRACTOR_COUNT[0], DISTRACTOR_COUNT[1] + 1))
    rings: list[tuple[float, ...]] = []
    strokes: list[tuple[np.ndarray, float, int]] = []
    for i in range(nd):
        for _ in range(2000):
            kind = int(rng.integers(0, classes))
            if i % 5 in (1, 3):  # ring
                ro = float(rng.uniform(*RING_RADIUS))
                ri = ro - float(rng.uniform(*RING_THICKNESS))
                cx, cy = float(rng.uniform(0, width)), float(rng.uniform(0, height))
                if field(cx, cy) < ro + 16.0:
                    continue
                if not clear_of_objects(lambda ox, oy: math.hypot(ox - cx, oy - cy), ro):
                    continue
                rings.append((cx, cy, ro, ri, kind))
                break
            length = float(rng.uniform(*STROKE_LENGTH))
            hw = 0.5 * float(rng.uniform(*STROKE_WIDTH))
            turn = float(rng.uniform(-2.0, 2.0))  # total turning angle (rad)
            th0 = float(rng.uniform(0, 2 * math.pi))
            x0, y0 = float(rng.uniform(0, width)), float(rng.uniform(0, height))
            t = np.linspace(0.0, 1.0, _STROKE_POINTS)
            ang = th0 + turn * t
            step = length / (_STROKE_POINTS - 1)
            px = x0 + np.concatenate([[0.0], np.cumsum(np.cos(ang[:-1]) * step)])
            py = y0 + np.concatenate([[0.0], np.cumsum(np.sin(ang[:-1]) * step)])
            pts = np.stack([px, py], 1)
            if min(field(a, b) for a, b in pts[::2]) < hw + 16.0:
                continue
            if not clear_of_objects(lambda ox, oy: float(_seg_dist(np.array(ox), np.array(oy), pts)), hw):
                continue
            strokes.append((pts, hw, kind))
            break
    return ObjectsLayout(
        base, label, classes, objects, np.array(rings, dtype=np.float64).reshape(-1, 5), tuple(strokes)
    )


def _kind_sign(kind: int, ix: np.ndarray, iy: np.ndarray) -> np.ndarray:
    """+-1 texture of ``kind`` at integer pixel coordinates (row ``(1, w)``, column ``(h, 1)``); period 4 px,
    zero sum over every aligned 4 x 4 block."""
    if kind == 0:
        t = (iy % 4) // 2 + 0 * ix
    elif kind == 1:
        t = (ix % 4) // 2 + 0 * iy
    elif kind == 2:
        t = (ix // 2 + iy // 2) % 2
    elif kind == 3:
        t = ((ix + iy) % 4) // 2
    else:
        t = ((ix - iy) % 4) // 2
    return t.astype(np.float32) * np.float32(2.0) - np.float32(1.0)


def _paint(
    col: np.ndarray,
    noise: np.ndarray,
    x: int,
    y: int,
    box: tuple[float, float, float, float],
    inside: Callable[[np.ndarray, np.ndarray], np.ndarray],
    kind: int,
) -> None:
    """Composite one ink shape into ``col`` (float32 (h, w, 3) of the window at ``x, y``).

    ``inside(px, py)`` is the shape's signed depth (px, positive inside) at points; ``box`` its level-0 extent.
    """
    h, w = col.shape[:2]
    x0, x1 = max(int(math.floor(box[0])) - 2, x), min(int(math.ceil(box[2])) + 2, x + w)
    y0, y1 = max(int(math.floor(box[1])) - 2, y), min(int(math.ceil(box[3])) + 2, y + h)
    if x0 >= x1 or y0 >= y1:
        return
    ix = np.arange(x0, x1, dtype=np.int64)[None, :]
    iy = np.arange(y0, y1, dtype=np.int64)[:, None]
    depth = inside(ix + 0.5, iy + 0.5)
    a = np.clip(depth + 0.5, 0.0, 1.0).astype(np.float32)
    if not a.any():
        return
    # whole aligned blocks, all opaque: evaluate the depth once per block centre, then expand to pixels
    jx, jy = ix // _TEXTURE_BLOCK, iy // _TEXTURE_BLOCK
    ux = np.arange(jx[0, 0], jx[0, -1] + 1)[None, :]
    uy = np.arange(jy[0, 0], jy[-1, 0] + 1)[:, None]
    benv = inside(ux * _TEXTURE_BLOCK + _TEXTURE_BLOCK / 2.0, uy * _TEXTURE_BLOCK + _TEXTURE_BLOCK / 2.0)
    env = (benv >= _BLOCK_INSET).astype(np.float32)[jy - jy[0, 0], jx - jx[0, 0]]
    target = (_kind_sign(kind, ix, iy) * env)[..., None] * INK_AMPLITUDE
    target += INK_MEAN
    target += noise[y0 - y : y1 - y, x0 - x : x1 - x, None]
    sub = col[y0 - y : y1 - y, x0 - x : x1 - x]
    sub += a[..., None] * (target - sub)


def render_objects_region(layout: ObjectsLayout, x: int, y: int, width: int, height: int) -> np.ndarray:
    """The intended (pre-JPEG) level-0 pixels of a window of an ``objects`` slide (tiling-independent).

    Returns:
        (height, width, 3) uint8 RGB.
    """
    base = render_region(layout.base, x, y, width, height)
    x1, y1 = x + width, y + height
    shapes: list[tuple[tuple[float, float, float, float], Callable, int]] = []
    for cx, cy, r, kind in layout.objects:
        if cx + r + 2 > x and cx - r - 2 < x1 and cy + r + 2 > y and cy - r - 2 < y1:
            shapes.append(
                (
                    (cx - r, cy - r, cx + r, cy + r),
                    lambda px, py, cx=cx, cy=cy, r=r: r - np.hypot(px - cx, py - cy),
                    int(kind),
                )
            )
    for cx, cy, ro, ri, kind in layout.rings:
        if cx + ro + 2 > x and cx - ro - 2 < x1 and cy + ro + 2 > y and cy - ro - 2 < y1:

            def ring(px, py, cx=cx, cy=cy, ro=ro, ri=ri):
                d = np.hypot(px - cx, py - cy)
                return np.minimum(ro - d, d - ri)

            shapes.append(((cx - ro, cy - ro, cx + ro, cy + ro), ring, int(kind)))
    for pts, hw, kind in layout.strokes:
        bx0, by0 = pts[:, 0].min() - hw, pts[:, 1].min() - hw
        bx1, by1 = pts[:, 0].max() + hw, pts[:, 1].max() + hw
        if bx1 + 2 > x and bx0 - 2 < x1 and by1 + 2 > y and by0 - 2 < y1:
            shapes.append(
                ((bx0, by0, bx1, by1), lambda px, py, pts=pts, hw=hw: hw - _seg_dist(px, py, pts, hw + 8.0), int(kind))
            )
    if not shapes:
        return base
    col = base.astype(np.float32)
    tex = _noise_texture(layout.base.hash_seed)
    ix = np.arange(x, x1, dtype=np.int64)
    iy = np.arange(y, y1, dtype=np.int64)
    px, py = x % _NOISE_PERIOD, y % _NOISE_PERIOD
    if px + width <= _NOISE_PERIOD and py + height <= _NOISE_PERIOD:
        noise = tex[py : py + height, px : px + width]
    else:
        noise = tex[np.ix_(iy % _NOISE_PERIOD, ix % _NOISE_PERIOD)]
    for box, inside, kind in shapes:
        _paint(col, noise, x, y, box, inside, kind)
    col += np.float32(0.5)
    np.clip(col, 0, 255, out=col)
    return col.astype(np.uint8)
