"""Chunks (or shards) of a store level, encoded here and stored through zarr's store API (the tiler's hot path).

Chunks are encoded exactly as zarr would (zstd levels: ``transpose(1, 2, 0)`` then zstd, i.e. the
interleaved chunk; JPEG levels: one RGB JPEG per chunk, ``workers.codecs``; full-size edge chunks padded
with the fill value 255; all-white chunks are not written, like zarr's ``write_empty_chunks=False``), and
shards are laid out exactly as zarr's ShardingCodec lays them out (:func:`encode_shard`), so any zarr v3 reader
reads them. Chunk (or shard) ``(cy, cx)`` of level ``l`` is the key ``<l>/c/0/<cy>/<cx>`` of the store
(``(c, y, x)`` arrays with one chunk along ``c``), set with one ``store.set`` — a local folder or object storage
(:mod:`workers.storage`). The encoding stays here rather than in zarr's array API so that chunk rows keep being
encoded on the tiler's threads while it reduces the next level. Positions are level pixels (``_lv``, see
:mod:`workers.frames`).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from workers import storage

__all__ = [
    "ChunkChecksumError",
    "ChunkWriter",
    "LocalChunkReader",
    "add_checksum",
    "decode_shard",
    "encode_shard",
    "level_codec_kwargs",
    "local_chunk_reader",
    "read_checked",
    "strip_checksum",
]


class ChunkChecksumError(ValueError):
    """A stored chunk whose crc32c does not match its bytes (flipped bits, a torn or overwritten object); the
    message names the store, the array and the chunk."""


def add_checksum(data: bytes) -> bytes:
    """``data`` followed by its crc32c, little-endian: what zarr's ``crc32c`` codec stores."""
    import google_crc32c

    return bytes(data) + np.uint32(google_crc32c.value(bytes(data))).astype("<u4").tobytes()


def strip_checksum(data: bytes, where: str = "a chunk") -> bytes:
    """The inverse of :func:`add_checksum`; :class:`ChunkChecksumError` naming ``where`` when the crc32c does not
    match."""
    import google_crc32c

    if len(data) < 4 or np.uint32(google_crc32c.value(bytes(data[:-4]))).astype("<u4").tobytes() != bytes(data[-4:]):
        raise ChunkChecksumError(f"{where}: stored crc32c does not match its bytes (a damaged chunk)")
    return data[:-4]


def _has_checksum(codecs: Any) -> bool:
    from zarr.codecs import Crc32cCodec

    return any(isinstance(c, Crc32cCodec) for c in codecs)


def _is_checksum_error(exc: BaseException) -> bool:
    return isinstance(exc, ChunkChecksumError) or "checksum" in str(exc).lower()


