"""foveate score: real Zarr stores, a real (tiny, untrained) model saved with pipeline.mlflow_model, real Ray.

One row per slide, error rows for an incomplete / corrupt store, resume, actors killed mid-run (os._exit from
inside, restarted by Ray), and hard top-k coordinates that equal the single-process forward chain.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flat_model_config import flat_replace

from pipeline.score import list_stores, read_predictions, score
from workers.store import COMPLETE_MARKER, SlideStore, write_store_from_array

GOOD = ["s0", "s1", "s2", "s3"]
BAD = {"incomplete": "incomplete", "corrupt_meta": "scorer:", "corrupt_chunks": "patches:"}
CLASSES = ["benign", "tumour", "other"]


def _slide(seed: int) -> np.ndarray:
    """A 300x400 slide: white background, a textured pinkish tissue block at a seed-dependent place."""
    rng = np.random.default_rng(seed)
    img = np.full((300, 400, 3), 245, np.uint8)
    y0, x0 = 20 + 10 * seed, 30 + 15 * seed
    tissue = rng.integers(90, 210, (200, 250, 3), dtype=np.uint8)
    tissue[..., 1] //= 2
    img[y0 : y0 + 200, x0 : x0 + 250] = tissue
    return img


def _model_config():
    from flat_model_config import flat_config

    return flat_config(
        **{
            "patch_size": 32,
            "k": 4,
            "scorer_downsample": 4.0,
            "num_classes": len(CLASSES),
            "aggregator": "attention_mil",
            "aggregator_hidden": 16,
            "scorer": {"channels": 8},
            "features": {"widths": [8, 16], "blocks": [1, 1], "feature_dim": 16},
        },
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from operators.checkpoint import save_checkpoint
    from operators.model import FoveateModel

    root = tmp_path_factory.mktemp("score")
    stores = root / "stores"
    for i, sid in enumerate(GOOD):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    for i, sid in enumerate(BAD):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    (stores / "incomplete.zarr" / COMPLETE_MARKER).unlink()
    (stores / "corrupt_meta.zarr" / "zarr.json").write_text("{ not json")
    chunks = [p for p in (stores / "corrupt_chunks.zarr" / "0").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert chunks
    for p in chunks:
        p.write_bytes(b"\x00garbage" * 7)
    torch.manual_seed(0)
    cfg = _model_config()
    model = FoveateModel(cfg).eval()
    ckpt = save_checkpoint(root / "model.pt", model, cfg, CLASSES)
    return {"root": root, "stores": stores, "ckpt": ckpt, "model": model}


def _reference(model, store_path):
    from workers.slide_forward import forward_slide

    with torch.no_grad():
        out = forward_slide(model, SlideStore(store_path), training=False)
    return out.coords_l0.numpy(), torch.softmax(out.logits[0], -1).numpy(), out.patch_scores.numpy()


def _by_id(table):
    return {r["slide_id"]: r for r in table.to_dict("records")}


@pytest.mark.parametrize(
    "selector,aggregator,recentre",
    [
        ("perturbed", "attention_mil", False),
        ("attention", "transformer", False),
        ("sinkhorn", "mean", False),
        ("lapsum", "max", False),
        ("perturbed", "mean", True),
    ],
)
def test_workers_without_ray_match_forward_chain(data, tmp_path, selector, aggregator, recentre):
    """The two stages as plain classes give the coordinates/probabilities of workers.slide_forward.forward_slide
    (hard top-k at inference; the slot weights of attention/SOFT/LapSum travel from scorer to classifier; the
    reads' shifts of model.geometry.recentre from scorer to classifier)."""
    import dataclasses

    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.scoring import ClassifierWorker, ScorerWorker

    cfg = flat_replace(_model_config(), selector=selector, aggregator=aggregator)
    cfg = dataclasses.replace(cfg, geometry=dataclasses.replace(cfg.geometry, recentre=recentre))
    torch.manual_seed(1)
    model = FoveateModel(cfg).eval()
    ckpt = checkpoint_dict(model, cfg, CLASSES)
    sw = ScorerWorker(ckpt, device="cpu")
    cw = ClassifierWorker(ckpt, heatmap_dir=tmp_path / "hm", model_name="m")
    items = sw.score_batch([(s, str(data["stores"] / f"{s}.zarr")) for s in ["s0", "s1", "incomplete"]])
    assert [i["status"] for i in items] == ["ok", "ok", "error"]
    assert "incomplete" in items[2]["error"]
    assert (items[0]["offsets"] is None) == (not recentre)
    if recentre:  # the textured tissue moves some reads off their cells
        assert np.abs(np.concatenate([items[0]["offsets"], items[1]["offsets"]])).max() > 0
    rows = cw.classify_batch(items)  # s0 and s1 go through the network as one batch
    for row in rows[:2]:
        coords, probs, pscores = _reference(model, data["stores"] / f"{row['slide_id']}.zarr")
        np.testing.assert_array_equal([[p["x"], p["y"]] for p in row["patches"]], coords)
        assert all(p["w"] == p["h"] == 32 for p in row["patches"])
        # the scorer scores s0 and s1 as one batch, the reference one slide at a time: float32 convolutions of
        # another batch size may sum in another order (seen: 1.8e-5 relative on an AMD EPYC), exact at batch 1
        np.testing.assert_allclose([p["score"] for p in row["patches"]], pscores, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose([row["probabilities"][c] for c in CLASSES], probs, rtol=1e-4, atol=1e-6)
        assert row["prediction"] == CLASSES[int(np.argmax(probs))]
        assert Path(row["heatmap"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rows[2]["status"] == "error" and rows[2]["patches"] == []


def test_batched_prefetched_stages_equal_slide_by_slide(data):
    """The scorer's batched calls over prefetched views, and the classifier's prefetched reads, give what one slide
    at a time in the calling thread gives; a broken store inside a batch fails its own item only."""
    from workers.scoring import ClassifierWorker, ScorerWorker

    slides = [(s, str(data["stores"] / f"{s}.zarr")) for s in ["s0", "s1", "corrupt_meta", "s2", "s3", "incomplete"]]
    one = ScorerWorker(str(data["ckpt"]), device="cpu", batch=1, prefetch=0).score_batch(slides)
    many = ScorerWorker(str(data["ckpt"]), device="cpu", batch=8, prefetch=3).score_batch(slides)
    assert [i["status"] for i in many] == ["ok", "ok", "error", "ok", "ok", "error"]
    for a, b in zip(one, many):
        assert (a["slide_id"], a["status"], a.get("error")) == (b["slide_id"], b["status"], b.get("error"))
        if a["status"] == "ok":
            np.testing.assert_array_equal(a["cells"], b["cells"])
            np.testing.assert_allclose(a["scores"], b["scores"], rtol=1e-4, atol=2e-5)  # batched convolutions
            assert b["timing"]["read"] > 0 and b["timing"]["score"] > 0
    serial = ClassifierWorker(str(data["ckpt"]), prefetch=0).classify_batch(one)
    threaded = ClassifierWorker(str(data["ckpt"]), prefetch=4).classify_batch(many)
    for a, b in zip(serial, threaded):
        assert (a["slide_id"], a["status"], a["prediction"]) == (b["slide_id"], b["status"], b["prediction"])
        assert [{**p, "score": 0} for p in a["patches"]] == [{**p, "score": 0} for p in b["patches"]]
        np.testing.assert_allclose([p["score"] for p in a["patches"]], [p["score"] for p in b["patches"]], atol=2e-5)
        for c in a["probabilities"]:
            assert a["probabilities"][c] == pytest.approx(b["probabilities"][c], rel=1e-5, abs=1e-6)


def test_bf16_autocast_stays_close_to_float32(data):
    """precision="bf16" (checked here on the CPU; the GPU figures are in benchmarks/score.py): the same slides
    scored, class probabilities within bfloat16's error, most chosen cells the same."""
    from workers.scoring import ClassifierWorker, ScorerWorker

    slides = [(s, str(data["stores"] / f"{s}.zarr")) for s in GOOD]
    ref = ScorerWorker(str(data["ckpt"]), device="cpu", precision="fp32").score_batch(slides)
    low = ScorerWorker(str(data["ckpt"]), device="cpu", precision="bf16").score_batch(slides)
    assert {i["precision"] for i in ref} == {"fp32"} and {i["precision"] for i in low} == {"bf16"}
    same = np.mean([len(set(a["cells"]) & set(b["cells"])) / len(a["cells"]) for a, b in zip(ref, low)])
    assert same >= 0.5
    rows_ref = ClassifierWorker(str(data["ckpt"]), precision="fp32").classify_batch(ref)
    rows_low = ClassifierWorker(str(data["ckpt"]), precision="bf16").classify_batch(ref)  # the same patches
    for a, b in zip(rows_ref, rows_low):
        assert max(abs(a["probabilities"][c] - b["probabilities"][c]) for c in CLASSES) < 0.05


def test_stage_arguments(data):
    from workers.scoring import ClassifierWorker, ScorerWorker

    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'fp32', 'bf16'\), got 'fp16'"):
        ScorerWorker(str(data["ckpt"]), device="cpu", precision="fp16")
    with pytest.raises(ValueError, match="prefetch must be an int >= 0.*got -1"):
        ClassifierWorker(str(data["ckpt"]), prefetch=-1)
    with pytest.raises(ValueError, match="batch must be an int >= 1.*got 0"):
        ScorerWorker(str(data["ckpt"]), device="cpu", batch=0)
    with pytest.raises(ValueError, match="device must be 'cuda', 'cuda:N', 'cpu' or None, got 'tpu'"):
        ClassifierWorker(str(data["ckpt"]), device="tpu")


def test_arguments(data, tmp_path):
    with pytest.raises(ValueError, match="--workers.*0"):
        score(str(data["ckpt"]), data["stores"], tmp_path / "p.parquet", workers=0)
    with pytest.raises(ValueError, match="--out must be a .parquet"):
        score(str(data["ckpt"]), data["stores"], tmp_path / "p.csv")
    with pytest.raises(FileNotFoundError, match="--stores"):
        score(str(data["ckpt"]), tmp_path / "nope", tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="has no <slide_id>.zarr"):
        score(str(data["ckpt"]), tmp_path, tmp_path / "p.parquet")
    assert [s for s, _ in list_stores(data["stores"])] == sorted(GOOD + list(BAD))


@pytest.mark.slow
@pytest.mark.e2e
def test_score_with_killed_actors_errors_mlflow_and_resume(data, ray_own, tmp_path, monkeypatch):
    """Score from an MLflow runs:/ URI while each stage's actor kills its own process (os._exit) mid-run: Ray
    restarts it and re-runs the call, and the output still has exactly one row per slide, equal to the
    single-process chain (hard top-k is deterministic). Then resume."""
    import mlflow

    from pipeline.mlflow_model import log_model

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("train", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    log_model(data["model"], _model_config(), CLASSES, run_id=run_id, tracking_uri=uri)

    out = tmp_path / "out" / "pred.parquet"
    m1, m2 = tmp_path / "scorer.crashed", tmp_path / "classifier.crashed"
    # actor classes that kill their own process the first time they reach a slide (Ray ships them by value)
    from workers.scoring import ClassifierWorker, ScorerWorker

    def crash_once(slide_id: str, marker: Path) -> None:
        if not marker.exists():
            marker.write_text(f"pid {os.getpid()} crashed on {slide_id}\n")
            os._exit(17)

    class CrashingScorer(ScorerWorker):
        def _read_view(self, slide_id, store_path):  # the per-slide work, in a reader thread
            if slide_id == "s2":
                crash_once(slide_id, m1)
            return super()._read_view(slide_id, store_path)

    class CrashingClassifier(ClassifierWorker):
        def classify_batch(self, items):
            if any(i["slide_id"] == "s1" for i in items):
                crash_once("s1", m2)
            return super().classify_batch(items)

    res = score(
        f"runs:/{run_id}",
        data["stores"],
        out,
        workers=1,
        batch_size=2,
        experiment="scoring",
        tracking_uri=uri,
        scorer_cls=CrashingScorer,
        classifier_cls=CrashingClassifier,
    )
    assert m1.is_file() and m2.is_file()  # both actor processes really died mid-run
    t = res.table
    assert sorted(t["slide_id"]) == sorted(GOOD + list(BAD)) and t["slide_id"].is_unique
    assert (res.total, res.scored, res.failed, res.skipped) == (7, 4, 3, 0)
    rows = _by_id(t)
    for sid in GOOD:
        r = rows[sid]
        coords, probs, _ = _reference(data["model"], data["stores"] / f"{sid}.zarr")
        assert r["status"] == "ok" and pd.isna(r["error"])
        np.testing.assert_array_equal([[p["x"], p["y"]] for p in r["patches"]], coords)
        np.testing.assert_allclose([r[f"prob_{c}"] for c in CLASSES], probs, rtol=1e-4, atol=1e-6)
        assert r["probability"] == pytest.approx(probs.max(), rel=1e-4) and r["prediction"] in CLASSES
        assert Path(r["heatmap"]).parent == out.parent / "pred_heatmaps" and Path(r["heatmap"]).is_file()
        assert r["seconds"] > 0
    for sid, needle in BAD.items():
        assert rows[sid]["status"] == "error" and needle in rows[sid]["error"], rows[sid]["error"]
        assert pd.isna(rows[sid]["prediction"]) and len(rows[sid]["patches"]) == 0

    # the scoring run in MLflow, with the predictions as an artifact
    srun = client.get_run(res.run_id)
    assert srun.data.tags["foveate.stage"] == "score" and srun.info.status == "FINISHED"
    assert srun.data.metrics["slides_scored"] == 4 and srun.data.metrics["slides_failed"] == 3
    assert [a.path for a in client.list_artifacts(res.run_id, "predictions")] == ["predictions/pred.parquet"]

    # resume: ok rows are kept as they are, failed slides are retried; fix one and add a new slide
    before = {r["slide_id"]: r["scored_at"] for r in read_predictions(out) if r["status"] == "ok"}
    from workers.store import mark_complete

    inc = data["stores"] / "incomplete.zarr"
    mark_complete(inc, "incomplete", sum(p.name.isdigit() for p in inc.iterdir()))  # finish it
    write_store_from_array(data["stores"] / "s9.zarr", _slide(5), tile_size=64, min_size=64)
    try:
        res2 = score(str(data["ckpt"]), data["stores"], out, workers=1, batch_size=2, experiment=None, heatmaps=False)
    finally:
        (data["stores"] / "incomplete.zarr" / COMPLETE_MARKER).unlink()
        shutil.rmtree(data["stores"] / "s9.zarr")
    assert (res2.total, res2.skipped, res2.scored, res2.failed) == (8, 4, 2, 2)
    rows2 = _by_id(res2.table)
    assert len(res2.table) == 8 and res2.table["slide_id"].is_unique
    assert {sid: rows2[sid]["scored_at"] for sid in before} == before  # not scored again
    assert rows2["incomplete"]["status"] == "ok" and rows2["s9"]["status"] == "ok"
    assert rows2["corrupt_meta"]["status"] == "error"
    assert pd.isna(rows2["s9"]["heatmap"]) and Path(rows2["s0"]["heatmap"]).is_file()
