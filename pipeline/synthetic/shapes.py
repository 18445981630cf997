"""The ``shapes`` task family: the label is the identity of the majority of a few small hand-drawn-like glyphs.

What carries the label, and what does not:

* the background is the objects family's tissue (:mod:`pipeline.synthetic.objects`: ~80-90 % of the slide is
  H&E-like tissue with colour drift, nuclei and noise, painted by :mod:`pipeline.synthetic.checker`);
* ``SHAPE_COUNT`` (5) *glyphs*, each a procedural stroke drawing of one of ``SHAPE_CLASSES`` (ring, triangle,
  square, plus, arrow, spiral, star, zigzag, figure-eight, crescent; the first ``classes`` are used):
  ``MAJORITY_COUNT`` (3) of the slide's class (the label) and 2 of other classes (``(label + o) % classes``
  with a seed-drawn offset ``o`` in ``1..classes-1`` each). Their boxes are 24..64 level-0 px on a side, at
  least ``SHAPE_GAP`` (48) px apart, inside the tissue;
* *distractors*: ``DISTRACTOR_DENSITY`` (30..80, drawn per slide) open strokes per megapixel of tissue, of the
  same size and ink, that are no class's glyph: arcs (at most 200 degrees, open), smooth waves, two-segment
  bends, hooks and smooth scribbles, drawn with a finer pen (``DISTRACTOR_STROKE_WIDTH`` 1.5..3 px against the
  glyphs' ``GLYPH_STROKE_WIDTH`` 5..8 px). Every distractor's box keeps at least 6 px from every other box,
  glyph or distractor (so a glyph is no more isolated than a distractor).

Why the glyphs are bolder than the distractors: as a mitotic figure is darker than the nuclei around it, a glyph
is *where to look* at low resolution (a darker smudge at the scorer's 1/16), but *what it is* only shows at full
resolution. In the family's first version (every stroke 2..5 px) nothing at 1/16 told the 5 glyphs from the ~300
strokes, and a scorer on the low-resolution view could not find them by construction (``benchmarks/RESULTS.md``,
"The shape family"); the held-out glyph task the family stands for has glyphs a low-resolution scorer does find.

Every stroke, glyph or distractor, is drawn the same way: the drawing's polylines in a unit box (``[-1, 1]^2``,
resampled every 0.1), a smooth elastic displacement (3 random plane waves per axis, 0.03..0.06 each), a
random affine (glyphs: rotation within +-25 degrees, distractors: any rotation; shear within +-0.3, aspect
``exp(+-0.2)``), scaled to a random size (larger side 30..61 px including the stroke, smaller side at least
25 px), and rendered anti-aliased (coverage = ``clip(half_width - distance + 0.5, 0, 1)``) with a per-instance
stroke width (above) in one flat ink colour (``INK``, plus the tissue's per-pixel noise). So neither colour,
texture, size nor stroke width tells one glyph class from another: only the drawing does, and the per-instance
distortion keeps a fixed template from matching it exactly.

The layout (tissue, the glyphs' places, which of them are the majority, every distortion, the distractors)
depends on the seed only; the label decides which drawings the glyphs are (and through that each glyph's box:
its larger side is drawn from the seed, the smaller one follows the distorted drawing). Coordinates are level-0
pixels, as in :mod:`pipeline.synthetic.checker`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.synthetic.checker import (
    _NOISE_PERIOD,
    MAX_SIDE,
    MIN_SIDE,
    SlideLayout,
    _check_class_count,
    _check_int,
    _noise_texture,
    _tissue_field,
    render_region,
)
from pipeline.synthetic.objects import _objects_base

__all__ = [
    "SHAPE_CLASSES",
    "SHAPES_DEFAULT_CLASSES",
    "SHAPES_DEFAULT_SIZE",
    "SHAPES_MIN_CLASSES",
    "SHAPES_MAX_CLASSES",
    "SHAPE_COUNT",
    "MAJORITY_COUNT",
    "GLYPH_STROKE_WIDTH",
    "DISTRACTOR_STROKE_WIDTH",
    "ShapesLayout",
    "check_shape_classes",
    "shape_class_names",
    "make_shapes_layout",
    "render_shapes_region",
]

SHAPE_CLASSES = (
    "ring",
    "triangle",
    "square",
    "plus",
    "arrow",
    "spiral",
    "star",
    "zigzag",
    "figure_eight",
    "crescent",
)
SHAPES_MIN_CLASSES, SHAPES_MAX_CLASSES = 2, len(SHAPE_CLASSES)
SHAPES_DEFAULT_CLASSES = 4
SHAPES_DEFAULT_SIZE = 8192
SHAPE_COUNT = 5  # glyphs per slide ...
MAJORITY_COUNT = 3  # ... of which this many are of the slide's class (the rest of other classes)
DISTRACTOR_KINDS = ("arc", "wave", "bend", "hook", "scribble")
DISTRACTOR_DENSITY = (30.0, 80.0)  # distractor strokes per megapixel of tissue (drawn per slide)
INK = np.array([62.0, 34.0, 104.0], np.float32)  # every stroke's colour (RGB), plus the tissue's noise
GLYPH_STROKE_WIDTH = (5.0, 8.0)  # px: a glyph is drawn with a bold pen ...
DISTRACTOR_STROKE_WIDTH = (1.5, 3.0)  # px: ... a distractor with a fine one
BOX_SIDE = (24, 64)  # every integer box side (px) lies in this range
_FIT_SIDE = (30.0, 61.0)  # the larger side of a drawing's float extent (stroke included)
_FIT_MIN = 25.0  # the smaller side's lower bound
GLYPH_ROTATION = math.radians(25.0)  # glyphs: rotation within +-25 degrees (distractors: any)
SHEAR = 0.3
ASPECT = 0.2  # log of the x/y aspect factor, within +-0.2
ELASTIC_AMPLITUDE = (0.03, 0.06)  # per wave, in unit-box units (the box is 2 wide)
ELASTIC_WAVENUMBER = (1.0, 2.5)  # rad per unit
_ELASTIC_WAVES = 3  # per axis
_SPACING = 0.1  # unit-box resampling step of every polyline
SHAPE_GAP = 48.0  # px at least between the boxes of two glyphs
_GAP = 6.0  # px at least between a distractor's box and any other box
_TISSUE_INSET = 8.0  # px: every box lies this deep inside the tissue field
_GRID = 64  # px: the cell of the placement hash
_SALT = 0x5A4E5


def check_shape_classes(classes: Any) -> int:
    """Validate the number of classes of the ``shapes`` task; returns it as an int."""
    glyphs = f"at most {SHAPES_MAX_CLASSES}: the glyph classes {', '.join(SHAPE_CLASSES)}"
    return _check_class_count(classes, SHAPES_MIN_CLASSES, SHAPES_MAX_CLASSES, "shapes", glyphs)


def shape_class_names(classes: int) -> tuple[str, ...]:
    """Class names of the ``shapes`` task with ``classes`` classes (index -> name)."""
    return SHAPE_CLASSES[: check_shape_classes(classes)]


# ------------------------------------------------------------------------------------------ drawings


def _arc(cx: float, cy: float, r: float, a0: float, a1: float, n: int = 64) -> np.ndarray:
    t = np.linspace(a0, a1, n)
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1)


def _closed(pts: list[tuple[float, float]]) -> np.ndarray:
    return np.array(pts + pts[:1], np.float64)


def _glyph_strokes(name: str) -> list[np.ndarray]:
    """The undistorted drawing of a glyph class: polylines in ``[-1, 1]^2`` (image axes: y down)."""
    if name == "ring":
        return [_arc(0, 0, 1, 0, 2 * math.pi)]
    if name == "triangle":
        return [_closed([(0.0, -1.0), (0.95, 0.75), (-0.95, 0.75)])]
    if name == "square":
        return [_closed([(-0.85, -0.85), (0.85, -0.85), (0.85, 0.85), (-0.85, 0.85)])]
    if name == "plus":
        return [np.array([(-1.0, 0.0), (1.0, 0.0)]), np.array([(0.0, -1.0), (0.0, 1.0)])]
    if name == "arrow":
        return [np.array([(-1.0, 0.0), (1.0, 0.0)]), np.array([(0.3, -0.65), (1.0, 0.0), (0.3, 0.65)])]
    if name == "spiral":
        t = np.linspace(0.0, 1.0, 160)
        r, a = 0.12 + 0.88 * t, 2 * math.pi * 1.75 * t
        return [np.stack([r * np.cos(a), r * np.sin(a)], 1)]
    if name == "star":  # pentagram: every second of 5 points on the circle
        a = -math.pi / 2 + np.arange(6) * (4 * math.pi / 5)
        return [np.stack([np.cos(a), np.sin(a)], 1)]
    if name == "zigzag":
        return [np.array([(-1.0, 0.7), (-0.5, -0.7), (0.0, 0.7), (0.5, -0.7), (1.0, 0.7)])]
    if name == "figure_eight":  # the 1:2 Lissajous curve
        t = np.linspace(0.0, 2 * math.pi, 128)
        return [np.stack([0.7 * np.sin(2 * t), np.sin(t)], 1)]
    if name == "crescent":  # the unit circle's left part minus a disk of radius 0.85 centred at (0.5, 0)
        xi = 0.25 + (1.0 - 0.85**2)  # the circles' crossing: x^2 - (x - 0.5)^2 = 1 - 0.85^2
        yi = math.sqrt(1.0 - xi * xi)
        outer = _arc(0, 0, 1, math.atan2(yi, xi), 2 * math.pi - math.atan2(yi, xi))
        inner_a = math.atan2(yi, xi - 0.5)
        inner = _arc(0.5, 0, 0.85, 2 * math.pi - inner_a, inner_a)
        return [np.concatenate([outer, inner, outer[:1]])]
    raise KeyError(name)  # pragma: no cover - SHAPE_CLASSES is the list


def _distractor_strokes(kind: str, rng: np.random.Generator) -> list[np.ndarray]:
    """A random open stroke of ``kind`` (no class's glyph) in about ``[-1, 1]^2``; draws a fixed number of values."""
    u = rng.uniform(size=16)
    if kind == "arc":  # an open arc, 60..200 degrees: never closes into a ring or a crescent
        span = math.radians(60.0 + 140.0 * u[0])
        return [_arc(0, 0, 1, -span / 2, span / 2)]
    if kind == "wave":  # a smooth sine, 1..2.5 half periods
        x = np.linspace(-1.0, 1.0, 64)
        return [np.stack([x, (0.3 + 0.4 * u[0]) * np.sin(math.pi * (1.0 + 1.5 * u[1]) * (x + 1) / 2 + 6.3 * u[2])], 1)]
    if kind == "bend":  # two straight arms at 40..140 degrees
        ang = math.radians(40.0 + 100.0 * u[0])
        arm = 0.6 + 0.4 * u[1]
        return [np.array([(1.0, 0.0), (0.0, 0.0), (arm * math.cos(ang), arm * math.sin(ang))])]
    if kind == "hook":  # a straight shaft ending in a half turn
        r = 0.3 + 0.2 * u[0]
        shaft = np.array([(0.0, -1.0), (0.0, 0.4)])
        curl = _arc(-r, 0.4, r, 0.0, math.pi * (0.8 + 0.4 * u[1]), 32)
        return [np.concatenate([shaft, curl])]
    # scribble: a smooth curve through 4 random points (a quadratic B-spline's control polygon)
    ctrl = u[8:16].reshape(4, 2) * 2.0 - 1.0
    t = np.linspace(0.0, 1.0, 24)[:, None]
    segs = []
    for i in range(len(ctrl) - 2):
        a, b, c = ctrl[i], ctrl[i + 1], ctrl[i + 2]
        a, c = (a + b) / 2 if i else a, (b + c) / 2 if i < len(ctrl) - 3 else c
        segs.append((1 - t) ** 2 * a + 2 * (1 - t) * t * b + t * t * c)
    return [np.concatenate(segs)]


def _resample(pts: np.ndarray, step: float) -> np.ndarray:
    """The polyline ``pts`` with points inserted so that no segment is longer than ``step``."""
    out = [pts[:1]]
    for a, b in zip(pts[:-1], pts[1:]):
        length = float(np.hypot(*(b - a)))
        if length < 1e-9:  # a repeated point (where two pieces of a drawing meet)
            continue
        n = max(1, int(math.ceil(length / step)))
        out.append(a + (b - a) * (np.arange(1, n + 1)[:, None] / n))
    return np.concatenate(out)


def _distort(
    strokes: list[np.ndarray], rng: np.random.Generator, rotation: float, side: float, half_width: float
) -> list[np.ndarray]:
    """Elastic displacement, affine and size fit of a unit-box drawing (see the module docstring).

    Draws a fixed number of values from ``rng`` (whatever the drawing). Returns the polylines in pixels,
    centred on their extent's centre.
    """
    pts = [_resample(s, _SPACING) for s in strokes]
    k = rng.uniform(*ELASTIC_WAVENUMBER, size=(2, _ELASTIC_WAVES))
    direction = rng.uniform(0.0, 2 * math.pi, size=(2, _ELASTIC_WAVES))
    phase = rng.uniform(0.0, 2 * math.pi, size=(2, _ELASTIC_WAVES))
    amp = rng.uniform(*ELASTIC_AMPLITUDE, size=(2, _ELASTIC_WAVES))
    shear = float(rng.uniform(-SHEAR, SHEAR))
    aspect = float(math.exp(rng.uniform(-ASPECT, ASPECT)))
    kx, ky = k * np.cos(direction), k * np.sin(direction)
    c, s = math.cos(rotation), math.sin(rotation)
    m = np.array([[c, -s], [s, c]]) @ np.array([[aspect, shear], [0.0, 1.0 / aspect]])
    out = []
    for p in pts:
        arg = p[:, 0:1, None] * kx[None] + p[:, 1:2, None] * ky[None] + phase[None]  # (P, 2 axes, waves)
        disp = (amp[None] * np.sin(arg)).sum(-1)  # (P, 2)
        out.append((p + disp) @ m.T)
    allp = np.concatenate(out)
    lo, hi = allp.min(0), allp.max(0)
    centre, ext = (lo + hi) / 2, np.maximum(hi - lo, 1e-6)
    scale = (side - 2 * half_width) / float(ext.max())
    fit = np.maximum(scale, (_FIT_MIN - 2 * half_width) / ext)  # a thin drawing is widened to the smallest side
    return [(p - centre) * fit for p in out]


# -------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ShapesLayout:
    """Everything that decides a ``shapes`` slide's pixels. Built by :func:`make_shapes_layout`.

    Attributes:
        base: the background (tissue, colour drift, nuclei, noise) as a :class:`SlideLayout` without structures.
        label: class index in ``[0, classes)`` (= the majority glyphs' class).
        classes: number of classes.
        glyph_classes: (SHAPE_COUNT,) int64 class index of each glyph.
        strokes: per drawing (the ``SHAPE_COUNT`` glyphs first, then the distractors) a tuple of (P, 2) float64
            level-0 polylines.
        half_widths: (n,) float64 stroke half widths, in the order of ``strokes``.
        boxes: (n, 4) float64 ``x0, y0, x1, y1`` extents (stroke included), in the order of ``strokes``.
        rotations: (n,) float64 rotation of each drawing in degrees.
        distractor_kinds: the kind (a ``DISTRACTOR_KINDS`` name) of each distractor.
    """

    base: SlideLayout
    label: int
    classes: int
    glyph_classes: np.ndarray
    strokes: tuple
    half_widths: np.ndarray
    boxes: np.ndarray
    rotations: np.ndarray
    distractor_kinds: tuple

    @property
    def width(self) -> int:
        return self.base.width

    @property
    def height(self) -> int:
        return self.base.height

    @property
    def seed(self) -> int:
        return self.base.seed

    def _box(self, i: int) -> dict[str, Any]:
        x0, y0, x1, y1 = self.boxes[i]
        ix0, iy0 = int(math.floor(x0)), int(math.floor(y0))
        ix1, iy1 = int(math.ceil(x1)), int(math.ceil(y1))
        return {
            "x": ix0,
            "y": iy0,
            "width": ix1 - ix0,
            "height": iy1 - iy0,
            "cx": float((x0 + x1) / 2),
            "cy": float((y0 + y1) / 2),
            "stroke_width": float(2 * self.half_widths[i]),
            "rotation": float(self.rotations[i]),
        }

    def structure_boxes(self) -> list[dict[str, Any]]:
        """The glyphs as level-0 boxes (``x, y, width, height`` enclosing the ink) plus ``cx, cy``, ``class``
        (its name; also as ``kind``, the key the benchmarks' kind vote reads), ``class_index``, ``majority``
        (of the slide's class), ``informative`` (always true), ``stroke_width`` and ``rotation`` (degrees)."""
        out = []
        for i, c in enumerate(self.glyph_classes):
            b = self._box(i)
            name = SHAPE_CLASSES[int(c)]
            b.update(
                {
                    "class": name,
                    "class_index": int(c),
                    "kind": name,
                    "majority": bool(int(c) == self.label),
                    "informative": True,
                }
            )
            out.append(b)
        return out

    def distractor_boxes(self) -> list[dict[str, Any]]:
        """The distractor strokes as level-0 boxes plus ``cx, cy``, ``shape`` (a ``DISTRACTOR_KINDS`` name),
        ``stroke_width`` and ``rotation`` (degrees)."""
        out = []
        for j, kind in enumerate(self.distractor_kinds):
            b = self._box(SHAPE_COUNT + j)
            b["shape"] = kind
            out.append(b)
        return out

    def sidecar_info(self) -> dict[str, Any]:
        names = SHAPE_CLASSES[: self.classes]
        counts = np.bincount(self.glyph_classes, minlength=self.classes)
        return {
            "task": "shapes",
            "classes": self.classes,
            "class_names": list(names),
            "label": names[self.label],
            "label_index": self.label,
            "class_counts": {n: int(counts[i]) for i, n in enumerate(names)},
            "majority_count": MAJORITY_COUNT,
            "distractors": self.distractor_boxes(),
        }


class _Placer:
    """Axis-aligned squares (centre, side) at least ``_GAP`` apart; a hash of ``_GRID`` px cells finds the
    neighbours (two squares of side <= 64 that are closer than ``_GAP`` are at most 2 cells apart)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[int, int], list[tuple[float, float, float]]] = {}

    def free(self, cx: float, cy: float, side: float) -> bool:
        gx, gy = int(cx // _GRID), int(cy // _GRID)
        for dx in range(-2, 3):
            for dy in range(-2, 3):
                for ox, oy, oside in self.cells.get((gx + dx, gy + dy), ()):
                    if max(abs(cx - ox), abs(cy - oy)) < (side + oside) / 2 + _GAP:
                        return False
        return True

    def add(self, cx: float, cy: float, side: float) -> None:
        self.cells.setdefault((int(cx // _GRID), int(cy // _GRID)), []).append((cx, cy, side))


def _tissue_megapixels(base: SlideLayout) -> float:
    n = 128
    gx = (np.arange(n) + 0.5) * (base.width / n)
    gy = (np.arange(n) + 0.5) * (base.height / n)
    xs, ys = np.meshgrid(gx, gy)
    inside = float((_tissue_field(base, xs.ravel(), ys.ravel()) > 0).mean())
    return inside * base.width * base.height / 1e6


def make_shapes_layout(
    width: int, height: int, label: int, seed: int, classes: int = SHAPES_DEFAULT_CLASSES
) -> ShapesLayout:
    """Draw a ``shapes`` slide from ``seed``; ``label`` (class index) only picks the glyphs' drawings.

    The glyphs' places, which ``MAJORITY_COUNT`` of them are of class ``label``, the other glyphs' class offsets,
    every distortion and every distractor come from the seed.
    """
    width = _check_int("width", width, MIN_SIDE, MAX_SIDE)
    height = _check_int("height", height, MIN_SIDE, MAX_SIDE)
    classes = check_shape_classes(classes)
    label = _check_int("label", label, 0, classes - 1)
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SALT]))
    base = _objects_base(width, height, seed, rng)
    placer = _Placer()

    # the glyphs: each one's distortion from its own stream (seed only), then places, majority and classes.
    # A glyph's larger side is its drawn size, so its place (a square of that side + 2) is known before its
    # class: a glyph keeps the same distance from the distractors as they keep from one another
    glyph_rngs = [np.random.default_rng(np.random.SeedSequence([seed, _SALT, 1, i])) for i in range(SHAPE_COUNT)]
    params = [
        (
            float(g.uniform(-GLYPH_ROTATION, GLYPH_ROTATION)),
            float(g.uniform(*_FIT_SIDE)),
            0.5 * float(g.uniform(*GLYPH_STROKE_WIDTH)),
        )
        for g in glyph_rngs
    ]
    centres: list[tuple[float, float]] = []
    for _ in range(20000):
        if len(centres) == SHAPE_COUNT:
            break
        side = params[len(centres)][1] + 2.0
        cx, cy = float(rng.uniform(0, width)), float(rng.uniform(0, height))
        if _tissue_field(base, np.array([cx]), np.array([cy]))[0] < side / math.sqrt(2) + _TISSUE_INSET:
            continue
        if any(
            max(abs(cx - ox), abs(cy - oy)) < (side + params[j][1] + 2.0) / 2 + SHAPE_GAP
            for j, (ox, oy) in enumerate(centres)
        ):
            continue
        placer.add(cx, cy, side)
        centres.append((cx, cy))
    if len(centres) < SHAPE_COUNT:  # pragma: no cover - the tissue always has room
        raise RuntimeError(f"could not place the glyphs for seed {seed}")
    majority = np.zeros(SHAPE_COUNT, bool)
    majority[rng.permutation(SHAPE_COUNT)[:MAJORITY_COUNT]] = True
    offsets = rng.integers(1, classes, size=SHAPE_COUNT)
    glyph_classes = np.where(majority, label, (label + offsets) % classes).astype(np.int64)

    strokes: list[tuple[np.ndarray, ...]] = []
    half_widths: list[float] = []
    boxes: list[tuple[float, float, float, float]] = []
    rotations: list[float] = []

    def add(polys: list[np.ndarray], cx: float, cy: float, hw: float, rotation: float) -> None:
        polys = [p + (cx, cy) for p in polys]
        allp = np.concatenate(polys)
        lo, hi = allp.min(0) - hw, allp.max(0) + hw
        strokes.append(tuple(polys))
        half_widths.append(hw)
        boxes.append((float(lo[0]), float(lo[1]), float(hi[0]), float(hi[1])))
        rotations.append(math.degrees(rotation))

    for (cx, cy), c, g, (rotation, side, hw) in zip(centres, glyph_classes, glyph_rngs, params):
        polys = _distort(_glyph_strokes(SHAPE_CLASSES[int(c)]), g, rotation, side, hw)
        add(polys, cx, cy, hw, rotation)

    # distractors: candidate places in batches (tissue depth vectorised), accepted in order while they fit
    target = int(round(float(rng.uniform(*DISTRACTOR_DENSITY)) * _tissue_megapixels(base)))
    kinds: list[str] = []
    tries = 0
    while len(kinds) < target and tries < 20 * target + 1000:
        n = 1024
        cxs, cys = rng.uniform(0, width, n), rng.uniform(0, height, n)
        sides = rng.uniform(*_FIT_SIDE, n)
        depth = _tissue_field(base, cxs, cys)
        for cx, cy, side, d in zip(cxs, cys, sides, depth):
            tries += 1
            if len(kinds) == target:
                break
            box = side + 2.0  # the integer box's bound
            if d < box / math.sqrt(2) + _TISSUE_INSET:
                continue
            if not placer.free(float(cx), float(cy), box):
                continue
            placer.add(float(cx), float(cy), box)
            kind = DISTRACTOR_KINDS[int(rng.integers(len(DISTRACTOR_KINDS)))]
            rotation = float(rng.uniform(0.0, 2 * math.pi))
            hw = 0.5 * float(rng.uniform(*DISTRACTOR_STROKE_WIDTH))
            polys = _distort(_distractor_strokes(kind, rng), rng, rotation, float(side), hw)
            add(polys, float(cx), float(cy), hw, rotation)
            kinds.append(kind)
    return ShapesLayout(
        base,
        label,
        classes,
        glyph_classes,
        tuple(strokes),
        np.array(half_widths, np.float64),
        np.array(boxes, np.float64).reshape(-1, 4),
        np.array(rotations, np.float64),
        tuple(kinds),
    )


# ----------------------------------------------------------------------------------------- rendering


def _polyline_distance(px: np.ndarray, py: np.ndarray, pts: np.ndarray, reach: float) -> np.ndarray:
    """Distance from the pixel centres ``px`` (1, w) x ``py`` (h, 1) to the polyline ``pts`` (P, 2), all segments
    at once; segments farther than ``reach`` from the pixels' bounding box are skipped (``inf`` where none is
    near, lower bounds beyond ``reach``)."""
    a, b = pts[:-1], pts[1:]
    near = (
        (np.minimum(a[:, 0], b[:, 0]) - reach <= px[0, -1])
        & (np.maximum(a[:, 0], b[:, 0]) + reach >= px[0, 0])
        & (np.minimum(a[:, 1], b[:, 1]) - reach <= py[-1, 0])
        & (np.maximum(a[:, 1], b[:, 1]) + reach >= py[0, 0])
    )
    if not near.any():
        return np.full((py.shape[0], px.shape[1]), np.inf)
    a, b = a[near], b[near]
    d = b - a
    ll = np.maximum((d * d).sum(1), 1e-12)[:, None, None]
    ax, ay = a[:, 0, None, None], a[:, 1, None, None]
    dx, dy = d[:, 0, None, None], d[:, 1, None, None]
    rx, ry = px[None] - ax, py[None] - ay  # (S, 1, w), (S, h, 1)
    t = np.clip((rx * dx + ry * dy) / ll, 0.0, 1.0)
    ex, ey = rx - t * dx, ry - t * dy
    return np.sqrt((ex * ex + ey * ey).min(0))


def render_shapes_region(layout: ShapesLayout, x: int, y: int, width: int, height: int) -> np.ndarray:
    """The intended (pre-JPEG) level-0 pixels of a window of a ``shapes`` slide (tiling-independent).

    Returns:
        (height, width, 3) uint8 RGB.
    """
    base = render_region(layout.base, x, y, width, height)
    x1, y1 = x + width, y + height
    b = layout.boxes
    hit = np.flatnonzero((b[:, 2] + 1 > x) & (b[:, 0] - 1 < x1) & (b[:, 3] + 1 > y) & (b[:, 1] - 1 < y1))
    if not len(hit):
        return base
    col = base.astype(np.float32)
    tex = _noise_texture(layout.base.hash_seed)
    for i in hit:
        bx0, by0, bx1, by1 = b[i]
        px0, px1 = max(int(math.floor(bx0)), x), min(int(math.ceil(bx1)), x1)
        py0, py1 = max(int(math.floor(by0)), y), min(int(math.ceil(by1)), y1)
        if px0 >= px1 or py0 >= py1:
            continue
        hw = float(layout.half_widths[i])
        px = np.arange(px0, px1, dtype=np.float64)[None, :] + 0.5
        py = np.arange(py0, py1, dtype=np.float64)[:, None] + 0.5
        dist = None
        for poly in layout.strokes[i]:
            d = _polyline_distance(px, py, poly, hw + 1.0)
            dist = d if dist is None else np.minimum(dist, d)
        a = np.clip(hw - dist + 0.5, 0.0, 1.0).astype(np.float32)
        if not a.any():
            continue
        noise = tex[np.ix_(np.arange(py0, py1) % _NOISE_PERIOD, np.arange(px0, px1) % _NOISE_PERIOD)]
        sub = col[py0 - y : py1 - y, px0 - x : px1 - x]
        sub += a[..., None] * ((INK + noise[..., None]) - sub)
    col += np.float32(0.5)
    np.clip(col, 0, 255, out=col)
    return col.astype(np.uint8)
