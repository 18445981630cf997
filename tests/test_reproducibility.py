"""A training is a function of its seed on one machine: the same seed gives bit-identical weights, in this process
or a new one, and an epoch draws nothing from torch's global RNG (only the initialisation does), so runs in
separate processes cannot disturb one another. Machines with other vector units (AVX2 against AVX-512) round
differently, so bit-identity across machines is not claimed."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flat_model_config import flat_config
from tiny_stores import rare_structures_store

from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers.trainer import OptimConfig, ScheduleConfig, Trainer

TESTS = Path(__file__).resolve().parent
SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import test_reproducibility as t
print(t.train_digest({store!r}, 3))
"""


def _trainer(seed: int) -> Trainer:
    cfg = flat_config(
        patch_size=64,
        scorer_downsample=8.0,
        k=3,
        selector="perturbed",
        num_samples=8,
        scorer=ScorerConfig(channels=8, pool="mean"),
        features=ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=16),
    )
    # a second phase that restarts the classifier: the restart's initialisation is seeded too
    sched = ScheduleConfig(select_until=0.5, select_restart=True)
    return Trainer(cfg, OptimConfig(epochs=4, accumulate=1, lr=0.05), sched, slides_per_epoch=2, seed=seed)


def train_digest(store: str, seed: int) -> str:
    """SHA-256 of the trained model's state and its last validation loss (trained on one torch thread, as
    ``robustness.py --in-process`` trains; the caller's thread count is restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
        tr = _trainer(seed)
        metrics: dict = {}
        while not tr.finished:
            metrics = tr.run_epoch(records, records)
    finally:
        torch.set_num_threads(threads)
    h = hashlib.sha256()
    for k, v in sorted(tr.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    h.update(repr(metrics["val_loss"]).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("repro") / "s.zarr"
    rare_structures_store(path)
    return str(path)


def test_same_seed_same_weights_different_seed_different(store):
    a, b, other = train_digest(store, 3), train_digest(store, 3), train_digest(store, 4)
    assert a == b
    assert other != a


def test_an_epoch_draws_nothing_from_the_global_rng(store):
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr = _trainer(3)
    before = torch.random.get_rng_state()
    while not tr.finished:  # through the switch and the classifier's restart
        tr.run_epoch(records, records)
    assert torch.equal(before, torch.random.get_rng_state())


def test_a_new_process_trains_the_same_weights(store):
    here = train_digest(store, 3)
    code = SCRIPT.format(tests=str(TESTS), root=str(TESTS.parent), store=store)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == here
