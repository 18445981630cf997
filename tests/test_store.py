import numpy as np
import pytest

from workers.pyramid import downsample2x
from workers.store import SlideStore, pyramid_shapes, write_store_from_array


def test_pyramid_shapes_power_of_two_down_to_min_size():
    shapes = pyramid_shapes((5000, 3001), min_size=1024)
    assert [ds for ds, _ in shapes] == [1, 2, 4, 8]
    assert shapes[-1][1] == (625, 376)
    with pytest.raises(ValueError, match="positive"):
        pyramid_shapes((0, 10))


def test_downsample2x_is_rounded_mean_with_edge_padding():
    a = np.arange(3 * 3 * 3, dtype=np.uint8).reshape(3, 3, 3)  # (h, w, c)
    d = downsample2x(a)
    assert d.shape == (2, 2, 3)
    assert d[0, 0, 0] == (a[0, 0, 0] + a[0, 1, 0] + a[1, 0, 0] + a[1, 1, 0] + 2) // 4
    assert d[1, 1, 0] == a[2, 2, 0]  # corner made of one replicated pixel


def test_store_read_region_matches_array_and_is_white_outside(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(700, 900, 3), dtype=np.uint8)
    s = write_store_from_array(tmp_path / "a.zarr", img, tile_size=128, min_size=256)
    assert s.dimensions == (900, 700)
    assert s.downsamples == (1.0, 2.0, 4.0)
    np.testing.assert_array_equal(s.read_region((100, 50), 0, (300, 200)), img[50:250, 100:400])
    out = s.read_region((-10, 690), 0, (30, 20))
    assert (out[:, :10] == 255).all() and (out[10:] == 255).all()
    np.testing.assert_array_equal(out[:10, 10:], img[690:700, 0:20])
    assert s.best_level_for_downsample(3.0) == 1


def test_incomplete_store_is_refused(tmp_path):
    img = np.full((64, 64, 3), 255, np.uint8)
    write_store_from_array(tmp_path / "b.zarr", img)
    (tmp_path / "b.zarr" / "foveate_complete.json").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        SlideStore(tmp_path / "b.zarr")


def test_store_validates_and_carries_the_rgb_omero_block(tmp_path):
    """ome-zarr-models validates the image (omero block included: its Omero model too) and ome-zarr-py reads
    the channel names, colours, contrast limits and visibility napari uses to show the slide in colour."""
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.common.omero import Omero
    from ome_zarr_models.v05.image import Image as NgffImage

    img = np.random.default_rng(1).integers(0, 256, size=(300, 200, 3), dtype=np.uint8)
    s = write_store_from_array(tmp_path / "c.zarr", img, tile_size=64, min_size=64)
    g = zarr.open_group(str(s.path), mode="r")
    omero = NgffImage.from_zarr(g).attributes.ome.omero
    assert omero == dict(g.attrs)["ome"]["omero"]
    channels = Omero.model_validate(omero).channels
    assert [c.color for c in channels] == ["FF0000", "00FF00", "0000FF"]
    assert all((c.window.start, c.window.end, c.window.min, c.window.max) == (0, 255, 0, 255) for c in channels)
    assert [c["label"] for c in omero["channels"]] == ["red", "green", "blue"]
    assert all(c["active"] is True for c in omero["channels"]) and omero["rdefs"] == {"model": "color"}
    node = list(Reader(parse_url(str(s.path)))())[0]
    assert node.metadata["channel_names"] == ["red", "green", "blue"]
    assert node.metadata["contrast_limits"] == [[0, 255]] * 3
    assert node.metadata["visible"] == [True] * 3
    assert node.metadata["colormap"] == [[[0, 0, 0], [1, 0, 0]], [[0, 0, 0], [0, 1, 0]], [[0, 0, 0], [0, 0, 1]]]
    assert "omero" not in dict(g["labels/tissue"].attrs)["ome"]  # labels are not RGB


def test_local_listing_walks_the_folder_and_equals_zarrs(tmp_path):
    """workers.storage.list_keys on a local store walks the folder in the calling thread; the keys are those zarr's
    own LocalStore.list_prefix yields, for the whole store, a level, a nested group and a missing prefix."""
    from zarr.core.sync import sync
    from zarr.storage import LocalStore

    from workers import storage

    rng = np.random.default_rng(0)
    write_store_from_array(tmp_path / "s.zarr", rng.integers(0, 255, (300, 500, 3), dtype=np.uint8), tile_size=64)
    store = LocalStore(tmp_path / "s.zarr")

    async def zarrs(prefix):
        return sorted([k async for k in store.list_prefix(prefix)])

    for prefix in ("", "0/", "0", "labels/", "labels/tissue/0", "missing/"):
        assert storage.list_keys(store, prefix) == sync(zarrs(prefix)), prefix
    assert len(storage.list_keys(store, "0/")) == 1 + 5 * 8  # zarr.json + the 5 x 8 chunks of level 0
