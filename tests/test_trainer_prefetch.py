"""The trainer prepares the next step's slides in a reader thread: the same training as without it, and a slide that
cannot be read fails its own step (with its own error), not the step before it."""

from __future__ import annotations

import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
from tiny_stores import checker_stores

from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers import patches
from workers.trainer import OptimConfig, ScheduleConfig, Trainer


def _config():
    from flat_model_config import flat_config

    return flat_config(
        patch_size=32,
        scorer_downsample=4.0,
        k=2,
        num_classes=2,
        scorer=ScorerConfig(channels=8),
        features=ResNetConfig(widths=(8,), blocks=(1,), feature_dim=8),
        color_jitter=0.0,
    )


def _trainer(n: int) -> Trainer:
    return Trainer(
        _config(), OptimConfig(epochs=1, accumulate=1, lr=0.01, warmup=0), ScheduleConfig(), slides_per_epoch=n
    )


def test_prefetched_slides_are_the_ones_trained_on(tmp_path):
    root, _ = checker_stores(tmp_path, ["a", "b"], [0, 200], count=4)
    records = [SimpleNamespace(store=str(root / f"s{i:02d}.zarr"), target=i % 2) for i in range(4)]
    prepared: list[str] = []
    real = patches.prepare_slide

    def spy(store, cfg, **kw):
        prepared.append((threading.current_thread().name, str(getattr(store, "location", store))))
        return real(store, cfg, **kw)

    patches._CACHE.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(patches, "prepare_slide", spy)
        torch.manual_seed(0)
        tr = _trainer(4)
        tr.train_epoch(records)
    # the reader thread prepared slides 1..3 ahead of their steps (slide 0: the first step's own)
    ahead = [p.rsplit("/", 1)[-1] for name, p in prepared if name.startswith("slide-prefetch")]
    assert ahead == ["s01.zarr", "s02.zarr", "s03.zarr"]
    patches._CACHE.clear()
    torch.manual_seed(0)
    again = _trainer(4)
    again._prepare_ahead = lambda recs: None  # no prefetch: the same weights
    again.train_epoch(records)
    for (k, a), b in zip(tr.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_broken_slide_fails_its_own_step(tmp_path):
    root, _ = checker_stores(tmp_path, ["a", "b"], [0, 200], count=3)
    shutil.rmtree(root / "s02.zarr" / "0")  # its level 0 gone: the store does not verify
    records = [SimpleNamespace(store=str(root / f"s{i:02d}.zarr"), target=i % 2) for i in range(3)]
    tr = _trainer(3)
    done = []
    step = tr.step

    def spy(batch, result):
        out = step(batch, result)
        done.append(batch[0].store)
        return out

    tr.step = spy
    with pytest.raises(Exception, match="s02"):
        tr.train_epoch(records)
    assert [d.rsplit("/", 1)[-1] for d in done] == ["s00.zarr", "s01.zarr"]
