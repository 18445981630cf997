"""foveate ingest without Ray: the Tiler, the source readers, the JPEG codec and passthrough, the store format.

Real OpenSlide on OpenSlide's own fixtures and on synthetic SVS / TIFF slides written by pipeline.synthetic.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import zarr

from pipeline.ingest_inputs import discover_inputs, make_slide_id
from workers.chunks import decode_shard, strip_checksum
from workers.codecs import JpegRGBCodec, decode_jpeg_chunk, encode_jpeg_chunk, merge_jpeg_tables
from workers.ingest_source import SlideOpenError, SlideSource, composite_on_white
from workers.store import SlideStore, is_complete
from workers.tiler import PROGRESS_DIR, IngestOptions, Tiler


def downsample2x_reference(rgb_chw: np.ndarray) -> np.ndarray:
    """2x2 mean (rounded half up) of a (c, h, w) uint8 array, odd edges padded by edge replication (numpy)."""
    c, h, w = rgb_chw.shape
    if h % 2 or w % 2:
        rgb_chw = np.pad(rgb_chw, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    x = rgb_chw.astype(np.uint16)
    s = x[:, 0::2, 0::2] + x[:, 1::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 1::2]
    return ((s + 2) // 4).astype(np.uint8)


def openslide_reference(path, level=0, box=None):
    """OpenSlide read_region of a whole level (or box x, y, w, h in level-0 px), composited on white with PIL."""
    import openslide
    from PIL import Image

    with openslide.OpenSlide(str(path)) as s:
        if box is None:
            x, y, (w, h) = 0, 0, s.level_dimensions[level]
        else:
            x, y, w, h = box
        img = s.read_region((x, y), level, (w, h))
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, img).convert("RGB"))


def reference_pyramid(level0_hwc, n):
    out, lv = [level0_hwc], np.moveaxis(level0_hwc, -1, 0)
    for _ in range(n - 1):
        lv = downsample2x_reference(lv)
        out.append(np.moveaxis(lv, 0, -1))
    return out


@pytest.fixture(scope="module")
def synth_slides(tmp_path_factory):
    from pipeline.synthetic import write_synthetic_slide

    d = tmp_path_factory.mktemp("synth")
    svs = d / "syn_a.svs"
    tif = d / "syn_b.tiff"
    write_synthetic_slide(svs, width=2048, height=2048, label=1, seed=3, fmt="svs", tile_size=256)
    write_synthetic_slide(tif, width=2000, height=2100, label=0, seed=4, fmt="tiff", tile_size=256)
    return {"svs": svs, "tiff": tif}


def _ingest_one(tmp_path, path, **kw):
    (inp,) = discover_inputs([path])
    tiler = Tiler(tmp_path / "stores", IngestOptions(**kw))
    row = tiler.ingest_slide(inp)
    tiler.close()
    return SlideStore(tmp_path / "stores" / f"{inp.slide_id}.zarr"), row


# ---------------------------------------------------------------------------------------------- pixels
@pytest.mark.parametrize("name,direct", [("boxes.tiff", True), ("small.svs", True), ("boxes_0.dcm", False)])
def test_fixture_level0_equals_openslide_and_levels_equal_reference(tmp_path, openslide_fixtures, name, direct):
    store, row = _ingest_one(tmp_path, openslide_fixtures / name, tile_size=64, min_size=32, codec="zstd")
    assert store.meta.extra["direct_decode"] is direct
    ref0 = openslide_reference(openslide_fixtures / name)
    np.testing.assert_array_equal(store.read_level(0), ref0)
    for lvl, ref in enumerate(reference_pyramid(ref0, store.level_count)):
        np.testing.assert_array_equal(store.read_level(lvl), ref, err_msg=f"level {lvl}")
    assert store.downsamples == tuple(float(2**i) for i in range(store.level_count))
    assert max(store.level_dimensions[-1]) <= 32
    assert row["width"], row["height"] == store.dimensions
    m = store.meta
    assert m.fingerprint.startswith("quickhash-1:") and m.vendor in ("generic-tiff", "aperio", "dicom")
    assert m.mpp is not None and m.foveate_version and m.codec == "zstd"
    assert m.extra["tile_grid"][0] == [-(-store.dimensions[0] // 64), -(-store.dimensions[1] // 64)]


@pytest.mark.parametrize("fmt", ["svs", "tiff"])
def test_synthetic_slide_level0_equals_openslide(tmp_path, synth_slides, fmt):
    path = synth_slides[fmt]
    store, _ = _ingest_one(tmp_path, path, tile_size=256, min_size=512, region_tiles=2, codec="zstd")
    assert store.meta.extra["direct_decode"] is True
    ref0 = openslide_reference(path)
    np.testing.assert_array_equal(store.read_level(0), ref0)
    refs = reference_pyramid(ref0, store.level_count)
    # svs 2048 -> 512: 3 levels, tiff 2100 -> 263: 4; regions of 2x2 tiles: stage 0 writes levels 0-1 from the
    # source, stage 1 (and 2) the rest from the store
    assert store.level_count == (3 if fmt == "svs" else 4)
    for lvl in range(1, store.level_count):
        np.testing.assert_array_equal(store.read_level(lvl), refs[lvl], err_msg=f"level {lvl}")
    # read_region in level-0 coordinates, white outside
    W, H = store.dimensions
    out = store.read_region((W - 100, H - 50), 0, (200, 100))
    np.testing.assert_array_equal(out[:50, :100], ref0[H - 50 :, W - 100 :])
    assert (out[50:] == 255).all() and (out[:, 100:] == 255).all()


def test_direct_reader_equals_openslide_on_unaligned_boxes(synth_slides):
    src = SlideSource.open(synth_slides["svs"])
    assert src.info.direct
    for box in [(0, 0, 300, 200), (255, 511, 258, 3), (1900, 1000, 148, 1048)]:
        np.testing.assert_array_equal(src.read_l0(*box), openslide_reference(synth_slides["svs"], box=box))
    src.close()


@pytest.mark.parametrize("h,w", [(64, 64), (63, 37), (1, 1), (5, 2)])
def test_downsample2x_equals_reference(h, w):
    from workers.pyramid import downsample2x

    rgb = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    np.testing.assert_array_equal(
        downsample2x(rgb), np.moveaxis(downsample2x_reference(np.moveaxis(rgb, -1, 0)), 0, -1)
    )


def test_composite_on_white_matches_pil():
    from PIL import Image

    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    img = Image.fromarray(rgba, "RGBA")
    ref = np.asarray(Image.alpha_composite(Image.new("RGBA", img.size, (255,) * 4), img).convert("RGB"))
    np.testing.assert_array_equal(composite_on_white(rgba), ref)
    rgba[..., 3] = 0
    assert (composite_on_white(rgba) == 255).all()


def test_mpp_resampling_halves_the_slide_consistently_across_regions(tmp_path, synth_slides):
    path = synth_slides["svs"]  # 0.25 mpp
    store, row = _ingest_one(tmp_path, path, tile_size=256, min_size=256, region_tiles=1, mpp=0.5)
    assert store.dimensions == (1024, 1024) and store.meta.mpp == (0.5, 0.5) and store.meta.source_mpp == (0.25, 0.25)
    ref = reference_pyramid(openslide_reference(path), 2)[1].astype(int)
    got = store.read_level(0).astype(int)
    assert np.abs(got - ref).mean() < 3.0  # Lanczos vs box filter
    # regions of 256 px were resampled independently: no seams at region borders
    seam = np.abs(np.diff(got, axis=1))[:, 255::256].mean()
    inner = np.abs(np.diff(got, axis=1))[:, 100::256].mean()
    assert seam < 2 * inner + 1


def test_mpp_requested_without_mpp_metadata_fails(tmp_path):
    import tifffile

    p = tmp_path / "nompp.tiff"
    tifffile.imwrite(p, np.full((512, 512, 3), 200, np.uint8), tile=(256, 256), photometric="rgb", metadata=None)
    inp = discover_inputs([p])[0]
    with pytest.raises(SlideOpenError, match="no mpp metadata"):
        Tiler(tmp_path / "s", IngestOptions(mpp=0.5)).plan(inp)
    store, _ = _ingest_one(tmp_path, p)
    assert store.meta.mpp is None


# ---------------------------------------------------------------------------------------------- JPEG
def test_jpeg_codec_round_trip_is_one_rgb_jpeg_per_chunk(tmp_path):
    yy, xx = np.mgrid[0:300, 0:500]
    img = np.stack([(xx * 255 // 499), np.full_like(xx, 120), (yy * 255 // 299)]).astype(np.uint8)
    g = zarr.open_group(str(tmp_path / "j.zarr"), mode="w", zarr_format=3)
    a = g.create_array(
        "0",
        shape=img.shape,
        chunks=(3, 256, 256),
        dtype="uint8",
        fill_value=255,
        serializer=JpegRGBCodec(quality=95),
        compressors=None,
    )
    a[...] = img
    back = zarr.open_array(str(tmp_path / "j.zarr" / "0"), mode="r")[...]
    assert back.shape == img.shape and np.abs(back.astype(int) - img).mean() < 1.5
    raw = (tmp_path / "j.zarr" / "0" / "c" / "0" / "0" / "0").read_bytes()
    import imagecodecs

    hwc = imagecodecs.jpeg8_decode(raw)
    assert hwc.shape == (256, 256, 3)  # one colour JPEG, not three grey ones
    meta = json.loads((tmp_path / "j.zarr" / "0" / "zarr.json").read_text())
    assert meta["codecs"] == [{"name": "foveate.jpeg", "configuration": {"quality": 95, "colorspace": "ycbcr"}}]
    c = encode_jpeg_chunk(img[:, :256, :256].copy(), 100)
    assert np.abs(decode_jpeg_chunk(c).astype(int) - img[:, :256, :256]).max() <= 8
    with pytest.raises(ValueError, match="quality"):
        JpegRGBCodec(quality=0)
    with pytest.raises(ValueError, match="chunk must be"):
        encode_jpeg_chunk(np.zeros((256, 256, 3), np.uint8))


def test_jpeg_passthrough_copies_source_tiles_bit_exactly(tmp_path, synth_slides):
    import tifffile

    path = synth_slides["svs"]
    store, row = _ingest_one(tmp_path, path, tile_size=256, min_size=512, codec="jpeg")
    assert row["codec"] == "jpeg-passthrough"
    m = store.meta
    # the source has levels 2048 and 1024 (YCbCr JPEG): both copied; 512 computed from the store and encoded
    assert m.extra["level_codecs"] == ["passthrough:ycbcr", "passthrough:ycbcr", "jpeg"]
    assert m.extra["source_levels"] == [0, 1, None] and store.downsamples == (1.0, 2.0, 4.0)
    with tifffile.TiffFile(path) as tf:
        page = tf.pages[0]
        for ty, tx in [(0, 0), (3, 5), (7, 7)]:
            i = ty * 8 + tx
            tf.filehandle.seek(page.dataoffsets[i])
            tile = tf.filehandle.read(page.databytecounts[i])
            side = m.extra["shard_sides"][0] // 256  # one shard per region: 8 x 8 chunks
            shard = (store.path / "0" / "c" / "0" / str(ty // side) / str(tx // side)).read_bytes()
            stored = decode_shard(shard, side)[(ty % side, tx % side)]
            chunk = strip_checksum(stored)  # the stored chunk ends with its crc32c
            assert chunk == merge_jpeg_tables(page.jpegtables, tile)  # copied, not re-encoded
            assert chunk.endswith(tile[2:])
        ref_tf = page.asarray()
    ref_os = openslide_reference(path)
    np.testing.assert_array_equal(store.read_level(0), ref_os)  # what OpenSlide decodes
    np.testing.assert_array_equal(store.read_level(0), ref_tf)  # and what tifffile decodes
    np.testing.assert_array_equal(store.read_level(1), openslide_reference(path, level=1))  # source pyramid level
    ref2 = np.moveaxis(downsample2x_reference(np.moveaxis(store.read_level(1), -1, 0)), 0, -1).astype(int)
    assert np.abs(store.read_level(2).astype(int) - ref2).mean() < 2


def test_jpeg_passthrough_of_rgb_jpeg_svs_fixture(tmp_path, openslide_fixtures):
    # small.svs stores un-transformed RGB in its JPEG tiles (photometric RGB): decoded without colour conversion
    store, row = _ingest_one(tmp_path, openslide_fixtures / "small.svs", tile_size=64, codec="jpeg")
    assert row["codec"] == "jpeg-passthrough" and store.meta.extra["level_codecs"] == ["passthrough:rgb"]
    np.testing.assert_array_equal(store.read_level(0), openslide_reference(openslide_fixtures / "small.svs"))


@pytest.mark.parametrize(
    "name,tile,codec,level_codecs",
    [
        ("syn-svs", 256, "jpeg-passthrough", ["passthrough:ycbcr", "passthrough:ycbcr", "jpeg"]),
        ("syn-tiff", 256, "jpeg-passthrough", ["passthrough:ycbcr"] * 3 + ["jpeg"]),
        ("small.svs", 64, "jpeg-passthrough", ["passthrough:rgb"]),
        ("syn-svs", 128, "zstd", ["zstd"] * 3),  # source tiles of 256 do not align with 128-px chunks
        ("boxes.tiff", 64, "zstd", ["zstd"] * 5),  # deflate tiles
        ("boxes_0.dcm", 64, "zstd", ["zstd"]),  # DICOM: frames not copied (yet)
    ],
)
def test_default_codec_copies_aligned_jpeg_tiles_and_stores_the_rest_losslessly(
    tmp_path, synth_slides, openslide_fixtures, name, tile, codec, level_codecs
):
    path = synth_slides[name[4:]] if name.startswith("syn-") else openslide_fixtures / name
    store, row = _ingest_one(tmp_path, path, tile_size=tile, min_size=512 if name.startswith("syn-") else 32)
    assert IngestOptions().codec == "auto"
    assert row["codec"] == codec == store.meta.codec and store.meta.extra["level_codecs"] == level_codecs
    assert ("copied from the source's JPEG tiles" in row["layout"]) == (codec == "jpeg-passthrough")
    if (name, tile) == ("syn-svs", 256):
        assert (
            row["layout"]
            == "levels 0-1 copied from the source's JPEG tiles (OpenSlide levels 0-1); level 2 made (jpeg)"
        )
    elif codec == "zstd":
        n = len(level_codecs)
        assert row["layout"] == (f"levels 0-{n - 1}" if n > 1 else "level 0") + " decoded (zstd)"
    ref0 = openslide_reference(path)
    np.testing.assert_array_equal(store.read_level(0), ref0)  # level 0 is what OpenSlide decodes, either way
    refs = reference_pyramid(ref0, store.level_count)
    for lvl, (c, src_level) in enumerate(zip(level_codecs, store.meta.extra["source_levels"])):
        got = store.read_level(lvl)
        if c.startswith("passthrough"):  # a copied source level: what OpenSlide decodes at that level
            np.testing.assert_array_equal(got, openslide_reference(path, level=src_level), err_msg=f"level {lvl}")
        elif c == "zstd":  # made from level 0, losslessly
            np.testing.assert_array_equal(got, refs[lvl], err_msg=f"level {lvl}")
        else:  # made from the level above and JPEG-encoded: within JPEG's error of the 2x mean of that level
            above = np.moveaxis(downsample2x_reference(np.moveaxis(store.read_level(lvl - 1), -1, 0)), 0, -1)
            assert np.abs(got.astype(int) - above.astype(int)).mean() < 2, f"level {lvl}"


def test_jpeg_codec_without_passthrough_for_deflate_source(tmp_path, openslide_fixtures):
    store, row = _ingest_one(tmp_path, openslide_fixtures / "boxes.tiff", tile_size=64, min_size=64, codec="jpeg")
    assert row["codec"] == "jpeg" and store.meta.extra["level_codecs"][0] == "jpeg"
    ref = openslide_reference(openslide_fixtures / "boxes.tiff").astype(int)
    assert np.abs(store.read_level(0).astype(int) - ref).mean() < 6


# ---------------------------------------------------------------------------------------------- format
def test_store_opens_with_ome_zarr_and_validates_with_ome_zarr_models(tmp_path, synth_slides):
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.v05.image import Image as NgffImage
    from ome_zarr_models.v05.image_label import ImageLabel

    for codec in ("zstd", "jpeg"):
        store, _ = _ingest_one(tmp_path / codec, synth_slides["tiff"], tile_size=256, min_size=512, codec=codec)
        nodes = list(Reader(parse_url(str(store.path)))())
        assert nodes and len(nodes[0].data) == store.level_count
        assert tuple(nodes[0].data[0].shape) == (3, store.dimensions[1], store.dimensions[0])
        np.testing.assert_array_equal(
            np.asarray(nodes[0].data[1][:, :64, :64]), np.moveaxis(store.read_level(1)[:64, :64], -1, 0)
        )
        assert nodes[0].metadata["channel_names"] == ["red", "green", "blue"]  # the omero block, read by ome-zarr-py
        assert nodes[0].metadata["colormap"] == [[[0, 0, 0], [1, 0, 0]], [[0, 0, 0], [0, 1, 0]], [[0, 0, 0], [0, 0, 1]]]
        g = zarr.open_group(str(store.path), mode="r")
        assert NgffImage.from_zarr(g).attributes.ome.omero["rdefs"] == {"model": "color"}
        ImageLabel.from_zarr(g["labels/tissue"])
        mask, ds = store.tissue_mask()
        assert mask.any() and not mask.all() and ds == store.downsamples[-1]
        lab0 = np.asarray(g["labels/tissue/0"][0])  # full-resolution label level: nearest-neighbour of the mask
        assert lab0.shape == (store.dimensions[1], store.dimensions[0])
        r = int(ds)
        sampled = lab0[r // 2 :: r, r // 2 :: r]
        np.testing.assert_array_equal(sampled, mask[: sampled.shape[0], : sampled.shape[1]])


_PLAIN_READER = """
import sys, warnings
import numpy as np, zarr
from ome_zarr.io import parse_url
from ome_zarr.reader import Reader

