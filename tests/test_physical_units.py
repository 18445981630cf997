"""Patch size and scorer resolution in µm (``model.patch_size_um``, ``model.scorer_mpp``): one model for slides
scanned at 20x and 40x. The same synthetic content is stored at 0.25 µm/px and, 2x-downsampled, at 0.5 µm/px:
the grids agree in µm, the patches the network sees agree to rounding, the scores and chosen cells agree, and
prediction boxes stay in each slide's own level-0 pixels."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch
from flat_model_config import FLAT_DEFAULTS, flat_config, flat_replace

from operators.checkpoint import build_model
from operators.config import from_dict, to_dict
from operators.errors import ConfigError
from operators.model import FoveateModel
from operators.model_config import ModelConfig
from workers.patches import PatchGrid, PatchReader, clear_cache, prepare_slide, slide_geometry
from workers.pyramid import downsample2x
from workers.slide_forward import forward_slide
from workers.store import write_store_from_array

CLASSES = ["a", "b"]
SMALL = {
    "k": 4,
    "tissue_threshold": 0.0,
    "num_classes": 2,
    "scorer": {"channels": 8},
    "features": {"widths": [8, 16], "blocks": [1, 1], "feature_dim": 16},
}


def _config(**kw) -> ModelConfig:
    """16 µm patches (64 px at 0.25 µm/px, 32 px at 0.5), a 1 µm/px scorer view, trained at 0.5 µm/px."""
    return flat_config(**{**SMALL, "patch_size_um": 16.0, "scorer_mpp": 1.0, "mpp": 0.5, **kw})


def _image_40x() -> np.ndarray:
    """640 x 768 px at 0.25 µm/px: white, a textured tissue block and a dark blob (something to score)."""
    rng = np.random.default_rng(0)
    img = np.full((640, 768, 3), 240, np.uint8)
    tissue = rng.integers(80, 220, (400, 520, 3), dtype=np.uint8)
    tissue[..., 1] //= 2
    img[100:500, 150:670] = tissue
    img[300:360, 420:500] = 30
    return img


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mpp")
    img = _image_40x()
    s40 = write_store_from_array(root / "s40.zarr", img, mpp=(0.25, 0.25), tile_size=64, min_size=64)
    s20 = write_store_from_array(root / "s20.zarr", downsample2x(img), mpp=(0.5, 0.5), tile_size=64, min_size=64)
    return s40, s20


# ------------------------------------------------------------------------------------------------ config


def test_exactly_one_of_each_pair_and_the_pixel_defaults():
    cfg = flat_config()
    assert (
        cfg.geometry.patch_size,
        cfg.geometry.scorer_downsample,
        cfg.geometry.patch_size_um,
        cfg.geometry.scorer_mpp,
    ) == (128, 16.0, None, None)
    with pytest.raises(
        ConfigError, match=r"model.geometry.patch_size and model.geometry.patch_size_um: exactly one may be set"
    ):
        flat_config(patch_size=64, patch_size_um=32.0)
    with pytest.raises(
        ConfigError, match=r"model.geometry.scorer_downsample and model.geometry.scorer_mpp: exactly one"
    ):
        from_dict(ModelConfig, {"scorer_downsample": 16, "scorer_mpp": 8.0})
    with pytest.raises(ConfigError, match=r"model.geometry.stride is in level-0 pixels .* stride_um"):
        flat_config(patch_size_um=32.0, stride=64)
    with pytest.raises(ConfigError, match=r"model.geometry.stride_um goes with patch_size_um"):
        flat_config(patch_size=64, stride_um=16.0)
    for bad in ({"patch_size_um": 0.0}, {"patch_size_um": float("inf")}, {"scorer_mpp": -1.0}):
        with pytest.raises(ConfigError, match=f"model.geometry.{next(iter(bad))} must be a finite number"):
            flat_config(**bad)
    with pytest.raises(ConfigError, match="model.geometry.patch_input must be an int >= 8"):
        flat_config(patch_input=4)
    um = from_dict(ModelConfig, {"patch_size": None, "patch_size_um": 32.0, "scorer_downsample": None, "scorer_mpp": 8})
    assert um.geometry.patch_size is None and um.geometry.scorer_downsample is None and um.geometry.physical
    with pytest.raises(ConfigError, match="resolved per slide"):
        _ = um.geometry.stride_l0
    assert not flat_replace(um, scorer_mpp=None).geometry.physical  # scorer back to pixels: not physical


def test_geometry_per_slide_resolution():
    cfg = _config(stride_um=8.0)
    g40, g20 = cfg.slide_geometry(0.25), cfg.slide_geometry(0.5)
    assert (g40.patch_size, g40.stride, g40.scorer_downsample, g40.patch_input) == (64, 32, 4.0, 32)
    assert (g20.patch_size, g20.stride, g20.scorer_downsample, g20.patch_input) == (32, 16, 2.0, 32)
    assert cfg.slide_geometry(0.3).patch_size == 53  # round(16 / 0.3): not a power of two away
    assert _config(patch_input=48).slide_geometry(0.5).patch_input == 48
    with pytest.raises(
        ConfigError, match=r"store /x.zarr records no mpp .* model.geometry.patch_size_um and model.geometry.scorer_mpp"
    ):
        cfg.slide_geometry(None, where="store /x.zarr")
    with pytest.raises(ConfigError, match=r"model.geometry.scorer_mpp=1.0 is finer than its level-0 mpp 2"):
        cfg.slide_geometry(2.0)
    with pytest.raises(ConfigError, match="needs model.geometry.patch_input .* or model.mpp"):
        _config(mpp=None).slide_geometry(0.5)
    px = flat_config(patch_size=64, scorer_downsample=8.0)
    assert px.slide_geometry(0.25) == dataclasses.replace(
        px.slide_geometry(None), mpp=0.25
    )  # pixels: mpp changes nothing
    assert px.slide_geometry().patch_input == 64


def test_checkpoint_round_trip_keeps_the_physical_geometry(tmp_path, stores):
    from operators.checkpoint import load_checkpoint, save_checkpoint

    cfg = _config(stride_um=16.0)
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg
    torch.manual_seed(0)
    model = FoveateModel(cfg).eval()
    loaded, lcfg, names = load_checkpoint(save_checkpoint(tmp_path / "m.pt", model, cfg, CLASSES))
    assert lcfg == cfg and names == CLASSES
    assert lcfg.slide_geometry(0.25) == cfg.slide_geometry(0.25) and lcfg.slide_geometry(0.5) == cfg.slide_geometry(0.5)
    clear_cache()
    with torch.inference_mode():
        a = forward_slide(model, stores[0].path, training=False)
        b = forward_slide(loaded, stores[0].path, training=False)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.logits, b.logits)
    # a checkpoint written before these keys existed loads with the pixel settings it had
    new = flat_config(patch_size=64)
    old = {**FLAT_DEFAULTS, "patch_size": 64, "stride": None, "scorer_downsample": 16.0, "num_classes": 2}
    old.update(scorer=to_dict(new.scorer), features=to_dict(new.features), mpp=None, patch_jitter=0.0)
    assert build_model(old)[1] == new


# ------------------------------------------------------------------------------------- two resolutions


def test_same_grid_in_um_and_same_patches_at_20x_and_40x(stores):
    s40, s20 = stores
    cfg = _config()
    clear_cache()
    a, b = prepare_slide(s40, cfg), prepare_slide(s20, cfg)
    assert a.grid.shape == b.grid.shape == (10, 12)
    assert (a.grid.patch_size, b.grid.patch_size) == (64, 32)
    cells = torch.arange(a.grid.num_cells)
    # the same cells in µm: corners and extents times each slide's mpp agree
    assert torch.equal(a.grid.cell_xy_l0(cells) * 0.25, b.grid.cell_xy_l0(cells) * 0.5)
    assert tuple(e * 0.25 for e in a.grid.extent_l0) == tuple(e * 0.5 for e in b.grid.extent_l0)
    # the scorer sees 1 µm/px on both (the 40x store's level 2 is the 20x store's level 1)
    assert a.lowres_u8.shape == b.lowres_u8.shape == (3, 160, 192)
    assert torch.equal(a.lowres_u8, b.lowres_u8) and torch.equal(a.cell_mask, b.cell_mask)
    # the network sees 32 px patches of the same 16 µm on both, equal to rounding
    pa, pb = a.reader.read(cells), b.reader.read(cells)
    assert pa.shape == pb.shape == (cells.numel(), 3, 32, 32)
    assert int((pa.int() - pb.int()).abs().max()) <= 1
    raw = a.reader._read_l0(cells[:3])  # what the 40x slide holds: twice the pixels
    assert raw.shape == (3, 3, 64, 64)
    # pixel settings on the same two stores: other grids, other content (the comparison above can fail)
    px = flat_replace(
        cfg, patch_size_um=None, stride_um=None, patch_size=32, stride=32, scorer_mpp=None, scorer_downsample=2.0
    )
    assert prepare_slide(s40, px).grid.shape != prepare_slide(s20, px).grid.shape


def test_forward_chooses_the_same_cells_with_boxes_in_each_slides_pixels(stores):
    s40, s20 = stores
    cfg = _config()
    torch.manual_seed(0)
    model = FoveateModel(cfg).eval()
    clear_cache()
    with torch.inference_mode():
        a = forward_slide(model, s40.path, training=False)
        b = forward_slide(model, s20.path, training=False)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.cell_indices, b.cell_indices)
    assert torch.equal(a.coords_l0, 2 * b.coords_l0)  # level-0 pixels of each slide
    assert torch.allclose(a.logits, b.logits, atol=1e-2)
    # a 0.3 µm/px slide (a non-power-of-two factor) gives patches of the network's size too
    g = slide_geometry(s40, flat_replace(cfg, patch_size_um=13.0, patch_input=40))
    grid = PatchGrid.from_store(s40, g.patch_size, g.stride)
    assert PatchReader(s40, grid, g.patch_input).read(torch.tensor([0, 5])).shape == (2, 3, 40, 40)


def test_store_without_mpp_is_refused_naming_it(tmp_path, stores):
    from operators.checkpoint import checkpoint_dict
    from pipeline.train import _check_grids
    from workers.scoring import ScorerWorker

    nompp = write_store_from_array(tmp_path / "nompp.zarr", _image_40x(), mpp=None, tile_size=64, min_size=64)
    cfg = _config()
    with pytest.raises(ConfigError, match=r"store .*nompp.zarr records no mpp"):
        prepare_slide(nompp, cfg, cache=False)
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, CLASSES)
    item = ScorerWorker(ckpt, device="cpu").score_one("nompp", str(nompp.path))
    assert item["status"] == "error" and "nompp.zarr records no mpp" in item["error"]

    class Rec:
        def __init__(self, sid, store):
            self.slide_id, self.store = sid, str(store.path)

    with pytest.raises(ConfigError, match=r"slide n: store .*nompp.zarr records no mpp"):
        _check_grids(cfg, [Rec("a", stores[0]), Rec("n", nompp)])
    # the k check counts each slide's own cells and says what patch_size_um is there
    with pytest.raises(
        ConfigError, match=r"slide a \(768 x 640 px at model.geometry.patch_size_um 64.0 = 256 px at mpp 0.25\)"
    ):
        _check_grids(flat_replace(cfg, patch_size_um=64.0, stride_um=64.0, k=13), [Rec("a", stores[0])])
    # no model.mpp nor patch_input: the training stores' median mpp fixes the network's patch side
    assert _check_grids(_config(mpp=None), [Rec("a", stores[0]), Rec("b", stores[1])]) == [0.25, 0.5]


def test_scoring_and_pyfunc_adapt_to_each_slide_without_the_mpp_warning(tmp_path, stores, caplog):
    from operators.checkpoint import checkpoint_dict, save_checkpoint
    from pipeline.serving import CHECKPOINT_ARTIFACT, FoveatePythonModel
    from workers.scoring import ClassifierWorker, ScorerWorker

    s40, s20 = stores
    cfg = _config()  # trained at 0.5 µm/px; s40 is at 0.25
    torch.manual_seed(0)
    model = FoveateModel(cfg).eval()
    ckpt = checkpoint_dict(model, cfg, CLASSES)
    scorer = ScorerWorker(ckpt, device="cpu", strict_mpp=True)  # strict: would refuse s40 for a pixel model
    classifier = ClassifierWorker(ckpt, ngff_dir=tmp_path / "ngff")
    with caplog.at_level(logging.WARNING):
        items = [scorer.score_one("s40", str(s40.path)), scorer.score_one("s20", str(s20.path))]
    assert [i["status"] for i in items] == ["ok", "ok"] and "training mpp" not in caplog.text
    r40, r20 = classifier.classify_batch(items)
    assert r40["status"] == r20["status"] == "ok"
    assert [(p["x"], p["y"], p["w"]) for p in r40["patches"]] == [
        (2 * p["x"], 2 * p["y"], 2 * p["w"]) for p in r20["patches"]
    ]
    assert {p["w"] for p in r40["patches"]} == {64}
    assert r40["probabilities"] == pytest.approx(r20["probabilities"], abs=1e-3)
    # the NGFF overlays: a cell is 16 µm on both
    import zarr

    for sid in ("s40", "s20"):
        ms = zarr.open_group(str(tmp_path / "ngff" / f"{sid}.zarr"), mode="r").attrs["ome"]["multiscales"][0]
        assert ms["datasets"][0]["coordinateTransformations"][0]["scale"] == [1.0, 16.0, 16.0]
    # the MLflow pyfunc model runs the same workers
    path = save_checkpoint(tmp_path / "m.pt", model, cfg, CLASSES)
    pyfunc = FoveatePythonModel()
    roots = sorted({os.path.dirname(str(s.path)) for s in (s40, s20)})  # what a logged model records (serve roots)
    ctx = {"artifacts": {CHECKPOINT_ARTIFACT: str(path)}, "model_config": {"serve_roots": roots}}
    pyfunc.load_context(type("Ctx", (), ctx)())
    import pandas as pd

    out = pyfunc.predict(None, pd.DataFrame({"store": [str(s40.path), str(s20.path)]}))
    assert list(out["status"]) == ["ok", "ok"]
    assert [p["w"] for p in out["patches"][0]] == [64] * 4 and [p["w"] for p in out["patches"][1]] == [32] * 4
    # a model with the scorer still in pixels keeps the warning (it does not adapt)
    half = flat_replace(cfg, scorer_mpp=None, scorer_downsample=4.0)
    item = ScorerWorker(checkpoint_dict(FoveateModel(half).eval(), half, CLASSES), strict_mpp=True).score_one(
        "s40", str(s40.path)
    )
    assert item["status"] == "error" and "scorer_downsample is level-0 pixels" in item["error"]
