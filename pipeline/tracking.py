"""MLflow tracking helpers: where the tracking store is, experiments, runs, params and metrics.

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set (e.g. the ``mlflow server`` that
``infra/local/up.sh`` starts), else the embedded default: a local sqlite file
``sqlite:///<workdir>/mlflow.db`` with artifacts under ``<workdir>/mlartifacts``. Everything here goes
through an explicit :class:`mlflow.MlflowClient`, so it works the same in the driver and in Ray workers.

Runs that die without ending (``kill -9``, the OOM killer, a lost machine) would stay RUNNING for good: every run
:func:`start_run` creates (or :func:`claim_run` takes over on ``--resume``) records the command's pid, its start
time and the host as tags (``foveate.pid``, ``foveate.pid_start``, ``foveate.host``), and the next command that opens
the experiment (:func:`get_or_create_experiment`) ends the RUNNING runs whose process is gone from this host as
KILLED, with the tag ``foveate.ended`` saying why (:func:`end_stale_runs`). Runs of other hosts are left alone.

A local sqlite tracking file, its artifact folder and the files it creates are owner-only (``0o600``/``0o700``):
they hold parameters, metrics and models that other users of the machine need not read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "resolve_tracking_uri",
    "tracking_uri",
    "artifact_location_for",
    "client_for",
    "get_or_create_experiment",
    "flatten_params",
    "start_run",
    "log_params",
    "log_metrics",
    "run_url",
    "claim_run",
    "end_stale_runs",
    "logged_steps",
    "process_tags",
]

PID_TAG, PID_START_TAG, HOST_TAG, ENDED_TAG = "foveate.pid", "foveate.pid_start", "foveate.host", "foveate.ended"

log = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000


def resolve_tracking_uri(explicit: str | None = None, *, default_dir: str | Path | None = None) -> str:
    """The MLflow tracking URI every command uses: ``explicit`` (``--tracking-uri``) if given, else
    ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<abs default_dir>/mlflow.db`` (the directory is created), else
    (no ``default_dir``) MLflow's own default."""
    if explicit:
        return _new_sqlite_owner_only(str(explicit))
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return _new_sqlite_owner_only(env)
    if default_dir is not None:
        from workers import storage

        if storage.is_url(default_dir):
            raise ValueError(
                f"no MLflow tracking URI: the default sqlite file cannot live under {str(default_dir)!r} (object "
                "storage); give --tracking-uri or set $MLFLOW_TRACKING_URI (an MLflow server, or sqlite:///<local file>)"
            )
        wd = Path(default_dir).expanduser().resolve()
        wd.mkdir(parents=True, exist_ok=True)
        db = wd / "mlflow.db"
        _owner_only_file(db)
        return f"sqlite:///{db}"
    import mlflow

    return mlflow.get_tracking_uri()


def tracking_uri(workdir: str | Path = ".") -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<abs workdir>/mlflow.db`` (:func:`resolve_tracking_uri`)."""
    return resolve_tracking_uri(default_dir=workdir)


def _new_sqlite_owner_only(uri: str) -> str:
    """``uri``; a ``sqlite:///`` file that does not exist yet is created owner-only first (MLflow would create it
    world-readable under the usual umask); an existing one is left as its owner set it."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        if db.parent.is_dir() and not db.exists():
            _owner_only_file(db)
    return uri


def _owner_only_file(path: Path) -> None:
    """Create ``path`` (if missing) readable and writable by its owner only, and make an existing one so."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
    except OSError as exc:  # not ours to change (a shared file): leave it as it is
        log.debug("could not make %s owner-only: %s", path, exc)


def _owner_only_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    except OSError as exc:
        log.debug("could not make %s owner-only: %s", path, exc)


def artifact_location_for(uri: str) -> str | None:
    """Artifact root for experiments created against a local store: ``<dir of the sqlite file>/mlartifacts``
    (MLflow's own default is relative to the current directory), created owner-only. None for a server (it
    decides)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        root = (db.parent / "mlartifacts").resolve()
        _owner_only_dir(root)
        return root.as_uri()
    if uri.startswith("file:"):
        return None
    if "://" not in uri:  # a plain directory = file store
        return None
    return None


