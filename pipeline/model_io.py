"""Trained foveate models in MLflow: log a model to a run, load one by URI.

The checkpoint format and its (de)serialisation live in :mod:`operators.model_io` (re-exported here);
this module adds MLflow. :func:`log_model` logs the model to an MLflow run as a PyTorch model (pickle
serialization, a signature, explicit pip requirements) with that checkpoint inside it (``extra_files``), and
the same checkpoint as a plain run artifact ``checkpoint/model.pt``. :func:`load_model` takes
``runs:/<id>[/path]``, ``models:/<name>/<version>``, ``models:/<model_id>``, any other MLflow artifact URI, a
local MLflow model directory or a local checkpoint file, and always rebuilds the model from the checkpoint
(never unpickles code).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from operators.model_io import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    build_model,
    checkpoint_dict,
    find_checkpoint,
    load_checkpoint,
    load_local,
    model_from_checkpoint,
    save_checkpoint,
    with_num_classes,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "checkpoint_dict",
    "save_checkpoint",
    "model_from_checkpoint",
    "load_checkpoint",
    "build_model",
    "with_num_classes",
    "model_signature",
    "log_model",
    "load_model",
]

log = logging.getLogger(__name__)


def model_signature(model_config: Any):
    """MLflow signature of ``FoveateModel.forward`` (embed + aggregate, the part after patch reading):
    ``patches`` (B, K, 3, p, p) float32 in [0, 1] and ``positions`` (B, K, 2) float32 (patch centres / slide
    size) in, class ``logits`` (B, C) out. Scoring whole slides (scorer + selection + patch reading) goes
    through ``workers.patches.forward_slide`` on the model :func:`load_model` returns."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    k, p, c = int(model_config.k), int(model_config.patch_size), int(model_config.num_classes)
    f32 = np.dtype(np.float32)
    return ModelSignature(
        inputs=Schema([TensorSpec(f32, (-1, k, 3, p, p), "patches"), TensorSpec(f32, (-1, k, 2), "positions")]),
        outputs=Schema([TensorSpec(f32, (-1, c), "logits")]),
    )


def _pip_requirements() -> list[str]:
    from importlib import metadata

    reqs = []
    for pkg in ("torch", "numpy", "zarr", "mlflow"):
        try:
            reqs.append(f"{pkg}=={metadata.version(pkg)}")
        except metadata.PackageNotFoundError:  # pragma: no cover
            reqs.append(pkg)
    return reqs


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
) -> str:
    """Log ``model`` to run ``run_id`` as an MLflow PyTorch model (with the checkpoint inside) and the
    checkpoint as the run artifact ``checkpoint/model.pt``.

    Returns:
        The logged model's URI (``models:/<model_id>``); ``runs:/<run_id>/<name>`` works as well.
    """
    import mlflow
    import mlflow.pytorch

    from pipeline.tracking import client_for

    with tempfile.TemporaryDirectory(prefix="foveate-model-") as tmp:
        ckpt = save_checkpoint(
            Path(tmp) / CHECKPOINT_NAME, model, model_config, class_names, train_config=train_config, metadata=metadata
        )
        client = client_for(tracking_uri)
        client.log_artifact(run_id, str(ckpt), "checkpoint")
        mlflow.set_tracking_uri(tracking_uri)
        # the logged model belongs to the run's experiment (MLflow takes the fluent current experiment)
        mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
        info = mlflow.pytorch.log_model(
            model.cpu().eval(),
            name=name,
            run_id=run_id,
            signature=model_signature(model_config),
            serialization_format="pickle",
            pip_requirements=_pip_requirements(),
            extra_files=[str(ckpt)],
            registered_model_name=registered_model_name,
            metadata={"class_names": [str(c) for c in class_names], "checkpoint": f"extra_files/{CHECKPOINT_NAME}"},
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
