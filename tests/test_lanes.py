"""Nothing outside its lane: what the viewer and the served model may read, what ``verify`` and the input listing
count, and failures that end in one line instead of a traceback.

Real stores, a real HTTP viewer, the logged pyfunc model of ``tests/test_serving.py`` behind MLflow's own
scoring handler, a real HTTP server on 127.0.0.1 that must receive nothing, moto's S3 server with authentication
on, and (as root) real read-only tmpfs mounts. The one simulation: a full disk while the manifest is written
(``OSError(ENOSPC)`` from the Parquet writer).
"""

from __future__ import annotations

import errno
import http.server
import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from workers.store import COMPLETE_MARKER, write_store_from_array


def _slide(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = np.full((300, 400, 3), 245, np.uint8)
    img[40:260, 60:340] = rng.integers(90, 210, (220, 280, 3), dtype=np.uint8)
    return img


def _get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@contextmanager
def _serving(viewer):
    from pipeline.view import make_server

    srv = make_server(viewer, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):
        type(self).hits.append(self.path)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture()
def recorder():
    """An HTTP server on 127.0.0.1 that records every request it gets."""
    _Recorder.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}", _Recorder.hits
    srv.shutdown()
    srv.server_close()


# ------------------------------------------------------------------ 1: the viewer reads overlays from its folder


@pytest.fixture(scope="module")
def view_data(tmp_path_factory):
    """Three stores; a predictions file whose rows name /etc/passwd (s0), its own heatmap (s1), and a heatmap
    file of its own folder that is a symlink to a file outside it (s2)."""
    from pipeline.predictions import PredictionWriter
    from workers.scoring import error_row

    root = tmp_path_factory.mktemp("lanes-view")
    stores = root / "stores"
    for i, sid in enumerate(["s0", "s1", "s2"]):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    preds = root / "preds" / "p.parquet"
    heat = root / "preds" / "p_heatmaps"
    heat.mkdir(parents=True)
    secret = root / "secret.png"
    secret.write_bytes(b"\x89PNG secret outside the predictions folder")
    (heat / "s1.png").write_bytes(b"\x89PNG the real heatmap of s1")
    (heat / "s2.png").symlink_to(secret)
    writer = PredictionWriter(preds)
    for sid, hm in (("s0", "/etc/passwd"), ("s1", str(heat / "s1.png")), ("s2", str(heat / "s2.png"))):
        row = error_row(sid, str(stores / f"{sid}.zarr"), "crafted")
        row["heatmap"] = hm
        writer.add(row)
    writer.flush(force=True)
    return {"root": root, "stores": stores, "preds": preds, "heat": heat}


def test_viewer_serves_heatmaps_only_from_the_predictions_own_folder(view_data):
    from pipeline.view import Viewer

    viewer = Viewer(view_data["stores"], view_data["preds"])
    with _serving(viewer) as url:
        status, _, body = _get(f"{url}/overlay/s0/heatmap.png")
        assert status == 404 and b"root:" not in body, body  # /etc/passwd named by a row is never read
        assert json.loads(_get(f"{url}/api/slide/s0")[2])["heatmap_url"] is None
        status, _, body = _get(f"{url}/overlay/s2/heatmap.png")  # a link out of the folder is not followed
        assert status == 404 and b"secret" not in body, body
        status, _, body = _get(f"{url}/overlay/s1/heatmap.png")
        assert status == 200 and body == (view_data["heat"] / "s1.png").read_bytes()


def test_viewer_finds_heatmaps_of_a_moved_predictions_folder(view_data, tmp_path):
    """The rows keep the old absolute paths; the heatmaps beside the moved file are the ones shown."""
    import shutil

    from pipeline.view import Viewer

    moved = tmp_path / "moved"
    shutil.copytree(view_data["preds"].parent, moved, symlinks=True)
    (view_data["heat"] / "s1.png").write_bytes(b"\x89PNG changed at the old place")
    try:
        viewer = Viewer(view_data["stores"], moved / "p.parquet")
        assert viewer.heatmap_png("s1") == b"\x89PNG the real heatmap of s1"
    finally:
        (view_data["heat"] / "s1.png").write_bytes(b"\x89PNG the real heatmap of s1")


