"""The logged model as a product (pipeline.serving): a pyfunc model of the whole pipeline, loadable where the
checkout is not, served by ``mlflow models serve``, promoted through the registry.

Real Zarr stores, a real (tiny, untrained) model logged to a real MLflow tracking store (sqlite), a real
``mlflow models serve`` process answering HTTP on 127.0.0.1, a separate interpreter in a fresh virtual
environment without the checkout, and ``foveate score`` on Ray for the reference predictions.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_score import CLASSES, _model_config, _slide

from workers.store import COMPLETE_MARKER, write_store_from_array

GOOD = ["s0", "s1", "s2"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Stores (3 good, 1 incomplete) and a model logged + registered in a sqlite tracking store."""
    import mlflow

    from operators.model import FoveateModel
    from pipeline.mlflow_model import log_model
    from pipeline.tracking import get_or_create_experiment

    root = tmp_path_factory.mktemp("serving")
    stores = root / "stores"
    for i, sid in enumerate([*GOOD, "incomplete"]):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    (stores / "incomplete.zarr" / COMPLETE_MARKER).unlink()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = get_or_create_experiment(client, "serving-test", uri)
    run_id = client.create_run(exp).info.run_id
    torch.manual_seed(0)
    cfg = _model_config()
    model = FoveateModel(cfg).eval()
    model_uri = log_model(
        model,
        cfg,
        CLASSES,
        run_id=run_id,
        tracking_uri=uri,
        registered_model_name="serving-test",
        input_example=pd.DataFrame({"store": [str(stores / "s0.zarr")]}),
    )
    client.set_terminated(run_id)
    local = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(root / "model"), tracking_uri=uri)
    )
    return {
        "root": root,
        "stores": stores,
        "uri": uri,
        "model_uri": model_uri,
        "run_id": run_id,
        "model": model,
        "local": local,
    }


def _expected(logged, sid):
    """The scoring workers' row (what foveate score writes; tests/test_score.py checks workers == score)."""
    from operators.checkpoint import checkpoint_dict
    from workers.scoring import ClassifierWorker, ScorerWorker

    ckpt = checkpoint_dict(logged["model"], _model_config(), CLASSES)
    item = ScorerWorker(ckpt, device="cpu").score_one(sid, str(logged["stores"] / f"{sid}.zarr"))
    return ClassifierWorker(ckpt).classify_batch([item])[0]


def _check_rows(rows, logged, sids):
    for row, sid in zip(rows, sids):
        exp = _expected(logged, sid)
        assert row["slide_id"] == sid and row["status"] == "ok", row
        assert [(p["x"], p["y"], p["w"], p["h"]) for p in row["patches"]] == [
            (p["x"], p["y"], p["w"], p["h"]) for p in exp["patches"]
        ]
        np.testing.assert_allclose(
            [p["score"] for p in row["patches"]], [p["score"] for p in exp["patches"]], rtol=1e-6
        )
        np.testing.assert_allclose(
            [row[f"prob_{c}"] for c in CLASSES], [exp["probabilities"][c] for c in CLASSES], rtol=1e-5, atol=1e-7
        )
        assert row["prediction"] == exp["prediction"]


def test_pyfunc_model_scores_stores_like_foveate_score(logged):
    import mlflow

    m = mlflow.pyfunc.load_model(logged["model_uri"])
    sig = m.metadata.signature
    assert sig.inputs.input_names() == ["store", "slide_id"]
    assert {"slide_id", "status", "error", "prediction", "probabilities", "patches", "prob_tumour"} <= set(
        sig.outputs.input_names()
    )
    stores = [str(logged["stores"] / f"{s}.zarr") for s in GOOD]
    out = m.predict(
        pd.DataFrame(
            {
                "store": [*stores, str(logged["stores"] / "incomplete.zarr"), str(logged["stores"] / "missing.zarr")],
                "slide_id": [*GOOD, "inc", None],
            }
        )
    )
    rows = out.to_dict(orient="records")
    assert len(rows) == 5
    _check_rows(rows[:3], logged, GOOD)
    assert all(r["model"] == f"runs:/{logged['run_id']}/model" for r in rows)
    assert rows[3]["status"] == "error" and "incomplete" in rows[3]["error"] and rows[3]["slide_id"] == "inc"
    assert rows[4]["status"] == "error" and rows[4]["slide_id"] == "missing"
    assert "no slide store" in rows[4]["error"]
    # the input schema is enforced: a table without a store column is refused with a clear message
    with pytest.raises(Exception, match="store"):
        m.predict(pd.DataFrame({"path": stores}))


def test_logged_model_artifacts_hold_no_pickle_and_installable_requirements(logged):
    local = logged["local"]
    mlmodel = (local / "MLmodel").read_text()
    assert "loader_module: mlflow.pyfunc.loaders.code_model" in mlmodel  # logged from code, no python_model.pkl
    assert not list(local.rglob("*.pkl"))
    assert {p.name for p in (local / "code").iterdir()} >= {"pipeline", "operators", "workers"}
    reqs = (local / "requirements.txt").read_text().split()
    assert "torch>=2.4" in reqs and not any("+" in r for r in reqs)  # a range an ordinary index serves
    assert not any(r.startswith("ray") for r in reqs)
    ckpt = torch.load(local / "artifacts" / "model.pt", weights_only=True)  # plain tensors and config
    assert ckpt["class_names"] == CLASSES


