"""MLflow runs do not outlive their process as RUNNING, a resumed run logs each step once, and the local tracking
files are owner-only. Real MLflow on sqlite; a real subprocess killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.tracking import (
    ENDED_TAG,
    HOST_TAG,
    PID_TAG,
    claim_run,
    client_for,
    get_or_create_experiment,
    log_metrics,
    logged_steps,
    resolve_tracking_uri,
    start_run,
)

REPO = Path(__file__).resolve().parents[1]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture()
def uri(tmp_path):
    return f"sqlite:///{tmp_path / 'track' / 'mlflow.db'}"


def test_a_run_whose_process_was_killed_is_ended_as_killed_by_the_next_command(tmp_path, uri):
    (tmp_path / "track").mkdir()
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pipeline.tracking import client_for, get_or_create_experiment, start_run
        client = client_for({uri!r})
        exp = get_or_create_experiment(client, "lifecycle", {uri!r})
        print(start_run(client, exp, run_name="doomed", tags={{"foveate.stage": "score"}}), flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, "the child did not start its run"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    client = client_for(uri)
    doomed = client.get_run(run_id)
    assert doomed.info.status == "RUNNING"  # nothing ended it: the process died with it open
    assert doomed.data.tags[PID_TAG] == str(proc.pid) and doomed.data.tags[HOST_TAG] == socket.gethostname()

    exp = client.get_experiment_by_name("lifecycle").experiment_id
    alive = start_run(client, exp, run_name="alive")  # this process: still running
    elsewhere = client.create_run(exp, tags={PID_TAG: str(proc.pid), HOST_TAG: "another-host"}).info.run_id
    untagged = client.create_run(exp).info.run_id  # a run another tool made: no record of its process

    assert get_or_create_experiment(client, "lifecycle", uri) == exp  # the next command opens the experiment
    doomed = client.get_run(run_id)
    assert doomed.info.status == "KILLED" and doomed.info.end_time is not None
    assert f"process {proc.pid} on {socket.gethostname()} is gone" in doomed.data.tags[ENDED_TAG]
    for rid in (alive, elsewhere, untagged):
        assert client.get_run(rid).info.status == "RUNNING", rid


def test_a_reused_pid_does_not_keep_a_dead_run_running(uri, tmp_path):
    (tmp_path / "track").mkdir()
    client = client_for(uri)
    exp = get_or_create_experiment(client, "reused", uri)
    # the pid of a live process (pid 1) but another start time: the recorded process is gone
    run = client.create_run(
        exp, tags={PID_TAG: "1", "foveate.pid_start": "0", HOST_TAG: socket.gethostname()}
    ).info.run_id
    get_or_create_experiment(client, "reused", uri)
    assert client.get_run(run).info.status == "KILLED"
    assert "another process" in client.get_run(run).data.tags[ENDED_TAG]


def test_a_resumed_run_is_claimed_and_logs_each_step_once(uri, tmp_path):
    (tmp_path / "track").mkdir()
    client = client_for(uri)
    exp = get_or_create_experiment(client, "resume", uri)
    run_id = client.create_run(exp, tags={PID_TAG: "999999999", HOST_TAG: socket.gethostname()}).info.run_id
    # before the crash: steps 1-3 of a per-step metric, epoch 1 of a per-epoch metric
    for step in (1, 2, 3):
        log_metrics(client, run_id, {"loss": 10.0 + step}, step=step)
    log_metrics(client, run_id, {"val_accuracy": 0.5}, step=1)
    client.set_terminated(run_id, status="FAILED")

    claim_run(client, run_id)  # --resume
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.data.tags[PID_TAG] == str(os.getpid())
    logged = logged_steps(client, run_id)
    assert logged == {"loss": {1, 2, 3}, "val_accuracy": {1}}
    # the resumed worker runs again from its last checkpoint (the end of epoch 1 = step 2): steps 3-4, epoch 2
    for step in (3, 4):
        log_metrics(client, run_id, {"loss": 20.0 + step}, step=step, skip=logged)
    log_metrics(client, run_id, {"val_accuracy": 0.5}, step=1, skip=logged)  # epoch 1 again (killed before saving)
    log_metrics(client, run_id, {"val_accuracy": 0.75}, step=2, skip=logged)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert loss == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0)]
    acc = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val_accuracy"))
    assert acc == [(1, 0.5), (2, 0.75)]


def test_the_local_tracking_file_and_artifacts_are_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    old = os.umask(0o022)  # the usual umask: without care, files come out world-readable
    try:
        uri = resolve_tracking_uri(default_dir=tmp_path / "work")
        db = tmp_path / "work" / "mlflow.db"
        assert uri == f"sqlite:///{db}"
        client = client_for(uri)
        exp = get_or_create_experiment(client, "private", uri)
        run_id = start_run(client, exp)
        client.log_text(run_id, "secret", "notes/a.txt")
        log_metrics(client, run_id, {"m": 1.0}, step=1)
        assert _mode(db) == 0o600
        arts = tmp_path / "work" / "mlartifacts"
        assert _mode(arts) == 0o700
        assert next(arts.rglob("a.txt")).read_text() == "secret"  # inside the owner-only folder

        # an explicit sqlite URI whose file does not exist yet is created owner-only too
        other = tmp_path / "other.db"
        assert resolve_tracking_uri(f"sqlite:///{other}") == f"sqlite:///{other}"
        assert _mode(other) == 0o600  # (MLflow then fills it: an empty file is an empty sqlite database)
    finally:
        os.umask(old)
