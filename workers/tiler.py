"""The tiler: plans a slide's store, writes its regions, finalises it (one plain class, no Ray).

A slide is cut into *regions*: square blocks of ``region_tiles x region_tiles`` chunks (default 8x8 of
256 px = 2048 px). Regions run in *stages*:

- stage 0 reads each block of level 0 from the source **once** and writes it to level 0 and to its
  downsampled contributions to levels ``1..k`` (``k = log2(region_tiles)``); every chunk of those levels
  belongs to exactly one region, so regions write straight into the store with no locks;
- stage ``s > 0`` reads blocks of the last level written from the **store** (never the source again) and
  writes the next ``k`` levels, until the smallest level is at most ``min_size`` px a side.

With ``--codec jpeg`` and a source whose level-0 tiles are JPEG of the chunk size, stage 0 instead
*copies* the compressed tiles of the source's own pyramid levels into the store chunks (no decode, no
re-encode), and later stages add power-of-two levels below the source's smallest one.

Each finished region leaves ``foveate_progress/s<stage>_r<index>.done`` in the store; a re-run skips
those (resume at region granularity, same bytes as an uninterrupted run because every region is a
deterministic function of the source). :meth:`Tiler.finalize` writes the tissue mask, the NGFF/foveate
metadata, removes the progress folder and writes ``foveate_complete.json`` last.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workers.ingest_inputs import SlideInput
from workers.ingest_source import SlideOpenError, SlideSource, SourceInfo
from workers.store import (
    COMPLETE_MARKER,
    StoreMeta,
    installed_version,
    ngff_multiscales,
    pyramid_shapes,
    register_codecs,
    write_tissue_labels,
)

__all__ = ["IngestOptions", "Region", "SlidePlan", "Tiler", "PLAN_FILE", "PROGRESS_DIR"]

log = logging.getLogger(__name__)

PLAN_FILE = "foveate_plan.json"
PROGRESS_DIR = "foveate_progress"
CODECS = ("zstd", "jpeg")
ZSTD_MIN_LEVEL = -131072  # zstd's fastest ("negative") level; any level decodes with plain zstd


@dataclass(frozen=True)
class IngestOptions:
    """Options of one ingest run (see ``foveate ingest --help``)."""

    tile_size: int = 256
    codec: str = "zstd"  # "zstd" (lossless) or "jpeg"
    jpeg_quality: int = 90
    zstd_level: int = 1
    mpp: float | None = None  # resample level 0 to this many microns per pixel
    min_size: int = 1024  # the smallest level's longer side is at most this
    region_tiles: int = 8  # regions are blocks of region_tiles x region_tiles chunks (a power of two)
    passthrough: bool = True  # with codec="jpeg": copy aligned source JPEG tiles without re-encoding
    direct: bool = True  # decode TIFF tiles directly (tifffile + imagecodecs) where exact
    threads: int = 1  # threads per tiler for JPEG decoding, zstd encoding and reductions (all release the GIL)

    def __post_init__(self) -> None:
        if self.tile_size < 16 or self.tile_size % 16:
            raise ValueError(f"tile_size must be a multiple of 16 and >= 16, got {self.tile_size!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {self.codec!r}")
        if not (1 <= self.jpeg_quality <= 100):
            raise ValueError(f"jpeg_quality must be in [1, 100], got {self.jpeg_quality!r}")
        if not (ZSTD_MIN_LEVEL <= self.zstd_level <= 22) or self.zstd_level == 0:
            raise ValueError(f"zstd_level must be in [{ZSTD_MIN_LEVEL}, -1] (fast levels) or [1, 22], got {self.zstd_level!r}")
        if self.mpp is not None and not (self.mpp > 0):
            raise ValueError(f"mpp must be > 0 microns per pixel, got {self.mpp!r}")
        if self.min_size < 16:
            raise ValueError(f"min_size must be >= 16, got {self.min_size!r}")
        if not isinstance(self.threads, int) or not (1 <= self.threads <= 64):
            raise ValueError(f"threads must be an int in [1, 64], got {self.threads!r}")
        if self.region_tiles < 1 or self.region_tiles & (self.region_tiles - 1):
            raise ValueError(f"region_tiles must be a power of two >= 1, got {self.region_tiles!r}")


@dataclass(frozen=True)
class Region:
    """One unit of work. ``kind``: 'source' (read level 0 from the slide), 'store' (read store level
    ``src_level``), 'copy' (copy the source's JPEG tiles of OpenSlide level ``src_level`` into store level
    ``out_levels[0]``). ``x, y, w, h`` in pixels of the level read (store level, or level 0 for 'source')."""

    stage: int
    index: int
    kind: str
    src_level: int
    x: int
    y: int
    w: int
    h: int
    out_levels: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"s{self.stage}_r{self.index}"

    @property
    def pixels(self) -> int:
        return self.w * self.h


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

    def identity(self) -> dict[str, Any]:
        """What must match for a partially written store to be resumed."""
        opts = {k: v for k, v in self.options.items() if k != "threads"}  # threads never change the bytes
        return {"fingerprint": self.info["fingerprint"], "options": opts, "level_shapes": [list(s) for s in self.level_shapes],
                "downsamples": self.downsamples, "level_codecs": self.level_codecs}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("todo")
        d["stages"] = [[asdict(r) for r in st] for st in self.stages]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SlidePlan":
        d = dict(d)
        d["stages"] = [[Region(**{**r, "out_levels": tuple(r["out_levels"])}) for r in st] for st in d["stages"]]
        d["level_shapes"] = [tuple(s) for s in d["level_shapes"]]
        d["mpp"] = tuple(d["mpp"]) if d.get("mpp") else None
        d["files"] = tuple(d.get("files") or ())
        return cls(**d)

    @property
    def tile(self) -> int:
        return int(self.options["tile_size"])


def reduce2x(hwc: np.ndarray) -> np.ndarray:
    """2x2 mean of an (h, w, 3) uint8 image, rounded half up, odd edges averaged over the pixels present.

    Pillow's ``Image.reduce(2)`` (C, SIMD); bit-identical to :func:`workers.store.downsample2x` (the
    reference, tested) on the channel-first array.
    """
    from PIL import Image

    return np.asarray(Image.fromarray(np.ascontiguousarray(hwc), "RGB").reduce(2))


class _Reducer:
    """2x reductions of blocks through Pillow with reused images (no fresh 16 MB image per block).

    Same arithmetic as :func:`reduce2x` (``Image.reduce(2)``); levels are chained as Pillow images, so
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


