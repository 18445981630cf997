"""benchmarks/array_stores.py: a tiled store made with hard links reads exactly as the same image written whole."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from array_stores import checker_tile, make_archive, tiled_store

from workers.store import SlideStore, verify_store, write_store_from_array


def test_tiled_store_equals_the_whole_image(tmp_path):
    tile = checker_tile(3, 2048, 1)
    tiled = SlideStore(tiled_store(tmp_path / "t.zarr", tile, 3, slide_id="t", chunk=512))
    whole = write_store_from_array(tmp_path / "w.zarr", np.tile(tile, (3, 3, 1)), tile_size=512, min_size=1024)
    assert verify_store(tmp_path / "t.zarr", deep=True) == []
    assert tiled.meta.level0_size == whole.meta.level0_size == (6144, 6144)
    assert tiled.meta.downsamples == whole.meta.downsamples
    for level, ds in enumerate(whole.meta.downsamples):  # every level linked (the tile covers whole chunks)
        side = int(6144 // ds)
        np.testing.assert_array_equal(
            tiled.read_region((0, 0), level, (side, side)), whole.read_region((0, 0), level, (side, side))
        )


def test_make_archive_labels_and_arguments(tmp_path):
    out = make_archive(tmp_path / "a", 2, 2048, tile=2048)
    assert (out / "labels.csv").read_text().splitlines() == ["slide_id,label", "s0000,0", "s0001,1"]
    assert SlideStore(out / "s0001.zarr").meta.level0_size == (2048, 2048)
    with pytest.raises(ValueError, match="multiple of the tile side 2048, got 3000"):
        make_archive(tmp_path / "b", 1, 3000, tile=2048)
    with pytest.raises(ValueError, match="multiple of 128"):
        tiled_store(tmp_path / "c.zarr", np.zeros((100, 100, 3), np.uint8), 2, slide_id="c", chunk=128)
