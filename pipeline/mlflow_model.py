"""Trained foveate models in MLflow: log a model to a run, load one by URI.

The checkpoint format and its (de)serialisation live in :mod:`operators.checkpoint`; this module adds
MLflow. :func:`log_model` logs the model to an MLflow run as a pyfunc model of the whole
pipeline (:mod:`pipeline.serving`: a table of stores in, ``foveate score`` rows out; logged from code, with the
checkpoint as its artifact, foveate's packages as ``code_paths`` and version-range requirements), and the same
checkpoint as a plain run artifact ``checkpoint/model.pt``. :func:`load_model` takes
``runs:/<id>[/path]``, ``models:/<name>/<version>``, ``models:/<model_id>``, any other MLflow artifact URI, a
local MLflow model directory or a local checkpoint file, and always rebuilds the model from the checkpoint
(never unpickles code).
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from operators.checkpoint import CHECKPOINT_NAME, find_checkpoint, load_checkpoint, load_local, save_checkpoint

__all__ = ["log_model", "load_model"]

log = logging.getLogger(__name__)


_PACKAGES = ("pipeline", "operators", "workers")
_NOT_SERVING = ("ray", "dask")  # runtime dependencies that serving does not need (dask: pipeline.lazy only)


def _pip_requirements() -> list[str]:
    """foveate's runtime dependencies as the version ranges of its package metadata (what an ordinary index
    serves; never a local build tag like ``+cpu``), without those that serving does not need. From a checkout
    that is not installed (``ray job submit --working-dir``): the same list read from ``pyproject.toml``."""
    import re
    from importlib import metadata

    try:
        reqs = [r for r in (metadata.requires("foveate") or []) if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        reqs = list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    out = []
    for r in reqs:
        name = re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower()
        if name not in _NOT_SERVING:
            out.append(r.split(";")[0].strip())
    return out


def _code_paths() -> list[str]:
    """foveate's own packages, shipped with the model (``code_paths``) so it loads where foveate is not
    installed."""
    root = Path(__file__).resolve().parents[1]
    return [str(root / p) for p in _PACKAGES]


def _logged_serve_roots(train_config: Mapping[str, Any] | None, input_example: Any) -> list[str]:
    """The folders a served model may read by default (:mod:`pipeline.serving`): its training stores'
    (``data.stores``) and its input example's. Local folders and ``s3://`` prefixes; nothing else."""
    from workers import storage

    found: list[str] = []
    data = (train_config or {}).get("data") if isinstance(train_config, Mapping) else None
    if isinstance(data, Mapping) and isinstance(data.get("stores"), str) and data["stores"]:
        found.append(storage.normalize(data["stores"]))
    stores = getattr(input_example, "get", lambda *_: None)("store")
    for s in list(stores) if stores is not None else []:
        if isinstance(s, str) and s:
            loc = storage.normalize(s)
            found.append(loc.rsplit("/", 1)[0] if storage.is_url(loc) else str(Path(loc).parent))
    roots = []
    for r in found:
        if storage.is_url(r):
            if r.startswith("s3://"):
                roots.append(r)
        else:
            roots.append(str(Path(r).resolve()))
    return list(dict.fromkeys(roots))


