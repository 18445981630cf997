"""The lazy Python API (pipeline.lazy): slide stores and scoring heatmaps as dask arrays. Every level read through
dask equals the store's own reads (workers.store.SlideStore) exactly, on stores written by the project (an array
written with write_store_from_array, a slide ingested by a tiler: sharded) and on a local S3 server; the mpp and
NGFF transforms are the store's; the heatmaps equal what the scorer scored; bad inputs are refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import zarr
from test_score import CLASSES, _model_config, _slide

from pipeline.lazy import LazyImage, open_heatmap, open_heatmaps, open_store
from workers.store import SlideStore, write_store_from_array

MPP = (0.5, 0.25)  # (x, y): anisotropic, so an axis swap shows


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """``{"array": 300x400 store (unsharded, mpp MPP), "nompp": the same without mpp, "ingested": a 2048^2
    synthetic slide ingested by a tiler (sharded, 256-px chunks)}``."""
    from pipeline.ingest_inputs import discover_inputs
    from pipeline.synthetic import write_synthetic_slide
    from workers.tiler import IngestOptions, Tiler

    root = tmp_path_factory.mktemp("lazy")
    out = {
        "array": write_store_from_array(root / "a.zarr", _slide(0), mpp=MPP, tile_size=64, min_size=64).location,
        "nompp": write_store_from_array(root / "n.zarr", _slide(1), mpp=None, tile_size=64, min_size=64).location,
    }
    svs = root / "slides" / "syn.svs"
    svs.parent.mkdir()
    write_synthetic_slide(svs, width=2048, height=2048, label=1, seed=3, fmt="svs", tile_size=256)
    (inp,) = discover_inputs([svs])
    tiler = Tiler(root / "stores", IngestOptions(tile_size=256, min_size=256))
    tiler.ingest_slide(inp)
    out["ingested"] = tiler.store_path(inp.slide_id)
    return out


def _assert_levels_equal_store(img: LazyImage, store: SlideStore) -> None:
    assert len(img.levels) == store.level_count
    for lv, level in enumerate(img.levels):
        w, h = store.level_dimensions[lv]
        assert level.shape == (3, h, w) and level.dtype == np.uint8
        np.testing.assert_array_equal(level.compute(), np.moveaxis(store.read_level(lv), -1, 0))
        # a window across chunk (and shard) edges: what read_region gives for it (location in level-0 pixels)
        ds = store.downsamples[lv]
        x0, y0, ww, hh = w // 3, h // 5, max(1, w // 2), max(1, h // 2)
        region = store.read_region((int(x0 * ds), int(y0 * ds)), lv, (ww, hh))
        np.testing.assert_array_equal(np.moveaxis(level[:, y0 : y0 + hh, x0 : x0 + ww].compute(), 0, -1), region)


@pytest.mark.parametrize("kind", ["array", "ingested"])
def test_every_level_equals_the_stores_own_reads(stores, kind):
    img = open_store(stores[kind])
    store = SlideStore(stores[kind])
    _assert_levels_equal_store(img, store)
    for lv, level in enumerate(img.levels):  # one dask chunk per shard (per chunk when not sharded)
        arr = store.levels[lv]
        assert level.chunksize == tuple(min(c, s) for c, s in zip(arr.shards or arr.chunks, arr.shape))
    assert (store.levels[0].shards is not None) == (kind == "ingested")
    tissue = img.labels["tissue"]
    assert len(tissue) == store.level_count
    for lv, lab in enumerate(tissue):
        np.testing.assert_array_equal(lab.compute(), store.group[f"labels/tissue/{lv}"][...])
    assert img.meta == store.meta and img.name == store.slide_id and img.location == store.location


def test_mpp_and_ngff_transforms_are_the_stores(stores):
    img = open_store(stores["array"])
    ds = SlideStore(stores["array"]).downsamples
    assert img.axes == ("c", "y", "x") and img.units == (None, "micrometer", "micrometer")
    assert img.downsamples == ds == (1.0, 2.0, 4.0, 8.0)
    assert img.mpp == tuple((MPP[0] * d, MPP[1] * d) for d in ds)
    assert img.scale == tuple((1.0, MPP[1] * d, MPP[0] * d) for d in ds)  # NGFF order (c, y, x)
    assert img.translation == ((0.0, 0.0, 0.0),) * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        img.mpp = None  # type: ignore[misc]
    # what ome-zarr-py (napari-ome-zarr's reader) makes of the same store: the same levels and transforms
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    node = next(iter(Reader(parse_url(img.location))()))
    assert [tuple(d.shape) for d in node.data] == [lv.shape for lv in img.levels]
    assert [tuple(t[0]["scale"]) for t in node.metadata["coordinateTransformations"]] == list(img.scale)
    np.testing.assert_array_equal(np.asarray(node.data[-1]), img.levels[-1].compute())

    nompp = open_store(stores["nompp"])  # no mpp: level-0 pixels
    assert nompp.mpp == (None,) * 4 and nompp.units == (None, None, None)
    assert nompp.scale == tuple((1.0, d, d) for d in ds)


@pytest.fixture(scope="module")
def scored(stores, tmp_path_factory):
    """Two slides (mpp MPP, and none) and an incomplete store scored by the two stages, with their heatmaps in
    ``p_ngff/`` beside the predictions file ``p.parquet`` (as foveate score lays them out)."""
    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from pipeline.predictions import PredictionWriter
    from workers.scoring import ClassifierWorker, ScorerWorker
    from workers.store import COMPLETE_MARKER

    root = tmp_path_factory.mktemp("scored")
    broken = write_store_from_array(root / "broken.zarr", _slide(2), tile_size=64, min_size=64)
    (broken.path / COMPLETE_MARKER).unlink()
    torch.manual_seed(0)
    ckpt = checkpoint_dict(FoveateModel(_model_config()).eval(), _model_config(), CLASSES)
    slides = [("a", stores["array"]), ("n", stores["nompp"]), ("broken", str(broken.path))]
    items = ScorerWorker(ckpt, device="cpu").score_batch(slides)
    rows = ClassifierWorker(ckpt, ngff_dir=root / "p_ngff").classify_batch(items)
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    writer = PredictionWriter(root / "p.parquet", rows)
    writer.flush(force=True)
    return {"root": root, "items": {i["slide_id"]: i for i in items}, "pred": root / "p.parquet"}


def test_heatmaps_equal_the_scores_on_the_slides_frame(stores, scored):
    from workers.patches import slide_geometry
    from workers.reports import score_grid

    stride = slide_geometry(SlideStore(stores["array"]), _model_config()).stride  # level-0 px of a grid step
    heat = open_heatmaps(scored["pred"])
    assert list(heat) == ["a", "n"]  # the ok rows, in row order; the error row has none
    for sid, img in heat.items():
        item = scored["items"][sid]
        gh, gw = item["grid_shape"]
        (level,) = img.levels
        assert level.shape == (1, gh, gw) and level.dtype == np.float32
        expected = score_grid(item["scores"], (gh, gw)).astype(np.float32)
        np.testing.assert_array_equal(level.compute()[0], expected)  # NaN where no candidate, equal_nan
        stored = zarr.open_group(str(scored["root"] / "p_ngff" / f"{sid}.zarr"), mode="r")
        np.testing.assert_array_equal(level.compute(), stored["0"][...])
        (ranks,) = img.labels["patches"]
        r = ranks.compute()[0]
        cells = np.asarray(item["cells"])
        assert sorted(r.reshape(-1)[cells].tolist()) == list(range(1, len(cells) + 1))
        assert int((r > 0).sum()) == len(cells)
        assert img.downsamples == (float(stride),) and img.meta is None and img.name == sid
    a, n = heat["a"], heat["n"]
    assert a.mpp == ((MPP[0] * stride, MPP[1] * stride),) and a.units[1:] == ("micrometer", "micrometer")
    assert a.scale == ((1.0, MPP[1] * stride, MPP[0] * stride),)  # the slide's µm frame: a cell = stride px
    assert n.mpp == (None,) and n.scale == ((1.0, float(stride), float(stride)),)

    # the _ngff folder alone: µm heatmaps have no downsample without their slide; open_heatmap takes one
    folder = open_heatmaps(scored["root"] / "p_ngff")
    assert list(folder) == ["a", "n"] and folder["a"].downsamples is None and folder["n"].downsamples == (stride,)
    path = scored["root"] / "p_ngff" / "a.zarr"
    for slide in (open_store(stores["array"]), SlideStore(stores["array"]), MPP):
        assert open_heatmap(path, slide=slide).downsamples == (float(stride),)


def test_bad_inputs_are_refused_by_name(stores, scored, tmp_path):
    with pytest.raises(TypeError, match=r"path_or_url must be a slide store's path or URL .* got int: 3"):
        open_store(3)
    with pytest.raises(ValueError, match="path_or_url must be .* got an empty string"):
        open_store("")
    with pytest.raises(ValueError, match=r"path_or_url must be a slide store's .*nope.zarr' has none"):
        open_store(tmp_path / "nope.zarr")
    with pytest.raises(ValueError, match="incomplete"):
        open_store(scored["root"] / "broken.zarr")
    with pytest.raises(ValueError, match="is a slide store: open it with open_store"):
        open_heatmap(stores["array"])
    with pytest.raises(ValueError, match="scoring heatmap's path or URL .* has no zarr.json"):
        open_heatmap(tmp_path / "nope.zarr")
    with pytest.raises(TypeError, match="slide must be the slide store's LazyImage"):
        open_heatmap(scored["root"] / "p_ngff" / "a.zarr", slide="a")
    with pytest.raises(ValueError, match="there is no file"):
        open_heatmaps(tmp_path / "none.parquet")
    with pytest.raises(ValueError, match="holds no <slide_id>.zarr heatmap"):
        open_heatmaps(tmp_path)
    from pipeline.predictions import PredictionWriter, read_predictions

    lone = tmp_path / "lone.parquet"  # ok rows, scored without heatmaps
    w = PredictionWriter(lone, [r for r in read_predictions(scored["pred"]) if r["status"] == "ok"])
    w.flush(force=True)
    with pytest.raises(ValueError, match=r"2 ok row\(s\) but no heatmap .* --no-heatmaps"):
        open_heatmaps(lone)


def test_exported_from_pipeline():
    import pipeline
    import pipeline.lazy

    assert {"open_store", "open_heatmap", "open_heatmaps", "LazyImage"} <= set(pipeline.__all__)
    assert pipeline.open_store is pipeline.lazy.open_store and pipeline.open_heatmaps is open_heatmaps


@pytest.mark.slow  # 25 s on the loaded 2-core VM: a moto server, two stores written to it and read back
def test_on_object_storage(tmp_path, monkeypatch):
    """An s3:// store and heatmap on a local S3 server (moto), through the same store-opening code: the same
    pixels and transforms as the local copies."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extras (pip install -e '.[test]')")
    pytest.importorskip("s3fs", reason="s3fs is in the test extras (pip install -e '.[test]')")
    from local_services import moto_s3

    from workers import storage
    from workers.ngff_overlay import write_score_overlay

    with moto_s3("lazy") as (_client, env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv(storage.STORAGE_OPTIONS_ENV, raising=False)
        url = "s3://lazy/stores/a.zarr"
        write_store_from_array(url, _slide(0), mpp=MPP, tile_size=64, min_size=64)
        local = write_store_from_array(tmp_path / "a.zarr", _slide(0), mpp=MPP, tile_size=64, min_size=64)
        img = open_store(url)
        assert img.location == url
        _assert_levels_equal_store(img, SlideStore(url))
        ref = open_store(local.location)
        assert (img.scale, img.mpp, img.downsamples) == (ref.scale, ref.mpp, ref.downsamples)
        for a, b in zip(img.levels, ref.levels):
            np.testing.assert_array_equal(a.compute(), b.compute())
        scores = np.arange(12, dtype=np.float32).reshape(3, 4)
        scores[0, 0] = np.nan
        hurl = write_score_overlay("s3://lazy/p_ngff/a.zarr", scores, np.array([11, 5]), stride=32, mpp=MPP)
        heat = open_heatmap(hurl, slide=img)
        np.testing.assert_array_equal(heat.levels[0].compute()[0], scores)
        assert heat.labels["patches"][0].compute()[0].reshape(-1)[[11, 5]].tolist() == [1, 2]
        assert heat.downsamples == (32.0,) and heat.mpp == ((MPP[0] * 32, MPP[1] * 32),)
        with pytest.raises(ValueError, match="has none"):
            open_store("s3://lazy/stores/missing.zarr")