@pytest.mark.slow
@pytest.mark.e2e
def test_logged_model_loads_in_an_interpreter_without_the_checkout(logged, tmp_path, fresh_venv):
    py = fresh_venv()
    script = tmp_path / "load.py"
    script.write_text(
        "import importlib.util, json, sys\n"
        "assert importlib.util.find_spec('pipeline') is None, 'the checkout is importable'\n"
        "import mlflow.pyfunc, pandas as pd\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1])\n"
        "import pipeline\n"
        "out = m.predict(pd.DataFrame({'store': sys.argv[2:]}))\n"
        "print(json.dumps({'pipeline': pipeline.__file__, 'rows': out.to_dict(orient='records')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    stores = [str(logged["stores"] / f"{s}.zarr") for s in GOOD]
    res = subprocess.run(
        [str(py), str(script), str(logged["local"]), *stores],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(got["pipeline"]).is_relative_to(logged["local"] / "code")  # foveate came with the model
    _check_rows(got["rows"], logged, GOOD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
@pytest.mark.e2e
def test_mlflow_models_serve_answers_like_foveate_score(logged, ray_local, tmp_path):
    from pipeline.score import score

    reference = score(
        "models:/serving-test/1",
        logged["stores"],
        tmp_path / "pred.parquet",
        workers=1,
        experiment=None,
        tracking_uri=logged["uri"],
        heatmaps=False,
    ).table
    ref = {r["slide_id"]: r for r in reference.to_dict(orient="records")}
    port = _free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    # as in an activated environment: mlflow starts uvicorn from PATH
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": logged["uri"],
        "PATH": f"{mlflow_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(
        [str(mlflow_bin), "models", "serve", "-m", "models:/serving-test/1", "-h", "127.0.0.1", "-p", str(port)]
        + ["--env-manager", "local", "-w", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not come up in 180 s"
            time.sleep(1)
        stores = [str(logged["stores"] / f"{s}.zarr") for s in GOOD]
        status, body = _post(
            f"{base}/invocations",
            json.dumps(
                {"dataframe_records": [{"store": s} for s in [*stores, str(logged["stores"] / "gone.zarr")]]}
            ).encode(),
        )
        assert status == 200, body
        rows = body["predictions"]
        assert len(rows) == 4
        for row in rows[:3]:  # the same predictions as foveate score
            r = ref[row["slide_id"]]
            assert row["prediction"] == r["prediction"]
            assert [(p["x"], p["y"]) for p in row["patches"]] == [(p["x"], p["y"]) for p in r["patches"]]
            np.testing.assert_allclose(
                [row[f"prob_{c}"] for c in CLASSES], [r[f"prob_{c}"] for c in CLASSES], rtol=1e-5, atol=1e-7
            )
        assert rows[3]["status"] == "error" and "no slide store" in rows[3]["error"]  # an error row, not a crash
        # bad requests: a 4xx with a message, and the server keeps answering
        status, body = _post(f"{base}/invocations", json.dumps({"dataframe_records": [{"path": "x"}]}).encode())
        assert 400 <= status < 500 and "store" in json.dumps(body), body
        status, body = _post(f"{base}/invocations", b"{not json")
        assert 400 <= status < 500, body
        status, body = _post(f"{base}/invocations", json.dumps({"dataframe_records": [{"store": stores[0]}]}).encode())
        assert status == 200 and body["predictions"][0]["status"] == "ok"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_registry_alias_promote_and_load(logged, tmp_path, capsys):
    """Two more registered versions with val_auc; `foveate compare --promote champion --by val_auc` points the
    alias at the best run's version, and models:/NAME@ALIAS / models:/NAME/VERSION load it."""
    import mlflow

    from operators.model import FoveateModel
    from pipeline.cli import main
    from pipeline.compare import promote
    from pipeline.mlflow_model import load_model, log_model
    from pipeline.tracking import get_or_create_experiment

    uri = logged["uri"]
    client = mlflow.MlflowClient(uri)
    exp = get_or_create_experiment(client, "promote-test", uri)
    models = {}
    for seed, auc in ((1, 0.7), (2, 0.9)):
        run_id = client.create_run(exp).info.run_id
        client.log_metric(run_id, "val_auc", auc)
        torch.manual_seed(seed)
        models[run_id] = FoveateModel(_model_config()).eval()
        log_model(
            models[run_id], _model_config(), CLASSES, run_id=run_id, tracking_uri=uri, registered_model_name="promo"
        )
        client.set_terminated(run_id)
    best = [r for r in models][1]
    assert (
        main(
            [
                "compare",
                "--experiment",
                "promote-test",
                "--out",
                str(tmp_path),
                "--tracking-uri",
                uri,
                "--promote",
                "champion",
                "--by",
                "val_auc",
            ]
        )
        == 0
    )
    assert "models:/promo@champion -> version 2" in capsys.readouterr().out
    v = client.get_model_version_by_alias("promo", "champion")
    assert v.run_id == best and v.tags["foveate.promoted_by"] == "val_auc=0.9 in promote-test"
    for u in ("models:/promo@champion", "models:/promo/2"):
        net, _, classes = load_model(u, tracking_uri=uri)
        assert classes == CLASSES
        for k, t in models[best].state_dict().items():
            assert torch.equal(net.state_dict()[k], t), (u, k)
    assert promote("promote-test", "worst", "val_auc", tracking_uri=uri, minimize=True)[0].version == "1"
    with pytest.raises(ValueError, match="no finished training run .* 'val_loss'"):
        promote("promote-test", "champion", "val_loss", tracking_uri=uri)
    with pytest.raises(ValueError, match="alias"):
        promote("promote-test", "latest", "val_auc", tracking_uri=uri)
    # a run without a registered model version: the message says how to register
    run_id = client.create_run(exp).info.run_id
    client.log_metric(run_id, "val_auc", 0.99)
    client.set_terminated(run_id)
    with pytest.raises(ValueError, match="tracking.registered_model"):
        promote("promote-test", "champion", "val_auc", tracking_uri=uri)
