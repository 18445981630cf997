"""workers.tiles: tiles cut from a store equal SlideStore.read_region, edge tiles, argument checks, the LRU."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from workers.store import write_store_from_array
from workers.tiles import TileCache, TileSource, encode_image


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (700, 1000, 3), dtype=np.uint8)  # not a multiple of the tile size
    return write_store_from_array(tmp_path_factory.mktemp("tiles") / "t.zarr", img, tile_size=128, min_size=100)


def _decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_tiles_equal_read_region_every_level(store):
    src = TileSource(store, tile_size=256)
    assert store.level_count >= 3
    for level in range(store.level_count):
        w, h = store.level_dimensions[level]
        cols, rows = src.grid(level)
        assert (cols, rows) == (-(-w // 256), -(-h // 256))
        ds = store.downsamples[level]
        for col in range(cols):
            for row in range(rows):
                got = _decode(src.tile(level, col, row, "png"))
                tw, th = min(256, w - col * 256), min(256, h - row * 256)  # edge tiles are cut to the level
                assert got.shape == (th, tw, 3)
                ref = store.read_region((int(col * 256 * ds), int(row * 256 * ds)), level, (tw, th))
                np.testing.assert_array_equal(got, ref)


def test_edge_tile_and_jpeg(store):
    src = TileSource(store, tile_size=256)
    cols, rows = src.grid(0)
    assert src.tile_box(0, cols - 1, rows - 1) == ((cols - 1) * 256, (rows - 1) * 256, 1000 - 768, 700 - 512)
    jpg = src.tile(0, cols - 1, rows - 1, "jpg")
    assert jpg[:2] == b"\xff\xd8"
    assert _decode(jpg).shape == (700 - 512, 1000 - 768, 3)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((-1, 0, 0), ValueError, "level must be in"),
        ((99, 0, 0), ValueError, "level must be in"),
        ((0, 4, 0), ValueError, "col must be in"),
        ((0, 0, 3), ValueError, "row must be in"),
        ((0, -1, 0), ValueError, "col must be in"),
        ((0, 0, "1"), TypeError, "row must be an int"),
        ((True, 0, 0), TypeError, "level must be an int"),
        ((0.0, 0, 0), TypeError, "level must be an int"),
    ],
)
def test_bad_arguments(store, args, exc, match):
    with pytest.raises(exc, match=match):
        TileSource(store).tile(*args)


def test_bad_format_and_construction(store):
    with pytest.raises(ValueError, match="format must be one of"):
        TileSource(store).tile(0, 0, 0, "gif")
    with pytest.raises(ValueError, match="tile_size must be >= 1"):
        TileSource(store, tile_size=0)
    with pytest.raises(TypeError, match="tile_size must be an int"):
        TileSource(store, tile_size=256.0)
    with pytest.raises(ValueError, match="expected an"):
        encode_image(np.zeros((4, 4), np.uint8))


def test_cache_hits_and_lru_budget(store):
    cache = TileCache(10_000_000)
    src = TileSource(store, cache=cache)
    a = src.tile(0, 0, 0)
    assert (cache.hits, cache.misses) == (0, 1)
    assert src.tile(0, 0, 0) is a
    assert cache.hits == 1
    small = TileCache(100)
    small.put("a", b"x" * 60)
    small.put("b", b"y" * 30)
    assert small.get("a") is not None  # a is now most recently used
    small.put("c", b"z" * 30)  # over budget: b (least recently used) goes
    assert small.get("b") is None and small.get("a") is not None and small.get("c") is not None
    assert small.nbytes == 90 and len(small) == 2
    small.put("big", b"q" * 101)  # larger than the budget: not kept
    assert small.get("big") is None


def test_only_the_tile_is_read(store, monkeypatch):
    """A tile reads read_region once with the tile's size (never a whole level)."""
    calls = []
    orig = store.read_region

    def spy(loc, level, size):
        calls.append((level, size))
        return orig(loc, level, size)

    monkeypatch.setattr(store, "read_region", spy)
    monkeypatch.setattr(store, "read_level", lambda *a: pytest.fail("read_level called"))
    TileSource(store, cache=TileCache(0)).tile(0, 1, 1)
    assert calls == [(0, (256, 256))]