warnings.simplefilter("error")  # a second registration of the codec would warn 'not configured'
store, out = sys.argv[1], sys.argv[2]
assert "workers.codecs" not in sys.modules
a0 = zarr.open_array(store + "/0", mode="r")
level0 = a0[...]
codec = a0.metadata.codecs[0]
codec = codec.codecs[0] if type(codec).__name__ == "ShardingCodec" else codec  # (sharded level: the inner codec)
assert type(codec).__module__ == "workers.codecs"  # loaded through the entry point
level1 = np.asarray(list(Reader(parse_url(store))())[0].data[1])
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "operators", "torch"))
assert not bad, bad
import workers.store  # now foveate's own explicit registration on top of the entry point: harmless
workers.store.register_codecs()
again = zarr.open_array(store + "/0", mode="r")[:, :64, :64]
np.savez(out, level0=level0, level1=level1, again=again)
"""


def test_jpeg_store_opens_in_a_fresh_interpreter_without_importing_foveate(tmp_path, synth_slides):
    """The ``zarr.codecs`` entry point ``foveate.jpeg`` (pyproject.toml) lets plain zarr and ome-zarr-py read a
    ``--codec jpeg`` store in a fresh interpreter that never imports workers/pipeline; registering it again
    explicitly afterwards changes nothing (same qualified name: one registry entry, no warning)."""
    import subprocess
    import sys
    import warnings
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="zarr.codecs")}
    assert eps.get("foveate.jpeg") == "workers.codecs:JpegRGBCodec", (
        "the zarr.codecs entry point is not installed: run `pip install -e .` after editing pyproject.toml"
    )
    store, row = _ingest_one(tmp_path, synth_slides["svs"], tile_size=256, min_size=512, codec="jpeg")
    assert row["codec"] == "jpeg-passthrough"
    assert _inner_codecs(json.loads((store.path / "0" / "zarr.json").read_text()))[0]["name"] == "foveate.jpeg"
    out = tmp_path / "plain.npz"
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_READER, str(store.path), str(out)],
        cwd=tmp_path,  # not the checkout: the codec comes from the installed metadata, not from ./workers
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    np.testing.assert_array_equal(np.moveaxis(got["level0"], 0, -1), store.read_level(0))
    np.testing.assert_array_equal(np.moveaxis(got["level1"], 0, -1), store.read_level(1))
    np.testing.assert_array_equal(got["again"], got["level0"][:, :64, :64])
    with warnings.catch_warnings():  # this process imported workers.codecs first, then the entry point loads
        warnings.simplefilter("error")
        assert zarr.registry.get_codec_class("foveate.jpeg") is JpegRGBCodec


# ---------------------------------------------------------------------------------------------- inputs, resume
def test_discover_inputs_dicom_grouping_csv_and_slide_ids(tmp_path, openslide_fixtures):
    found = discover_inputs([openslide_fixtures])
    dcm = [i for i in found if i.path.endswith(".dcm")]
    assert len(dcm) == 1 and len(dcm[0].files) == 2  # boxes_0.dcm + boxes_1.dcm: one slide
    assert not any(i.path.endswith(".png") for i in found)
    assert discover_inputs([openslide_fixtures]) == found  # deterministic
    assert len({i.slide_id for i in found}) == len(found)
    assert make_slide_id("a b/c", "/x") == make_slide_id("a b/c", "/x") != make_slide_id("a b/c", "/y")
    assert make_slide_id("a b/c", "/x").startswith("a_b_c-")
    csv = tmp_path / "m.csv"
    csv.write_text(f"path,label\n{openslide_fixtures / 'small.svs'},1\nmissing.svs,0\n")
    rows = discover_inputs([csv])
    assert [r.carried["label"] for r in rows] == ["1", "0"]
    assert rows[1].path == str(tmp_path / "missing.svs")


def test_interrupted_slide_resumes_with_identical_arrays(tmp_path, synth_slides):
    inp = discover_inputs([synth_slides["svs"]])[0]
    opts = IngestOptions(tile_size=256, min_size=256, region_tiles=2, codec="zstd")
    ref_tiler = Tiler(tmp_path / "ref", opts)
    ref_tiler.ingest_slide(inp)
    t = Tiler(tmp_path / "run", opts)
    plan = t.plan(inp)
    for r in plan.todo[0][:5]:  # a partial run: 5 of 16 stage-0 regions
        t.write_region(plan.store_path, r)
    assert not is_complete(plan.store_path)
    with pytest.raises(RuntimeError, match="regions not written"):
        t.finalize(plan.store_path)
    t2 = Tiler(tmp_path / "run", opts)
    plan2 = t2.plan(inp)
    assert plan2.resumed_regions == 5 and len(plan2.todo[0]) == 11
    for st in plan2.todo:
        for r in st:
            t2.write_region(plan2.store_path, r)
    t2.finalize(plan2.store_path)
    a, b = SlideStore(ref_tiler.store_path(inp.slide_id)), SlideStore(plan2.store_path)
    assert not (Path(plan2.store_path) / PROGRESS_DIR).exists()
    for lvl in range(a.level_count):
        np.testing.assert_array_equal(a.read_level(lvl), b.read_level(lvl))


def test_a_copy_killed_mid_region_resumes_with_identical_arrays(tmp_path, synth_slides):
    # the default codec copies: a tiler that dies after copying part of a region's tiles leaves no done marker for
    # it and no completion marker; a fresh tiler copies that region again and ends byte-identical to a clean run
    inp = discover_inputs([synth_slides["svs"]])[0]
    opts = IngestOptions(tile_size=256, min_size=512, region_tiles=1)  # 1-chunk regions: copy blocks of 4 x 4

    class DiesMidCopy(Tiler):
        def _copy_region(self, plan, region):
            if region.index == 2:
                src = self._source(plan.source_path, plan.files or None)
                raw = src.raw_jpeg_tile(region.src_level, region.box.x // 256, region.box.y // 256)
                self._writer(plan).write_encoded(
                    region.level,
                    region.box.x,
                    region.box.y,
                    256,
                    256,
                    {(region.box.y // 256, region.box.x // 256): merge_jpeg_tables(raw[1], raw[0])},
                )
                raise RuntimeError("killed mid-copy")
            return super()._copy_region(plan, region)

    ref = Tiler(tmp_path / "ref", opts)
    ref.ingest_slide(inp)
    t = DiesMidCopy(tmp_path / "run", opts)
    plan = t.plan(inp)
    assert all(r.kind == "copy" for r in plan.todo[0]) and len(plan.todo[0]) > 3
    with pytest.raises(RuntimeError, match="killed mid-copy"):
        for r in plan.todo[0]:
            t.write_region(plan.store_path, r)
    assert not is_complete(plan.store_path)
    done = {p.stem for p in (Path(plan.store_path) / PROGRESS_DIR).glob("*.done")}
    assert done == {"s0_r0", "s0_r1"}
    t2 = Tiler(tmp_path / "run", opts)
    plan2 = t2.plan(inp)
    assert plan2.resumed_regions == 2
    for st in plan2.todo:
        for r in st:
            t2.write_region(plan2.store_path, r)
    t2.finalize(plan2.store_path)
    a, b = SlideStore(ref.store_path(inp.slide_id)), SlideStore(plan2.store_path)
    assert a.meta.codec == b.meta.codec == "jpeg-passthrough"
    for lvl in range(a.level_count):
        np.testing.assert_array_equal(a.read_level(lvl), b.read_level(lvl), err_msg=f"level {lvl}")


def test_ingest_options_validate_arguments():
    with pytest.raises(ValueError, match="codec must be one of"):
        IngestOptions(codec="png")
    with pytest.raises(ValueError, match="region_tiles must be a power of two"):
        IngestOptions(region_tiles=3)
    with pytest.raises(ValueError, match="tile_size"):
        IngestOptions(tile_size=100)


def _inner_codecs(meta: dict) -> list[dict]:
    """The chunk codecs of an array's zarr.json (inside the sharding codec of a sharded level)."""
    codecs = meta["codecs"]
    if codecs[0]["name"] == "sharding_indexed":
        return codecs[0]["configuration"]["codecs"]
    return codecs


