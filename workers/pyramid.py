"""Pure pyramid planning (no I/O): which levels a store gets and which regions write them, and the one 2x
downsampler every pyramid uses.

A slide is cut into *regions*: square blocks of ``region_tiles x region_tiles`` chunks (default 8x8 of
256 px = 2048 px). Regions run in *stages*:

- stage 0 reads each block of level 0 from the source **once** and writes it to level 0 and to its
  downsampled contributions to levels ``1..k`` (``k = log2(region_tiles)``); every chunk of those levels
  belongs to exactly one region, so regions write straight into the store with no locks;
- stage ``s > 0`` reads blocks of the last level written from the **store** (never the source again) and
  writes the next ``k`` levels, until the smallest level is at most ``min_size`` px a side.

With JPEG passthrough (``--codec auto`` or ``jpeg`` and a source whose level-0 tiles are JPEG of the chunk size),
stage 0 instead *copies* the compressed tiles of the source's own pyramid levels into the store chunks, in blocks
``COPY_BLOCK_FACTOR`` times a region's side (a copy is a few ms of work per region: fewer, larger tasks), and later
stages add power-of-two levels below the source's smallest one.

Frames (see :mod:`workers.frames`): a :class:`Region`'s ``box`` is always in pixels of store level
``Region.level`` (0 for a source read, the level read for a store read, the level written for a copy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from workers.frames import Box

__all__ = [
    "pyramid_shapes",
    "downsample2x",
    "Reducer",
    "Region",
    "SlidePlan",
    "LevelPlan",
    "plan_levels",
    "plan_stages",
    "level_shard_sides",
    "blocks",
    "COPY_BLOCK_FACTOR",
]

COPY_BLOCK_FACTOR = 4  # a copy region is this many region sides a side (16x the chunks of a decoding region)


def pyramid_shapes(level0_size: tuple[int, int], *, min_size: int = 1024) -> list[tuple[int, tuple[int, int]]]:
    """Power-of-two pyramid: ``[(downsample, (width, height)), ...]`` from level 0 down to the
    first level whose longer side is at most ``min_size`` (so the smallest is about 1-2k px for
    ``min_size=1024``). Sizes round up (``ceil``), matching a 2x2 mean with edge padding."""
    w, h = int(level0_size[0]), int(level0_size[1])
    if w < 1 or h < 1:
        raise ValueError(f"level0_size must be positive (width, height), got {level0_size!r}")
    out = [(1, (w, h))]
    ds = 1
    while max(w, h) > min_size:
        ds *= 2
        w, h = math.ceil(w / 2), math.ceil(h / 2)
        out.append((ds, (w, h)))
    return out


def downsample2x(hwc: np.ndarray) -> np.ndarray:
    """2x2 mean of an (h, w, 3) uint8 image, rounded half up, odd edges averaged over the pixels present
    (the same as padding by edge replication). Pillow's ``Image.reduce(2)`` (C, SIMD); the one 2x
    downsampler of every store pyramid (:class:`Reducer` applies it to reused images)."""
    from PIL import Image

    return np.asarray(Image.fromarray(np.ascontiguousarray(hwc), "RGB").reduce(2))


class Reducer:
    """2x reductions of blocks through Pillow with reused images (no fresh 16 MB image per block).

    Same arithmetic as :func:`downsample2x` (``Image.reduce(2)``); levels are chained as Pillow images, so
    only the chunks' numpy views are converted back.
    """

    def __init__(self) -> None:
        self._images: dict[tuple[int, int], Any] = {}

    def load(self, hwc: np.ndarray) -> Any:
        """A Pillow RGB image holding ``hwc`` ((h, w, 3) uint8, C-contiguous), reused per size."""
        from PIL import Image

        h, w = hwc.shape[:2]
        img = self._images.get((w, h))
        if img is None:
            if len(self._images) >= 4:  # full blocks plus edge blocks; ~16 MB each (Pillow stores RGBX)
                self._images.clear()
            img = self._images[(w, h)] = Image.new("RGB", (w, h))
        img.frombytes(hwc if hwc.flags.c_contiguous else np.ascontiguousarray(hwc))
        return img


def blocks(width: int, height: int, block: int) -> list[tuple[int, int, int, int]]:
    return [
        (x, y, min(block, width - x), min(block, height - y))
        for y in range(0, height, block)
        for x in range(0, width, block)
    ]


@dataclass(frozen=True)
class Region:
    """One unit of work.

    Attributes:
        stage, index: its place in the plan (``key`` = ``s<stage>_r<index>``).
        kind: ``"source"`` (read level 0 from the slide), ``"store"`` (read store level ``level``) or
            ``"copy"`` (copy the source's JPEG tiles of OpenSlide level ``src_level`` into store level ``level``).
        src_level: OpenSlide level copied (``"copy"``), else -1.
        level: the store level whose pixels ``box`` is in (0 for ``"source"``).
        box: the block, in pixels of store level ``level``.
        out_levels: store levels written.
    """

    stage: int
    index: int
    kind: str
    src_level: int
    level: int
    box: Box
    out_levels: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"s{self.stage}_r{self.index}"

    @property
    def pixels(self) -> int:
        return self.box.width * self.box.height

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["box"] = list(self.box)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Region:
        return cls(**{**d, "box": Box(*d["box"]), "out_levels": tuple(d["out_levels"])})


@dataclass
class SlidePlan:
    """Everything the region writers need (stored as ``foveate_plan.json`` in the store)."""

    slide_id: str
    store_path: str
    source_path: str
    source: str
    info: dict[str, Any]
    options: dict[str, Any]
    level_shapes: list[tuple[int, int]]  # (width, height) per store level
    downsamples: list[float]
    level_codecs: list[str]  # per level: "zstd", "jpeg" or "passthrough:<colorspace>"
    source_levels: list[int | None]  # per store level: OpenSlide level copied (passthrough) or None
    mpp: tuple[float, float] | None
    stages: list[list[Region]] = field(default_factory=list)
    todo: list[list[Region]] = field(default_factory=list)  # not yet done (filled by plan())
    resumed_regions: int = 0
    files: tuple[str, ...] = ()
    shard_sides: list[int] | None = None  # per level: shard side in px (one shard per region), None: unsharded

    def identity(self) -> dict[str, Any]:
        """What must match for a partially written store to be resumed."""
        opts = {k: v for k, v in self.options.items() if k != "threads"}  # threads never change the bytes
        return {
            "fingerprint": self.info["fingerprint"],
            "options": opts,
            "level_shapes": [list(s) for s in self.level_shapes],
            "downsamples": self.downsamples,
            "level_codecs": self.level_codecs,
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("todo")
        d["stages"] = [[r.to_json() for r in st] for st in self.stages]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SlidePlan:
        d = dict(d)
        d["stages"] = [[Region.from_json(r) for r in st] for st in d["stages"]]
        d["level_shapes"] = [tuple(s) for s in d["level_shapes"]]
        d["mpp"] = tuple(d["mpp"]) if d.get("mpp") else None
        d["files"] = tuple(d.get("files") or ())
        return cls(**d)

    @property
    def tile(self) -> int:
        return int(self.options["tile_size"])


@dataclass
class LevelPlan:
    """The store levels of one slide: per level its ``(width, height)``, downsample, codec (``"zstd"``,
    ``"jpeg"`` or ``"passthrough:<colorspace>"``) and the OpenSlide level copied into it (passthrough) or None."""

    shapes: list[tuple[int, int]]
    downsamples: list[float]
    codecs: list[str]
    source_levels: list[int | None]

    @property
    def passthrough(self) -> bool:
        return any(s is not None for s in self.source_levels)


def plan_levels(
    size_l0: tuple[int, int],
    *,
    tile: int,
    min_size: int,
    codec: str,
    jpeg_levels: list | None = None,
    level_dimensions: list | None = None,
    level_downsamples: list | None = None,
) -> LevelPlan:
    """Store levels for a slide whose (resampled) level 0 is ``size_l0``. With ``jpeg_levels`` (the source's
    per-level ``(tile_w, tile_h, colorspace)`` or None, only when passthrough applies) the source's own levels
    of ``tile``-px JPEG tiles are copied, then power-of-two levels follow down to ``min_size``."""
    shapes: list[tuple[int, int]] = []
    downs: list[float] = []
    codecs: list[str] = []
    src_levels: list[int | None] = []
    jl = jpeg_levels
    if jl:
        for lvl, spec in enumerate(jl):
            if spec is None or spec[0] != tile or spec[1] != tile:
                break
            if shapes and max(shapes[-1]) <= min_size:
                break
            shapes.append(tuple(level_dimensions[lvl]))
            downs.append(float(level_downsamples[lvl]))
            codecs.append(f"passthrough:{spec[2]}")
            src_levels.append(lvl)
        while max(shapes[-1]) > min_size:
            w, h = shapes[-1]
            shapes.append((math.ceil(w / 2), math.ceil(h / 2)))
            downs.append(downs[-1] * 2)
            codecs.append("jpeg")
            src_levels.append(None)
    else:
        for ds, (w, h) in pyramid_shapes(size_l0, min_size=min_size):
            shapes.append((w, h))
            downs.append(float(ds))
            codecs.append(codec)
            src_levels.append(None)
    return LevelPlan(shapes, downs, codecs, src_levels)


def plan_stages(levels: LevelPlan, *, tile: int, region_tiles: int) -> list[list[Region]]:
    """The regions of each stage (see the module doc)."""
    t, kmax = tile, int(math.log2(region_tiles))
    shapes, src_levels = levels.shapes, levels.source_levels
    stages: list[list[Region]] = []
    if levels.passthrough:
        st0: list[Region] = []
        for lvl, sl in enumerate(src_levels):
            if sl is None:
                continue
            w, h = shapes[lvl]
            for x, y, bw, bh in blocks(w, h, t * region_tiles * COPY_BLOCK_FACTOR):
                st0.append(Region(0, len(st0), "copy", sl, lvl, Box(x, y, bw, bh), (lvl,)))
        stages.append(st0)
        done_to = max(i for i, sl in enumerate(src_levels) if sl is not None)
    else:
        k = min(kmax, len(shapes) - 1)
        size = t * (1 << k)
        w0, h0 = shapes[0]
        stages.append(
            [
                Region(0, i, "source", -1, 0, Box(x, y, bw, bh), tuple(range(0, k + 1)))
                for i, (x, y, bw, bh) in enumerate(blocks(w0, h0, size))
            ]
        )
        done_to = k
    while done_to < len(shapes) - 1:
        k = max(1, min(kmax, len(shapes) - 1 - done_to))
        w, h = shapes[done_to]
        size = t * (1 << k)
        s = len(stages)
        stages.append(
            [
                Region(s, i, "store", -1, done_to, Box(x, y, bw, bh), tuple(range(done_to + 1, done_to + k + 1)))
                for i, (x, y, bw, bh) in enumerate(blocks(w, h, size))
            ]
        )
        done_to += k
    return stages


def level_shard_sides(stages: list[list[Region]], level_shapes: list[tuple[int, int]], *, tile: int) -> list[int]:
    """Per store level, the side in pixels of the shard that one region of ``stages`` writes on it: the
    region's full block (``tile * region_tiles`` on the level it reads) halved once per level below it, cut to
    the level's longer side rounded up to whole chunks. Every region's box on that level then lies in exactly
    one shard (regions start on multiples of the block size), so a region writes each of its levels as one
    object, and no two regions share one."""
    t = int(tile)
    sides: list[int] = [0] * len(level_shapes)
    groups: dict[tuple[int, int], list[Region]] = {}
    for st in stages:
        for r in st:  # (a passthrough stage copies several levels: one group per level read)
            groups.setdefault((r.stage, r.level), []).append(r)
    for (_, base), regs in groups.items():
        full = max(max(r.box.width, r.box.height) for r in regs)
        full = t * (1 << max(0, math.ceil(math.log2(-(-full // t)))))  # the block size (a power of two)
        for lvl in regs[0].out_levels:
            side = full >> (lvl - base) if lvl > base else full
            w, h = level_shapes[lvl]
            sides[lvl] = max(t, min(side, -(-max(w, h) // t) * t))
    if any(s == 0 for s in sides):
        raise ValueError(f"level_shard_sides: no region writes level {sides.index(0)}")
    return sides
