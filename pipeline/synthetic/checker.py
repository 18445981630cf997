"""The ``checker`` task family, and the H&E-like tissue background every family paints on.

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

The tissue background (:class:`SlideLayout` without structures, drawn by :func:`render_region`) is what the
other families (:mod:`pipeline.synthetic.objects`) paint their own shapes on; the slide side limits
(``MIN_SIDE``, ``MAX_SIDE``) and the integer argument check are shared with them, the writer and the archive.

Coordinates are level-0 pixels, ``(x, y)`` and ``(width, height)`` as OpenSlide uses them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MIN_SIDE",
    "MAX_SIDE",
    "SlideLayout",
    "make_layout",
    "render_region",
]

MIN_SIDE = 2000
MAX_SIDE = 100_000

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
            out.append(
                {
                    **_disk_box(cx, cy, r),
                    "cx": float(cx),
                    "cy": float(cy),
                    "radius": float(r),
                    "textured": bool(self.label),
                }
            )
        return out


def _check_class_count(classes: Any, lo: int, hi: int, task: str, allowed: str) -> int:
    """``classes`` as an int in ``[lo, hi]`` for ``task``, else ValueError naming the range and ``allowed``."""
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or not lo <= int(classes) <= hi:
        raise ValueError(f"classes must be an int in [{lo}, {hi}] for task {task!r} ({allowed}), got {classes!r}")
    return int(classes)


def _disk_box(cx: float, cy: float, r: float) -> dict[str, int]:
    """The integer level-0 box ``x, y, width, height`` enclosing the disk of radius ``r`` at ``(cx, cy)``."""
    x0, y0 = int(math.floor(cx - r)), int(math.floor(cy - r))
    x1, y1 = int(math.ceil(cx + r)), int(math.ceil(cy + r))
    return {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}


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