def test_threads_and_fast_zstd_levels_give_the_same_pixels_and_bytes(tmp_path, synth_slides):
    # TIFF 2000 x 2100: edge chunks and edge regions; regions of 2 x 2 tiles -> levels from source and from store
    path = synth_slides["tiff"]
    kw = {"tile_size": 256, "min_size": 256, "region_tiles": 2, "codec": "zstd"}
    ref, _ = _ingest_one(tmp_path / "t1", path, **kw)
    thr, _ = _ingest_one(tmp_path / "t2", path, **kw, threads=3)
    fast, _ = _ingest_one(tmp_path / "fast", path, **kw, zstd_level=-5)
    files = lambda s: {
        p.relative_to(s.path): p.read_bytes() for p in sorted(s.path.glob("[0-9]*/c/**/*")) if p.is_file()
    }
    assert files(ref) == files(thr) and len(files(ref)) > 10  # the thread pool changes nothing on disk
    for lvl in range(ref.level_count):
        np.testing.assert_array_equal(fast.read_level(lvl), ref.read_level(lvl), err_msg=f"level {lvl}")
        meta = json.loads((fast.path / str(lvl) / "zarr.json").read_text())
        assert {"name": "zstd", "configuration": {"level": -5, "checksum": False}} in _inner_codecs(meta)
        # plain zarr (no foveate codec registration needed) reads the zstd levels: channel-first (c, y, x)
        plain = zarr.open_array(str(fast.path / str(lvl)), mode="r")[...]
        np.testing.assert_array_equal(np.moveaxis(plain, 0, -1), ref.read_level(lvl))
    assert sum(map(len, files(fast).values())) > sum(map(len, files(ref).values()))  # fast level: larger chunks
    with pytest.raises(ValueError, match="threads must be"):
        IngestOptions(threads=0)
    with pytest.raises(ValueError, match="zstd_level must be"):
        IngestOptions(zstd_level=0)


