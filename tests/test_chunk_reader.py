"""Reading chunks straight from a local store's files (workers.chunks.LocalChunkReader): the same pixels zarr
returns, for every codec chain and layout ingest writes (JPEG or zstd, sharded or not), every chunk including the
cut edge chunks and chunks never written; patches read through it equal patches read through zarr; layouts it does
not know are left to zarr; a damaged shard index is an error, not wrong pixels."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr

from workers.chunks import level_codec_kwargs, local_chunk_reader
from workers.patches import PatchGrid, PatchReader
from workers.store import write_store_from_array


def _image(h: int = 700, w: int = 610, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 255, np.uint8)
    y1, x1 = h - 50 - (h % 64), w - 50 - (w % 64)
    img[40:y1, 30:x1] = rng.integers(0, 256, (y1 - 40, x1 - 30, 3), dtype=np.uint8)  # white borders: not written
    return img


@pytest.mark.parametrize(
    "codec, shard",
    [("jpeg", 256), ("zstd", 256), ("jpeg", None), ("zstd", None), ("passthrough:rgb", 256), ("zstd", 128)],
)
def test_every_chunk_equals_zarr(tmp_path, codec, shard):
    import workers.codecs  # noqa: F401  (registers the JPEG codec)

    img = np.moveaxis(_image(), -1, 0)  # (3, h, w)
    arr = zarr.create_array(
        store=str(tmp_path / "s.zarr"),
        name="0",
        shape=img.shape,
        chunks=(3, 64, 64),
        dtype="uint8",
        fill_value=255,
        config={"write_empty_chunks": False},
        zarr_format=3,
        **level_codec_kwargs(codec, zstd_level=3, jpeg_quality=90, shard_side=shard),
    )
    arr[...] = img
    reader = local_chunk_reader(zarr.open_array(str(tmp_path / "s.zarr"), path="0", mode="r"))
    assert (
        reader is not None and reader.chunk == (64, 64) and reader.shard == (None if shard is None else (shard, shard))
    )
    h, w = img.shape[1:]
    missing = 0
    for cy in range(-(-h // 64)):
        for cx in range(-(-w // 64)):
            ref = np.asarray(arr[:, cy * 64 : min(h, cy * 64 + 64), cx * 64 : min(w, cx * 64 + 64)])
            missing += reader.encoded(cy, cx) is None
            np.testing.assert_array_equal(reader.read(cy, cx), ref)
    assert missing > 0  # the white border was not written: read as the fill value
    with pytest.raises(IndexError):
        reader.read(h // 64 + 1, 0)


def test_patches_through_the_chunk_files_equal_patches_through_zarr(tmp_path):
    store = write_store_from_array(tmp_path / "s.zarr", _image(1100, 900, seed=1), tile_size=128, min_size=256)
    grid = PatchGrid.from_store(store, 48, 40)
    direct, via_zarr = PatchReader(store, grid), PatchReader(store, grid)
    via_zarr._direct = False
    cells = torch.randperm(grid.num_cells, generator=torch.Generator().manual_seed(0))[:60]
    offsets = torch.randint(-70, 71, (60, 2), generator=torch.Generator().manual_seed(1))  # some past the edges
    for off in (None, offsets):
        a = direct.read(cells, off)
        assert direct._direct, "the store's chunk files were not read directly"
        assert torch.equal(a, via_zarr.read(cells, off))


def test_unknown_layouts_are_left_to_zarr_and_a_damaged_index_is_an_error(tmp_path):
    arr = zarr.create_array(store=str(tmp_path / "g.zarr"), shape=(3, 64, 64), chunks=(3, 32, 32), dtype="uint16")
    assert local_chunk_reader(arr) is None  # not uint8
    arr = zarr.create_array(
        store=str(tmp_path / "b.zarr"), shape=(3, 64, 64), chunks=(3, 32, 32), dtype="uint8", compressors=None
    )
    assert local_chunk_reader(arr) is None  # an uncompressed chain ingest does not write
    img = np.moveaxis(_image(256, 256), -1, 0)
    arr = zarr.create_array(
        store=str(tmp_path / "s.zarr"),
        shape=img.shape,
        chunks=(3, 64, 64),
        dtype="uint8",
        fill_value=255,
        zarr_format=3,
        **level_codec_kwargs("zstd", zstd_level=3, jpeg_quality=90, shard_side=128),
    )
    arr[...] = img
    reader = local_chunk_reader(arr)
    np.testing.assert_array_equal(reader.read(0, 0), np.asarray(arr[:, :64, :64]))  # its index is kept now
    arr[:, :64, :64] = 7  # the store written again: the kept index is not used for the new shard file
    np.testing.assert_array_equal(reader.read(0, 0), np.full((3, 64, 64), 7, np.uint8))
    np.testing.assert_array_equal(reader.read(1, 1), np.asarray(arr[:, 64:128, 64:128]))
    shard = tmp_path / "s.zarr" / "c" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # a flipped bit in the index
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        reader.read(0, 0)
    assert os.path.getsize(shard) == len(data)
