"""The OME-Zarr overlay that foveate score writes per slide (workers.ngff_overlay): valid NGFF 0.5 (ome-zarr-models),
readable by ome-zarr-py, and on the slide store's own coordinate frame — the chosen patches' label pixels and
the heatmap values sit exactly where the predictions row puts the patches, in micrometres as in the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from test_score import CLASSES, _model_config, _slide

from workers.store import write_store_from_array


@pytest.fixture()
def scored(tmp_path):
    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.scoring import ClassifierWorker, ScorerWorker

    store = write_store_from_array(tmp_path / "s0.zarr", _slide(0), mpp=(0.5, 0.5), tile_size=64, min_size=64)
    torch.manual_seed(0)
    ckpt = checkpoint_dict(FoveateModel(_model_config()).eval(), _model_config(), CLASSES)
    item = ScorerWorker(ckpt, device="cpu").score_one("s0", str(store.path))
    row = ClassifierWorker(ckpt, ngff_dir=tmp_path / "ngff").classify_batch([item])[0]
    assert row["status"] == "ok"
    return store, item, row, tmp_path / "ngff" / "s0.zarr"


def test_overlay_is_valid_ngff_on_the_slide_frame(scored):
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.v05.image import Image as NgffImage
    from ome_zarr_models.v05.image_label import ImageLabel

    store, item, row, path = scored
    g = zarr.open_group(str(path), mode="r")
    NgffImage.from_zarr(g)
    ImageLabel.from_zarr(g["labels/patches"])
    gh, gw = item["grid_shape"]
    stride = _model_config().geometry.stride_l0
    # the same µm frame as the slide store: a cell is a pixel of stride * mpp µm
    ms = g.attrs["ome"]["multiscales"][0]
    assert ms["datasets"][0]["coordinateTransformations"] == [
        {"type": "scale", "scale": [1.0, 0.5 * stride, 0.5 * stride]}
    ]
    slide_ms = zarr.open_group(str(store.path), mode="r").attrs["ome"]["multiscales"][0]
    assert slide_ms["axes"] == ms["axes"]  # same axes and units
    heat = np.asarray(g["0"][0])
    ranks = np.asarray(g["labels/patches/0"][0])
    assert heat.shape == ranks.shape == (gh, gw)
    ordered = sorted(row["patches"], key=lambda p: -p["score"])
    for rank, p in enumerate(ordered, start=1):  # every chosen patch's box lands on its own cell
        cy, cx = p["y"] // stride, p["x"] // stride
        assert ranks[cy, cx] == rank
        assert heat[cy, cx] == pytest.approx(p["score"], rel=1e-6)
        # in µm: the label pixel's origin is the box's level-0 origin times mpp, as in the slide store
        assert (cy * 0.5 * stride, cx * 0.5 * stride) == (p["y"] * 0.5, p["x"] * 0.5)
    assert int((ranks > 0).sum()) == len(row["patches"])
    assert np.isnan(heat[~np.isfinite(np.asarray(item["scores"], np.float32)).reshape(gh, gw)]).all()
    # ome-zarr-py reads the image and finds the label image
    nodes = list(Reader(parse_url(str(path)))())
    assert nodes and np.allclose(np.asarray(nodes[0].data[0])[0], heat, equal_nan=True)
    assert any("patches" in str(n.zarr) for n in nodes)


def test_overlay_arguments(tmp_path):
    from workers.ngff_overlay import write_score_overlay

    with pytest.raises(ValueError, match="scores_grid must be"):
        write_score_overlay(tmp_path / "a.zarr", np.zeros(4), [0], stride=32, mpp=None)
    with pytest.raises(ValueError, match="stride must be a positive int"):
        write_score_overlay(tmp_path / "a.zarr", np.zeros((2, 2)), [0], stride=0, mpp=None)
    with pytest.raises(ValueError, match=r"cells must lie in \[0, 4\)"):
        write_score_overlay(tmp_path / "a.zarr", np.zeros((2, 2)), [4], stride=32, mpp=None)
    p = write_score_overlay(tmp_path / "a.zarr", np.arange(4.0).reshape(2, 2), [3, 1], stride=32, mpp=None)
    write_score_overlay(p, np.arange(4.0).reshape(2, 2), [0], stride=32, mpp=None)  # replaced atomically
    assert np.asarray(zarr.open_group(str(p), mode="r")["labels/patches/0"][0]).tolist() == [[1, 0], [0, 0]]
    assert not list(tmp_path.glob(".a.zarr.*"))