def read_checked(arr: Any, selection: tuple[slice, ...], where: str) -> np.ndarray:
    """``arr[selection]`` of a ``(c, y, x)`` zarr array (basic slices); when a stored chunk fails its checksum (or
    cannot be decoded), a :class:`ChunkChecksumError` that names ``where`` (the store), the array and the first
    chunk of the selection that fails (each touched chunk is read alone to find it, on the error path only)."""
    try:
        return np.asarray(arr[selection])
    except Exception as exc:
        if not _is_checksum_error(exc):
            raise
        first = exc
    chunks = tuple(int(v) for v in arr.chunks)  # the inner chunks of a sharded array
    ranges = []
    for sl, n, c in zip(selection, arr.shape, chunks):
        start, stop, _ = sl.indices(int(n))
        ranges.append(range(start // c, max(start // c + 1, -(-stop // c))))
    for idx in itertools.product(*ranges):
        sel = tuple(slice(i * c, min((i + 1) * c, int(n))) for i, c, n in zip(idx, chunks, arr.shape))
        try:
            arr[sel]
        except Exception as exc:
            if _is_checksum_error(exc):
                key = "/".join(str(i) for i in idx)
                raise ChunkChecksumError(
                    f"{where}: array {arr.path or '/'}, chunk {key}: stored crc32c does not match its bytes (a "
                    "damaged chunk; re-ingest the store with --overwrite)"
                ) from exc
            raise
    raise ChunkChecksumError(f"{where}: array {arr.path or '/'}: {first}") from first


def level_codec_kwargs(
    codec: str, *, zstd_level: int, jpeg_quality: int, shard_side: int | None = None, checksum: bool = True
) -> dict[str, Any]:
    """``zarr.create_array`` keyword arguments of a level stored with ``codec`` (``"zstd"``, ``"jpeg"`` or
    ``"passthrough:<colorspace>"``), in shards of ``shard_side`` px (zarr's ShardingCodec) when given. With
    ``checksum`` every (inner) chunk ends with its crc32c (zarr's ``crc32c`` codec, last in the chain), so a
    damaged chunk fails its read instead of decoding to other pixels; a shard's index always carries one."""
    import zarr

    if shard_side:
        return {
            **level_codec_kwargs(codec, zstd_level=zstd_level, jpeg_quality=jpeg_quality, checksum=checksum),
            "shards": (3, int(shard_side), int(shard_side)),
        }

    from workers.codecs import JpegRGBCodec

    crc = [zarr.codecs.Crc32cCodec()] if checksum else []
    if codec == "zstd":
        # chunks stored interleaved (y, x, c) through zarr's standard transpose codec: the writer encodes
        # rows of the decoded (h, w, 3) block as they are, any zarr v3 reader sees (c, y, x)
        return {
            "filters": [zarr.codecs.TransposeCodec(order=(1, 2, 0))],
            "compressors": [zarr.codecs.ZstdCodec(level=zstd_level), *crc],
        }
    if codec == "jpeg":
        return {"serializer": JpegRGBCodec(quality=jpeg_quality), "compressors": crc or None}
    if codec.startswith("passthrough:"):
        return {
            "serializer": JpegRGBCodec(quality=jpeg_quality, colorspace=codec.split(":", 1)[1]),
            "compressors": crc or None,
        }
    raise ValueError(f"unknown level codec {codec!r}")


_MAX_U64 = 2**64 - 1
_morton_cache: dict[int, list[tuple[int, int]]] = {}


def _morton(ny: int, nx: int) -> list[tuple[int, int]]:
    """``(cy, cx)`` of an ``ny x nx`` shard in the order zarr's ShardingCodec lays out its inner chunks."""
    order = _morton_cache.get((ny, nx))
    if order is None:
        from zarr.core.indexing import morton_order_iter

        order = _morton_cache[(ny, nx)] = [(c[1], c[2]) for c in morton_order_iter((1, ny, nx))]
    return order


def encode_shard(chunks: dict[tuple[int, int], bytes], n: int | tuple[int, int]) -> bytes | None:
    """The bytes zarr's ``ShardingCodec`` (index at the end, index codecs ``bytes`` little-endian + ``crc32c``)
    writes for a shard of ``n x n`` (or ``ny x nx``) inner chunks of a ``(c, y, x)`` array with one chunk along
    ``c``, given the encoded inner chunks by their ``(cy, cx)`` within the shard (absent or empty: fill value).
    None when the shard holds no chunk (zarr then stores no object)."""
    import google_crc32c

    if not chunks:
        return None
    ny, nx = (n, n) if isinstance(n, int) else n
    index = np.full((1, ny, nx, 2), _MAX_U64, dtype="<u8")
    parts: list[bytes] = []
    offset = 0
    for cy, cx in _morton(ny, nx):
        data = chunks.get((cy, cx))
        if not data:
            continue
        index[0, cy, cx] = (offset, len(data))
        parts.append(data)
        offset += len(data)
    if not parts:
        return None
    ib = index.tobytes()
    parts.append(ib)
    parts.append(np.uint32(google_crc32c.value(ib)).astype("<u4").tobytes())
    return b"".join(parts)


def decode_shard(data: bytes, n: int) -> dict[tuple[int, int], bytes]:
    """The inverse of :func:`encode_shard`: the encoded inner chunks ``{(cy, cx): bytes}`` of a shard object of
    ``n x n`` chunks (checksum of the index checked; ValueError when it does not match)."""
    size = n * n * 16
    if len(data) < size + 4:
        raise ValueError(f"a shard of {n}x{n} chunks needs at least {size + 4} bytes, got {len(data)}")
    index = _parse_shard_index(data[-size - 4 :], (n, n))
    return {
        (cy, cx): data[int(o) : int(o) + int(ln)]
        for cy in range(n)
        for cx in range(n)
        for o, ln in [index[cy, cx]]
        if o != _MAX_U64
    }


def _parse_shard_index(tail: bytes, n: tuple[int, int]) -> np.ndarray:
    """The ``[ny, nx, 2]`` (offset, length) index of a shard of ``n = (ny, nx)`` chunks from the shard's last
    ``ny * nx * 16 + 4`` bytes (the little-endian index and its crc32c); ValueError when the checksum does not match."""
    import google_crc32c

    size = n[0] * n[1] * 16
    ib, crc = tail[:size], tail[size:]
    if len(tail) != size + 4 or np.uint32(google_crc32c.value(ib)).astype("<u4").tobytes() != crc:
        raise ValueError("shard index checksum mismatch (a damaged or truncated shard)")
    return np.frombuffer(ib, dtype="<u8").reshape(n[0], n[1], 2)


class ChunkWriter:
    """Encodes the chunks of one store's levels and writes them through zarr's store API.

    Unsharded levels get one object per chunk (``<level>/c/0/<cy>/<cx>``). Sharded levels (``shard_sides``)
    get one object per shard of ``side x side`` pixels — the footprint of one ingest region on that level — so
    a block written by a region is exactly one shard (``<level>/c/0/<sy>/<sx>``), assembled here with zarr's
    byte layout (:func:`encode_shard`) and stored with one ``set``.

    Args:
        store: the store's zarr store (``workers.storage.open_store``).
        tile: chunk side.
        level_shapes: ``(width, height)`` per level (bounds checks).
        level_codecs: codec per level (see :func:`level_codec_kwargs`).
        shard_sides: shard side in pixels per level (a multiple of ``tile``), or None (unsharded).
        zstd_level, jpeg_quality: encoder settings.
        executor: returns the thread pool that encodes chunk rows in parallel, or None (inline).
        durable: :meth:`sync` flushes what was written to a local disk (else it does nothing).
        checksum: every chunk ends with its crc32c (the arrays were created with
            ``level_codec_kwargs(..., checksum=True)``).
    """

    def __init__(
        self,
        store: Any,
        *,
        tile: int,
        level_shapes: list[tuple[int, int]],
        level_codecs: list[str],
        shard_sides: list[int] | None = None,
        zstd_level: int,
        jpeg_quality: int,
        executor: Callable[[], ThreadPoolExecutor | None] = lambda: None,
        durable: bool = False,
        checksum: bool = True,
    ):
        self.store = store
        self.checksum = bool(checksum)
        self.tile = int(tile)
        self.level_shapes = level_shapes
        self.level_codecs = level_codecs
        self.shard_sides = list(shard_sides) if shard_sides else None
        self.zstd_level, self.jpeg_quality = zstd_level, jpeg_quality
        self._executor = executor
        self._local = threading.local()  # per-thread chunk buffers
        self._zstd: Any = None
        self.durable = bool(durable)

    def sync(self) -> None:
        """Make every chunk written (or removed) so far durable on a local disk
        (:func:`workers.storage.sync_local`); the tiler calls it before it marks a region done. A no-op unless
        ``durable`` (and on object storage, where a finished PUT is durable)."""
        if self.durable:
            storage.sync_local(self.store)

    def _shard(self, level: int) -> int:
        return self.shard_sides[level] if self.shard_sides else 0

    def _check_box(self, level: int, x_lv: int, y_lv: int, w: int, h: int) -> None:
        t = self.tile
        w_lv, h_lv = self.level_shapes[level]
        if x_lv % t or y_lv % t:
            raise ValueError(f"block origin ({x_lv}, {y_lv}) is not aligned to the {t}-px chunk grid")
        if x_lv + w > w_lv or y_lv + h > h_lv:
            raise ValueError(f"block {w}x{h} at ({x_lv}, {y_lv}) exceeds level {level} of size {w_lv}x{h_lv}")
        s = self._shard(level)
        if s and (x_lv // s != (x_lv + w - 1) // s or y_lv // s != (y_lv + h - 1) // s):
            raise ValueError(
                f"block {w}x{h} at ({x_lv}, {y_lv}) of level {level} spans more than one {s}-px shard "
                "(sharded levels are written one region = one shard at a time)"
            )

    def write_block(self, level: int, x_lv: int, y_lv: int, block: np.ndarray) -> list[Future]:
        """Encode and store the chunks of ``block`` (h, w, 3) at ``(x_lv, y_lv)`` of ``level`` (chunk-aligned;
        within one shard on a sharded level).

        With a thread pool the chunk rows are encoded there and their futures returned (``block`` must stay
        unchanged until they finish); otherwise everything is written before returning ``[]``."""
        t = self.tile
        bh, bw, _ = block.shape
        self._check_box(level, x_lv, y_lv, bw, bh)
        codec = self.level_codecs[level]
        rows = range(0, bh, t)
        pool = self._executor()
        s = self._shard(level)
        if not s:
            if pool is None or len(rows) < 2:
                for oy in rows:
                    self._store_row(level, self._encode_row(codec, x_lv, y_lv, block, oy))
                return []
            return [
                pool.submit(lambda oy: self._store_row(level, self._encode_row(codec, x_lv, y_lv, block, oy)), oy)
                for oy in rows
            ]
        if pool is None or len(rows) < 2:
            encoded: dict[tuple[int, int], bytes | None] = {}
            for oy in rows:
                encoded.update(self._encode_row(codec, x_lv, y_lv, block, oy))
            self._store_shard(level, x_lv, y_lv, encoded)
            return []
        futures = [pool.submit(self._encode_row, codec, x_lv, y_lv, block, oy) for oy in rows]

        def assemble() -> None:
            encoded: dict[tuple[int, int], bytes | None] = {}
            for f in futures:  # submitted before this task: never waits on a task queued behind it
                encoded.update(f.result())
            self._store_shard(level, x_lv, y_lv, encoded)

        return [*futures, pool.submit(assemble)]

    def write_encoded(self, level: int, x_lv: int, y_lv: int, w: int, h: int, chunks: dict[tuple[int, int], bytes]):
        """Store already-encoded chunks (JPEG passthrough) of the box ``(x_lv, y_lv, w, h)`` of ``level``, keyed by
        their level chunk indices ``(cy, cx)``; chunks of the box not given are fill value."""
        self._check_box(level, x_lv, y_lv, w, h)
        t = self.tile
        full: dict[tuple[int, int], bytes | None] = {
            (cy, cx): None
            for cy in range(y_lv // t, -(-(y_lv + h) // t))
            for cx in range(x_lv // t, -(-(x_lv + w) // t))
        }
        full.update({k: add_checksum(d) if self.checksum else d for k, d in chunks.items()})
        if self._shard(level):
            self._store_shard(level, x_lv, y_lv, full)
        else:
            self._store_row(level, full)

    def clear_chunks(self, level: int, x_lv: int, y_lv: int, w: int, h: int) -> None:
        """An all-white box of ``level``: no chunk is stored (fill value); remove any left by an earlier run."""
        self.write_encoded(level, x_lv, y_lv, w, h, {})

    def _store_row(self, level: int, encoded: dict[tuple[int, int], bytes | None]) -> None:
        storage.put_bytes(
            self.store, [(f"{level}/c/0/{cy}/{cx}", d) for (cy, cx), d in encoded.items() if d is not None]
        )
        # (a re-run of a region never leaves a stale chunk)
        storage.delete_keys(self.store, [f"{level}/c/0/{cy}/{cx}" for (cy, cx), d in encoded.items() if d is None])

    def _store_shard(self, level: int, x_lv: int, y_lv: int, encoded: dict[tuple[int, int], bytes | None]) -> None:
        s, t = self._shard(level), self.tile
        sy, sx = y_lv // s, x_lv // s
        n, cy0, cx0 = s // t, sy * (s // t), sx * (s // t)
        data = encode_shard({(cy - cy0, cx - cx0): d for (cy, cx), d in encoded.items() if d is not None}, n)
        key = f"{level}/c/0/{sy}/{sx}"
        if data is None:
            storage.delete_keys(self.store, [key])
        else:
            storage.put_bytes(self.store, [(key, data)])

    def _encode_row(
        self, codec: str, x_lv: int, y_lv: int, block: np.ndarray, oy: int
    ) -> dict[tuple[int, int], bytes | None]:
        """Encode the chunks of block rows ``oy:oy+t``: ``{(cy, cx): bytes, or None for an all-white chunk}``
        (thread-safe)."""
        from workers.codecs import encode_jpeg_hwc

        t = self.tile
        cbuf = getattr(self._local, "chunk", None)
        if cbuf is None or cbuf.shape != (t, t, 3):
            cbuf = self._local.chunk = np.empty((t, t, 3), np.uint8)
        zstd = self._zstd_codec() if codec == "zstd" else None
        cy = (y_lv + oy) // t
        out: dict[tuple[int, int], bytes | None] = {}
        for ox in range(0, block.shape[1], t):
            chunk = block[oy : oy + t, ox : ox + t]
            cx = (x_lv + ox) // t
            if chunk.shape[0] != t or chunk.shape[1] != t:  # edge chunk: padded with the fill value 255
                cbuf.fill(255)
                cbuf[: chunk.shape[0], : chunk.shape[1]] = chunk
            else:
                np.copyto(cbuf, chunk)
            if cbuf[0, 0, 0] == 255 and cbuf.min() == 255:  # short-circuits for most tissue chunks
                out[(cy, cx)] = None
                continue
            if zstd is not None:
                data = zstd.encode(cbuf)  # the transpose codec's (y, x, c) chunk, zarr's own zstd encoder
            else:
                data = encode_jpeg_hwc(cbuf, self.jpeg_quality)
            out[(cy, cx)] = add_checksum(data) if self.checksum else data
        return out

    def _zstd_codec(self) -> Any:
        """numcodecs' Zstd at the run's level: the encoder zarr's ``ZstdCodec`` itself uses (same bytes)."""
        if self._zstd is None:
            from numcodecs import Zstd

            self._zstd = Zstd(level=self.zstd_level)
        return self._zstd


# ------------------------------------------------------------------------------------------------ reading
class LocalChunkReader:
    """Decoded chunks of one level of a *local* store, read straight from its chunk (or shard) files: the pixels
    zarr returns, without zarr's per-call machinery (a level-0 patch read touches one to four chunks, and zarr's
    asynchronous get, shard-index read and codec pipeline cost about 2 ms per call on top of a 0.7 ms JPEG
    decode; ``benchmarks/RESULTS.md``, "Speed of a training step").

    Only the layouts ingest writes are read here (:func:`local_chunk_reader` returns None for anything else, and
    callers fall back to zarr): a ``(3, h, w)`` uint8 array on a local folder, the default ``/`` chunk keys,
    optionally zarr's sharding (index at the end, ``bytes`` little-endian + ``crc32c``), and inner chunks that are
    :class:`workers.codecs.JpegRGBCodec` JPEGs, ``transpose(1, 2, 0)`` + ``bytes`` + ``zstd`` or ``bytes`` + ``zstd``,
    each optionally followed by ``crc32c`` (checked on every read). A missing
    chunk (no file, or an empty shard-index entry) is the fill value. The shard indexes are read once per shard
    and kept (16 bytes per chunk) while the shard file's size and mtime stay the same; thread-safe for reads.

    Args:
        root: the store's folder; ``array_path``: the level's key inside it (``"0"``).
        shape: ``(3, h, w)``; ``chunk``: inner chunk ``(th, tw)``; ``shard``: shard ``(sh, sw)`` or None.
        decode: bytes of one inner chunk -> ``(3, th, tw)`` uint8.
        fill: the fill value.
        checksum: each stored chunk ends with its crc32c (checked, then stripped, before ``decode``; a mismatch is a
            :class:`ChunkChecksumError` naming the store, array and chunk).
    """

    def __init__(
        self,
        root: str,
        array_path: str,
        shape,
        chunk,
        shard,
        decode: Callable[[bytes], np.ndarray],
        fill,
        checksum: bool = False,
    ):
        self.store_root, self.array_path = str(root), str(array_path)
        self.checksum = bool(checksum)
        self.root = os.path.join(root, array_path) if array_path else root
        self.shape = tuple(int(v) for v in shape)
        self.chunk = (int(chunk[0]), int(chunk[1]))
        self.shard = None if shard is None else (int(shard[0]), int(shard[1]))
        self._decode = decode
        self.fill = int(fill)
        self._index: dict[tuple[int, int], tuple[Any, np.ndarray | None]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _shard_index(self, path: str, key: tuple[int, int], n: tuple[int, int]) -> np.ndarray | None:
        """The shard's index ``[ny, nx, 2]`` (offset, length), kept while the file's size and mtime stay the same
        (a store written again is read again); None when the shard is not stored."""
        try:
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            hit = self._index.get(key)
            if hit is not None and hit[0] == stamp:
                return hit[1]
        index = None
        if stamp is not None:
            size = n[0] * n[1] * 16
            if stamp[0] < size + 4:
                raise ValueError(f"shard {path} holds {stamp[0]} bytes, fewer than its index needs ({size + 4})")
            with open(path, "rb") as fh:
                fh.seek(stamp[0] - size - 4)
                tail = fh.read(size + 4)
            try:
                index = _parse_shard_index(tail, n)
            except ValueError as exc:
                raise ValueError(f"shard {path}: {exc}") from None
        with self._lock:
            self._index[key] = (stamp, index)
        return index

    def encoded(self, cy: int, cx: int) -> bytes | None:
        """The stored bytes of inner chunk ``(cy, cx)`` (None: not stored, i.e. the fill value)."""
        th, tw = self.chunk
        if self.shard is None:
            try:
                with open(os.path.join(self.root, "c", "0", str(cy), str(cx)), "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                return None
        ny, nx = self.shard[0] // th, self.shard[1] // tw
        sy, sx = cy // ny, cx // nx
        path = os.path.join(self.root, "c", "0", str(sy), str(sx))
        index = self._shard_index(path, (sy, sx), (ny, nx))
        if index is None:
            return None
        off, nbytes = (int(v) for v in index[cy - sy * ny, cx - sx * nx])
        if off == _MAX_U64:
            return None
        with open(path, "rb") as fh:
            fh.seek(off)
            data = fh.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"shard {path}: chunk ({cy}, {cx}) is cut short ({len(data)} of {nbytes} bytes)")
        return data

    def read(self, cy: int, cx: int) -> np.ndarray:
        """Chunk ``(cy, cx)`` as ``(3, th', tw')`` uint8, cut at the level's edge (``th' <= th``) as zarr returns it."""
        th, tw = self.chunk
        h = min(th, self.shape[1] - cy * th)
        w = min(tw, self.shape[2] - cx * tw)
        if h <= 0 or w <= 0 or cy < 0 or cx < 0:
            raise IndexError(f"chunk ({cy}, {cx}) is outside a level of shape {self.shape} in {th}x{tw} chunks")
        data = self.encoded(cy, cx)
        if data is None:
            return np.full((3, h, w), self.fill, dtype=np.uint8)
        if self.checksum:
            data = strip_checksum(data, f"{self.store_root}: array {self.array_path or '/'}, chunk 0/{cy}/{cx}")
        full = self._decode(data)
        if full.shape != (3, th, tw):
            raise ValueError(f"chunk ({cy}, {cx}) of {self.root} decodes to {full.shape}, expected {(3, th, tw)}")
        return full[:, :h, :w]


def _zstd_decoder(chunk: tuple[int, int], interleaved: bool) -> Callable[[bytes], np.ndarray]:
    """zstd-compressed raw bytes of a ``chunk = (th, tw)`` chunk -> ``(3, th, tw)`` uint8; ``interleaved``: the bytes
    are ``(th, tw, 3)`` (zarr's ``transpose(1, 2, 0)`` codec before them), else ``(3, th, tw)``."""
    import numcodecs

    zstd = numcodecs.Zstd()
    th, tw = chunk

    def decode(data: bytes) -> np.ndarray:
        raw = np.frombuffer(zstd.decode(data), dtype=np.uint8)
        if raw.size != th * tw * 3:
            raise ValueError(f"a zstd chunk decodes to {raw.size} bytes, expected {th * tw * 3}")
        if interleaved:
            return np.ascontiguousarray(raw.reshape(th, tw, 3).transpose(2, 0, 1))
        return raw.reshape(3, th, tw).copy()

    return decode


def _inner_decoder(codecs: Any, chunk: tuple[int, int]) -> Callable[[bytes], np.ndarray] | None:
    """A decoder of one inner chunk for the codec chains ingest writes, or None."""
    from zarr.codecs import BytesCodec, TransposeCodec, ZstdCodec

    from workers.codecs import JpegRGBCodec, decode_jpeg_chunk

    codecs = tuple(codecs)
    if len(codecs) == 1 and isinstance(codecs[0], JpegRGBCodec):
        colorspace = codecs[0].colorspace
        return lambda data: decode_jpeg_chunk(data, colorspace)
    if (
        len(codecs) == 3
        and isinstance(codecs[0], TransposeCodec)
        and tuple(codecs[0].order) == (1, 2, 0)
        and isinstance(codecs[1], BytesCodec)
        and isinstance(codecs[2], ZstdCodec)
    ):
        return _zstd_decoder(chunk, interleaved=True)
    if len(codecs) == 2 and isinstance(codecs[0], BytesCodec) and isinstance(codecs[1], ZstdCodec):
        return _zstd_decoder(chunk, interleaved=False)
    return None


def local_chunk_reader(arr: Any) -> LocalChunkReader | None:
    """A :class:`LocalChunkReader` of a zarr v3 array (a store level), or None when its layout or location is one
    this reader does not handle (object storage, other codecs, other key encodings): read it with zarr then."""
    try:
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
        from zarr.storage import LocalStore

        store = arr.store_path.store
        meta = arr.metadata
        if not isinstance(store, LocalStore) or getattr(meta, "zarr_format", None) != 3:
            return None
        if len(arr.shape) != 3 or int(arr.shape[0]) != 3 or np.dtype(arr.dtype) != np.uint8:
            return None
        enc = meta.chunk_key_encoding
        if type(enc).__name__ != "DefaultChunkKeyEncoding" or getattr(enc, "separator", None) != "/":
            return None
        outer = tuple(int(v) for v in meta.chunk_grid.chunk_shape)
        codecs = tuple(meta.codecs)
        shard = None
        if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
            sc = codecs[0]
            idx = tuple(sc.index_codecs)
            if (
                str(getattr(sc.index_location, "value", sc.index_location)) != "end"
                or len(idx) != 2
                or not isinstance(idx[0], BytesCodec)
                or str(getattr(idx[0].endian, "value", idx[0].endian)) != "little"
                or not isinstance(idx[1], Crc32cCodec)
            ):
                return None
            inner = tuple(int(v) for v in sc.chunk_shape)
            if outer[0] != 3 or inner[0] != 3 or outer[1] % inner[1] or outer[2] % inner[2]:
                return None
            shard, chunk, codecs = (outer[1], outer[2]), (inner[1], inner[2]), sc.codecs
        elif outer[0] == 3:
            chunk = (outer[1], outer[2])
        else:
            return None
        codecs = tuple(codecs)
        checksum = bool(codecs) and isinstance(codecs[-1], Crc32cCodec)
        decode = _inner_decoder(codecs[:-1] if checksum else codecs, chunk)
        if decode is None:
            return None
        fill = meta.fill_value
        return LocalChunkReader(
            str(store.root), str(arr.store_path.path), arr.shape, chunk, shard, decode, int(fill), checksum=checksum
        )
    except Exception:  # an unexpected zarr layout: the zarr path reads it
        return None
