"""The frozen-feature cache (workers.feature_cache) on real tiny Zarr stores: a second epoch encodes no cell it
has already seen, cached and uncached forwards give the same logits, another encoder or geometry gets a fresh
cache, a trained encoder never uses it, and colour jitter keeps it out of training (not out of evaluation)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from operators.config import from_dict
from operators.model import FoveateModel
from operators.model_config import ModelConfig
from pipeline.data import SlideRecord
from workers.feature_cache import FeatureCache
from workers.patches import prepare_slide
from workers.slide_forward import forward_slide
from workers.store import SlideStore, write_store_from_array
from workers.trainer import OptimConfig, ScheduleConfig, Trainer


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> list[SlideRecord]:
    """Three 256x256 stores (64x64 chunks) with a tissue square, one with a checkerboard."""
    root = tmp_path_factory.mktemp("stores")
    recs = []
    for i in range(3):
        rng = np.random.default_rng(i)
        img = np.full((256, 256, 3), 240, np.uint8)
        img[32:224, 32:224] = (200, 120, 180)
        img[32:224, 32:224] += rng.integers(0, 30, (192, 192, 3), dtype=np.uint8)
        if i == 1:
            img[64:80, 96:112] = (np.indices((16, 16)).sum(0) % 2 * 80).astype(np.uint8)[..., None]
        path = root / f"s{i}.zarr"
        write_store_from_array(path, img, tile_size=64, min_size=64)
        recs.append(SlideRecord(f"s{i}", str(path), "pos" if i == 1 else "neg", int(i == 1)))
    return recs


def _cfg(
    *, freeze: bool = True, jitter: float = 0.0, patch_size: int = 32, selector: str = "hard", standardise: bool = False
) -> ModelConfig:
    return from_dict(
        ModelConfig,
        {
            "geometry": {"patch_size": patch_size, "scorer_downsample": 4},
            "selection": {"selector": selector, "k": 4},
            "scorer": {"channels": 4, "num_layers": 2},
            "features": {
                "widths": [4, 8],
                "blocks": [1, 1],
                "feature_dim": 8,
                "freeze": freeze,
                "standardise": standardise,
            },
            "aggregator": {"kind": "attention_mil", "hidden": 8},
            "augment": {"color_jitter": jitter},
            "num_classes": 2,
        },
    )


class Counting(torch.nn.Module):
    """The feature network, counting the patches it encodes."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.feature_dim, self.patches = inner, inner.feature_dim, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.patches += int(x.shape[0])
        return self.inner(x)


def _trainer(cfg: ModelConfig, cache: Path | None, n: int) -> tuple[Trainer, Counting]:
    tr = Trainer(cfg, OptimConfig(epochs=3, lr=0.01), ScheduleConfig(), slides_per_epoch=n, feature_cache=cache)
    counter = Counting(tr.model.features)
    tr.model.features = counter
    return tr, counter


def _filled(cache: FeatureCache, rec: SlideRecord, num_cells: int) -> set[int]:
    return set(np.flatnonzero(cache._arrays(SlideStore(rec.store).location, num_cells)[2]).tolist())


def test_second_epoch_encodes_no_cell_already_seen(stores, tmp_path):
    num_cells = 64  # 256 / 32 squared
    tr, counter = _trainer(_cfg(), tmp_path / "cache", len(stores))
    cache = tr.feature_cache
    assert cache is not None and cache.dir.is_relative_to(tmp_path / "cache")
    written: list[tuple[str, int]] = []
    write = cache.write

    def recording_write(location, n, cells, values):
        written.extend((location, int(c)) for c in cells)
        write(location, n, cells, values)

    cache.write = recording_write
    tr.train_epoch(stores)
    first = counter.patches
    assert first > 0 and first == len(written) == len(set(written))  # every encoded cell is cached, once
    seen = {SlideStore(rec.store).location: _filled(cache, rec, num_cells) for rec in stores}
    assert sum(map(len, seen.values())) == first

    written.clear()
    tr.train_epoch(stores)
    second = counter.patches - first
    assert second == len(written)  # the encoder ran only on the cells newly written ...
    for loc, cell in written:  # ... none of which was cached after epoch 1
        assert cell not in seen[loc]
    assert cache.hits > 0

    # evaluation reads the same cache: a second pass encodes nothing
    tr.evaluate(stores)
    before = counter.patches
    ev = tr.evaluate(stores)
    assert counter.patches == before and ev.patches == len(stores) * 4