def test_viewer_caps_concurrent_patch_and_tile_requests(view_data):
    """Beyond ``max_concurrent`` image requests at once: 503 with Retry-After; pages and JSON are not capped."""
    from pipeline.view import Viewer

    with pytest.raises(ValueError, match="max_concurrent"):
        Viewer(view_data["stores"], max_concurrent=0)
    viewer = Viewer(view_data["stores"], max_concurrent=1, queue_timeout_s=0.2)
    with _serving(viewer) as url:
        assert _get(f"{url}/patch/s0?x=0&y=0&w=64&h=64")[0] == 200
        assert viewer.image_slots.acquire(timeout=5)  # one request in flight: the cap is reached
        try:
            t0 = time.monotonic()
            status, headers, body = _get(f"{url}/patch/s0?x=0&y=0&w=64&h=64")
            assert status == 503 and headers.get("Retry-After") == "1", (status, headers)
            assert "busy" in json.loads(body)["error"]
            assert time.monotonic() - t0 < 5
            assert _get(f"{url}/tiles/s1/0/0/0.jpg")[0] == 503
            assert _get(f"{url}/api/slides")[0] == 200
        finally:
            viewer.image_slots.release()
        assert _get(f"{url}/tiles/s1/0/0/0.jpg")[0] == 200