def test_all_white_region_writes_no_chunks_and_removes_stale_ones(tmp_path, synth_slides):
    inp = discover_inputs([synth_slides["tiff"]])[0]
    t = Tiler(tmp_path / "s", IngestOptions(tile_size=256, min_size=256, region_tiles=2, codec="zstd"))
    plan = t.plan(inp)
    src = SlideSource.open(inp.path)
    white = [r for r in plan.todo[0] if src.read_l0(*r.box).min() == 255]
    tissue = [r for r in plan.todo[0] if r not in white]
    src.close()
    assert white and tissue, "the synthetic slide should have background-only and tissue regions"
    r = white[0]
    sides = plan.shard_sides  # one shard object per region and level
    stale = [
        Path(plan.store_path)
        / str(lvl)
        / "c"
        / "0"
        / str((r.box.y >> j) // sides[lvl])
        / str((r.box.x >> j) // sides[lvl])
        for j, lvl in enumerate(r.out_levels)
    ]
    for f in stale:  # e.g. left by a run over different pixels
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"stale")
    t.write_region(plan.store_path, r)
    assert not any(f.exists() for f in stale)
    for st in plan.todo:
        for reg in st:
            t.write_region(plan.store_path, reg)
    t.finalize(plan.store_path)
    store = SlideStore(plan.store_path)
    ref0 = openslide_reference(synth_slides["tiff"])
    np.testing.assert_array_equal(store.read_level(0), ref0)
    for lvl, ref in enumerate(reference_pyramid(ref0, store.level_count)):
        np.testing.assert_array_equal(store.read_level(lvl), ref, err_msg=f"level {lvl}")


@pytest.mark.parametrize("shard_chunks", [None, 3, 8])
def test_tissue_label_levels_are_exact_nearest_neighbour_resamplings(tmp_path, shard_chunks):
    """Read back through zarr: one object per chunk, shards of 3 x 3 chunks (several rows of shards, partial ones
    at the edges) and of 8 x 8 (non-square: cut to the level)."""
    from workers.store import write_tissue_labels

    rng = np.random.default_rng(5)
    mask = rng.random((13, 21)) < 0.5
    mask[:4] = True  # whole tissue chunks too
    shapes, downs = [(161, 100), (81, 50), (41, 25), (21, 13)], [1.0, 2.0, 4.0, 8.0]
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    write_tissue_labels(g, mask, shapes, downs, (0.5, 0.5), chunk=16, shard_chunks=shard_chunks)
    level0 = [p for p in (tmp_path / "s.zarr/labels/tissue/0/c").rglob("*") if p.is_file()]
    if shard_chunks:  # level 0 is 7 x 11 chunks of 16 px: 3 x 4 shards of 3 x 3 chunks, or 1 x 2 of up to 7 x 8
        assert len(level0) == {3: 12, 8: 2}[shard_chunks]
    else:
        assert len(level0) > 40  # one object per chunk (each holding some tissue)
    for j, ((w, h), dj) in enumerate(zip(shapes, downs)):
        iy = np.minimum(((np.arange(h) + 0.5) * (dj / 8.0)).astype(int), 12)
        ix = np.minimum(((np.arange(w) + 0.5) * (dj / 8.0)).astype(int), 20)
        np.testing.assert_array_equal(
            g[f"labels/tissue/{j}"][0], mask[np.ix_(iy, ix)].astype(np.uint8), err_msg=f"level {j}"
        )


@pytest.mark.parametrize("codec", ["zstd", "jpeg"])
def test_chunks_and_region_markers_reach_the_disk_before_a_region_counts_as_done(tmp_path, synth_slides, codec):
    """Durability (reliability issue, case 3): every object goes through zarr's store API (workers.storage.put_bytes);
    between a region's last chunk (shard) write and its done marker the filesystem is synced (one syncfs per
    region), and the tissue mask and metadata are synced before the completion marker, the marker after it;
    options.fsync=false turns it off."""
    import workers.storage as storage_mod

    events: list[tuple[str, str]] = []
    real_put, real_sync = storage_mod.put_bytes, storage_mod.sync_filesystem

    def put_bytes(store, items):
        pairs = list(items.items()) if isinstance(items, dict) else list(items)
        for k, _ in pairs:
            kind = "marker" if k.endswith(".done") else "complete" if k == "foveate_complete.json" else "put"
            kind = "chunk" if re.match(r"^\d+/c/", k) else kind
            events.append((kind, k))
        return real_put(store, pairs)

    def sync_filesystem(path):
        events.append(("syncfs", path))
        return real_sync(path)

    def run(sub, **kw):
        events.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(storage_mod, "put_bytes", put_bytes)
            mp.setattr(storage_mod, "sync_filesystem", sync_filesystem)
            store, row = _ingest_one(tmp_path / sub, synth_slides["svs"], codec=codec, threads=2, **kw)
        assert row["levels"] >= 2

    run("on")
    kinds = [k for k, _ in events]
    markers = [i for i, k in enumerate(kinds) if k == "marker"]
    assert kinds.count("chunk") >= 2 and markers
    for i in markers:  # the last thing before each marker (after any chunk write) is a filesystem sync
        last_chunk = max((j for j in range(i) if kinds[j] == "chunk"), default=-1)
        assert any(kinds[j] == "syncfs" for j in range(last_chunk + 1, i)), i
    (done,) = [i for i, k in enumerate(kinds) if k == "complete"]
    last_put = max(i for i, k in enumerate(kinds[:done]) if k in ("put", "chunk"))
    assert any(e[0] == "put" and e[1].startswith("labels/") for e in events[:done])  # the tissue mask
    assert "syncfs" in kinds[last_put:done] and kinds[done + 1 :] == ["syncfs"]  # synced before and after

    run("off", fsync=False)
    kinds = [k for k, _ in events]
    assert "syncfs" not in kinds, events
    assert kinds.count("marker") >= 1 and kinds.count("complete") == 1
