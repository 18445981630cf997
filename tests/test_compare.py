"""foveate compare: runs logged with MLflow in a sqlite store -> table, CSV and PNG."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from mlflow.entities import Metric, Param

from pipeline.compare import COLUMNS, compare, format_table


def _log_run(client, exp_id, name, params, metrics_by_step, tags=None):
    run = client.create_run(exp_id, run_name=name, tags=tags or {})
    rid = run.info.run_id
    ms = [Metric(k, v, 1000 + step, step) for step, m in enumerate(metrics_by_step) for k, v in m.items()]
    client.log_batch(rid, metrics=ms, params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(rid)
    return rid


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """One sqlite store for the module (creating one costs seconds of schema migrations)."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("cmp")
    other = client.create_experiment("other")
    ids = {}
    ids["topk"] = _log_run(
        client,
        exp_id,
        "topk-transformer",
        {"model.selector": "perturbed", "model.k": "8", "model.aggregator": "transformer"},
        [
            {"val_accuracy": 0.5, "val_auc": 0.6, "train_seconds": 10.0},
            {
                "val_accuracy": 0.95,
                "val_auc": 0.99,
                "train_seconds": 20.0,
                "epoch_patches_per_second": 123.0,
                "peak_memory_mb": 512.0,
            },
        ],
        tags={"foveate.stage": "train"},
    )
    ids["lapsum"] = _log_run(
        client,
        exp_id,
        "lapsum-mean",
        {"model.selector": "lapsum", "model.k": "4", "model.aggregator": "mean"},
        [
            {
                "val_accuracy": 0.75,
                "val_auc": 0.8,
                "train_seconds": 7.5,
                "epoch_patches_per_second": 80.0,
                "peak_memory_mb": 300.0,
            }
        ],
    )
    # a benchmark-style run with the fallback names
    ids["bench"] = _log_run(
        client,
        exp_id,
        "downsampled-cnn",
        {"operator": "none", "aggregator": "cnn"},
        [{"accuracy": 0.55, "auc": 0.5, "train_seconds": 3.0}],
    )
    _log_run(client, exp_id, "score", {"model_uri": "runs:/x"}, [{"slides_ok": 3}], tags={"foveate.stage": "score"})
    _log_run(client, other, "elsewhere", {"model.selector": "hard"}, [{"val_accuracy": 1.0}])
    client.create_experiment("empty")
    return uri, ids


def test_table_csv_png(experiment, tmp_path):
    uri, ids = experiment
    res = compare("cmp", out_dir=tmp_path / "out", tracking_uri=uri)
    t = res.table
    assert list(t.columns) == list(COLUMNS)
    # best accuracy first; the score run and the other experiment's run are left out
    assert list(t["run_id"]) == [ids["topk"], ids["lapsum"], ids["bench"]]
    top = t.iloc[0]
    assert (top["operator"], int(top["k"]), top["aggregator"]) == ("perturbed", 8, "transformer")
    # latest value of each metric
    assert top["accuracy"] == pytest.approx(0.95) and top["auc"] == pytest.approx(0.99)
    assert top["train_seconds"] == pytest.approx(20.0)
    assert top["patches_per_second"] == pytest.approx(123.0) and top["peak_memory_mb"] == pytest.approx(512.0)
    assert top["accuracy_metric"] == "val_accuracy"
    bench = t.iloc[2]
    assert (bench["operator"], bench["aggregator"], bench["accuracy"]) == ("none", "cnn", pytest.approx(0.55))
    assert pd.isna(bench["k"]) and math.isnan(bench["peak_memory_mb"])

    csv = pd.read_csv(res.csv_path)
    assert list(csv["run_id"]) == list(t["run_id"])
    np.testing.assert_allclose(csv["accuracy"], [0.95, 0.75, 0.55])
    assert list(csv["operator"]) == ["perturbed", "lapsum", "none"]

    import matplotlib.image as mpimg

    img = mpimg.imread(res.png_path)
    assert res.png_path.name == "compare_cmp_accuracy_vs_time.png"
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01  # something is drawn

    text = format_table(t)
    assert "perturbed" in text and "lapsum" in text and "transformer" in text


def test_cli_and_errors(experiment, tmp_path, capsys, monkeypatch):
    from pipeline.cli import main

    uri, _ = experiment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["compare", "--experiment", "cmp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 run(s)" in out and "topk-transformer" in out and "0.95" in out
    assert (tmp_path / "compare_cmp.csv").is_file()
    with pytest.raises(ValueError, match="'nope' not found.*cmp"):
        compare("nope", out_dir=None, tracking_uri=uri)
    assert main(["compare", "--experiment", "nope", "--out", str(tmp_path)]) == 2


def test_empty_experiment(experiment, tmp_path):
    res = compare("empty", out_dir=tmp_path, tracking_uri=experiment[0])
    assert len(res.table) == 0 and list(res.table.columns) == list(COLUMNS)
    assert res.png_path.is_file() and pd.read_csv(res.csv_path).empty


def test_trials_follow_their_search(experiment, tmp_path):
    """A tune search (parent run) and its trials (tag mlflow.parentRunId): each trial right after its search, best
    first, marked in the printed table; a run whose parent is elsewhere stays where its accuracy puts it."""
    import mlflow

    uri, _ = experiment
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("search")
    ids = {"solo": _log_run(client, exp_id, "solo", {}, [{"val_accuracy": 0.9}])}
    ids["search"] = _log_run(client, exp_id, "tune-x", {}, [{"val_accuracy": 0.8}])
    for name, acc in (("tune-x-trial-000", 0.7), ("tune-x-trial-001", 0.95), ("tune-x-trial-002", 0.6)):
        ids[name] = _log_run(client, exp_id, name, {}, [{"val_accuracy": acc}], {"mlflow.parentRunId": ids["search"]})
    ids["orphan"] = _log_run(client, exp_id, "orphan", {}, [{"val_accuracy": 0.85}], {"mlflow.parentRunId": "gone"})

    res = compare("search", out_dir=tmp_path, tracking_uri=uri)
    order = ["solo", "orphan", "search", "tune-x-trial-001", "tune-x-trial-000", "tune-x-trial-002"]
    assert list(res.table["run_id"]) == [ids[n] for n in order]
    assert list(res.table["parent_run_id"][3:]) == [ids["search"]] * 3
    assert pd.read_csv(res.csv_path)["parent_run_id"].tolist()[3:] == [ids["search"]] * 3
    lines = format_table(res.table).splitlines()[1:]
    assert [ln.split()[0] for ln in lines[:3]] == ["solo", "orphan", "tune-x"]
    assert all(ln.startswith("└ tune-x-trial-") for ln in lines[3:]), lines