# ------------------------------------------------------------------ 2: the served model opens stores under roots


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The model of tests/test_serving.py (logged with an input example under its stores folder), loaded."""
    import mlflow
    import torch
    from test_score import CLASSES, _model_config

    from operators.model import FoveateModel
    from pipeline.mlflow_model import log_model
    from pipeline.tracking import get_or_create_experiment

    root = tmp_path_factory.mktemp("lanes-serve")
    stores = root / "stores"
    other = root / "other"
    for i, sid in enumerate(["s0", "s1"]):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    write_store_from_array(other / "o0.zarr", _slide(2), tile_size=64, min_size=64)
    (stores / "escape.zarr").symlink_to(other / "o0.zarr")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(get_or_create_experiment(client, "lanes-serve", uri)).info.run_id
    torch.manual_seed(0)
    model_uri = log_model(
        FoveateModel(_model_config()).eval(),
        _model_config(),
        CLASSES,
        run_id=run_id,
        tracking_uri=uri,
        input_example=pd.DataFrame({"store": [str(stores / "s0.zarr")]}),
    )
    client.set_terminated(run_id)
    mlflow.set_tracking_uri(uri)
    return {"model": mlflow.pyfunc.load_model(model_uri), "stores": stores, "other": other, "root": root}


def test_served_model_opens_no_url_and_no_path_outside_its_roots(served, recorder, monkeypatch):
    base, hits = recorder
    monkeypatch.delenv("FOVEATE_SERVE_ROOTS", raising=False)
    stores, other = served["stores"], served["other"]
    asked = [
        str(stores / "s0.zarr"),
        f"{base}/x.zarr",
        f"https://127.0.0.1:{base.rsplit(':', 1)[1]}/x.zarr",
        f"file://{other / 'o0.zarr'}",
        str(other / "o0.zarr"),
        f"{stores}/../other/o0.zarr",
        str(stores / "escape.zarr"),  # a link inside the root to a store outside it
        "s3://bucket/stores/x.zarr",
        "memory://x.zarr",
    ]
    out = served["model"].predict(pd.DataFrame({"store": asked})).to_dict(orient="records")
    assert out[0]["status"] == "ok", out[0]
    for r in out[1:]:
        assert r["status"] == "error" and "FOVEATE_SERVE_ROOTS" in r["error"], r
    assert "scheme" in out[1]["error"] and "http" in out[1]["error"]
    assert "outside" in out[4]["error"]
    assert hits == []  # no request reached the host named in the input


def test_served_model_roots_from_the_environment(served, recorder, monkeypatch):
    base, hits = recorder
    stores, other = served["stores"], served["other"]
    monkeypatch.setenv("FOVEATE_SERVE_ROOTS", f"{other},s3://bucket/stores")
    out = (
        served["model"]
        .predict(pd.DataFrame({"store": [str(other / "o0.zarr"), str(stores / "s0.zarr"), f"{base}/y.zarr"]}))
        .to_dict(orient="records")
    )
    assert out[0]["status"] == "ok", out[0]
    assert out[1]["status"] == "error" and "outside" in out[1]["error"]
    assert out[2]["status"] == "error" and hits == []
    monkeypatch.setenv("FOVEATE_SERVE_ROOTS", "http://127.0.0.1/stores")
    with pytest.raises(ValueError, match="FOVEATE_SERVE_ROOTS"):
        served["model"].predict(pd.DataFrame({"store": [str(other / "o0.zarr")]}))


def test_serve_roots_parse_and_logged_defaults(tmp_path):
    from pipeline.mlflow_model import _logged_serve_roots
    from pipeline.serving import StoreRefused, check_store, parse_roots

    (tmp_path / "a").mkdir()
    roots = parse_roots(f"{tmp_path}/a:s3://bkt/stores/,file://{tmp_path}/b")
    assert roots == [str((tmp_path / "a").resolve()), "s3://bkt/stores", str((tmp_path / "b").resolve())]
    assert check_store("s3://bkt/stores/x.zarr", roots) == "s3://bkt/stores/x.zarr"
    for bad in ("s3://bkt/stores/../other/x.zarr", "s3://bkt/storesX/x.zarr", "s3://other/stores/x.zarr", "x.zarr"):
        with pytest.raises(StoreRefused):
            check_store(bad, roots)
    for bad in ("http://host/x", "relative/dir", "s3://", "gs://bkt/x"):
        with pytest.raises(ValueError, match="FOVEATE_SERVE_ROOTS"):
            parse_roots(bad)
    cfg = {"data": {"stores": "s3://bkt/train"}}
    example = pd.DataFrame({"store": [str(tmp_path / "a" / "s0.zarr"), "http://host/x.zarr"]})
    assert _logged_serve_roots(cfg, example) == ["s3://bkt/train", str((tmp_path / "a").resolve())]
    assert _logged_serve_roots(None, None) == []


@contextmanager
def _scoring_server(model):
    """MLflow's own scoring app (what ``mlflow models serve`` runs) for ``model`` on a free port of 127.0.0.1."""
    import uvicorn
    from mlflow.pyfunc import scoring_server

    server = uvicorn.Server(uvicorn.Config(scoring_server.init(model), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the scoring server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _post(url: str, records: list[dict]) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps({"dataframe_records": records}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_served_model_refuses_requests_over_its_store_limit(served, monkeypatch):
    """Over HTTP through MLflow's scoring app: a 400 naming the limit at once, not a 504 after a minute."""
    monkeypatch.delenv("FOVEATE_SERVE_ROOTS", raising=False)
    monkeypatch.setenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "false")  # scoring_server.init sets it; restored
    monkeypatch.setenv("FOVEATE_SERVE_MAX_STORES", "2")
    model = served["model"]
    s0 = {"store": str(served["stores"] / "s0.zarr")}
    with _scoring_server(model) as url:
        t0 = time.monotonic()
        status, body = _post(f"{url}/invocations", [s0] * 3)
        assert status == 400 and time.monotonic() - t0 < 10, (status, body[-2000:])
        assert "FOVEATE_SERVE_MAX_STORES" in body and "3 stores" in body and "at most 2" in body
        status, body = _post(f"{url}/invocations", [s0] * 2)
        assert status == 200 and [r["status"] for r in json.loads(body)["predictions"]] == ["ok", "ok"], body[-2000:]
    monkeypatch.setenv("FOVEATE_SERVE_MAX_STORES", "lots")
    with pytest.raises(ValueError, match="FOVEATE_SERVE_MAX_STORES"):
        model.predict(pd.DataFrame({"store": [str(served["stores"] / "s0.zarr")]}))


# ------------------------------------------------------------------ 3: verify takes stores and checks something


@pytest.fixture()
def stores(tmp_path):
    d = tmp_path / "stores"
    for i, sid in enumerate(["good", "bad"]):
        write_store_from_array(d / f"{sid}.zarr", _slide(i), tile_size=64, min_size=64)
    (d / "bad.zarr" / COMPLETE_MARKER).unlink()
    return d


def test_verify_takes_a_store_path(stores, capsys):
    from pipeline.cli import main

    assert main(["verify", str(stores / "bad.zarr")]) == 1
    out = capsys.readouterr().out
    assert "bad: damaged" in out and "1 damaged" in out
    assert main(["verify", str(stores / "good.zarr")]) == 0
    assert "good: ok" in capsys.readouterr().out
    assert main(["verify", str(stores / "good.zarr"), str(stores / "bad.zarr")]) == 1


def test_verify_that_checked_nothing_fails(tmp_path, capsys):
    from pipeline.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) != 0
    captured = capsys.readouterr()
    assert "no <slide_id>.zarr store" in captured.out + captured.err
    assert main(["verify", str(tmp_path / "missing")]) != 0


# ------------------------------------------------------------------ 4: linked folders of the input are followed


def test_linked_input_folders_are_followed_once(tmp_path, caplog):
    from pipeline.ingest_inputs import discover_inputs

    inp, outside = tmp_path / "in", tmp_path / "outside"
    (inp / "plain").mkdir(parents=True)
    (outside / "deep").mkdir(parents=True)
    (inp / "plain" / "a.svs").write_bytes(b"")
    (outside / "deep" / "b.svs").write_bytes(b"")
    (inp / "linked").symlink_to(outside)  # a linked folder: followed
    (inp / "again").symlink_to(outside)  # the same folder through a second link: skipped, named
    (outside / "deep" / "loop").symlink_to(inp)  # a loop back to the input: skipped, named
    with caplog.at_level(logging.WARNING, logger="pipeline.ingest_inputs"):
        found = discover_inputs([inp])
    assert sorted(Path(s.path).name for s in found) == ["a.svs", "b.svs"]
    assert Path(next(s.path for s in found if s.path.endswith("b.svs"))) == (outside / "deep" / "b.svs").resolve()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "loop" in warned and ("again" in warned or "linked" in warned), warned


# ------------------------------------------------------------------ 5: one-line reasons


@pytest.fixture()
def read_only(tmp_path):
    """A folder this process cannot write: chmod for a user, a read-only tmpfs for root."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("running as root and cannot mount a read-only tmpfs")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def _one_line_error(capsys, caplog) -> str:
    """What the command said on stderr and in its log (no traceback), then cleared for the next call."""
    err = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    caplog.clear()
    assert "Traceback" not in err, err
    return err


def test_export_into_a_read_only_folder_is_one_line(view_data, read_only, capsys, caplog):
    from pipeline.cli import main
    from pipeline.predictions import PredictionWriter
    from workers.scoring import error_row

    preds = read_only.parent / "ok.parquet"
    w = PredictionWriter(preds)
    row = error_row("s0", "x", "")
    row.update(status="ok", error=None, prediction="a", probability=1.0, probabilities={"a": 1.0})
    row["patches"] = [{"x": 0, "y": 0, "w": 8, "h": 8, "score": 1.0}]
    w.add(row)
    w.flush(force=True)
    for target in (read_only, read_only / "sub"):
        code = main(["-q", "export", "--predictions", str(preds), "--format", "geojson", "--out", str(target)])
        err = _one_line_error(capsys, caplog)
        assert code != 0 and str(read_only) in err and ("writ" in err or "read-only" in err.lower()), err


def test_score_into_a_read_only_folder_is_one_line(read_only, capsys, caplog, tmp_path):
    from test_score import CLASSES, _model_config

    from operators.checkpoint import save_checkpoint
    from operators.model import FoveateModel
    from pipeline.cli import main

    ckpt = save_checkpoint(tmp_path / "model.pt", FoveateModel(_model_config()).eval(), _model_config(), CLASSES)
    write_store_from_array(tmp_path / "st" / "s0.zarr", _slide(0), tile_size=64, min_size=64)
    t0 = time.monotonic()
    code = main(
        ["-q", "score", "--model", str(ckpt), "--stores", str(tmp_path / "st"), "--out", str(read_only / "p.parquet")]
        + ["--experiment", ""]
    )
    err = _one_line_error(capsys, caplog)
    assert code != 0 and str(read_only) in err and ("writ" in err or "read-only" in err.lower()), err
    assert time.monotonic() - t0 < 30  # refused before Ray starts


def test_manifest_write_on_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    from pipeline.ingest_manifest import merge_manifest, read_manifest

    out = tmp_path / "stores"
    merge_manifest(out, [{"slide_id": "a", "source": "/a.svs", "status": "ok"}])
    before = (out / "manifest.parquet").read_bytes(), (out / "manifest.csv").read_bytes()

    def full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"PAR1 half")  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    with pytest.raises(OSError, match="manifest") as info:
        merge_manifest(out, [{"slide_id": "b", "source": "/b.svs", "status": "ok"}])
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in out.iterdir()) == ["manifest.csv", "manifest.parquet"]
    assert ((out / "manifest.parquet").read_bytes(), (out / "manifest.csv").read_bytes()) == before
    monkeypatch.undo()
    assert list(read_manifest(out)["slide_id"]) == ["a"]


def test_full_disk_in_a_command_is_one_line(view_data, tmp_path, monkeypatch, capsys, caplog):
    """A command whose write hits ENOSPC: one line naming the file and the cause, exit 1, no temporary."""
    import pipeline.export as export_mod
    from pipeline.cli import main

    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            real(self, "partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    from pipeline.predictions import PredictionWriter
    from workers.scoring import error_row

    preds = tmp_path / "ok.parquet"
    w = PredictionWriter(preds)
    row = error_row("s0", "x", "")
    row.update(status="ok", error=None, prediction="a", probability=1.0, probabilities={"a": 1.0})
    row["patches"] = [{"x": 0, "y": 0, "w": 8, "h": 8, "score": 1.0}]
    w.add(row)
    w.flush(force=True)
    monkeypatch.setattr(Path, "write_text", full)
    assert export_mod  # the module's writer goes through Path.write_text
    code = main(["-q", "export", "--predictions", str(preds), "--format", "geojson", "--out", str(tmp_path / "gj")])
    err = _one_line_error(capsys, caplog)
    assert code == 1 and "No space left on device" in err and "gj" in err, err
    assert list((tmp_path / "gj").iterdir()) == []


# ------------------------------------------------------------------ 5: object storage errors name what failed


@pytest.fixture(scope="module")
def s3_auth():
    """moto's S3 server on 127.0.0.1 with a bucket, then with request authentication switched on."""
    pytest.importorskip("moto.server")
    import moto.settings as moto_settings
    from local_services import moto_s3

    with moto_s3("lanes-bucket") as (client, env):
        client.put_object(Bucket="lanes-bucket", Key="archive/a.svs", Body=b"x")
        saved = moto_settings.INITIAL_NO_AUTH_ACTION_COUNT
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            yield env
        finally:
            moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = saved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_wrong_credentials_are_named_not_a_missing_bucket(s3_auth, monkeypatch):
    from pipeline.ingest import _out_dir
    from pipeline.ingest_inputs import discover_inputs
    from workers import storage

    for k, v in s3_auth.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(storage.STORAGE_OPTIONS_ENV, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    with pytest.raises(ValueError) as info:
        _out_dir("s3://lanes-bucket/stores")
    msg = str(info.value)
    assert "lanes-bucket" in msg and s3_auth["AWS_ENDPOINT_URL"] in msg and "AWS_ACCESS_KEY_ID" in msg, msg
    assert "bucket 'lanes-bucket' does not exist" not in msg and "refused the credentials" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="lanes-bucket.*credentials"):
        discover_inputs(["s3://lanes-bucket/archive/"])
    import moto.settings as moto_settings

    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))  # any key is accepted
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' does not exist"):
        _out_dir("s3://no-such-bucket/stores")


