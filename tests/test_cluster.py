"""A real local cluster, driven as docs/commands.md shows: `infra/local/up.sh` starts a Ray head (token
authentication on, its own temp dir, 2 CPUs, custom resource ``head``) and an MLflow tracking server (HTTP basic
authentication); a second node joins it as a separate process (`ray start --address ...`, its own temp dir and
scratch folder, 2 CPUs, custom resource ``node2``); stores on a local S3 (moto) server. ``ray job submit``: ingest
(slides read from the bucket) -> train with 2 workers and ``placement_strategy=SPREAD`` (each worker prints its
node id: one on each node) -> the run in MLflow through the server (metrics, logged model, checkpoint) -> score,
and the second node is killed (its whole session, SIGKILL) while scoring runs: every slide still gets exactly one
``ok`` row, the scoring run is in MLflow, and ``foveate compare`` reads the runs through the server. The second
node is killed and `infra/local/down.sh` runs in a ``finally``; nothing of either node may be left running.

Resources, so that the head alone can finish after the kill: scoring runs 1 scorer + 1 classifier actor of 1 CPU
each (cluster total 4 CPUs). While scoring starts, a "blocker" job holds 1 of the head's 2 CPUs
(``--entrypoint-num-cpus 1 --entrypoint-resources '{"head": 1}'``), so at least one scoring actor must be placed
on the second node; the blocker is released right after the kill, so the head then has 2 free CPUs for the
actors Ray restarts. Every wait has a timeout that fails with the job's logs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from local_services import live_pids_mentioning, moto_s3

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

pytest.importorskip("moto.server", reason="moto[server] is in the test extras (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BUCKET = "foveate-mn"
N_SLIDES = 8
EXPERIMENT = "cluster-test"
SUBMIT = ["ray", "job", "submit", "--working-dir", ".", "--runtime-env", "configs/runtime_env.yaml"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _session_pids(sid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
            out.append(int(proc.name))
    return out


def _kill(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


class Node:
    """One `ray start` in its own session (start_new_session): every daemon it leaves behind is in that session."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], temp_dir: str, log: Path):
        self.name, self.temp_dir, self.log = name, temp_dir, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                ["ray", "start", "--disable-usage-stats", "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir]
                + args,
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.sid = self.proc.pid

    def wait_started(self, timeout: float) -> None:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`ray start` of {self.name} still running after {timeout}s:\n{self.tail()}") from None
        assert rc == 0, f"`ray start` of {self.name} failed (rc {rc}):\n{self.tail()}"

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def pids(self) -> list[int]:
        return sorted(set(_session_pids(self.sid)) | set(live_pids_mentioning(self.temp_dir)))

    def kill(self, grace: float = 0.0) -> None:
        """SIGTERM (if ``grace``) then SIGKILL every process of the session and every one naming the temp dir."""
        if grace:
            _kill(self.pids(), signal.SIGTERM)
            t0 = time.monotonic()
            while self.pids() and time.monotonic() - t0 < grace:
                time.sleep(0.3)
        for _ in range(20):
            left = self.pids()
            if not left:
                return
            _kill(left, signal.SIGKILL)
            time.sleep(0.3)


class Cluster:
    """The client side of the cluster: the job API (with the token), the up.sh exports, the second node."""

    def __init__(
        self, dashboard: str, token: str, env: dict[str, str], exports: dict[str, str], node2: Node, run: Path
    ):
        self.dashboard, self.token, self.env, self.exports, self.node2, self.run = (
            dashboard,
            token,
            env,
            exports,
            node2,
            run,
        )
        self.node_ids: dict[str, str] = {}

    def get(self, path: str, timeout: float = 30) -> object:
        req = urllib.request.Request(self.dashboard + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def state(self, kind: str) -> list[dict]:
        """Ray's state API over HTTP (``/api/v0/<kind>``), detail on."""
        return self.get(f"/api/v0/{kind}?limit=10000&detail=1")["data"]["result"]["result"]

    def alive_nodes(self) -> dict[str, dict]:
        return {n["node_id"]: n for n in self.state("nodes") if n["state"] == "ALIVE"}

    def wait_nodes(self, n_nodes: int, tail) -> None:
        """Until the job API answers and ``n_nodes`` nodes are alive (else AssertionError after 120 s, with
        ``tail()``); then ``node_ids``: ``{"head" | "node2": node id}`` by their custom resources."""
        t0 = time.monotonic()
        while True:
            try:
                nodes = self.alive_nodes()
                if len(nodes) == n_nodes:
                    break
            except OSError:
                nodes = {}
            assert time.monotonic() - t0 < 120, f"not {n_nodes} alive node(s) after 120s: {nodes}\n{tail()}"
            time.sleep(1)
        self.node_ids = {
            ("head" if "head" in n.get("resources_total", {}) else "node2"): nid for nid, n in nodes.items()
        }
        assert set(self.node_ids) == ({"head", "node2"} if n_nodes == 2 else {"head"}), nodes

    def job(self, job_id: str) -> dict:
        return self.get(f"/api/jobs/{job_id}")

    def logs(self, job_id: str) -> str:
        return self.get(f"/api/jobs/{job_id}/logs").get("logs", "")

    def submit(self, args: list[str], timeout: float, what: str, opts: tuple[str, ...] | list[str] = ()) -> str:
        cmd = [*SUBMIT, *opts, "--", *args]
        t0 = time.monotonic()
        for _attempt in range(2):
            proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
            out = proc.stdout + proc.stderr
            # Ray hashes the working dir twice (upload, then the job's runtime_env); a file edited in between (a
            # developer checkout with editors or other processes writing) gives a package that was never uploaded.
            if proc.returncode == 0 or "Failed to download runtime_env file package" not in out:
                break
        print(f"--- {what}: rc {proc.returncode} in {time.monotonic() - t0:.1f}s")
        assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{out[-6000:]}"
        return out

    def wait_job(self, job_id: str, timeout: float) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            info = self.job(job_id)
            if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} not finished after {timeout}s:\n{self.logs(job_id)[-6000:]}")


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET) as pair:
        yield pair


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    for tool in ("curl", "setsid", "ps"):
        if shutil.which(tool) is None:
            pytest.skip(f"infra/local/up.sh needs {tool!r}, not found on PATH")
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("the `ray` CLI is not next to this interpreter")
    run = tmp_path_factory.mktemp("cluster")
    ray_port, dash, mlflow_port, client_port, agent1, agent2 = _free_ports(6)
    tmp_node2 = f"/tmp/fov-cl-{uuid.uuid4().hex[:8]}-n2"  # short: unix socket paths
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "MLFLOW_", "AWS_")) and k != "FOVEATE_STORAGE_OPTIONS"
    }
    base.update(
        s3[1],  # the head's jobs and the second node reach the bucket with these
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    up_env = dict(
        base,
        FOVEATE_RUN_DIR=str(run),
        FOVEATE_RAY_PORT=str(ray_port),
        FOVEATE_DASHBOARD_PORT=str(dash),
        FOVEATE_MLFLOW_PORT=str(mlflow_port),
        FOVEATE_RAY_CLIENT_PORT=str(client_port),
        FOVEATE_AGENT_PORT=str(agent1),
        FOVEATE_RAY_NUM_CPUS="2",
        FOVEATE_RAY_RESOURCES='{"head": 1}',
        FOVEATE_UP_TIMEOUT="180",
        FOVEATE_SCRATCH_DIR=str(run / "scratch-head"),
        PYTHON=sys.executable,
    )
    node2 = None
    try:
        out = subprocess.run(
            ["bash", "infra/local/up.sh"], cwd=REPO, env=up_env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"up.sh failed:\n{out.stdout}\n{out.stderr}"
        exports = dict(
            line[len("export ") :].split("=", 1) for line in out.stdout.splitlines() if line.startswith("export ")
        )
        assert set(exports) >= {
            "RAY_ADDRESS",
            "RAY_AUTH_MODE",
            "RAY_AUTH_TOKEN_PATH",
            "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
        }, out.stdout
        # idempotent: a second up.sh leaves both services alone
        again = subprocess.run(
            ["bash", "infra/local/up.sh"], cwd=REPO, env=up_env, capture_output=True, text=True, timeout=120
        )
        assert again.returncode == 0 and again.stderr.count("already running") == 2, again.stderr
        node_env = {k: v for k, v in exports.items() if k != "RAY_ADDRESS"}  # a node joins by the GCS address
        node2 = Node(
            "node2",
            [f"--address=127.0.0.1:{ray_port}", f"--dashboard-agent-listen-port={agent2}"]
            + ["--num-cpus=2", '--resources={"node2": 1}'],
            dict(base, **node_env, FOVEATE_SCRATCH_DIR=str(run / "scratch-node2")),
            tmp_node2,
            run / "node2.log",
        )
        node2.wait_started(180)
        token = Path(exports["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        c = Cluster(exports["RAY_ADDRESS"], token, dict(base, **exports), exports, node2, run)
        c.wait_nodes(2, node2.tail)
        yield c
    finally:
        if node2 is not None:
            node2.kill(grace=5)
        down = subprocess.run(
            ["bash", "infra/local/down.sh"], cwd=REPO, env=up_env, capture_output=True, text=True, timeout=180
        )
        print(down.stderr)
        tmp_head = (run / "ray_temp_dir").read_text().strip() if (run / "ray_temp_dir").exists() else None
        for d in filter(None, (tmp_head, tmp_node2)):  # nothing of either node may be left running
            assert not live_pids_mentioning(d), f"processes naming {d} still running after down.sh"
        shutil.rmtree(tmp_node2, ignore_errors=True)


@contextlib.contextmanager
def ray_nodes(run: Path, aws: dict[str, str], second_node: bool = True):
    """A bare head of 2 CPUs started with `ray start` here (no MLflow server; MLflow in a sqlite file of ``run``)
    and, with ``second_node``, a second node as in the module doc; a :class:`Cluster`. For
    ``benchmarks/multinode.py``, which compares one node with two. Every process of both nodes is gone when this
    exits (else AssertionError)."""
    token_file = run / "ray_auth_token"
    token = uuid.uuid4().hex + uuid.uuid4().hex
    token_file.write_text(token)
    token_file.chmod(0o600)
    tag = uuid.uuid4().hex[:8]
    tmp_head, tmp_node2 = f"/tmp/fov-mn-{tag}-h", f"/tmp/fov-mn-{tag}-n2"  # short: unix socket paths
    gcs, dash, client_port, agent1, agent2 = _free_ports(5)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "MLFLOW_", "AWS_")) and k != "FOVEATE_STORAGE_OPTIONS"
    }
    base.update(
        aws,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_file),
        RAY_USAGE_STATS_ENABLED="0",
        MLFLOW_TRACKING_URI=f"sqlite:///{run}/mlflow.db",
        PYTHONUNBUFFERED="1",
    )
    head_env = dict(base, FOVEATE_SCRATCH_DIR=str(run / "scratch-head"))
    node2_env = dict(base, FOVEATE_SCRATCH_DIR=str(run / "scratch-node2"))
    client_env = dict(base, RAY_ADDRESS=f"http://127.0.0.1:{dash}")
    head = node2 = None
    try:
        head = Node(
            "head",
            ["--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
            + [f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent1}"]
            + ["--num-cpus=2", '--resources={"head": 1}'],
            head_env,
            tmp_head,
            run / "head.log",
        )
        head.wait_started(180)
        if second_node:
            node2 = Node(
                "node2",
                [f"--address=127.0.0.1:{gcs}", f"--dashboard-agent-listen-port={agent2}"]
                + ["--num-cpus=2", '--resources={"node2": 1}'],
                node2_env,
                tmp_node2,
                run / "node2.log",
            )
            node2.wait_started(180)
        c = Cluster(f"http://127.0.0.1:{dash}", token, client_env, {}, node2, run)
        c.wait_nodes(2 if second_node else 1, head.tail)
        yield c
    finally:
        for node in (node2, head):
            if node is not None:
                node.kill(grace=5)
        for d in (tmp_head, tmp_node2):
            assert not live_pids_mentioning(d), f"processes naming {d} still running"
            shutil.rmtree(d, ignore_errors=True)


def test_token_auth_is_on(cluster):
    url = cluster.dashboard + "/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=30)
    assert err.value.code == 401
    token_path = Path(cluster.exports["RAY_AUTH_TOKEN_PATH"])
    assert oct(token_path.stat().st_mode & 0o777) == "0o600"
    assert cluster.get("/api/jobs/") is not None  # the token is accepted


def test_mlflow_server_requires_the_password(cluster):
    import base64

    uri = cluster.exports["MLFLOW_TRACKING_URI"]
    url = uri + "/api/2.0/mlflow/experiments/search"
    body = json.dumps({"max_results": 10}).encode()
    user, password = cluster.exports["MLFLOW_TRACKING_USERNAME"], cluster.exports["MLFLOW_TRACKING_PASSWORD"]
    pw_file = cluster.run / "mlflow_password"
    assert pw_file.read_text() == password and oct(pw_file.stat().st_mode & 0o777) == "0o600"
    assert oct((cluster.run / "env.sh").stat().st_mode & 0o777) == "0o600"
    # MLflow's tracking and user databases, its artifacts: owner-only
    mlflow_dir = cluster.run / "mlflow"
    for name in ("mlflow.db", "basic_auth.db"):
        assert oct((mlflow_dir / name).stat().st_mode & 0o777) == "0o600", name
    for d in (mlflow_dir, mlflow_dir / "artifacts"):
        assert oct(d.stat().st_mode & 0o777) == "0o700", d

    def post(auth: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
        req = urllib.request.Request(url, data=body, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=120).status  # basic auth hashes: slow on a loaded machine
        except urllib.error.HTTPError as err:
            return err.code

    assert post(None) == 401  # no credentials: refused
    assert post(f"{user}:wrong-{password}") == 401
    assert post(f"{user}:{password}") == 200
    # health stays open for up.sh's readiness check
    assert urllib.request.urlopen(uri + "/health", timeout=120).status == 200


def _read_parquet(client, key: str):
    import pandas as pd

    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return pd.read_parquet(io.BytesIO(body))


def test_two_nodes_ingest_train_spread_score_survives_losing_a_node(cluster, s3, tmp_path, monkeypatch):
    import mlflow

    client, _aws = s3
    c = cluster
    uri = c.exports["MLFLOW_TRACKING_URI"]
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, c.exports[name])

    # slides into the bucket, listed by a CSV with relative paths
    synth = tmp_path / "synth"
    subprocess.run(
        [sys.executable, "-m", "pipeline", "synth", str(synth), "--count", str(N_SLIDES), "--size", "2000"]
        + ["--seed", "0"],
        cwd=REPO,
        env=c.env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    rows = ["path,label"]
    for line in (synth / "labels.csv").read_text().splitlines()[1:]:
        path, label = line.rsplit(",", 1)
        name = Path(path).name
        client.put_object(Bucket=BUCKET, Key=f"slides/{name}", Body=Path(path).read_bytes())
        rows.append(f"{name},{label}")
    client.put_object(Bucket=BUCKET, Key="slides/labels.csv", Body=("\n".join(rows) + "\n").encode())
    root = f"s3://{BUCKET}"

    c.submit(
        ["python", "-m", "pipeline", "ingest", f"{root}/slides/labels.csv", "--out", f"{root}/stores"]
        + ["--address", "auto"],
        300,
        "ingest job",
    )
    manifest = _read_parquet(client, "stores/manifest.parquet")
    assert len(manifest) == N_SLIDES, manifest

    out = c.submit(
        ["python", "-m", "pipeline", "train", "--config", "configs/demo.yaml", "--workers", "2"]
        + ["--set", f"data.stores={root}/stores", "--set", f"workdir={root}/work", "--set", "optim.epochs=1"]
        + ["--set", "placement_strategy=SPREAD", "--set", f"tracking.experiment={EXPERIMENT}"],
        420,
        "train job",
    )
    placed = dict(re.findall(r"foveate-train-worker rank (\d+)/2 node ([0-9a-f]+)", out))
    assert sorted(placed) == ["0", "1"], out[-4000:]
    assert set(placed.values()) == set(c.node_ids.values()), (placed, c.node_ids)  # one worker on each node

    ml = mlflow.MlflowClient(tracking_uri=uri)  # through the HTTP server
    exp = ml.get_experiment_by_name(EXPERIMENT)
    (run,) = ml.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["placement_strategy"] == "SPREAD"
    m = run.data.metrics
    for key in ("val_accuracy", "val_auc", "epoch_train_loss", "train_seconds", "epoch_patches_per_second"):
        assert key in m, (key, sorted(m))
    assert run.data.params["model.selection.selector"] == "perturbed"
    assert [lm.source_run_id for lm in ml.search_logged_models([exp.experiment_id])] == [run.info.run_id]
    assert "checkpoint/model.pt" in [a.path for a in ml.list_artifacts(run.info.run_id, "checkpoint")]

    # a job holding 1 of the head's 2 CPUs: at least one scoring actor has to go to node2
    ready, release = c.run / "blocker.ready", c.run / "blocker.release"
    blocker = (
        "import os, time\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "t = time.time()\n"
        f"while not os.path.exists({str(release)!r}) and time.time() - t < 600: time.sleep(0.5)\n"
    )
    subprocess.run(
        ["ray", "job", "submit", "--no-wait", "--submission-id", "mn-blocker", "--entrypoint-num-cpus", "1"]
        + ["--entrypoint-resources", '{"head": 1}', "--", "python", "-c", blocker],
        cwd=REPO,
        env=c.env,
        check=True,
        timeout=120,
        capture_output=True,
    )
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert time.monotonic() - t0 < 120, c.logs("mn-blocker")
            time.sleep(0.5)
        score_id = f"mn-score-{uuid.uuid4().hex[:6]}"
        c.submit(
            ["python", "-m", "pipeline", "score", "--model", f"runs:/{run.info.run_id}", "--stores", f"{root}/stores"]
            + ["--out", f"{root}/preds/p.parquet", "--workers", "1", "--scorer-workers", "1", "--batch-size", "1"],
            120,
            "score job (submitted)",
            opts=["--no-wait", "--submission-id", score_id],
        )
        t0 = time.monotonic()
        while True:  # until a scoring actor is alive on node2 (the job still running)
            info = c.job(score_id)
            assert info["status"] in ("PENDING", "RUNNING"), (
                f"score job {info['status']} before node2 was killed:\n{c.logs(score_id)[-6000:]}"
            )
            actors = [
                a
                for a in c.state("actors")
                if a.get("class_name") in ("ScorerWorker", "ClassifierWorker") and a.get("state") == "ALIVE"
            ]
            on_node2 = [a["class_name"] for a in actors if a.get("node_id") == c.node_ids["node2"]]
            if on_node2:
                break
            assert time.monotonic() - t0 < 240, f"no scoring actor on node2 after 240s: {actors}"
            time.sleep(1)
        print(f"--- killing node2 ({on_node2} on it) {time.monotonic() - t0:.1f}s after submitting the score job")
        c.node2.kill()  # SIGKILL, no grace: the node is lost
        assert not c.node2.pids()
    finally:
        release.touch()  # the blocker job ends: the head has both CPUs again
    info = c.wait_job(score_id, 300)
    logs = c.logs(score_id)
    assert info["status"] == "SUCCEEDED", f"score job {info['status']}:\n{logs[-6000:]}"
    print(logs[-3000:])

    table = _read_parquet(client, "preds/p.parquet")
    slide_ids = sorted(manifest["slide_id"])
    assert sorted(table["slide_id"]) == slide_ids and table["slide_id"].is_unique, table[["slide_id", "status"]]
    assert (table["status"] == "ok").all(), table[["slide_id", "error"]]
    k = int(run.data.params["model.selection.k"])
    assert all(len(p) == k for p in table["patches"])
    (score_run,) = ml.search_runs([ml.get_experiment_by_name("foveate-score").experiment_id])
    assert score_run.data.metrics["slides_scored"] == N_SLIDES
    assert score_run.data.params["out"] == f"{root}/preds/p.parquet"  # named; a remote file is not copied in
    assert ml.list_artifacts(score_run.info.run_id, "predictions") == []
    # foveate compare against the HTTP server
    from pipeline.compare import compare

    res = compare(EXPERIMENT, out_dir=tmp_path / "cmp", tracking_uri=uri)
    assert list(res.table["run_id"]) == [run.info.run_id]
    assert res.table.iloc[0]["operator"] == "perturbed" and int(res.table.iloc[0]["k"]) == k
    assert res.table.iloc[0]["accuracy"] == pytest.approx(m["val_accuracy"])
    t0 = time.monotonic()
    while set(c.alive_nodes()) != {c.node_ids["head"]}:  # Ray has noticed the loss
        assert time.monotonic() - t0 < 120, c.alive_nodes()
        time.sleep(1)
    c.wait_job("mn-blocker", 60)
