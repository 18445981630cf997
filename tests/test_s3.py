"""Stores on object storage, against a real S3 API: moto's server on 127.0.0.1 (``moto[server]``), reached through
s3fs with credentials and endpoint from the environment (``AWS_*``), exactly as a user's bucket would be.

- a tiler reading its slide from the bucket (copied to bounded local scratch, removed after the slide) and killed
  mid-slide leaves no object that looks like a complete store, and a fresh tiler resumes at region granularity to
  the same pixels as an uninterrupted local ingest; a missing shard object is found; JPEG passthrough from a
  slide in the bucket copies the source tiles;
- ingest -> train (crash after epoch 1, resume) -> score -> score again (resume), every path an ``s3://`` URL,
  on an in-process Ray; a slide that fails leaves no store behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("moto.server", reason="moto[server] is in the test extras (pip install -e '.[test]')")
pytest.importorskip("s3fs", reason="s3fs is in the test extras (pip install -e '.[test]')")

from local_services import moto_s3

from pipeline.ingest_inputs import discover_inputs
from workers import storage
from workers.store import COMPLETE_MARKER, SlideStore, verify_store
from workers.tiler import PLAN_FILE, PROGRESS_DIR, IngestOptions, Tiler

BUCKET = "foveate-test"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port of 127.0.0.1 with one bucket; the AWS_* variables point at it for this
    module (and for the Ray workers started after it)."""
    with moto_s3(BUCKET) as (client, env):
        saved = {k: os.environ.get(k) for k in [*env, storage.STORAGE_OPTIONS_ENV]}
        os.environ.update(env)
        os.environ.pop(storage.STORAGE_OPTIONS_ENV, None)
        try:
            yield client
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _keys(client, prefix: str) -> list[str]:
    out, token = [], None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kw)
        out += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return sorted(out)
        token = page["NextContinuationToken"]


@pytest.fixture(scope="module")
def svs(tmp_path_factory) -> Path:
    from pipeline.synthetic import write_synthetic_slide

    p = tmp_path_factory.mktemp("s3slides") / "s3a.svs"
    write_synthetic_slide(p, width=2048, height=2048, label=1, seed=11, fmt="svs", tile_size=256)
    return p


@pytest.fixture(scope="module")
def svs_url(s3, svs) -> str:
    """The slide uploaded to the bucket, with a CSV manifest beside it (relative path, a label)."""
    s3.put_object(Bucket=BUCKET, Key="slides/a/s3a.svs", Body=svs.read_bytes())
    s3.put_object(Bucket=BUCKET, Key="slides/a/broken.svs", Body=b"II*\x00 not a slide")
    s3.put_object(Bucket=BUCKET, Key="slides/list.csv", Body=b"path,label\na/s3a.svs,pos\n")
    return f"s3://{BUCKET}/slides/a/s3a.svs"