@pytest.mark.parametrize("standardise", [False, True])
def test_cached_and_uncached_forward_give_the_same_logits(stores, tmp_path, standardise):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(standardise=standardise)).eval()
    if standardise:  # statistics as training leaves them; the cache holds the encoder's own features
        model.feature_norm.mean.uniform_(-1, 1)
        model.feature_norm.var.uniform_(0.5, 2)
    cache = FeatureCache(tmp_path / "c", model)
    counter = Counting(model.features)
    model.features = counter
    with torch.no_grad():
        for rec in stores:
            plain = forward_slide(model, rec.store, training=False)
            filling = forward_slide(model, rec.store, training=False, feature_cache=cache)
            n = counter.patches
            cached = forward_slide(model, rec.store, training=False, feature_cache=cache)
            assert counter.patches == n  # all four cells from the cache
            assert cached.info["cache_hits"] == 4 and cached.info["cells_read"] == 4
            assert torch.equal(plain.cell_indices, cached.cell_indices)
            torch.testing.assert_close(filling.logits, plain.logits, rtol=0, atol=1e-6)
            torch.testing.assert_close(cached.logits, plain.logits, rtol=0, atol=1e-6)
            raw = cache.lookup(SlideStore(rec.store).location, 64, plain.cell_indices.sort().values)[1]
            want = model.encode(
                prepare_slide(rec.store, model.cfg).reader.read(plain.cell_indices.sort().values).float() / 255
            )
            torch.testing.assert_close(raw.to(want.dtype), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cached", [False, True])
def test_standardisation_statistics_come_from_the_bag_not_the_evidence_reads(stores, tmp_path, cached):
    cfg = _cfg(standardise=True)
    torch.manual_seed(0)
    model = FoveateModel(cfg).train()
    assert model.uses_evidence and cfg.evidence.explore_cells > 0  # the step reads cells beyond the bag
    cache = FeatureCache(tmp_path / "c", model) if cached else None
    out = forward_slide(model, stores[1].store, training=True, target=1, feature_cache=cache)
    k = cfg.selection.k
    assert out.info["cells_read"] > k and out.cell_indices.numel() == k
    with torch.no_grad():  # the bag's own encoder features (no augmentation in this config)
        pixels = prepare_slide(stores[1].store, cfg).reader.read(out.cell_indices.cpu()).float() / 255
        bag = model.encode(pixels)
    st = model.feature_norm
    torch.testing.assert_close(st.mean, bag.mean(0).to(st.mean.dtype), rtol=0, atol=1e-5)
    torch.testing.assert_close(st.var, bag.var(0).to(st.var.dtype), rtol=1e-4, atol=1e-5)


def test_other_encoder_weights_or_geometry_get_a_fresh_cache(stores, tmp_path):
    root = tmp_path / "c"
    torch.manual_seed(0)
    model = FoveateModel(_cfg()).eval()
    base = FeatureCache(root, model)
    loc = SlideStore(stores[0].store).location
    cells = torch.arange(4)
    with torch.no_grad():
        base.write(loc, 64, cells, torch.ones(4, 8))
    torch.manual_seed(0)
    same = FeatureCache(root, FoveateModel(_cfg()))
    assert same.dir == base.dir and bool(same.lookup(loc, 64, cells)[0].all())

    with torch.no_grad():
        next(model.features.parameters()).add_(0.01)
    other_weights = FeatureCache(root, model)
    torch.manual_seed(0)
    other_geometry = FeatureCache(root, FoveateModel(_cfg(patch_size=64)))
    dirs = {base.dir, other_weights.dir, other_geometry.dir}
    assert len(dirs) == 3
    for fresh, n in ((other_weights, 64), (other_geometry, 16)):
        hit, vals = fresh.lookup(loc, n, torch.arange(4))
        assert not bool(hit.any()) and vals.shape == (0, 8)


def test_a_trained_encoder_never_uses_the_cache(stores, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="workers.trainer"):
        tr, counter = _trainer(_cfg(freeze=False), tmp_path / "cache", len(stores))
    assert tr.feature_cache is None and "feature cache: off" in caplog.text
    with pytest.raises(ValueError, match="frozen"):
        FeatureCache(tmp_path / "x", FoveateModel(_cfg(freeze=False)))
    # a cache handed to forward_slide with a trained encoder is ignored
    torch.manual_seed(0)
    frozen = FoveateModel(_cfg())
    cache = FeatureCache(tmp_path / "c", frozen)
    model = FoveateModel(_cfg(freeze=False)).eval()
    with torch.no_grad():
        out = forward_slide(model, stores[0].store, training=False, feature_cache=cache)
    assert "cache_hits" not in out.info and cache.hits == cache.misses == 0
    tr.train_epoch(stores)
    first = counter.patches
    tr.train_epoch(stores)
    assert counter.patches == 2 * first
    assert not (tmp_path / "cache").exists()


def test_colour_jitter_keeps_the_cache_out_of_training_only(stores, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="workers.slide_forward"):
        tr, counter = _trainer(_cfg(jitter=0.2), tmp_path / "cache", len(stores))
        tr.train_epoch(stores)
        first = counter.patches
        tr.train_epoch(stores)
    assert counter.patches == 2 * first and tr.feature_cache.hits == tr.feature_cache.misses == 0
    assert caplog.text.count("not used in training while model.augment changes the patch pixels (color_jitter=0.2") == 1
    tr.evaluate(stores)
    n = counter.patches
    tr.evaluate(stores)
    assert counter.patches == n and tr.feature_cache.hits == len(stores) * 4


def test_soft_patches_go_through_the_encoder_and_match(stores, tmp_path):
    """The perturbed selector's soft slots mix several cells' pixels: in training they are encoded, not cached,
    so the forward with the cache equals the one without (same noise)."""
    torch.manual_seed(0)
    model = FoveateModel(_cfg(selector="perturbed")).train()
    cache = FeatureCache(tmp_path / "c", model)
    outs = []
    for c in (None, cache, cache):
        g = torch.Generator().manual_seed(3)
        outs.append(forward_slide(model, stores[1].store, training=True, sigma=0.1, generator=g, feature_cache=c))
    for o in outs[1:]:
        torch.testing.assert_close(o.logits, outs[0].logits, rtol=0, atol=1e-6)


def test_the_run_config_places_the_cache_beside_the_run(tmp_path):
    from pipeline.config import from_dict as run_from_dict
    from pipeline.train import TrainConfig, feature_cache_dir

    frozen = {"model": {"features": {"freeze": True}}}
    run = str(tmp_path / "run")
    assert feature_cache_dir(run_from_dict(TrainConfig, frozen), run) == str(Path(run) / "feature_cache")
    assert feature_cache_dir(run_from_dict(TrainConfig, {**frozen, "feature_cache": False}), run) is None  # YAML off
    assert feature_cache_dir(run_from_dict(TrainConfig, {**frozen, "feature_cache": "/c"}), run) == "/c"
    assert feature_cache_dir(run_from_dict(TrainConfig, {}), run) is None  # a trained encoder
    assert feature_cache_dir(run_from_dict(TrainConfig, frozen), "s3://bucket/run") is None
