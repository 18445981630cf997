"""Saving and loading trained foveate models: plain checkpoints and MLflow models.

A checkpoint (``*.pt``) is a dict that ``torch.load(path, weights_only=True)`` reads, with only tensors
and plain Python values in it::

    {"format": "foveate-model/1",
     "state_dict": {name: tensor, ...},        # FoveateModel.state_dict()
     "model_config": {...},                    # operators.model.ModelConfig as a plain dict
     "class_names": ["benign", "tumour"],      # class index -> name
     "train_config": {...} or None,            # the full resolved TrainConfig, for the record
     "metadata": {...}}                        # e.g. run id, epoch

:func:`log_model` logs the model to an MLflow run as a PyTorch model (pickle serialization, a
signature, explicit pip requirements) with that checkpoint inside it (``extra_files``), and the same
checkpoint as a plain run artifact ``checkpoint/model.pt``. :func:`load_model` takes ``runs:/<id>[/path]``,
``models:/<name>/<version>``, ``models:/<model_id>``, any other MLflow artifact URI, a local MLflow model
directory or a local checkpoint file, and always rebuilds the model from the checkpoint (never unpickles
code).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

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

CHECKPOINT_FORMAT = "foveate-model/1"
CHECKPOINT_NAME = "model.pt"
_NUM_CLASSES_FIELDS = ("num_classes", "n_classes")


def with_num_classes(model_config: Any, num_classes: int) -> Any:
    """``model_config`` with its number-of-classes field set to ``num_classes``."""
    names = {f.name for f in dataclasses.fields(model_config)}
    for field in _NUM_CLASSES_FIELDS:
        if field in names:
            return dataclasses.replace(model_config, **{field: int(num_classes)})
    raise TypeError(f"{type(model_config).__name__} has none of the fields {_NUM_CLASSES_FIELDS}")


def build_model(model_config: Any):
    """A fresh ``FoveateModel`` from a ``ModelConfig`` or its plain-dict form."""
    from operators.model import FoveateModel, ModelConfig

    from pipeline.config import from_dict

    if isinstance(model_config, Mapping):
        model_config = from_dict(ModelConfig, model_config)
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig or a mapping, got {type(model_config).__name__}")
    return FoveateModel(model_config), model_config


def checkpoint_dict(model: torch.nn.Module, model_config: Any, class_names: list[str] | tuple[str, ...], *,
                    train_config: Mapping[str, Any] | None = None,
                    metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint content (tensors on CPU, everything else plain)."""
    from pipeline.config import to_dict

    return {
        "format": CHECKPOINT_FORMAT,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": to_dict(model_config),
        "class_names": [str(c) for c in class_names],
        "train_config": to_dict(dict(train_config)) if train_config is not None else None,
        "metadata": to_dict(dict(metadata or {})),
    }


def save_checkpoint(path: str | Path, model: torch.nn.Module, model_config: Any,
                    class_names: list[str] | tuple[str, ...], **kwargs: Any) -> Path:
    """Write :func:`checkpoint_dict` to ``path`` (atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint_dict(model, model_config, class_names, **kwargs), tmp)
    tmp.replace(path)
    return path


def model_from_checkpoint(ckpt: Mapping[str, Any]):
    """``(model in eval mode, ModelConfig, class_names)`` from a loaded checkpoint dict."""
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != CHECKPOINT_FORMAT:
        got = ckpt.get("format") if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise ValueError(f"not a foveate model checkpoint (format {got!r}, expected {CHECKPOINT_FORMAT!r})")
    model, cfg = build_model(ckpt["model_config"])
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model, cfg, list(ckpt["class_names"])


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu"):
    """``(model, ModelConfig, class_names)`` from a checkpoint file, read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model checkpoint at {path}")
    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    return model_from_checkpoint(ckpt)


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


def log_model(model: torch.nn.Module, model_config: Any, class_names: list[str] | tuple[str, ...], *,
              run_id: str, tracking_uri: str, name: str = "model",
              train_config: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
              registered_model_name: str | None = None) -> str:
    """Log ``model`` to run ``run_id`` as an MLflow PyTorch model (with the checkpoint inside) and the
    checkpoint as the run artifact ``checkpoint/model.pt``.

    Returns:
        The logged model's URI (``models:/<model_id>``); ``runs:/<run_id>/<name>`` works as well.
    """
    import mlflow
    import mlflow.pytorch

    from pipeline.tracking import client_for

    with tempfile.TemporaryDirectory(prefix="foveate-model-") as tmp:
        ckpt = save_checkpoint(Path(tmp) / CHECKPOINT_NAME, model, model_config, class_names,
                               train_config=train_config, metadata=metadata)
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


def _find_checkpoint(root: Path) -> Path | None:
    if root.is_file():
        return root
    for candidate in (root / "extra_files" / CHECKPOINT_NAME, root / "checkpoint" / CHECKPOINT_NAME, root / CHECKPOINT_NAME):
        if candidate.is_file():
            return candidate
    found = sorted(root.rglob(CHECKPOINT_NAME))
    return found[0] if found else None


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
    local = Path(text).expanduser()
    if "://" not in text and ":/" not in text:
        if not local.exists():
            raise FileNotFoundError(f"model {text!r}: no such checkpoint file or model directory")
        ckpt = _find_checkpoint(local)
        if ckpt is None:
            raise ValueError(f"model {text!r}: no {CHECKPOINT_NAME} in this directory")
        return load_checkpoint(ckpt, map_location=map_location)
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    candidates = [text]
    if text.startswith("runs:/"):
        parts = text[len("runs:/"):].strip("/").split("/", 1)
        if len(parts) == 1:  # the whole run: its plain checkpoint first
            candidates = [f"runs:/{parts[0]}/checkpoint/{CHECKPOINT_NAME}", f"runs:/{parts[0]}/model"]
    errors = []
    with tempfile.TemporaryDirectory(prefix="foveate-load-") as tmp:
        for i, cand in enumerate(candidates):
            try:
                path = Path(mlflow.artifacts.download_artifacts(artifact_uri=cand, dst_path=str(Path(tmp) / str(i))))
            except Exception as exc:  # noqa: BLE001 - report all candidates below
                errors.append(f"{cand}: {exc}")
                continue
            ckpt = _find_checkpoint(path)
            if ckpt is not None:
                return load_checkpoint(ckpt, map_location=map_location)
            errors.append(f"{cand}: no {CHECKPOINT_NAME} in the downloaded artifacts")
    raise ValueError(f"could not load model {text!r}: " + "; ".join(errors))