def test_slides_on_s3_are_listed_and_copied_to_bounded_scratch(s3, svs, svs_url, tmp_path):
    from pipeline.ingest_inputs import discover_inputs
    from workers.ingest_source import SlideOpenError

    found = discover_inputs([f"s3://{BUCKET}/slides/a/"])
    assert [i.path for i in found] == [f"s3://{BUCKET}/slides/a/broken.svs", svs_url]
    (row,) = discover_inputs([f"s3://{BUCKET}/slides/list.csv"])
    assert row.path == svs_url and row.carried == {"label": "pos"} and row.slide_id == found[1].slide_id
    scratch = tmp_path / "scratch"
    opts = IngestOptions(tile_size=256, min_size=256, codec="jpeg")  # JPEG passthrough from the copy
    t = Tiler(tmp_path / "stores", opts, scratch_dir=scratch, scratch_max_bytes=svs.stat().st_size + 1)
    plan = t.plan(found[1])
    copies = [p for p in scratch.rglob("*") if p.is_file()]
    assert len(copies) == 1 and copies[0].stat().st_size == svs.stat().st_size  # one local copy while writing
    for st in plan.todo:
        for r in st:
            t.write_region(plan.store_path, r)
    meta = t.finalize(plan.store_path)
    assert meta["codec"] == "jpeg-passthrough"
    assert not [p for p in scratch.rglob("*") if p.is_file()]  # removed after the slide
    ref = Tiler(tmp_path / "ref", opts)
    (local,) = discover_inputs([svs])
    ref.ingest_slide(local)
    a, b = SlideStore(plan.store_path), SlideStore(ref.store_path(local.slide_id))
    assert a.meta.fingerprint == b.meta.fingerprint and a.meta.source == svs_url
    for lvl in range(a.level_count):
        np.testing.assert_array_equal(a.read_level(lvl), b.read_level(lvl), err_msg=f"level {lvl}")
    with pytest.raises(SlideOpenError, match="not a slide OpenSlide can open"):
        t.plan(found[0])
    with pytest.raises(SlideOpenError, match="no such object"):
        t.plan(discover_inputs([f"s3://{BUCKET}/slides/a/missing.svs"])[0])
    small = Tiler(tmp_path / "stores", opts, scratch_dir=scratch, scratch_max_bytes=1000)
    with pytest.raises(SlideOpenError, match="more than the scratch bound of 0.00 GB"):
        small.plan(found[1])
    t.close()
    assert not scratch.exists() or not any(scratch.rglob("*.svs"))


@pytest.mark.slow
def test_killed_tiler_on_s3_leaves_no_complete_store_and_resumes_by_region(s3, svs, svs_url, tmp_path):
    opts = IngestOptions(tile_size=256, min_size=256, region_tiles=2, codec="zstd")  # the decoding path
    (inp,) = discover_inputs([svs_url])  # the slide itself is read from the bucket too
    prefix = "kill/stores"

    class DiesInRegion5(Tiler):
        def _level_written(self, region, level, pending):
            if region.key == "s0_r5" and level == 0:
                for f in pending:
                    f.result()
                raise RuntimeError("killed mid-region")

    t = DiesInRegion5(f"s3://{BUCKET}/{prefix}", opts)
    plan = t.plan(inp)
    assert plan.store_path == f"s3://{BUCKET}/{prefix}/{inp.slide_id}.zarr"
    with pytest.raises(RuntimeError, match="killed mid-region"):
        for r in plan.todo[0]:
            t.write_region(plan.store_path, r)
    keys = _keys(s3, f"{prefix}/{inp.slide_id}.zarr/")
    assert not any(k.endswith(COMPLETE_MARKER) for k in keys)  # nothing looks like a complete store
    assert any(k.endswith(PLAN_FILE) for k in keys)
    done = {k.rsplit("/", 1)[-1].removesuffix(".done") for k in keys if f"/{PROGRESS_DIR}/" in k}
    assert done == {f"s0_r{i}" for i in range(5)}
    # region 5 (512-px blocks, 4 per row: x 512-1023, y 512-1023) wrote its level-0 shard, not its level-1 one
    assert f"{prefix}/{inp.slide_id}.zarr/0/c/0/1/1" in keys and f"{prefix}/{inp.slide_id}.zarr/1/c/0/1/1" not in keys
    assert verify_store(plan.store_path) == [f"incomplete: no {COMPLETE_MARKER} (ingest did not finish; re-run ingest)"]
    with pytest.raises(ValueError, match="incomplete"):
        SlideStore(plan.store_path)

    t2 = Tiler(f"s3://{BUCKET}/{prefix}", opts)  # a fresh actor resumes at region granularity
    plan2 = t2.plan(inp)
    assert plan2.resumed_regions == 5
    for st in plan2.todo:
        for r in st:
            t2.write_region(plan2.store_path, r)
    t2.finalize(plan2.store_path)
    keys = _keys(s3, f"{prefix}/{inp.slide_id}.zarr/")
    assert not any(f"/{PROGRESS_DIR}/" in k for k in keys) and keys[-1].endswith("zarr.json")
    assert f"{prefix}/{inp.slide_id}.zarr/{COMPLETE_MARKER}" in keys

    ref = Tiler(tmp_path / "local", opts)
    (local,) = discover_inputs([svs])
    ref.ingest_slide(local)
    a, b = SlideStore(plan2.store_path), SlideStore(ref.store_path(local.slide_id))
    assert a.level_count == b.level_count == 4
    for lvl in range(a.level_count):
        np.testing.assert_array_equal(a.read_level(lvl), b.read_level(lvl), err_msg=f"level {lvl}")
    np.testing.assert_array_equal(a.tissue_mask()[0], b.tissue_mask()[0])
    # the inventory of the marker lists the shard objects; removing one is found by name of its level
    marker = json.loads(
        s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{inp.slide_id}.zarr/{COMPLETE_MARKER}")["Body"].read()
    )
    shards = [k for k in keys if k.startswith(f"{prefix}/{inp.slide_id}.zarr/0/c/")]
    # one object per 512-px region on level 0 (16 regions; background-only regions store none)
    assert marker["inventory"]["0"]["chunks"] == len(shards) and 8 <= len(shards) <= 16
    s3.delete_object(Bucket=BUCKET, Key=shards[3])
    problems = verify_store(plan2.store_path)
    n = len(shards)
    assert problems == [f"level 0: {n - 1} chunk object(s) in the store, the completion marker lists {n}"]
    with pytest.raises(ValueError, match="damaged: level 0"):
        SlideStore(plan2.store_path)


