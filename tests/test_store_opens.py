"""One open per slide in scoring: the scorer opens and verifies each store (one listing per level), and the
classifier reads the same store from the scorer's hand-off (``SlideStore.handoff`` / ``from_handoff``) with no
second open, verification or listing — on real stores on disk, counted at zarr's store API (every listing of a
``LocalStore``) and at ``workers.store.verify_store``, in process and across Ray actors."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_score import CLASSES, _model_config, _slide
from zarr.storage import LocalStore

import workers.storage
import workers.store
from workers.store import SlideStore, write_store_from_array

SLIDES = ["s0", "s1", "s2"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("opens") / "stores"
    for i, sid in enumerate(SLIDES):
        write_store_from_array(root / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    return root


@pytest.fixture(scope="module")
def ckpt():
    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel

    torch.manual_seed(0)
    return checkpoint_dict(FoveateModel(_model_config()).eval(), _model_config(), CLASSES)


@pytest.fixture()
def counts(monkeypatch):
    """``{"listings": Counter(store path), "verified": Counter(store path), "metadata_reads": Counter(store path)}``:
    every listing of a local zarr store (``list``, ``list_prefix``, ``list_dir``, and the folder walks of
    ``workers.storage.list_keys``), every ``verify_store`` call and
    every ``zarr.json`` read, counted while the real calls run (keys: the stores' absolute paths)."""
    out = {"listings": Counter(), "verified": Counter(), "metadata_reads": Counter()}
    for name in ("list", "list_prefix", "list_dir"):
        real = getattr(LocalStore, name)

        def spy(self, *args, _real=real):
            out["listings"][str(self.root)] += 1
            return _real(self, *args)

        monkeypatch.setattr(LocalStore, name, spy)
    real_walk = workers.storage._walk_keys  # workers.storage.list_keys walks a LocalStore's folder itself

    def walk(root, prefix):
        out["listings"][str(root)] += 1
        return real_walk(root, prefix)

    monkeypatch.setattr(workers.storage, "_walk_keys", walk)
    real_get = LocalStore.get

    async def get(self, key, *args, **kwargs):
        if key.endswith("zarr.json"):
            out["metadata_reads"][str(self.root)] += 1
        return await real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get", get)
    real_verify = workers.store.verify_store

    def verify(path, **kwargs):
        out["verified"][str(getattr(path, "root", path))] += 1
        return real_verify(path, **kwargs)

    monkeypatch.setattr(workers.store, "verify_store", verify)
    return out


def _levels(stores: Path, sid: str) -> int:
    return sum(p.is_dir() and p.name.isdigit() for p in (stores / f"{sid}.zarr").iterdir())


def test_scoring_opens_and_verifies_each_store_once(stores, ckpt, counts, tmp_path):
    """Scorer + classifier over three slides: each store verified once and listed once per level (the
    verification's inventory); the same rows as a classifier that opens and verifies the store again."""
    from workers.scoring import ClassifierWorker, ScorerWorker

    scorer = ScorerWorker(ckpt, device="cpu")
    classifier = ClassifierWorker(ckpt, heatmap_dir=tmp_path / "hm", ngff_dir=tmp_path / "ngff")
    items = scorer.score_batch([(s, str(stores / f"{s}.zarr")) for s in SLIDES])
    assert [i["status"] for i in items] == ["ok"] * 3
    after_scorer = {k: Counter(v) for k, v in counts.items()}
    rows = classifier.classify_batch(items)
    assert [r["status"] for r in rows] == ["ok"] * 3, [r["error"] for r in rows]

    def of_slides(counter: Counter) -> dict[str, int]:  # the slide stores' counts (not the overlays written)
        return {Path(k).name: v for k, v in counter.items() if Path(k).parent == stores}

    assert of_slides(counts["verified"]) == {f"{s}.zarr": 1 for s in SLIDES}  # one verification, in the scorer
    levels = {f"{s}.zarr": _levels(stores, s) for s in SLIDES}
    assert of_slides(counts["listings"]) == levels  # its inventory: one listing per level
    # the classifier asked the slide stores for no listing and no metadata: only pixels
    for k in ("listings", "metadata_reads"):
        assert of_slides(counts[k]) == of_slides(after_scorer[k])

    # the count sees a second open: a classifier given items without the hand-off opens and verifies again
    plain = [{k: v for k, v in i.items() if k != "store_handoff"} for i in items]
    again = ClassifierWorker(ckpt).classify_batch(plain)
    assert of_slides(counts["verified"]) == {f"{s}.zarr": 2 for s in SLIDES}
    assert of_slides(counts["listings"]) == {k: 2 * n for k, n in levels.items()}
    for r, a in zip(rows, again):  # and the hand-off reads the same pixels: the same predictions
        assert r["patches"] == a["patches"] and r["probabilities"] == a["probabilities"]


def test_handoff_rebuilds_the_store_without_a_request(stores, counts):
    """``from_handoff`` of a JSON round trip: the same metadata and pixels on every level, and the store was
    asked for nothing while it was rebuilt."""
    store = SlideStore(stores / "s1.zarr")
    handoff = json.loads(json.dumps(store.handoff()))  # what crosses processes is plain JSON
    before = {k: Counter(v) for k, v in counts.items()}
    again = SlideStore.from_handoff(handoff)
    assert {k: Counter(v) for k, v in counts.items()} == before
    assert again.verified and again.location == store.location and again.meta == store.meta
    assert again.level_dimensions == store.level_dimensions
    for lv in range(store.level_count):
        w, h = store.level_dimensions[lv]
        ds = store.downsamples[lv]
        loc = (int(-7 * ds), int(5 * ds))  # across the slide's edge: white outside on both
        np.testing.assert_array_equal(again.read_region(loc, lv, (w, h)), store.read_region(loc, lv, (w, h)))
    mask, ds = again.tissue_mask()
    ref_mask, ref_ds = store.tissue_mask()
    assert ds == ref_ds and np.array_equal(mask, ref_mask)
    assert SlideStore(stores / "s1.zarr", require_complete=False).handoff()["verified"] is False


def test_bad_handoffs(stores, ckpt):
    from workers.scoring import ClassifierWorker, ScorerWorker

    handoff = SlideStore(stores / "s0.zarr").handoff()
    with pytest.raises(TypeError, match="handoff must be the dict SlideStore.handoff"):
        SlideStore.from_handoff([handoff])
    with pytest.raises(ValueError, match="handoff lacks levels"):
        SlideStore.from_handoff({k: v for k, v in handoff.items() if k != "levels"})
    with pytest.raises(ValueError, match=r"1 level\(s\) of metadata for a store of 4"):
        SlideStore.from_handoff({**handoff, "levels": handoff["levels"][:1]})
    with pytest.raises(ValueError, match="not the metadata of a foveate store"):
        SlideStore.from_handoff({**handoff, "group": {**handoff["group"], "attributes": {}}})
    # an item whose hand-off names another store than the slide's gets an error row naming both
    item = ScorerWorker(ckpt, device="cpu").score_one("s1", str(stores / "s1.zarr"))
    row = ClassifierWorker(ckpt).classify_batch([{**item, "store_handoff": handoff}])[0]
    assert row["status"] == "error" and "hand-off names" in row["error"] and "s0.zarr" in row["error"]


@pytest.mark.slow  # about a minute on 2 cores: an in-process Ray and two actor pools
@pytest.mark.e2e
def test_one_open_per_slide_across_ray_actors(stores, ckpt, ray_local, tmp_path):
    """``foveate score`` on Ray: each scorer and classifier actor records the stores it verified (in its own
    process); over the run, every slide was verified exactly once, by a scorer."""
    from operators.checkpoint import save_checkpoint
    from pipeline.score import score
    from workers.scoring import ClassifierWorker, ScorerWorker

    log_dir = tmp_path / "verified"
    log_dir.mkdir()

    def record_verifications(stage: str) -> None:  # in the actor's process
        import workers.store as ws

        real = ws.verify_store

        def verify(path, **kwargs):
            with open(log_dir / f"{stage}-{os.getpid()}.log", "a") as f:
                f.write(Path(getattr(path, "root", path)).name + "\n")
            return real(path, **kwargs)

        ws.verify_store = verify

    class CountingScorer(ScorerWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            record_verifications("scorer")

    class CountingClassifier(ClassifierWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            record_verifications("classifier")

    from operators.model import FoveateModel

    torch.manual_seed(0)
    model_path = save_checkpoint(tmp_path / "m.pt", FoveateModel(_model_config()).eval(), _model_config(), CLASSES)
    res = score(
        str(model_path),
        stores,
        tmp_path / "p.parquet",
        workers=1,
        batch_size=2,
        experiment=None,
        scorer_cls=CountingScorer,
        classifier_cls=CountingClassifier,
    )
    assert (res.scored, res.failed) == (3, 0)
    by_stage: dict[str, Counter] = {"scorer": Counter(), "classifier": Counter()}
    for f in log_dir.iterdir():
        by_stage[f.name.split("-")[0]].update(f.read_text().split())
    assert by_stage["scorer"] == {f"{s}.zarr": 1 for s in SLIDES}
    assert by_stage["classifier"] == {}