def log_model(
    model: torch.nn.Module,
    model_config: Any,
    class_names: list[str] | tuple[str, ...],
    *,
    run_id: str,
    tracking_uri: str,
    name: str = "model",
    train_config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    registered_model_name: str | None = None,
    input_example: Any = None,
) -> str:
    """Log ``model`` to run ``run_id`` as an MLflow pyfunc model of the whole pipeline
    (:class:`pipeline.serving.FoveatePythonModel`: stores in, ``foveate score`` rows out) and the checkpoint as
    the run artifact ``checkpoint/model.pt``.

    Args:
        registered_model_name: also register the model under this name (a new version).
        input_example: a table with a ``store`` column (e.g. one training store) saved as the model's input
            example; MLflow checks at log time that the served model answers it.

    The served model opens stores only under its serve roots (:mod:`pipeline.serving`): recorded here as the
    folder of ``train_config["data"]["stores"]`` and of the input example's stores, replaced by
    ``$FOVEATE_SERVE_ROOTS`` where the model is served.

    Returns:
        The logged model's URI (``models:/<model_id>``); ``runs:/<run_id>/<name>`` works as well.
    """
    import mlflow
    import mlflow.pyfunc
    from mlflow.models import Model

    from pipeline import serving
    from pipeline.tracking import client_for

    with tempfile.TemporaryDirectory(prefix="foveate-model-") as tmp:
        meta = {**(metadata or {}), "model_name": f"runs:/{run_id}/{name}"}  # the ``model`` column of its rows
        ckpt = save_checkpoint(
            Path(tmp) / CHECKPOINT_NAME, model, model_config, class_names, train_config=train_config, metadata=meta
        )
        client = client_for(tracking_uri)
        client.log_artifact(run_id, str(ckpt), "checkpoint")
        mlflow.set_tracking_uri(tracking_uri)
        # the logged model belongs to the run's experiment (MLflow takes the fluent current experiment)
        mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
        # Model.log (what mlflow.pyfunc.log_model calls) takes the run explicitly: no fluent run is started or ended
        with warnings.catch_warnings():  # the signature describes the input; no example is needed for it
            warnings.filterwarnings("ignore", message=".*input example was not provided.*")
            info = Model.log(
                None,  # artifact_path (deprecated; MLflow 3 takes name)
                name=name,
                flavor=mlflow.pyfunc,
                python_model=str(Path(serving.__file__).with_name("serving_entry.py")),
                artifacts={serving.CHECKPOINT_ARTIFACT: str(ckpt)},
                code_paths=_code_paths(),
                run_id=run_id,
                signature=serving.signature([str(c) for c in class_names]),
                input_example=input_example,
                pip_requirements=_pip_requirements(),
                registered_model_name=registered_model_name,
                metadata={"class_names": [str(c) for c in class_names], "checkpoint": f"artifacts/{CHECKPOINT_NAME}"},
                # what the served model may open unless $FOVEATE_SERVE_ROOTS says otherwise (pipeline.serving)
                model_config={"serve_roots": _logged_serve_roots(train_config, input_example)},
            )
    return info.model_uri


def load_model(uri: str | Path, *, map_location: str | torch.device = "cpu", tracking_uri: str | None = None):
    """Load a trained model.

    Args:
        uri: ``runs:/<run_id>`` (the run's checkpoint artifact), ``runs:/<run_id>/model``, ``models:/...``,
            another MLflow artifact URI, a local MLflow model directory or a local ``.pt`` checkpoint.
        map_location: device for the tensors.
        tracking_uri: MLflow tracking URI (default: ``$MLFLOW_TRACKING_URI``).

    Returns:
        ``(model in eval mode, ModelConfig, class_names)``.
    """
    text = str(uri)
    if "://" not in text and ":/" not in text:
        return load_local(text, map_location=map_location)
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    candidates = [text]
    if text.startswith("runs:/"):
        parts = text[len("runs:/") :].strip("/").split("/", 1)
        if len(parts) == 1:  # the whole run: its plain checkpoint first
            candidates = [f"runs:/{parts[0]}/checkpoint/{CHECKPOINT_NAME}", f"runs:/{parts[0]}/model"]
    errors = []
    with tempfile.TemporaryDirectory(prefix="foveate-load-") as tmp:
        for i, cand in enumerate(candidates):
            try:
                path = Path(mlflow.artifacts.download_artifacts(artifact_uri=cand, dst_path=str(Path(tmp) / str(i))))
            except Exception as exc:
                errors.append(f"{cand}: {exc}")
                continue
            ckpt = find_checkpoint(path)
            if ckpt is not None:
                return load_checkpoint(ckpt, map_location=map_location)
            errors.append(f"{cand}: no {CHECKPOINT_NAME} in the downloaded artifacts")
    raise ValueError(f"could not load model {text!r}: " + "; ".join(errors))
