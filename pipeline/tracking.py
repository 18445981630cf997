"""MLflow tracking helpers: where the tracking store is, experiments, runs, params and metrics.

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set (e.g. the ``mlflow server`` that
``infra/local/up.sh`` starts), else the embedded default: a local sqlite file
``sqlite:///<workdir>/mlflow.db`` with artifacts under ``<workdir>/mlartifacts``. Everything here goes
through an explicit :class:`mlflow.MlflowClient`, so it works the same in the driver and in Ray workers.
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
]

log = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000


def resolve_tracking_uri(explicit: str | None = None, *, default_dir: str | Path | None = None) -> str:
    """The MLflow tracking URI every command uses: ``explicit`` (``--tracking-uri``) if given, else
    ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<abs default_dir>/mlflow.db`` (the directory is created), else
    (no ``default_dir``) MLflow's own default."""
    if explicit:
        return str(explicit)
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    if default_dir is not None:
        from workers import storage

        if storage.is_url(default_dir):
            raise ValueError(
                f"no MLflow tracking URI: the default sqlite file cannot live under {str(default_dir)!r} (object "
                "storage); give --tracking-uri or set $MLFLOW_TRACKING_URI (an MLflow server, or sqlite:///<local file>)"
            )
        wd = Path(default_dir).expanduser().resolve()
        wd.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{wd / 'mlflow.db'}"
    import mlflow

    return mlflow.get_tracking_uri()


def tracking_uri(workdir: str | Path = ".") -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<abs workdir>/mlflow.db`` (:func:`resolve_tracking_uri`)."""
    return resolve_tracking_uri(default_dir=workdir)


def artifact_location_for(uri: str) -> str | None:
    """Artifact root for experiments created against a local store: ``<dir of the sqlite file>/mlartifacts``
    (MLflow's own default is relative to the current directory). None for a server (it decides)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        return (db.parent / "mlartifacts").resolve().as_uri()
    if uri.startswith("file:"):
        return None
    if "://" not in uri:  # a plain directory = file store
        return None
    return None


def client_for(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def get_or_create_experiment(client, name: str, uri: str | None = None) -> str:
    """The id of experiment ``name``, created (with a local artifact root for sqlite URIs) if missing."""
    if not name or not isinstance(name, str):
        raise ValueError(f"experiment name must be a non-empty string, got {name!r}")
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = artifact_location_for(uri or client.tracking_uri)
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by someone else
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


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
    """Create a run and return its id (status RUNNING)."""
    run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
    return run.info.run_id


def log_metrics(
    client, run_id: str, metrics: Mapping[str, float], step: int, *, timestamp_ms: int | None = None
) -> None:
    """Log finite scalar metrics at ``step`` in one batch (non-numbers and NaN are skipped)."""
    import math
    import time

    from mlflow.entities import Metric

    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    batch = []
    for k, v in metrics.items():
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
