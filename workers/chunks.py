"""Raw chunk files of a store level, written without going through zarr (the tiler's hot path).

Chunks are encoded exactly as zarr would (zstd levels: ``transpose(1, 2, 0)`` then zstd, i.e. the
interleaved chunk; JPEG levels: one RGB JPEG per chunk, ``workers.codecs``; full-size edge chunks padded
with the fill value 255; all-white chunks are not written, like zarr's ``write_empty_chunks=False``), so any
zarr v3 reader reads them. Chunk ``(cy, cx)`` of level ``l`` is the file ``<store>/<l>/c/0/<cy>/<cx>``
(``(c, y, x)`` arrays with one chunk along ``c``). Positions are level pixels (``_lv``, see
:mod:`workers.frames`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ChunkWriter", "fsync_dir", "level_codec_kwargs", "sync_filesystem", "write_file", "write_json_atomic"]


def write_file(path: str, data: bytes, *, sync: bool = False) -> None:
    """Create/replace ``path`` with ``data`` (raw ``os.write``: less overhead than a buffered file); ``sync``:
    ``fdatasync`` before closing (its directory entry needs :func:`fsync_dir` of the folder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (files created, replaced or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_syncfs: Any = None


def sync_filesystem(path: str) -> None:
    """Flush everything written to the filesystem holding ``path`` — file data, new files and folders — with one
    ``syncfs(2)`` (Linux; ``sync()`` elsewhere). One call per ingest region instead of an ``fdatasync`` per
    chunk file: ``benchmarks/ingest.py --no-fsync-too`` measured 3-15 % against 22-31 % of the throughput
    (RESULTS.md)."""
    global _syncfs
    if _syncfs is None:
        import ctypes

        try:
            _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
        except (AttributeError, OSError):
            _syncfs = False
    if not _syncfs:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _syncfs(fd) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def level_codec_kwargs(codec: str, *, zstd_level: int, jpeg_quality: int) -> dict[str, Any]:
    """``zarr.create_array`` keyword arguments of a level stored with ``codec`` (``"zstd"``, ``"jpeg"`` or
    ``"passthrough:<colorspace>"``)."""
    import zarr

    from workers.codecs import JpegRGBCodec

    if codec == "zstd":
        # chunks stored interleaved (y, x, c) through zarr's standard transpose codec: the writer encodes
        # rows of the decoded (h, w, 3) block as they are, any zarr v3 reader sees (c, y, x)
        return {
            "filters": [zarr.codecs.TransposeCodec(order=(1, 2, 0))],
            "compressors": [zarr.codecs.ZstdCodec(level=zstd_level)],
        }
    if codec == "jpeg":
        return {"serializer": JpegRGBCodec(quality=jpeg_quality), "compressors": None}
    if codec.startswith("passthrough:"):
        return {
            "serializer": JpegRGBCodec(quality=jpeg_quality, colorspace=codec.split(":", 1)[1]),
            "compressors": None,
        }
    raise ValueError(f"unknown level codec {codec!r}")


class ChunkWriter:
    """Encodes and writes the chunks of one store's levels.

    Args:
        store_path: the ``<slide_id>.zarr`` folder.
        tile: chunk side.
        level_shapes: ``(width, height)`` per level (bounds checks).
        level_codecs: codec per level (see :func:`level_codec_kwargs`).
        zstd_level, jpeg_quality: encoder settings.
        executor: returns the thread pool that encodes chunk rows in parallel, or None (inline).
        durable: :meth:`sync` flushes what was written to the disk (else it does nothing).
    """

    def __init__(
        self,
        store_path: str,
        *,
        tile: int,
        level_shapes: list[tuple[int, int]],
        level_codecs: list[str],
        zstd_level: int,
        jpeg_quality: int,
        executor: Callable[[], ThreadPoolExecutor | None] = lambda: None,
        durable: bool = False,
    ):
        self.store_path = str(store_path)
        self.tile = int(tile)
        self.level_shapes = level_shapes
        self.level_codecs = level_codecs
        self.zstd_level, self.jpeg_quality = zstd_level, jpeg_quality
        self._executor = executor
        self._local = threading.local()  # per-thread chunk buffers
        self._zstd: Any = None
        self.durable = bool(durable)

    def sync(self) -> None:
        """Make every chunk written (or removed) so far durable, folders included (:func:`sync_filesystem`); the
        tiler calls it before it marks a region done. A no-op unless ``durable``."""
        if self.durable:
            sync_filesystem(self.store_path)

    def _root(self, level: int) -> str:
        return f"{self.store_path}/{level}/c/0"

    def put_chunk(self, row_dirs: dict[int, str], level: int, cy: int, cx: int, data: bytes) -> None:
        """Write one encoded chunk file (plain strings: pathlib is too slow here)."""
        d = row_dirs.get(cy)
        if d is None:
            d = row_dirs[cy] = f"{self._root(level)}/{cy}"
            os.makedirs(d, exist_ok=True)
        write_file(f"{d}/{cx}", data)

    def write_block(self, level: int, x_lv: int, y_lv: int, block: np.ndarray) -> list[Future]:
        """Encode and write the chunks of ``block`` (h, w, 3) at ``(x_lv, y_lv)`` of ``level`` (chunk-aligned).

        With a thread pool the chunk rows are encoded there and their futures returned (``block`` must stay
        unchanged until they finish); otherwise everything is written before returning ``[]``."""
        t = self.tile
        w_lv, h_lv = self.level_shapes[level]
        bh, bw, _ = block.shape
        if x_lv % t or y_lv % t:
            raise ValueError(f"block origin ({x_lv}, {y_lv}) is not aligned to the {t}-px chunk grid")
        if x_lv + bw > w_lv or y_lv + bh > h_lv:
            raise ValueError(f"block {bw}x{bh} at ({x_lv}, {y_lv}) exceeds level {level} of size {w_lv}x{h_lv}")
        codec = self.level_codecs[level]
        root = self._root(level)
        rows = range(0, bh, t)
        pool = self._executor()
        if pool is None or len(rows) < 2:
            for oy in rows:
                self._write_chunk_row(codec, root, x_lv, y_lv, block, oy)
            return []
        return [pool.submit(self._write_chunk_row, codec, root, x_lv, y_lv, block, oy) for oy in rows]

    def clear_chunks(self, level: int, x_lv: int, y_lv: int, w: int, h: int) -> None:
        """An all-white box of ``level``: no chunk is stored (fill value); remove any left by an earlier run."""
        t = self.tile
        root = self._root(level)
        for cy in range(y_lv // t, -(-(y_lv + h) // t)):
            row = f"{root}/{cy}"
            if not os.path.isdir(row):
                continue
            for cx in range(x_lv // t, -(-(x_lv + w) // t)):
                p = f"{row}/{cx}"
                if os.path.exists(p):
                    os.unlink(p)

    def _write_chunk_row(self, codec: str, root: str, x_lv: int, y_lv: int, block: np.ndarray, oy: int) -> None:
        """Encode and write the chunks of block rows ``oy:oy+t`` (one chunk-row directory; thread-safe)."""
        from workers.codecs import encode_jpeg_hwc

        t = self.tile
        cbuf = getattr(self._local, "chunk", None)
        if cbuf is None or cbuf.shape != (t, t, 3):
            cbuf = self._local.chunk = np.empty((t, t, 3), np.uint8)
        zstd = self._zstd_codec() if codec == "zstd" else None
        cy = (y_lv + oy) // t
        row_dir: str | None = None
        for ox in range(0, block.shape[1], t):
            chunk = block[oy : oy + t, ox : ox + t]
            cx = (x_lv + ox) // t
            if chunk.shape[0] != t or chunk.shape[1] != t:  # edge chunk: padded with the fill value 255
                cbuf.fill(255)
                cbuf[: chunk.shape[0], : chunk.shape[1]] = chunk
            else:
                np.copyto(cbuf, chunk)
            if cbuf[0, 0, 0] == 255 and cbuf.min() == 255:  # short-circuits for most tissue chunks
                p = f"{root}/{cy}/{cx}"
                if os.path.exists(p):  # (a re-run of a region never leaves a stale chunk)
                    os.unlink(p)
                continue
            if zstd is not None:
                data = zstd.encode(cbuf)  # the transpose codec's (y, x, c) chunk, zarr's own zstd encoder
            else:
                data = encode_jpeg_hwc(cbuf, self.jpeg_quality)
            if row_dir is None:
                row_dir = f"{root}/{cy}"
                os.makedirs(row_dir, exist_ok=True)
            write_file(f"{row_dir}/{cx}", data)

    def _zstd_codec(self) -> Any:
        """numcodecs' Zstd at the run's level: the encoder zarr's ``ZstdCodec`` itself uses (same bytes)."""
        if self._zstd is None:
            from numcodecs import Zstd

            self._zstd = Zstd(level=self.zstd_level)
        return self._zstd