def _write_file(path: str, data: bytes) -> None:
    """Create/replace ``path`` with ``data`` (raw ``os.write``: less overhead than a buffered file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _blocks(width: int, height: int, block: int) -> list[tuple[int, int, int, int]]:
    return [(x, y, min(block, width - x), min(block, height - y))
            for y in range(0, height, block) for x in range(0, width, block)]


class Tiler:
    """Plans, writes and finalises slide stores. Holds a small cache of open slides and plans, so one
    instance (one Ray actor) opens each slide once.

    Args:
        store_dir: folder holding ``<slide_id>.zarr`` stores.
        options: :class:`IngestOptions`.
        cache_size: how many slides to keep open.
        version: the foveate version the stores record (default: the installed distribution's).
        fault_kill_at: test hook: ``os._exit(1)`` while writing region ``s0_r<fault_kill_at>`` (after
            some of its chunks are written, before its done marker) - a worker killed mid-slide.
    """

    def __init__(self, store_dir: str | Path, options: IngestOptions | None = None, *, cache_size: int = 4,
                 fault_kill_at: int | None = None, version: str | None = None):
        self.store_dir = Path(store_dir)
        self.version = version or installed_version()
        self.options = options or IngestOptions()
        self.cache_size = int(cache_size)
        self.fault_kill_at = fault_kill_at
        self._sources: OrderedDict[str, SlideSource] = OrderedDict()
        self._plans: OrderedDict[str, SlidePlan] = OrderedDict()
        self._block_buffers: dict[tuple[int, int], np.ndarray] = {}  # reused source blocks (bounded: few sizes)
        self._local = threading.local()  # per-thread chunk buffers
        self._pool: ThreadPoolExecutor | None = None
        self._reducer = _Reducer()
        self._zstd: Any = None
        register_codecs()

    # ------------------------------------------------------------------ cache
    def _source(self, path: str, files: tuple[str, ...] | None = None) -> SlideSource:
        src = self._sources.get(path)
        if src is None:
            src = SlideSource.open(path, files=files, allow_direct=self.options.direct)
            self._sources[path] = src
            while len(self._sources) > self.cache_size:
                _, old = self._sources.popitem(last=False)
                old.close()
        else:
            self._sources.move_to_end(path)
        return src

    def _plan(self, store_path: str) -> SlidePlan:
        plan = self._plans.get(store_path)
        if plan is None:
            plan = SlidePlan.from_json(json.loads((Path(store_path) / PLAN_FILE).read_text()))
            self._plans[store_path] = plan
            while len(self._plans) > 4 * self.cache_size:
                self._plans.popitem(last=False)
        return plan

    def _executor(self) -> ThreadPoolExecutor | None:
        if self.options.threads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.options.threads, thread_name_prefix="tiler")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for s in self._sources.values():
            s.close()
        self._sources.clear()
        self._plans.clear()

    # ------------------------------------------------------------------ plan
    def store_path(self, slide_id: str) -> Path:
        return self.store_dir / f"{slide_id}.zarr"

    def plan(self, slide: SlideInput, *, overwrite: bool = False) -> SlidePlan:
        """Open the slide, create (or reopen, to resume) its store and return the regions still to do.

        Raises:
            SlideOpenError: the slide cannot be opened/read, or ``--mpp`` was asked for a slide without mpp.
        """
        opts = self.options
        src = self._source(slide.path, slide.files or None)
        info = src.info
        W, H = info.dimensions
        mpp = info.mpp
        if opts.mpp is not None:
            if info.mpp is None:
                raise SlideOpenError(f"--mpp {opts.mpp} asked but {slide.source} has no mpp metadata")
            fx, fy = info.mpp[0] / opts.mpp, info.mpp[1] / opts.mpp
            W, H = max(1, round(W * fx)), max(1, round(H * fy))
            mpp = (float(opts.mpp), float(opts.mpp))
        t, R = opts.tile_size, opts.region_tiles
        kmax = int(math.log2(R))

        # levels
        shapes: list[tuple[int, int]] = []
        downs: list[float] = []
        codecs: list[str] = []
        src_levels: list[int | None] = []
        jl = info.jpeg_levels
        passthrough = (opts.codec == "jpeg" and opts.passthrough and opts.mpp is None and bool(jl) and jl[0] is not None
                       and jl[0][0] == t and jl[0][1] == t)
        if passthrough:
            for lvl, spec in enumerate(jl):
                if spec is None or spec[0] != t or spec[1] != t:
                    break
                if shapes and max(shapes[-1]) <= opts.min_size:
                    break
                shapes.append(tuple(info.level_dimensions[lvl]))
                downs.append(float(info.level_downsamples[lvl]))
                codecs.append(f"passthrough:{spec[2]}")
                src_levels.append(lvl)
            while max(shapes[-1]) > opts.min_size:
                w, h = shapes[-1]
                shapes.append((math.ceil(w / 2), math.ceil(h / 2)))
                downs.append(downs[-1] * 2)
                codecs.append("jpeg")
                src_levels.append(None)
        else:
            for ds, (w, h) in pyramid_shapes((W, H), min_size=opts.min_size):
                shapes.append((w, h))
                downs.append(float(ds))
                codecs.append(opts.codec)
                src_levels.append(None)

        # stages
        stages: list[list[Region]] = []
        if passthrough:
            st0 = []
            for lvl, sl in enumerate(src_levels):
                if sl is None:
                    continue
                w, h = shapes[lvl]
                for (x, y, bw, bh) in _blocks(w, h, t * R):
                    st0.append(Region(0, len(st0), "copy", sl, x, y, bw, bh, (lvl,)))
            stages.append(st0)
            done_to = max(i for i, sl in enumerate(src_levels) if sl is not None)
        else:
            k = min(kmax, len(shapes) - 1)
            B = t * (1 << k)
            stages.append([Region(0, i, "source", -1, x, y, bw, bh, tuple(range(0, k + 1)))
                           for i, (x, y, bw, bh) in enumerate(_blocks(W, H, B))])
            done_to = k
        while done_to < len(shapes) - 1:
            k = max(1, min(kmax, len(shapes) - 1 - done_to))
            w, h = shapes[done_to]
            B = t * (1 << k)
            s = len(stages)
            stages.append([Region(s, i, "store", done_to, x, y, bw, bh, tuple(range(done_to + 1, done_to + k + 1)))
                           for i, (x, y, bw, bh) in enumerate(_blocks(w, h, B))])
            done_to += k

        plan = SlidePlan(slide_id=slide.slide_id, store_path=str(self.store_path(slide.slide_id)), source_path=slide.path,
                         source=slide.source, info=asdict(info), options=asdict(opts), level_shapes=shapes,
                         downsamples=downs, level_codecs=codecs, source_levels=src_levels, mpp=mpp, stages=stages,
                         files=tuple(slide.files))
        self._create_or_resume(plan, overwrite=overwrite)
        self._plans[plan.store_path] = plan
        return plan

    def _create_or_resume(self, plan: SlidePlan, *, overwrite: bool) -> None:
        import zarr

        path = Path(plan.store_path)
        plan_file = path / PLAN_FILE
        if path.exists() and not overwrite and plan_file.is_file() and not (path / COMPLETE_MARKER).exists():
            try:
                old = SlidePlan.from_json(json.loads(plan_file.read_text()))
                same = old.identity() == json.loads(json.dumps(plan.identity()))
            except Exception:  # noqa: BLE001 - unreadable plan: start over
                same = False
            if same:
                prog = path / PROGRESS_DIR
                done = {p.stem for p in prog.glob("*.done")} if prog.is_dir() else set()
                plan.todo = [[r for r in st if r.key not in done] for st in plan.stages]
                plan.resumed_regions = sum(len(st) for st in plan.stages) - sum(len(st) for st in plan.todo)
                return
        if path.exists():
            shutil.rmtree(path)
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        t = plan.tile
        for lvl, ((w, h), codec) in enumerate(zip(plan.level_shapes, plan.level_codecs)):
            group.create_array(str(lvl), shape=(3, h, w), chunks=(3, t, t), dtype="uint8", fill_value=255,
                               dimension_names=("c", "y", "x"), **self._codec_kwargs(codec))
        (path / PROGRESS_DIR).mkdir()
        _write_json_atomic(plan_file, plan.to_json())  # last: a store with a plan file has all its arrays
        plan.todo = [list(st) for st in plan.stages]
        plan.resumed_regions = 0

    def _codec_kwargs(self, codec: str) -> dict[str, Any]:
        import zarr

        from workers.codecs import JpegRGBCodec

        if codec == "zstd":
            # chunks stored interleaved (y, x, c) through zarr's standard transpose codec: the writer encodes
            # rows of the decoded (h, w, 3) block as they are, any zarr v3 reader sees (c, y, x)
            return {"filters": [zarr.codecs.TransposeCodec(order=(1, 2, 0))],
                    "compressors": [zarr.codecs.ZstdCodec(level=self.options.zstd_level)]}
        if codec == "jpeg":
            return {"serializer": JpegRGBCodec(quality=self.options.jpeg_quality), "compressors": None}
        if codec.startswith("passthrough:"):
            return {"serializer": JpegRGBCodec(quality=self.options.jpeg_quality, colorspace=codec.split(":", 1)[1]),
                    "compressors": None}
        raise ValueError(f"unknown level codec {codec!r}")

    # ------------------------------------------------------------------ regions
    def write_region(self, store_path: str, region: Region) -> dict[str, Any]:
        """Write one region (idempotent; skipped when its done marker exists). Returns counters."""
        t0, c0 = time.perf_counter(), time.process_time()
        plan = self._plan(str(store_path))
        path = Path(plan.store_path)
        marker = path / PROGRESS_DIR / f"{region.key}.done"
        if marker.exists():
            return {"tiles": self._region_tiles(plan, region), "skipped": True, "seconds": 0.0, "cpu_seconds": 0.0}
        if region.kind == "copy":
            n = self._copy_region(plan, region)
        else:
            if region.kind == "source":
                block = self._read_source_block(plan, region)
            elif region.kind == "store":
                block = self._read_store_block(plan, region)
            else:
                raise ValueError(f"unknown region kind {region.kind!r}")
            n = 0
            xl, yl = region.x, region.y
            img = None
            pending: list[Future] = []
            # an all-white block (background: most of a slide) has all-white reductions: no chunk to write at any
            # level, so skip the copies, checks and reductions (a strided sample rules out tissue blocks cheaply)
            white = bool(block[::61, ::61].min() == 255) and bool(block.min() == 255)
            bh, bw = block.shape[:2]
            try:
                for j, lvl in enumerate(region.out_levels):
                    if region.kind == "store" or j > 0:
                        xl, yl = xl // 2, yl // 2
                        bh, bw = -(-bh // 2), -(-bw // 2)
                        if not white:
                            # (overlaps the previous level's chunk encoding when threads > 1)
                            img = (self._reducer.load(block) if img is None else img).reduce(2)
                            block = np.asarray(img)
                    if white:
                        self._clear_chunks(plan, lvl, xl, yl, bw, bh)
                    else:
                        pending += self._write_block(plan, lvl, xl, yl, block)
                    n += 1
                    if self.fault_kill_at is not None and region.stage == 0 and region.index == self.fault_kill_at:
                        for f in pending:
                            f.result()
                        log.error("test hook: killing worker %d while writing %s", os.getpid(), region.key)
                        os._exit(1)
            finally:
                for f in pending:
                    f.result()
        marker.write_text("")
        return {"tiles": self._region_tiles(plan, region), "skipped": False, "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.process_time() - c0}

    def _region_tiles(self, plan: SlidePlan, region: Region) -> int:
        t = plan.tile
        return math.ceil(region.w / t) * math.ceil(region.h / t)

    def _read_source_block(self, plan: SlidePlan, region: Region) -> np.ndarray:
        src = self._source(plan.source_path, plan.files or None)
        if self.options.mpp is None:
            buf = self._block_buffers.get((region.h, region.w))
            if buf is None:
                if len(self._block_buffers) >= 4:  # full blocks plus the slide's right/bottom edge blocks
                    self._block_buffers.clear()
                buf = self._block_buffers[(region.h, region.w)] = np.empty((region.h, region.w, 3), np.uint8)
            return src.read_l0(region.x, region.y, region.w, region.h, out=buf, pool=self._executor())
        return self._read_resampled(src, plan, region)

    def _read_resampled(self, src: SlideSource, plan: SlidePlan, region: Region) -> np.ndarray:
        """Level-0 block of the store at the target mpp: Lanczos resampling of a source crop with margin."""
        from PIL import Image

        info = src.info
        SW, SH = info.dimensions
        fx = info.mpp[0] / self.options.mpp
        fy = info.mpp[1] / self.options.mpp
        mx = math.ceil(3 * max(1.0, 1 / fx)) + 2
        my = math.ceil(3 * max(1.0, 1 / fy)) + 2
        sx0, sy0 = region.x / fx, region.y / fy
        sx1, sy1 = (region.x + region.w) / fx, (region.y + region.h) / fy
        cx0, cy0 = max(0, math.floor(sx0) - mx), max(0, math.floor(sy0) - my)
        cx1, cy1 = min(SW, math.ceil(sx1) + mx), min(SH, math.ceil(sy1) + my)
        crop = src.read_l0(cx0, cy0, cx1 - cx0, cy1 - cy0)
        img = Image.fromarray(crop, "RGB")
        box = (sx0 - cx0, sy0 - cy0, min(sx1, SW) - cx0, min(sy1, SH) - cy0)
        return np.asarray(img.resize((region.w, region.h), Image.Resampling.LANCZOS, box=box))

    def _read_store_block(self, plan: SlidePlan, region: Region) -> np.ndarray:
        import zarr

        arr = zarr.open_array(str(Path(plan.store_path) / str(region.src_level)), mode="r")
        return np.ascontiguousarray(np.moveaxis(arr[:, region.y : region.y + region.h, region.x : region.x + region.w], 0, -1))

    @staticmethod
    def _put_chunk(row_dirs: dict[int, str], level_root: str, cy: int, cx: int, data: bytes) -> None:
        """Write one encoded chunk file ``<level>/c/0/<cy>/<cx>`` (plain strings: pathlib is too slow here)."""
        d = row_dirs.get(cy)
        if d is None:
            d = row_dirs[cy] = f"{level_root}/{cy}"
            os.makedirs(d, exist_ok=True)
        _write_file(f"{d}/{cx}", data)

    def _write_block(self, plan: SlidePlan, level: int, x: int, y: int, block: np.ndarray) -> list[Future]:
        """Encode and write the chunks of ``block`` (h, w, 3) at (x, y) of ``level`` (chunk-aligned).

        Chunks are encoded exactly as zarr would (zstd levels: ``transpose(1, 2, 0)`` then zstd, i.e. the
        interleaved chunk; full-size edge chunks padded with the fill value 255; all-white chunks are not
        written, like zarr's ``write_empty_chunks=False``). With ``threads > 1`` the chunk rows are encoded
        by the thread pool and their futures returned (``block`` must stay unchanged until they finish);
        otherwise everything is written before returning ``[]``."""
        t = plan.tile
        W, H = plan.level_shapes[level]
        bh, bw, _ = block.shape
        if x % t or y % t:
            raise ValueError(f"block origin ({x}, {y}) is not aligned to the {t}-px chunk grid")
        if x + bw > W or y + bh > H:
            raise ValueError(f"block {bw}x{bh} at ({x}, {y}) exceeds level {level} of size {W}x{H}")
        codec = plan.level_codecs[level]
        level_root = f"{plan.store_path}/{level}/c/0"
        rows = range(0, bh, t)
        pool = self._executor()
        if pool is None or len(rows) < 2:
            for oy in rows:
                self._write_chunk_row(codec, level_root, t, x, y, block, oy)
            return []
        return [pool.submit(self._write_chunk_row, codec, level_root, t, x, y, block, oy) for oy in rows]

    @staticmethod
    def _clear_chunks(plan: SlidePlan, level: int, x: int, y: int, w: int, h: int) -> None:
        """An all-white box of ``level``: no chunk is stored (fill value); remove any left by an earlier run."""
        t = plan.tile
        root = f"{plan.store_path}/{level}/c/0"
        for cy in range(y // t, -(-(y + h) // t)):
            row = f"{root}/{cy}"
            if not os.path.isdir(row):
                continue
            for cx in range(x // t, -(-(x + w) // t)):
                p = f"{row}/{cx}"
                if os.path.exists(p):
                    os.unlink(p)

    def _write_chunk_row(self, codec: str, level_root: str, t: int, x: int, y: int, block: np.ndarray, oy: int) -> None:
        """Encode and write the chunks of block rows ``oy:oy+t`` (one chunk-row directory; thread-safe)."""
        from workers.codecs import encode_jpeg_hwc

        cbuf = getattr(self._local, "chunk", None)
        if cbuf is None or cbuf.shape != (t, t, 3):
            cbuf = self._local.chunk = np.empty((t, t, 3), np.uint8)
        zstd = self._zstd_codec() if codec == "zstd" else None
        quality = self.options.jpeg_quality
        cy = (y + oy) // t
        row_dir: str | None = None
        for ox in range(0, block.shape[1], t):
            chunk = block[oy : oy + t, ox : ox + t]
            cx = (x + ox) // t
            if chunk.shape[0] != t or chunk.shape[1] != t:  # edge chunk: padded with the fill value 255
                cbuf.fill(255)
                cbuf[: chunk.shape[0], : chunk.shape[1]] = chunk
            else:
                np.copyto(cbuf, chunk)
            if cbuf[0, 0, 0] == 255 and cbuf.min() == 255:  # short-circuits for most tissue chunks
                p = f"{level_root}/{cy}/{cx}"
                if os.path.exists(p):  # (a re-run of a region never leaves a stale chunk)
                    os.unlink(p)
                continue
            if zstd is not None:
                data = zstd.encode(cbuf)  # the transpose codec's (y, x, c) chunk, zarr's own zstd encoder
            else:
                data = encode_jpeg_hwc(cbuf, quality)
            if row_dir is None:
                row_dir = f"{level_root}/{cy}"
                os.makedirs(row_dir, exist_ok=True)
            _write_file(f"{row_dir}/{cx}", data)

    def _zstd_codec(self) -> Any:
        """numcodecs' Zstd at the run's level: the encoder zarr's ``ZstdCodec`` itself uses (same bytes)."""
        if self._zstd is None:
            from numcodecs import Zstd

            self._zstd = Zstd(level=self.options.zstd_level)
        return self._zstd

    def _copy_region(self, plan: SlidePlan, region: Region) -> int:
        """JPEG passthrough: copy the source's compressed tiles into the store's chunks, no decode."""
        from workers.codecs import merge_jpeg_tables

        src = self._source(plan.source_path, plan.files or None)
        t = plan.tile
        lvl = region.out_levels[0]
        n = 0
        level_root = f"{plan.store_path}/{lvl}/c/0"
        row_dirs: dict[int, str] = {}
        for ty in range(region.y // t, -(-(region.y + region.h) // t)):
            for tx in range(region.x // t, -(-(region.x + region.w) // t)):
                raw = src.raw_jpeg_tile(region.src_level, tx, ty)
                if raw is None:
                    continue
                self._put_chunk(row_dirs, level_root, ty, tx, merge_jpeg_tables(raw[1], raw[0]))
                n += 1
        return n

    # ------------------------------------------------------------------ finalize
    def finalize(self, store_path: str) -> dict[str, Any]:
        """Tissue mask, metadata, completion marker (written last). Returns the manifest fields."""
        import zarr

        from workers.tissue import tissue_mask

        c0 = time.process_time()
        plan = self._plan(str(store_path))
        path = Path(plan.store_path)
        prog = path / PROGRESS_DIR
        missing = [r.key for st in plan.stages for r in st if not (prog / f"{r.key}.done").exists()]
        if missing:
            raise RuntimeError(f"cannot finalise {path.name}: {len(missing)} regions not written (e.g. {missing[0]})")
        group = zarr.open_group(str(path), mode="r+", zarr_format=3)
        last = len(plan.level_shapes) - 1
        low = np.asarray(group[str(last)][...])
        mask = tissue_mask(np.ascontiguousarray(np.moveaxis(low, 0, -1)))
        tissue_ds = float(plan.downsamples[last])
        write_tissue_labels(group, mask, [tuple(x) for x in plan.level_shapes], plan.downsamples, plan.mpp)
        info = plan.info
        passthrough = any(c.startswith("passthrough") for c in plan.level_codecs)
        meta = StoreMeta(
            slide_id=plan.slide_id, source=plan.source, vendor=info["vendor"], level0_size=tuple(plan.level_shapes[0]),
            tile_size=plan.tile, downsamples=tuple(plan.downsamples), mpp=plan.mpp,
            source_mpp=tuple(info["mpp"]) if info["mpp"] else None, fingerprint=info["fingerprint"],
            codec=("jpeg-passthrough" if passthrough else plan.options["codec"]), foveate_version=self.version,
            tissue_downsample=tissue_ds, tissue_fraction=float(mask.mean()),
            extra={"source_dimensions": list(info["dimensions"]), "level_codecs": plan.level_codecs,
                   "source_levels": plan.source_levels, "tile_grid": [[math.ceil(w / plan.tile), math.ceil(h / plan.tile)]
                                                                      for w, h in plan.level_shapes],
                   "direct_decode": bool(info["direct"]), "resampled_to_mpp": plan.options.get("mpp")},
        )
        group.attrs.update({"ome": {"version": "0.5", "multiscales": ngff_multiscales(plan.slide_id, plan.downsamples, plan.mpp)},
                            "foveate": meta.to_json()})
        shutil.rmtree(prog, ignore_errors=True)
        _write_json_atomic(path / COMPLETE_MARKER, {"slide_id": plan.slide_id, "levels": len(plan.downsamples),
                                                    "fingerprint": info["fingerprint"], "foveate_version": self.version})
        self._plans.pop(str(store_path), None)
        return {"width": plan.level_shapes[0][0], "height": plan.level_shapes[0][1],
                "mpp": plan.mpp[0] if plan.mpp else None, "tissue_fraction": float(mask.mean()),
                "vendor": info["vendor"], "codec": meta.codec, "levels": len(plan.downsamples),
                "cpu_seconds": time.process_time() - c0}

    # ------------------------------------------------------------------ convenience
    def ingest_slide(self, slide: SlideInput, *, overwrite: bool = False) -> dict[str, Any]:
        """Whole slide in this process (no Ray): plan, every region in stage order, finalize."""
        plan = self.plan(slide, overwrite=overwrite)
        for st in plan.todo:
            for r in st:
                self.write_region(plan.store_path, r)
        return self.finalize(plan.store_path)
