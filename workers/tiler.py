"""The tiler actor: plans a slide's store, writes its regions, finalises it (one plain class, no Ray).

Planning is pure (:mod:`workers.pyramid`: levels, stages of regions, shard sides, the 2x downsampler); chunks
and shards are encoded and stored through zarr's store API by :class:`workers.chunks.ChunkWriter` (a local folder
or object storage, :mod:`workers.storage`); this module opens sources (slides on object storage from a local
scratch copy, :class:`workers.ingest_source.SlideScratch`), creates or resumes stores and runs regions. Frames: :mod:`workers.frames` (a region's box is in pixels of store level
``Region.level``; names ending ``_l0`` / ``_lv`` mark level-0 / level pixels).

Each finished region leaves the key ``foveate_progress/s<stage>_r<index>.done`` in the store; a re-run skips
those (resume at region granularity, same bytes as an uninterrupted run because every region is a
deterministic function of the source). :meth:`Tiler.finalize` writes the tissue mask and the NGFF/foveate
metadata (``workers.store.write_store_metadata``, shared with ``write_store_from_array``), removes the
progress folder and writes ``foveate_complete.json`` last.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from operators.errors import ConfigError
from workers import storage
from workers.chunks import ChunkWriter, level_codec_kwargs
from workers.frames import Box
from workers.ingest_source import SlideFile, SlideOpenError, SlideScratch, SlideSource
from workers.pyramid import Reducer, Region, SlidePlan, level_shard_sides, plan_levels, plan_stages
from workers.store import COMPLETE_MARKER, installed_version, mark_complete, register_codecs, write_store_metadata

__all__ = ["IngestOptions", "Region", "SlidePlan", "Tiler", "PLAN_FILE", "PROGRESS_DIR", "describe_levels"]

log = logging.getLogger(__name__)

PLAN_FILE = "foveate_plan.json"
PROGRESS_DIR = "foveate_progress"
CODECS = ("auto", "zstd", "jpeg")
ZSTD_MIN_LEVEL = -131072  # zstd's fastest ("negative") level; any level decodes with plain zstd


@dataclass(frozen=True)
class IngestOptions:
    """How a tiler writes stores (``foveate ingest`` flags / the ``options`` section of its config; validated
    here, raising ``ConfigError``)."""

    tile_size: int = 256
    codec: str = "auto"  # "auto": copy aligned source JPEG tiles, else zstd; "zstd" (lossless); "jpeg"
    jpeg_quality: int = 90
    zstd_level: int = 1
    mpp: float | None = None  # resample level 0 to this many microns per pixel
    min_size: int = 1024  # the smallest level's longer side is at most this
    region_tiles: int = 8  # regions are blocks of region_tiles x region_tiles chunks (a power of two)
    passthrough: bool = True  # with codec "auto" or "jpeg": copy aligned source JPEG tiles without re-encoding
    direct: bool = True  # decode TIFF tiles directly (tifffile + imagecodecs) where exact
    threads: int = 1  # threads per tiler for JPEG decoding, zstd encoding and reductions (all release the GIL)
    fsync: bool = True  # chunks and region markers reach the disk before a region counts as done
    shard: bool = True  # one zarr shard per region and level (False: one object per chunk)
    checksum: bool = True  # every chunk ends with its crc32c (zarr's crc32c codec): a damaged chunk fails its read

    def __post_init__(self) -> None:
        if self.tile_size < 16 or self.tile_size % 16:
            raise ConfigError(f"tile_size must be a multiple of 16 and >= 16, got {self.tile_size!r}")
        if self.codec not in CODECS:
            raise ConfigError(f"codec must be one of {CODECS}, got {self.codec!r}")
        if not (1 <= self.jpeg_quality <= 100):
            raise ConfigError(f"jpeg_quality must be in [1, 100], got {self.jpeg_quality!r}")
        if not (ZSTD_MIN_LEVEL <= self.zstd_level <= 22) or self.zstd_level == 0:
            raise ConfigError(
                f"zstd_level must be in [{ZSTD_MIN_LEVEL}, -1] (fast levels) or [1, 22], got {self.zstd_level!r}"
            )
        if self.mpp is not None and not (self.mpp > 0):
            raise ConfigError(f"mpp must be > 0 microns per pixel, got {self.mpp!r}")
        if self.min_size < 16:
            raise ConfigError(f"min_size must be >= 16, got {self.min_size!r}")
        if not isinstance(self.threads, int) or not (1 <= self.threads <= 64):
            raise ConfigError(f"threads must be an int in [1, 64], got {self.threads!r}")
        if self.region_tiles < 1 or self.region_tiles & (self.region_tiles - 1):
            raise ConfigError(f"region_tiles must be a power of two >= 1, got {self.region_tiles!r}")
        for name in ("passthrough", "direct", "fsync", "shard", "checksum"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")


def _span(levels: list[int]) -> str:
    if len(levels) == 1:
        return f"level {levels[0]}"
    return f"levels {levels[0]}-{levels[-1]}"


def describe_levels(level_codecs: list[str], source_levels: list[int | None]) -> str:
    """One line on how a store's levels were made: which were copied from the source's JPEG tiles (and from which
    OpenSlide levels) and which were decoded or made, with their codec."""
    copied = [i for i, s in enumerate(source_levels) if s is not None]
    made = [i for i, s in enumerate(source_levels) if s is None]
    parts = []
    if copied:
        src = [source_levels[i] for i in copied]
        parts.append(f"{_span(copied)} copied from the source's JPEG tiles (OpenSlide {_span(src)})")
    if made:
        codecs = sorted({level_codecs[i] for i in made})
        how = "made" if copied else "decoded"
        parts.append(f"{_span(made)} {how} ({', '.join(codecs)})")
    return "; ".join(parts)


class Tiler:
    """Plans, writes and finalises slide stores. Holds a small cache of open slides and plans, so one
    instance (one Ray actor) opens each slide once.

    Args:
        store_dir: folder or object-storage URL holding ``<slide_id>.zarr`` stores (:mod:`workers.storage`).
        options: :class:`IngestOptions`.
        cache_size: how many slides to keep open.
        version: the foveate version the stores record (default: the installed distribution's).
        scratch_dir, scratch_max_bytes: where slides on object storage (``s3://...`` paths) are copied to, and the
            bound on those copies (:class:`workers.ingest_source.SlideScratch`; defaults from
            ``$FOVEATE_SCRATCH_DIR`` / ``$FOVEATE_SCRATCH_MAX_GB``). A copy is deleted when its slide is finalised,
            evicted from the cache or the tiler closes.
    """

    def __init__(
        self,
        store_dir: str | Path,
        options: IngestOptions | None = None,
        *,
        cache_size: int = 4,
        version: str | None = None,
        scratch_dir: str | Path | None = None,
        scratch_max_bytes: int | None = None,
    ):
        self.store_dir = storage.normalize(store_dir)
        self.version = version or installed_version()
        self.options = options or IngestOptions()
        self.cache_size = int(cache_size)
        self._sources: OrderedDict[str, SlideSource] = OrderedDict()
        self._plans: OrderedDict[str, SlidePlan] = OrderedDict()
        self._block_buffers: dict[tuple[int, int], np.ndarray] = {}  # reused source blocks (bounded: few sizes)
        self._writers: dict[str, ChunkWriter] = {}
        self._stores: OrderedDict[str, Any] = OrderedDict()
        self._scratch_args = (scratch_dir, scratch_max_bytes)
        self._scratch: SlideScratch | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._reducer = Reducer()
        register_codecs()

    # ------------------------------------------------------------------ cache
    def _source(self, path: str, files: tuple[str, ...] | None = None) -> SlideSource:
        src = self._sources.get(path)
        if src is None:
            if storage.is_url(path):  # a slide on object storage: opened from its local scratch copy
                local = self._scratch_copies().local(path)
                src = SlideSource.open(local, files=(local,), allow_direct=self.options.direct)
            else:
                src = SlideSource.open(path, files=files, allow_direct=self.options.direct)
            self._sources[path] = src
            while len(self._sources) > self.cache_size:
                old_path, old = self._sources.popitem(last=False)
                old.close()
                if self._scratch is not None:
                    self._scratch.release(old_path)
        else:
            self._sources.move_to_end(path)
        return src

    def _store(self, store_path: str) -> Any:
        """The zarr store of a slide store (opened once per actor)."""
        st = self._stores.get(store_path)
        if st is None:
            st = self._stores[store_path] = storage.open_store(store_path)
            while len(self._stores) > 4 * self.cache_size:
                self._stores.popitem(last=False)
        return st

    def _scratch_copies(self) -> SlideScratch:
        if self._scratch is None:
            self._scratch = SlideScratch(*self._scratch_args, on_evict=self._close_source)
        return self._scratch

    def _close_source(self, path: str) -> None:
        src = self._sources.pop(path, None)
        if src is not None:
            src.close()

    def _plan(self, store_path: str) -> SlidePlan:
        plan = self._plans.get(store_path)
        if plan is None:
            raw = storage.get_bytes(self._store(store_path), PLAN_FILE)
            if raw is None:
                raise RuntimeError(f"{store_path} has no {PLAN_FILE}: plan the slide first")
            plan = SlidePlan.from_json(json.loads(raw))
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
        if self._scratch is not None:
            self._scratch.clear()

    # ------------------------------------------------------------------ plan
    def store_path(self, slide_id: str) -> str:
        return storage.join(self.store_dir, f"{slide_id}.zarr")

    def plan(self, slide: SlideFile, *, overwrite: bool = False) -> SlidePlan:
        """Open the slide, create (or reopen, to resume) its store and return the regions still to do.

        Raises:
            SlideOpenError: the slide cannot be opened/read, or ``--mpp`` was asked for a slide without mpp.
        """
        opts = self.options
        src = self._source(slide.path, slide.files or None)
        info = src.info
        w_l0, h_l0 = info.dimensions
        mpp = info.mpp
        if opts.mpp is not None:
            if info.mpp is None:
                raise SlideOpenError(f"--mpp {opts.mpp} asked but {slide.source} has no mpp metadata")
            fx, fy = info.mpp[0] / opts.mpp, info.mpp[1] / opts.mpp
            w_l0, h_l0 = max(1, round(w_l0 * fx)), max(1, round(h_l0 * fy))
            mpp = (float(opts.mpp), float(opts.mpp))
        t = opts.tile_size
        jl = info.jpeg_levels
        passthrough = (
            opts.codec in ("auto", "jpeg")
            and opts.passthrough
            and opts.mpp is None
            and bool(jl)
            and jl[0] is not None
            and jl[0][0] == t
            and jl[0][1] == t
        )
        levels = plan_levels(
            (w_l0, h_l0),
            tile=t,
            min_size=opts.min_size,
            codec="zstd" if opts.codec == "auto" else opts.codec,
            jpeg_levels=jl if passthrough else None,
            level_dimensions=info.level_dimensions,
            level_downsamples=info.level_downsamples,
        )
        stages = plan_stages(levels, tile=t, region_tiles=opts.region_tiles)
        plan = SlidePlan(
            slide_id=slide.slide_id,
            store_path=str(self.store_path(slide.slide_id)),
            source_path=slide.path,
            source=slide.source,
            info=asdict(info),
            options=asdict(opts),
            level_shapes=levels.shapes,
            downsamples=levels.downsamples,
            level_codecs=levels.codecs,
            source_levels=levels.source_levels,
            mpp=mpp,
            stages=stages,
            files=tuple(slide.files),
            shard_sides=level_shard_sides(stages, levels.shapes, tile=t) if opts.shard else None,
        )
        self._create_or_resume(plan, overwrite=overwrite)
        self._plans[plan.store_path] = plan
        return plan

    def _create_or_resume(self, plan: SlidePlan, *, overwrite: bool) -> None:
        import zarr

        loc = plan.store_path
        store = self._store(loc)
        raw = storage.get_bytes(store, PLAN_FILE)
        if raw is not None and not overwrite and not storage.exists(store, COMPLETE_MARKER):
            try:
                old = SlidePlan.from_json(json.loads(raw))
                same = old.identity() == json.loads(json.dumps(plan.identity()))
            except Exception:
                same = False
            if same:
                done = {
                    k.rsplit("/", 1)[-1].removesuffix(".done") for k in storage.list_keys(store, PROGRESS_DIR + "/")
                }
                plan.todo = [[r for r in st if r.key not in done] for st in plan.stages]
                plan.resumed_regions = sum(len(st) for st in plan.stages) - sum(len(st) for st in plan.todo)
                return
        # a fresh store: nothing of an earlier one survives (the completion marker first, so that a crash
        # while removing never leaves an old marker over missing chunks)
        storage.delete_keys(store, [COMPLETE_MARKER])
        storage.remove_tree(loc)
        self._stores.pop(loc, None)
        store = self._store(loc)
        group = zarr.open_group(store=store, mode="w", zarr_format=3)
        t = plan.tile
        for lvl, ((w, h), codec) in enumerate(zip(plan.level_shapes, plan.level_codecs)):
            group.create_array(
                str(lvl),
                shape=(3, h, w),
                chunks=(3, t, t),
                dtype="uint8",
                fill_value=255,
                dimension_names=("c", "y", "x"),
                **level_codec_kwargs(
                    codec,
                    zstd_level=self.options.zstd_level,
                    jpeg_quality=self.options.jpeg_quality,
                    shard_side=plan.shard_sides[lvl] if plan.shard_sides else None,
                    checksum=bool(plan.options.get("checksum", False)),
                ),
            )
        # last: a store with a plan file has all its arrays
        storage.put_bytes(store, {PLAN_FILE: json.dumps(plan.to_json(), indent=1).encode()})
        plan.todo = [list(st) for st in plan.stages]
        plan.resumed_regions = 0

    # ------------------------------------------------------------------ regions
    def _writer(self, plan: SlidePlan) -> ChunkWriter:
        w = self._writers.get(plan.store_path)
        if w is None:
            w = self._writers[plan.store_path] = ChunkWriter(
                self._store(plan.store_path),
                tile=plan.tile,
                level_shapes=plan.level_shapes,
                level_codecs=plan.level_codecs,
                shard_sides=plan.shard_sides,
                zstd_level=self.options.zstd_level,
                jpeg_quality=self.options.jpeg_quality,
                executor=self._executor,
                durable=self.options.fsync,
                checksum=bool(plan.options.get("checksum", False)),  # (a plan of an older version: none)
            )
            while len(self._writers) > 4 * self.cache_size:
                self._writers.pop(next(iter(self._writers)))
        return w

    def write_region(self, store_path: str, region: Region) -> dict[str, Any]:
        """Write one region (idempotent; skipped when its done marker exists). Returns counters."""
        t0, c0 = time.perf_counter(), time.process_time()
        plan = self._plan(str(store_path))
        store = self._store(plan.store_path)
        marker = f"{PROGRESS_DIR}/{region.key}.done"
        if storage.exists(store, marker):
            return {"tiles": self._region_tiles(plan, region), "skipped": True, "seconds": 0.0, "cpu_seconds": 0.0}
        if region.kind == "copy":
            self._copy_region(plan, region)
        else:
            if region.kind == "source":
                block = self._read_source_block(plan, region)
            elif region.kind == "store":
                block = self._read_store_block(plan, region)
            else:
                raise ValueError(f"unknown region kind {region.kind!r}")
            writer = self._writer(plan)
            box_lv = region.box  # pixels of store level region.level, then of each output level in turn
            img = None
            pending: list[Future] = []
            # an all-white block (background: most of a slide) has all-white reductions: no chunk to write at any
            # level, so skip the copies, checks and reductions (a strided sample rules out tissue blocks cheaply)
            white = bool(block[::61, ::61].min() == 255) and bool(block.min() == 255)
            try:
                for j, lvl in enumerate(region.out_levels):
                    if region.kind == "store" or j > 0:
                        box_lv = box_lv.halved()
                        if not white:
                            # (overlaps the previous level's chunk encoding when threads > 1)
                            img = (self._reducer.load(block) if img is None else img).reduce(2)
                            block = np.asarray(img)
                    if white:
                        writer.clear_chunks(lvl, box_lv.x, box_lv.y, box_lv.width, box_lv.height)
                    else:
                        pending += writer.write_block(lvl, box_lv.x, box_lv.y, block)
                    self._level_written(region, lvl, pending)
            finally:
                for f in pending:
                    f.result()
        # the region's chunks (and their folder entries) are durable before its done marker exists; a marker
        # lost in a crash only makes the re-run write the region again
        self._writer(plan).sync()
        storage.put_bytes(store, {marker: b""})
        return {
            "tiles": self._region_tiles(plan, region),
            "skipped": False,
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
        }

    def _level_written(self, region: Region, level: int, pending: list[Future]) -> None:
        """Called after each output level of a decoded region is handed to the writer (``pending``: its chunk
        rows still being encoded). Nothing here; fault-injection tests override it to die mid-region."""

    def _region_tiles(self, plan: SlidePlan, region: Region) -> int:
        t = plan.tile
        return math.ceil(region.box.width / t) * math.ceil(region.box.height / t)

    def _read_source_block(self, plan: SlidePlan, region: Region) -> np.ndarray:
        src = self._source(plan.source_path, plan.files or None)
        x_l0, y_l0, w, h = region.box
        if self.options.mpp is None:
            buf = self._block_buffers.get((h, w))
            if buf is None:
                if len(self._block_buffers) >= 4:  # full blocks plus the slide's right/bottom edge blocks
                    self._block_buffers.clear()
                buf = self._block_buffers[(h, w)] = np.empty((h, w, 3), np.uint8)
            return src.read_l0(x_l0, y_l0, w, h, out=buf, pool=self._executor())
        return self._read_resampled(src, region.box)

    def _read_resampled(self, src: SlideSource, box_l0: Box) -> np.ndarray:
        """Level-0 block of the store at the target mpp: Lanczos resampling of a source crop with margin."""
        from PIL import Image

        info = src.info
        w_src, h_src = info.dimensions
        fx = info.mpp[0] / self.options.mpp
        fy = info.mpp[1] / self.options.mpp
        mx = math.ceil(3 * max(1.0, 1 / fx)) + 2
        my = math.ceil(3 * max(1.0, 1 / fy)) + 2
        sx0, sy0 = box_l0.x / fx, box_l0.y / fy
        sx1, sy1 = box_l0.right / fx, box_l0.bottom / fy
        cx0, cy0 = max(0, math.floor(sx0) - mx), max(0, math.floor(sy0) - my)
        cx1, cy1 = min(w_src, math.ceil(sx1) + mx), min(h_src, math.ceil(sy1) + my)
        crop = src.read_l0(cx0, cy0, cx1 - cx0, cy1 - cy0)
        img = Image.fromarray(crop, "RGB")
        box = (sx0 - cx0, sy0 - cy0, min(sx1, w_src) - cx0, min(sy1, h_src) - cy0)
        return np.asarray(img.resize((box_l0.width, box_l0.height), Image.Resampling.LANCZOS, box=box))

    def _read_store_block(self, plan: SlidePlan, region: Region) -> np.ndarray:
        import zarr

        arr = zarr.open_array(store=self._store(plan.store_path), path=str(region.level), mode="r")
        b = region.box
        return np.ascontiguousarray(np.moveaxis(arr[:, b.y : b.bottom, b.x : b.right], 0, -1))

    def _copy_region(self, plan: SlidePlan, region: Region) -> int:
        """JPEG passthrough: copy the source's compressed tiles into the store's chunks, no decode."""
        from workers.codecs import merge_jpeg_tables

        src = self._source(plan.source_path, plan.files or None)
        writer = self._writer(plan)
        t = plan.tile
        b = region.box
        chunks: dict[tuple[int, int], bytes] = {}
        for ty in range(b.y // t, -(-b.bottom // t)):
            for tx in range(b.x // t, -(-b.right // t)):
                raw = src.raw_jpeg_tile(region.src_level, tx, ty)
                if raw is None:
                    continue
                chunks[(ty, tx)] = merge_jpeg_tables(raw[1], raw[0])
        writer.write_encoded(region.level, b.x, b.y, b.width, b.height, chunks)
        return len(chunks)

    # ------------------------------------------------------------------ finalize
    def finalize(self, store_path: str) -> dict[str, Any]:
        """Tissue mask, metadata, completion marker (written last). Returns the manifest fields."""
        import zarr

        c0 = time.process_time()
        plan = self._plan(str(store_path))
        store = self._store(plan.store_path)
        progress = storage.list_keys(store, PROGRESS_DIR + "/")
        done = {k.rsplit("/", 1)[-1].removesuffix(".done") for k in progress}
        missing = [r.key for st in plan.stages for r in st if r.key not in done]
        if missing:
            raise RuntimeError(
                f"cannot finalise {storage.basename(plan.store_path)}: {len(missing)} regions not written "
                f"(e.g. {missing[0]})"
            )
        group = zarr.open_group(store=store, mode="r+", zarr_format=3)
        info = plan.info
        passthrough = any(c.startswith("passthrough") for c in plan.level_codecs)
        meta = write_store_metadata(
            group,
            slide_id=plan.slide_id,
            source=plan.source,
            vendor=info["vendor"],
            level_shapes=plan.level_shapes,
            downsamples=plan.downsamples,
            mpp=plan.mpp,
            tile_size=plan.tile,
            codec=("jpeg-passthrough" if passthrough else plan.level_codecs[0]),
            version=self.version,
            source_mpp=tuple(info["mpp"]) if info["mpp"] else None,
            fingerprint=info["fingerprint"],
            extra={
                "source_dimensions": list(info["dimensions"]),
                "level_codecs": plan.level_codecs,
                "source_levels": plan.source_levels,
                "tile_grid": [[math.ceil(w / plan.tile), math.ceil(h / plan.tile)] for w, h in plan.level_shapes],
                "direct_decode": bool(info["direct"]),
                "resampled_to_mpp": plan.options.get("mpp"),
                "shard_sides": plan.shard_sides,
            },
            shard_labels=bool(plan.shard_sides),
        )
        storage.delete_prefix(store, PROGRESS_DIR)
        mark_complete(
            store,
            plan.slide_id,
            len(plan.downsamples),
            durable=self.options.fsync,
            fingerprint=info["fingerprint"],
            foveate_version=self.version,
        )
        self._plans.pop(str(store_path), None)
        self._writers.pop(str(store_path), None)
        if self._scratch is not None:  # the slide is done: its local copy goes
            self._scratch.release(plan.source_path)
        return {
            "width": plan.level_shapes[0][0],
            "height": plan.level_shapes[0][1],
            "mpp": plan.mpp[0] if plan.mpp else None,
            "tissue_fraction": meta.tissue_fraction,
            "vendor": info["vendor"],
            "codec": meta.codec,
            "levels": len(plan.downsamples),
            "cpu_seconds": time.process_time() - c0,
            "layout": describe_levels(plan.level_codecs, plan.source_levels),
        }

    # ------------------------------------------------------------------ convenience
    def ingest_slide(self, slide: SlideFile, *, overwrite: bool = False) -> dict[str, Any]:
        """Whole slide in this process (no Ray): plan, every region in stage order, finalize."""
        plan = self.plan(slide, overwrite=overwrite)
        for st in plan.todo:
            for r in st:
                self.write_region(plan.store_path, r)
        return self.finalize(plan.store_path)