def client_for(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def get_or_create_experiment(client, name: str, uri: str | None = None) -> str:
    """The id of experiment ``name``, created (with a local artifact root for sqlite URIs) if missing. Opening an
    existing experiment ends its stale runs (:func:`end_stale_runs`)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"experiment name must be a non-empty string, got {name!r}")
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        try:
            end_stale_runs(client, exp.experiment_id)
        except Exception as exc:  # never let the clean-up stop the command
            log.warning("could not check experiment %r for stale runs: %s", name, exc)
        return exp.experiment_id
    location = artifact_location_for(uri or client.tracking_uri)
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by someone else
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of ``/proc/PID/stat``), None when
    it is gone or unknown (no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _host() -> str:
    import socket

    return socket.gethostname()


def process_tags() -> dict[str, str]:
    """The tags that tie a run to this process: pid, its start time (a reused pid is told apart) and host."""
    pid = os.getpid()
    return {PID_TAG: str(pid), PID_START_TAG: _pid_start(pid) or "", HOST_TAG: _host()}


def _process_gone(tags: Mapping[str, str]) -> str | None:
    """Why the process recorded in a run's tags is gone from this host (None: alive, another host's, or no
    record)."""
    if tags.get(HOST_TAG) != _host() or not str(tags.get(PID_TAG, "")).isdigit():
        return None
    pid = int(tags[PID_TAG])
    if pid == os.getpid():
        return None
    start = _pid_start(pid)
    if start is None:
        if Path("/proc").is_dir():
            return f"process {pid} on {tags[HOST_TAG]} is gone"
        try:  # no /proc: a signal 0 tells whether the pid exists
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"process {pid} on {tags[HOST_TAG]} is gone"
        except PermissionError:
            return None
        return None
    recorded = tags.get(PID_START_TAG) or ""
    if recorded and recorded != start:
        return f"process {pid} on {tags[HOST_TAG]} is gone (the pid now belongs to another process)"
    return None


def end_stale_runs(client, experiment_id: str) -> list[str]:
    """End the RUNNING runs of ``experiment_id`` whose recorded process (:func:`process_tags`) is gone from this
    host as KILLED, tagged ``foveate.ended`` with the reason; runs without the tags (other tools) or of another
    host are left alone. Returns the ids of the runs ended."""
    from mlflow.entities import ViewType

    ended = []
    runs = client.search_runs(
        [experiment_id], filter_string="attributes.status = 'RUNNING'", run_view_type=ViewType.ACTIVE_ONLY
    )
    for run in runs:
        why = _process_gone(run.data.tags)
        if why is None:
            continue
        client.set_tag(run.info.run_id, ENDED_TAG, f"killed: {why} (found by a later command)")
        client.set_terminated(run.info.run_id, status="KILLED")
        log.warning("MLflow run %s was still RUNNING but %s: ended as KILLED", run.info.run_id, why)
        ended.append(run.info.run_id)
    return ended


def claim_run(client, run_id: str) -> None:
    """Take over an existing run in this process (``--resume``): RUNNING again, with this process's tags."""
    client.update_run(run_id, status="RUNNING")
    for k, v in process_tags().items():
        client.set_tag(run_id, k, v)


def logged_steps(client, run_id: str) -> dict[str, set[int]]:
    """``{metric: steps already logged}`` of a run (one history request per metric): a resumed run skips what it
    logged before (:func:`log_metrics`'s ``skip``), so each epoch and step is logged once."""
    run = client.get_run(run_id)
    return {k: {int(m.step) for m in client.get_metric_history(run_id, k)} for k in run.data.metrics}


def flatten_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"a.b.c": "value"}`` (lists as JSON, None as ``"None"``), values capped at MLflow's
    6000 characters."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, prefix=f"{name}."))
            continue
        if isinstance(value, (list, tuple, dict)):
            text = json.dumps(list(value) if isinstance(value, tuple) else value)
        else:
            text = str(value)
        out[name] = text[:_MAX_PARAM_LEN]
    return out


def log_params(client, run_id: str, config: Mapping[str, Any], *, yaml_name: str = "config.yaml") -> None:
    """Log the full resolved config as flattened params and as a YAML artifact."""
    import yaml
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in flatten_params(config).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100])
    client.log_text(run_id, yaml.safe_dump(dict(config), sort_keys=False), yaml_name)


def start_run(client, experiment_id: str, *, run_name: str | None = None, tags: Mapping[str, str] | None = None) -> str:
    """Create a run and return its id (status RUNNING), tagged with this process (:func:`process_tags`) so that a
    later command can end it if the process dies without ending it."""
    run = client.create_run(experiment_id, run_name=run_name, tags={**dict(tags or {}), **process_tags()})
    return run.info.run_id


def log_metrics(
    client,
    run_id: str,
    metrics: Mapping[str, float],
    step: int,
    *,
    timestamp_ms: int | None = None,
    skip: Mapping[str, set[int]] | None = None,
) -> None:
    """Log finite scalar metrics at ``step`` in one batch (non-numbers and NaN are skipped, and so is a metric whose
    ``step`` is in ``skip[name]``: already logged before a resume, :func:`logged_steps`)."""
    import math
    import time

    from mlflow.entities import Metric

    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    batch = []
    for k, v in metrics.items():
        if skip is not None and int(step) in skip.get(k, ()):
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            batch.append(Metric(k, f, ts, int(step)))
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to look at a run: the server's page for http(s) URIs, else the ``mlflow ui`` command."""
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"mlflow ui --backend-store-uri {uri}  (then open experiment {experiment_id}, run {run_id})"
