"""Deep-zoom tiles cut from a slide store on request (``foveate view``).

A tile is a ``tile_size`` square of one store level: tile ``(col, row)`` of level ``l`` covers level-``l`` pixels
``[col * tile_size, (col + 1) * tile_size) x [row * tile_size, (row + 1) * tile_size)``, i.e. level-0 pixels
``col * tile_size * downsamples[l]`` onwards (the frames: :mod:`workers.frames`). Edge tiles are cut to the
level's extent (smaller than ``tile_size``). Only the chunks under the tile are read
(:meth:`workers.store.SlideStore.read_region`), never a whole level; encoded tiles are kept in a
:class:`TileCache` (least recently used out first, bounded in bytes), which several :class:`TileSource` objects
may share.
"""

from __future__ import annotations

import io
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

__all__ = ["FORMATS", "TileCache", "TileSource", "encode_image"]

log = logging.getLogger(__name__)

# format name (as in the URL) -> (Pillow format, media type)
FORMATS: dict[str, tuple[str, str]] = {"png": ("PNG", "image/png"), "jpg": ("JPEG", "image/jpeg")}


def encode_image(rgb: np.ndarray, fmt: str = "png", *, quality: int = 85) -> bytes:
    """Encode an ``(h, w, 3)`` or ``(h, w, 4)`` uint8 array as PNG or JPEG bytes.

    Args:
        rgb: the pixels.
        fmt: ``"png"`` or ``"jpg"`` (see :data:`FORMATS`).
        quality: JPEG quality.

    Raises:
        ValueError: an unknown format, or not an image array.
    """
    from PIL import Image

    if fmt not in FORMATS:
        raise ValueError(f"tile format must be one of {sorted(FORMATS)}, got {fmt!r}")
    arr = np.asarray(rgb)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise ValueError(f"expected an (h, w, 3|4) uint8 array, got {arr.shape} {arr.dtype}")
    buf = io.BytesIO()
    img = Image.fromarray(np.ascontiguousarray(arr))
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        img.convert("RGB").save(buf, format="JPEG", quality=int(quality))
    return buf.getvalue()


class TileCache:
    """A thread-safe LRU of encoded tiles, bounded by the total size of its values.

    Args:
        max_bytes: the budget; the least recently used entries are dropped when it is exceeded (a value larger
            than the budget is not kept).

    Attributes:
        hits, misses: lookup counts.
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._data: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> bytes | None:
        """The value of ``key`` (marked most recently used), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Hashable, value: bytes) -> None:
        """Store ``value`` under ``key`` and drop least recently used entries beyond the budget."""
        if len(value) > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                _, dropped = self._data.popitem(last=False)
                self._bytes -= len(dropped)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        """Total size of the cached values."""
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0


def _index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


class TileSource:
    """Tiles of one slide store.

    Args:
        store: an open :class:`workers.store.SlideStore`.
        tile_size: tile side in pixels of the tile's level.
        cache: a shared :class:`TileCache` (default: a private one of 64 MiB).
        quality: JPEG quality of ``jpg`` tiles.
    """

    def __init__(self, store, *, tile_size: int = 256, cache: TileCache | None = None, quality: int = 85):
        if isinstance(tile_size, bool) or not isinstance(tile_size, int):
            raise TypeError(f"tile_size must be an int, got {type(tile_size).__name__}")
        if tile_size < 1:
            raise ValueError(f"tile_size must be >= 1, got {tile_size}")
        self.store = store
        self.tile_size = tile_size
        self.cache = cache if cache is not None else TileCache(64 * 2**20)
        self.quality = int(quality)
        self._key = str(getattr(store, "path", id(store)))

    @property
    def level_count(self) -> int:
        return self.store.level_count

    def grid(self, level: int) -> tuple[int, int]:
        """``(cols, rows)`` of tiles of ``level``.

        Raises:
            ValueError: no such level.
        """
        level = _index("level", level)
        if not 0 <= level < self.store.level_count:
            raise ValueError(f"level must be in [0, {self.store.level_count}), got {level}")
        w, h = self.store.level_dimensions[level]
        return math.ceil(w / self.tile_size), math.ceil(h / self.tile_size)

    def tile_box(self, level: int, col: int, row: int) -> tuple[int, int, int, int]:
        """``(x, y, w, h)`` of the tile in pixels of ``level`` (``w``, ``h`` smaller at the right / bottom edge).

        Raises:
            TypeError: a non-integer argument.
            ValueError: a level, column or row outside the level's tile grid.
        """
        cols, rows = self.grid(level)
        col, row = _index("col", col), _index("row", row)
        if not 0 <= col < cols:
            raise ValueError(f"col must be in [0, {cols}) at level {level}, got {col}")
        if not 0 <= row < rows:
            raise ValueError(f"row must be in [0, {rows}) at level {level}, got {row}")
        w, h = self.store.level_dimensions[level]
        x, y = col * self.tile_size, row * self.tile_size
        return x, y, min(self.tile_size, w - x), min(self.tile_size, h - y)

    def pixels(self, level: int, col: int, row: int) -> np.ndarray:
        """The tile as ``(h, w, 3)`` uint8 (reads only the chunks under it)."""
        x, y, w, h = self.tile_box(level, col, row)
        ds = self.store.downsamples[level]
        # a level-0 location whose floor(location / ds) is exactly (x, y) even for non-integer downsamples
        loc = (_level0(x, ds), _level0(y, ds))
        return self.store.read_region(loc, level, (w, h))

    def tile(self, level: int, col: int, row: int, fmt: str = "png") -> bytes:
        """The encoded tile (from the cache when it is there).

        Args:
            level: store level (0 = full resolution).
            col, row: tile column and row in that level's grid (:meth:`grid`).
            fmt: ``"png"`` or ``"jpg"``.

        Raises:
            TypeError: a non-integer level, column or row.
            ValueError: a level, column or row outside the store, or an unknown format.
        """
        if fmt not in FORMATS:
            raise ValueError(f"tile format must be one of {sorted(FORMATS)}, got {fmt!r}")
        self.tile_box(level, col, row)  # validate before touching the cache
        key = (self._key, self.tile_size, int(level), int(col), int(row), fmt)
        data = self.cache.get(key)
        if data is None:
            data = encode_image(self.pixels(level, col, row), fmt, quality=self.quality)
            self.cache.put(key, data)
        return data


def _level0(x_level: int, ds: float) -> float:
    """A level-0 coordinate ``c`` with ``floor(c / ds) == x_level``."""
    c = x_level * ds
    if math.floor(c / ds) < x_level:
        c = math.nextafter(c, math.inf)
        while math.floor(c / ds) < x_level:
            c = math.nextafter(c, math.inf)
    return c
