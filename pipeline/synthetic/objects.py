"""The ``objects`` task family: the label is the kind of the majority of a few small textured objects.

Unlike the checker family (:mod:`pipeline.synthetic.checker`) in what carries the label:

* tissue covers most of the slide (~80-90 %, so the tissue mask cannot narrow the search), with the same
  H&E-like background as the checker task (colour drift, nuclei, noise);
* 3..6 small round *informative objects* (diameter 40..52 px), each of a *kind* = a fine texture of period
  4 px on the same mean ink colour: horizontal stripes, vertical stripes, checkerboard, diagonal stripes,
  antidiagonal stripes (``OBJECT_KINDS``; the first ``classes`` are used). The label is the kind of the
  majority of the informative objects; every slide also holds exactly one object of another kind (so finding
  one object is not enough: the majority is n - 1 of n);
* 20..60 *distractors* with the same ink colour and textures of random kinds (drawn from the seed, never
  from the label): elongated curved strokes (160..480 px long, 10..16 px wide) and rings (outer diameter
  96..160 px, 10..14 px thick). At 1/16 scale distractors are faint lines and rings, informative objects
  compact 2.5..3.3 px dots: a low-resolution scorer can learn where to look, but only full-resolution patches
  tell which kind an object is.

The texture is added on whole aligned 4 x 4 blocks only (a block is textured only when it lies entirely
inside the shape's opaque part), and every kind sums to zero over an aligned 4 x 4 block; so the 1/4, 1/8,
1/16 levels (exact box downsamples) of two slides with the same seed and different labels are identical up
to rounding and JPEG noise. The layout (tissue, positions, sizes, which objects are in the majority,
distractor kinds) depends on the seed only; the label only decides which kind the majority has and, via
a fixed offset, which kinds the minority have.

Coordinates are level-0 pixels, as in :mod:`pipeline.synthetic.checker`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    _disk_box,
    _draw_waves,
    _noise_texture,
    _tissue_field,
    render_region,
)

__all__ = [
    "OBJECT_KINDS",
    "OBJECTS_DEFAULT_SIZE",
    "OBJECTS_MIN_CLASSES",
    "OBJECTS_MAX_CLASSES",
    "ObjectsLayout",
    "check_classes",
    "object_class_names",
    "make_objects_layout",
    "render_objects_region",
]

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


def check_classes(classes: Any) -> int:
    """Validate the number of classes of the ``objects`` task; returns it as an int."""
    kinds = f"kinds {OBJECT_KINDS[:OBJECTS_MAX_CLASSES]}"
    return _check_class_count(classes, OBJECTS_MIN_CLASSES, OBJECTS_MAX_CLASSES, "objects", kinds)


def object_class_names(classes: int) -> tuple[str, ...]:
    """Class names of the ``objects`` task with ``classes`` classes (index -> name)."""
    return OBJECT_KINDS[: check_classes(classes)]


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
            out.append(
                {
                    **_disk_box(cx, cy, r),
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
            out.append(
                {
                    **_disk_box(cx, cy, ro),
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
    classes = check_classes(classes)
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