@pytest.mark.slow
def test_shards_against_one_object_per_chunk_on_s3(s3, svs):
    (inp,) = discover_inputs([svs])
    counts = {}
    for shard in (True, False):
        t = Tiler(f"s3://{BUCKET}/count{int(shard)}", IngestOptions(tile_size=256, min_size=256, shard=shard))
        t.ingest_slide(inp)
        counts[shard] = len(_keys(s3, f"count{int(shard)}/"))
        store = SlideStore(t.store_path(inp.slide_id))
        assert store.meta.extra["shard_sides"] == ([2048, 1024, 512, 256] if shard else None)
    # 2048^2 px, 256-px chunks: level 0 is 1 shard instead of 64 chunk objects
    assert counts[True] < counts[False] / 2, counts


@pytest.fixture(scope="module")
def slide_csv(tmp_path_factory) -> Path:
    """Six small synthetic slides (labels 0/1) and one broken file, listed in a CSV with a label column."""
    import tifffile

    d = tmp_path_factory.mktemp("e2e")
    rows = []
    for i in range(6):  # 512 x 512 tiled RGB TIFFs: tissue with noise, a checkerboard in the positives
        rng = np.random.default_rng(i)
        img = np.full((512, 512, 3), 240, np.uint8)
        img[64:448, 64:448] = (200, 120, 180)
        img[64:448, 64:448] += rng.integers(0, 20, (384, 384, 1), dtype=np.uint8)
        if i % 2:
            img[128 + 32 * (i % 3) : 160 + 32 * (i % 3), 192:224] = (np.indices((32, 32)).sum(0) % 2 * 80)[..., None]
        p = d / f"e{i}.tiff"
        tifffile.imwrite(p, img, tile=(128, 128), photometric="rgb", compression="zlib")
        rows.append({"path": str(p), "label": str(i % 2)})
    bad = d / "broken.tiff"
    bad.write_bytes(b"II*\x00 this is not a slide")
    rows.append({"path": str(bad), "label": "1"})
    csv = d / "slides.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    return csv


TINY = """
data: {{stores: {stores}, labels: manifest, val_fraction: 0.34, seed: 0}}
model:
  patch_size: 32
  k: 4
  scorer_downsample: 4
  num_samples: 8
  max_support: 2
  scorer: {{channels: 4, num_layers: 2}}
  features: {{widths: [4, 8], blocks: [1, 1], feature_dim: 8}}
  aggregator: mean
optim: {{epochs: 2, lr: 0.01, accumulate: 2, warmup: 1}}
schedule: {{sigma_start: 0.1, sigma_end: 0.0}}
tracking: {{experiment: test-s3, artifact_slides: 1, run_name: s3run}}
workdir: {workdir}
"""


