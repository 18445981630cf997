"""foveate export: real prediction rows (real stores scored by the two score workers with a tiny untrained model,
written by PredictionWriter) as GeoJSON for QuPath; polygons checked with shapely; the CLI's errors."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import shapely.geometry as shapely_geometry
import torch
from test_score import CLASSES, _model_config, _slide

from pipeline.cli import main
from pipeline.export import export
from pipeline.predictions import PredictionWriter, read_predictions
from workers.export import OBJECT_TYPE, class_colors, geojson_filename, prediction_features
from workers.store import COMPLETE_MARKER, write_store_from_array

SLIDES = ["s0", "s1"]


@pytest.fixture(scope="module")
def preds(tmp_path_factory):
    """A predictions file with two ok rows and one error row (an incomplete store)."""
    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.scoring import ClassifierWorker, ScorerWorker

    root = tmp_path_factory.mktemp("export")
    stores = root / "stores"
    for i, sid in enumerate([*SLIDES, "broken"]):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    (stores / "broken.zarr" / COMPLETE_MARKER).unlink()
    torch.manual_seed(0)
    cfg = _model_config()
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, CLASSES)
    items = ScorerWorker(ckpt, device="cpu").score_batch([(s, str(stores / f"{s}.zarr")) for s in [*SLIDES, "broken"]])
    rows = ClassifierWorker(ckpt, model_name="tiny").classify_batch(items)
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    path = root / "predictions.parquet"
    PredictionWriter(path, rows).flush(force=True)
    return path


def _features(path):
    data = json.loads(path.read_text())
    assert data["type"] == "FeatureCollection"
    return data["features"]


def test_export_writes_one_qupath_geojson_per_ok_slide(preds, tmp_path):
    rows = {r["slide_id"]: r for r in read_predictions(preds)}
    res = export(preds, tmp_path / "out")
    assert [p.name for p in res.written] == ["s0.geojson", "s1.geojson"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s0.geojson", "s1.geojson"]  # no temp files
    assert [sid for sid, _ in res.skipped] == ["broken"] and "incomplete" in res.skipped[0][1]
    assert res.rejected == []
    colors = class_colors(rows.values())
    assert list(colors) == CLASSES  # model order, one colour each
    for sid in SLIDES:
        row = rows[sid]
        feats = _features(tmp_path / "out" / f"{sid}.geojson")
        k = len(row["patches"])
        assert k == 4 and len(feats) == k
        boxes = []
        for f in feats:
            assert f["type"] == "Feature" and f["geometry"]["type"] == "Polygon"
            poly = shapely_geometry.shape(f["geometry"])
            assert poly.is_valid and not poly.is_empty and len(poly.interiors) == 0
            ring = f["geometry"]["coordinates"][0]
            assert ring[0] == ring[-1] and len(ring) == 5  # closed rectangle
            assert poly.exterior.is_ccw
            assert all(isinstance(v, int) for pt in ring for v in pt)  # level-0 pixel corners
            x0, y0, x1, y1 = poly.bounds
            assert poly.area == (x1 - x0) * (y1 - y0)  # axis-aligned box
            boxes.append((int(x0), int(y0), int(x1 - x0), int(y1 - y0)))
        assert sorted(boxes) == sorted((p["x"], p["y"], p["w"], p["h"]) for p in row["patches"])
        # ranks: 1 = highest scorer score
        ranked = sorted(row["patches"], key=lambda p: -p["score"])
        for i, (f, p) in enumerate(zip(feats, ranked), start=1):
            props = f["properties"]
            assert props["objectType"] == OBJECT_TYPE == "annotation"
            assert props["name"] == f"rank {i}"
            assert props["classification"] == {"name": row["prediction"], "color": colors[row["prediction"]]}
            assert len(props["classification"]["color"]) == 3
            assert props["measurements"] == {"rank": i, "score": p["score"], "probability": row["probability"]}
            assert props["metadata"] == {"slide_id": sid, "prediction": row["prediction"]}
            for key, want in [
                ("rank", i),
                ("score", p["score"]),
                ("prediction", row["prediction"]),
                ("probability", row["probability"]),
                ("slide_id", sid),
            ]:
                assert props[key] == want
            assert shapely_geometry.shape(f["geometry"]).bounds == (p["x"], p["y"], p["x"] + p["w"], p["y"] + p["h"])
        assert len({f["id"] for f in feats}) == k
    again = export(preds, tmp_path / "again")  # deterministic: same row, same file (ids included)
    assert [p.read_bytes() for p in again.written] == [p.read_bytes() for p in res.written]


def test_features_of_a_row_edge_cases(preds):
    row = next(r for r in read_predictions(preds) if r["status"] == "ok")
    inf_row = {**row, "patches": [{**row["patches"][0], "score": float("-inf")}, *row["patches"][1:]]}
    feats = prediction_features(inf_row)["features"]
    last = feats[-1]["properties"]  # a patch without a finite score ranks last and has no score measurement
    assert last["rank"] == len(feats) and last["score"] is None and "score" not in last["measurements"]
    json.dumps(prediction_features(inf_row), allow_nan=False)
    with pytest.raises(ValueError, match="status 'ok'"):
        prediction_features({**row, "status": "error"})
    with pytest.raises(ValueError, match="positive w and h"):
        prediction_features({**row, "patches": [{**row["patches"][0], "w": 0}]})
    with pytest.raises(TypeError, match="mapping"):
        prediction_features([row])
    assert geojson_filename("slide-1a2b.v2") == "slide-1a2b.v2.geojson"
    for bad in ["../x", "a/b", "..", ".", "", "a\\b", "/etc/passwd"]:
        with pytest.raises(ValueError, match="cannot be a file name"):
            geojson_filename(bad)
    with pytest.raises(TypeError, match="string"):
        geojson_filename(3)


def test_slide_ids_that_escape_the_folder_are_refused(preds, tmp_path, capsys):
    rows = read_predictions(preds)
    ok = next(r for r in rows if r["status"] == "ok")
    evil = tmp_path / "evil.parquet"
    PredictionWriter(evil, [*rows, {**ok, "slide_id": "../escaped"}, {**ok, "slide_id": "sub/x"}]).flush(force=True)
    out = tmp_path / "deep" / "out"
    assert main(["export", "--predictions", str(evil), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "refused 2 slide id(s)" in text and "'../escaped'" in text and "'sub/x'" in text
    assert "broken:" in text and "status=error" in text  # the error row is listed
    assert sorted(p.name for p in out.iterdir()) == ["s0.geojson", "s1.geojson"]
    assert not (out.parent / "escaped.geojson").exists() and not (out / "sub").exists()


def test_cli_writes_files_and_reports_bad_arguments(preds, tmp_path, capsys, caplog):
    out = tmp_path / "cli"
    assert main(["export", "--predictions", str(preds), "--format", "geojson", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"2 GeoJSON file(s) in {out}" in text and "broken: " in text and "Import objects" in text
    assert len(_features(out / "s0.geojson")) == 4

    with caplog.at_level(logging.ERROR):
        assert main(["export", "--predictions", str(tmp_path / "nope.parquet"), "--out", str(out)]) == 2
    assert "--predictions: no such file" in caplog.text

    not_parquet = tmp_path / "p.parquet"
    not_parquet.write_text("slide_id,status\n")
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert main(["export", "--predictions", str(not_parquet), "--out", str(out)]) == 2
    assert "--predictions" in caplog.text and "not a readable predictions file" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert main(["export", "--predictions", str(preds), "--out", str(out / "s0.geojson")]) == 2
    assert "--out must be a folder" in caplog.text

    with pytest.raises(SystemExit) as exc:
        main(["export", "--predictions", str(preds), "--format", "csv", "--out", str(out)])
    assert exc.value.code == 2
    assert "invalid choice: 'csv'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--format must be one of \['geojson'\], got 'qupath'"):
        export(preds, out, fmt="qupath")


def test_boxes_lie_on_the_slide_in_level0_pixels(preds):
    """The tiny model's patches are level-0 boxes on a 400 x 300 slide (what QuPath shows over the image)."""
    for row in read_predictions(preds):
        for f in prediction_features(row)["features"] if row["status"] == "ok" else []:
            x0, y0, x1, y1 = shapely_geometry.shape(f["geometry"]).bounds
            assert 0 <= x0 < x1 <= 400 + 32 and 0 <= y0 < y1 <= 300 + 32
    assert np.isfinite([r["probability"] for r in read_predictions(preds) if r["status"] == "ok"]).all()


def test_export_reads_predictions_from_object_storage(preds, tmp_path, monkeypatch):
    from local_services import moto_s3

    from workers import storage

    with moto_s3("preds") as (client, env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv(storage.STORAGE_OPTIONS_ENV, raising=False)
        client.put_object(Bucket="preds", Key="run/predictions.parquet", Body=preds.read_bytes())
        res = export("s3://preds/run/predictions.parquet", tmp_path / "s3out")
        local = export(preds, tmp_path / "localout")
        assert [p.name for p in res.written] == [p.name for p in local.written] == ["s0.geojson", "s1.geojson"]
        for a, b in zip(res.written, local.written):
            assert a.read_bytes() == b.read_bytes()
        with pytest.raises(FileNotFoundError, match="s3://preds/run/missing.parquet"):
            export("s3://preds/run/missing.parquet", tmp_path / "x")