def test_s3_dead_endpoint_is_named(monkeypatch):
    pytest.importorskip("s3fs")
    from pipeline.ingest import _out_dir
    from workers import storage

    dead = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv(storage.STORAGE_OPTIONS_ENV, raising=False)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        _out_dir("s3://some-bucket/stores")
    msg = str(info.value)
    assert dead in msg and "some-bucket" in msg and "reach" in msg and "does not exist" not in msg, msg
    assert time.monotonic() - t0 < 30


def test_score_with_s3_stores_refused_or_unreachable_is_one_line(s3_auth, monkeypatch, capsys, caplog, tmp_path):
    """``foveate score --stores s3://...`` (and ``--out s3://...``, ``foveate verify s3://...``, ``data.stores`` of
    ``foveate train``) with refused credentials, a dead endpoint or a missing bucket: one line naming bucket,
    endpoint and credential source, before Ray, MLflow or the model."""
    from pipeline.cli import main
    from workers import storage

    for k, v in s3_auth.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(storage.STORAGE_OPTIONS_ENV, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    model = str(tmp_path / "never-loaded.pt")
    write_store_from_array(tmp_path / "st" / "s0.zarr", _slide(0), tile_size=64, min_size=64)

    def score(stores: str, out: str) -> tuple[int, str]:
        t0 = time.monotonic()
        code = main(["-q", "score", "--model", model, "--stores", stores, "--out", out, "--experiment", ""])
        assert time.monotonic() - t0 < 30
        return code, _one_line_error(capsys, caplog)

    endpoint = s3_auth["AWS_ENDPOINT_URL"]
    code, err = score("s3://lanes-bucket/stores", str(tmp_path / "p.parquet"))
    assert code == 2 and "--stores" in err and "'lanes-bucket'" in err and endpoint in err, err
    assert "refused the credentials" in err and "AWS_ACCESS_KEY_ID" in err and "not-" in err, err
    assert "not-a-key" not in err  # the key is named by its first letters only
    code, err = score(str(tmp_path / "st"), "s3://lanes-bucket/runs/p.parquet")
    assert code == 2 and "--out" in err and "'lanes-bucket'" in err and "refused the credentials" in err, err
    code = main(["-q", "verify", "s3://lanes-bucket/stores"])
    err = _one_line_error(capsys, caplog)
    assert code == 2 and "'lanes-bucket'" in err and endpoint in err and "refused the credentials" in err, err
    from pipeline.data import DataConfig, build_slide_table

    with pytest.raises(ValueError, match="data.stores 's3://lanes-bucket/stores': bucket 'lanes-bucket' at .* refused"):
        build_slide_table(DataConfig(stores="s3://lanes-bucket/stores"))  # what foveate train reads first

    dead = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    code, err = score("s3://lanes-bucket/stores", str(tmp_path / "p.parquet"))
    assert code == 2 and dead in err and "'lanes-bucket'" in err and "reach" in err and "AWS_ACCESS_KEY_ID" in err, err

    import moto.settings as moto_settings

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))  # any key is accepted
    code, err = score("s3://no-such-bucket/stores", str(tmp_path / "p.parquet"))
    assert code == 2 and "bucket 'no-such-bucket' does not exist" in err and endpoint in err, err
    code, err = score("s3://lanes-bucket/empty", str(tmp_path / "p.parquet"))
    assert code == 2 and "has no <slide_id>.zarr stores" in err, err