@pytest.mark.slow
@pytest.mark.e2e
def test_ingest_train_score_resume_with_every_path_on_s3(s3, ray_own, slide_csv, tmp_path):
    from pipeline.config import load_config
    from pipeline.ingest import ingest
    from pipeline.score import score
    from pipeline.train import TrainConfig, train

    root = f"s3://{BUCKET}/e2e"
    res = ingest([slide_csv], f"{root}/stores", options=IngestOptions(tile_size=128, min_size=128), progress=False)
    status = {r["slide_id"].split("-")[0]: r["status"] for r in res.rows}
    assert status == {**{f"e{i}": "ok" for i in range(6)}, "broken": "failed"}
    assert res.manifest_path == f"{root}/stores/manifest.parquet"
    keys = _keys(s3, "e2e/stores/")
    complete = {k.split("/")[2] for k in keys if k.endswith(COMPLETE_MARKER)}
    assert len(complete) == 6 and not any(k.split("/")[2].startswith("broken") for k in keys)  # nothing left

    def crash_after_first_epoch(epoch: int) -> None:
        if epoch == 1:
            raise RuntimeError("simulated crash after checkpointing epoch 1")

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(TINY.format(stores=f"{root}/stores", workdir=f"{root}/work"))
    cfg = load_config(TrainConfig, cfg_file)
    with pytest.raises(Exception, match="simulated crash"):
        train(cfg, workers=1, after_epoch=crash_after_first_epoch)
    run_keys = _keys(s3, "e2e/work/train/s3run/")
    assert "e2e/work/train/s3run/train_state.json" in run_keys
    assert any("/ray/checkpoint_" in k and k.endswith("train_state.pt") for k in run_keys)  # on S3, not on disk
    result = train(cfg, workers=1, resume=True)
    assert result.metrics["epoch"] == 2 and result.run_dir == f"{root}/work/train/s3run"
    import mlflow

    run = mlflow.MlflowClient(result.tracking_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["foveate.resumed"] == "1"

    out = f"{root}/preds/p.parquet"
    r1 = score(result.model_uri, f"{root}/stores", out, workers=1, scorer_workers=1)
    assert (r1.total, r1.scored, r1.failed, r1.skipped) == (6, 6, 0, 0)
    table = pd.read_parquet(storage.filesystem(out)[0].open(storage.filesystem(out)[1], "rb"))
    assert sorted(table["status"]) == ["ok"] * 6 and all(s.startswith(f"{root}/stores/") for s in table["store"])
    assert all(h.startswith(f"{root}/preds/p_heatmaps/") for h in table["heatmap"])
    pngs = [k for k in _keys(s3, "e2e/preds/p_heatmaps/") if k.endswith(".png")]
    overlays = {k.split("/")[3] for k in _keys(s3, "e2e/preds/p_ngff/")}
    assert len(pngs) == 6 and len(overlays) == 6
    r2 = score(result.model_uri, f"{root}/stores", out, workers=1, scorer_workers=1)  # resumes: nothing to redo
    assert (r2.scored, r2.skipped) == (0, 6) and sorted(r2.table["slide_id"]) == sorted(table["slide_id"])


def test_no_sqlite_tracking_store_in_a_bucket(monkeypatch):
    from pipeline.tracking import resolve_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(
        ValueError, match=r"cannot live under 's3://b/runs'.*--tracking-uri or set \$MLFLOW_TRACKING_URI"
    ):
        resolve_tracking_uri(None, default_dir="s3://b/runs")
    assert resolve_tracking_uri("http://mlflow:5000", default_dir="s3://b/runs") == "http://mlflow:5000"
