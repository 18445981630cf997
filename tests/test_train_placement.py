"""``placement_strategy`` (train config): validated, and handed to Ray Train's ``ScalingConfig`` (no Ray needed:
the trainer class is replaced by one that records its arguments). The real two-node placement is checked in
tests/test_cluster.py."""

from __future__ import annotations

import pytest

from operators.errors import ConfigError
from pipeline.train_config import PLACEMENT_STRATEGIES, TrainConfig


def test_default_is_ray_trains_pack_and_unknown_strategies_are_refused():
    assert TrainConfig().placement_strategy == "PACK"
    for s in PLACEMENT_STRATEGIES:
        assert TrainConfig(placement_strategy=s).placement_strategy == s
    with pytest.raises(ConfigError, match="placement_strategy: got 'spread'"):
        TrainConfig(placement_strategy="spread")


def test_strategy_reaches_the_scaling_config(monkeypatch, tmp_path):
    pytest.importorskip("ray.train.torch")
    import ray.train.torch

    from pipeline import train as train_mod

    seen = {}

    class FakeTrainer:
        def __init__(self, fn, **kwargs):
            seen.update(kwargs)

        def fit(self):
            return "fitted"

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", FakeTrainer)
    cfg = TrainConfig(workers=2, use_gpu=False, placement_strategy="SPREAD")
    assert (
        train_mod._fit(cfg, str(tmp_path / "run"), [], [], ["0", "1"], f"sqlite:///{tmp_path / 'x.db'}", "rid")
        == "fitted"
    )
    sc = seen["scaling_config"]
    assert (sc.num_workers, sc.placement_strategy, sc.use_gpu) == (2, "SPREAD", False)
    assert sc.resources_per_worker == {"CPU": 1}
