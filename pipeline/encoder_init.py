"""Pretrained encoders in MLflow: log the encoder of a ``foveate pretrain`` run, resolve ``model.features.init``.

A pretraining run logs its encoder under the artifact folder ``encoder/``::

    encoder/encoder.pt      # the ResNet's state_dict (torch.save; what model.features.init loads)
    encoder/features.json   # {"format": "foveate-encoder/1", "features": {model.features it was built with}, ...}

and, with ``pretrain.registered_model``, registers that folder as a model version. :func:`resolve_init` turns
``model.features.init`` into the state dict: a local ``state_dict`` file, ``runs:/<run_id>`` (its
``encoder/encoder.pt``), ``runs:/<run_id>/<path>`` (a ``.pt`` file or a folder holding ``encoder.pt``) or
``models:/<name>/<version>`` / ``models:/<name>@<alias>``, and checks that the encoder's architecture (widths,
blocks, feature_dim, norm; read from its tensors) is the config's.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from operators.config import to_dict
from operators.errors import ConfigError
from operators.model_config import FeaturesConfig, is_init_uri
from operators.resnet import architecture_of, check_architecture, encoder_state

__all__ = ["ENCODER_DIR", "ENCODER_FILE", "ENCODER_FORMAT", "log_encoder", "resolve_init", "load_encoder_file"]

log = logging.getLogger(__name__)

ENCODER_DIR = "encoder"
ENCODER_FILE = "encoder.pt"
ENCODER_FORMAT = "foveate-encoder/1"


def log_encoder(
    client: Any,
    run_id: str,
    state_dict: Mapping[str, torch.Tensor],
    features: FeaturesConfig,
    *,
    metadata: Mapping[str, Any] | None = None,
    registered_model: str | None = None,
) -> str:
    """Log ``state_dict`` and the features config it was built with to run ``run_id`` (``encoder/``), and register
    the folder as a new version of ``registered_model`` when given. Returns ``runs:/<run_id>/encoder``."""
    with tempfile.TemporaryDirectory(prefix="foveate-encoder-") as tmp:
        folder = Path(tmp) / ENCODER_DIR
        folder.mkdir()
        torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, folder / ENCODER_FILE)
        info = {"format": ENCODER_FORMAT, "features": to_dict(features), **to_dict(dict(metadata or {}))}
        (folder / "features.json").write_text(json.dumps(info, indent=2))
        client.log_artifacts(run_id, str(folder), ENCODER_DIR)
    uri = f"runs:/{run_id}/{ENCODER_DIR}"
    if registered_model:
        try:
            client.create_registered_model(registered_model)
        except Exception:  # it exists already
            pass
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{ENCODER_DIR}"
        version = client.create_model_version(registered_model, source, run_id=run_id)
        log.info("registered the encoder as models:/%s/%s", registered_model, version.version)
    return uri


def load_encoder_file(path: str | Path, *, where: str) -> dict[str, torch.Tensor]:
    """A ``state_dict`` file (``torch.load(weights_only=True)``); ConfigError naming ``where`` when it is missing or
    not a state dict."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{where}: no such state_dict file {str(path)!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"{where}: {path} is not a state_dict file torch.load(weights_only=True) reads ({exc})"
        ) from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{where}: {path} holds a {type(state).__name__}, not a state_dict (names -> tensors)")
    return dict(state)


def _candidates(init: str) -> list[str]:
    if init.startswith("runs:/"):
        run_id, _, rest = init[len("runs:/") :].strip("/").partition("/")
        if not rest:
            return [f"runs:/{run_id}/{ENCODER_DIR}/{ENCODER_FILE}"]
        return [f"runs:/{run_id}/{rest}"]
    return [init]


def _download(init: str, tracking_uri: str | None, where: str) -> dict[str, torch.Tensor]:
    import mlflow

    from pipeline.tracking import resolve_tracking_uri

    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    errors = []
    with tempfile.TemporaryDirectory(prefix="foveate-init-") as tmp:
        for i, cand in enumerate(_candidates(init)):
            try:
                got = Path(mlflow.artifacts.download_artifacts(artifact_uri=cand, dst_path=str(Path(tmp) / str(i))))
            except Exception as exc:
                first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                errors.append(f"{cand}: {first}")
                continue
            found = got if got.is_file() else next(iter(sorted(got.rglob(ENCODER_FILE))), None)
            if found is None:
                errors.append(f"{cand}: no {ENCODER_FILE} in the downloaded artifacts")
                continue
            return load_encoder_file(found, where=where)
    raise ConfigError(
        f"{where}: cannot find the pretrained encoder ({'; '.join(errors)}); give the run of a `foveate pretrain` "
        f"(runs:/<run_id>), a registered encoder (models:/<name>/<version>) or a local state_dict file"
    )


def resolve_init(
    features: FeaturesConfig, *, tracking_uri: str | None = None, key: str = "model.features.init"
) -> dict[str, torch.Tensor]:
    """The state dict ``features.init`` names, checked against ``features``' architecture.

    Args:
        features: ``model.features`` (``kind: resnet``, ``init`` set).
        tracking_uri: the MLflow tracking URI for ``runs:/`` and ``models:/`` (default: ``$MLFLOW_TRACKING_URI``, else
            MLflow's current one).
        key: the config key that named ``init``, for the messages (``model.experimental.gate_encoder`` names the
            cluster gate's encoder the same way).

    Raises:
        ConfigError: the file or the MLflow encoder cannot be found, or its widths / blocks / feature_dim / norm
            differ from ``features``' (the message gives both).
    """
    if features.kind != "resnet" or not features.init:
        raise ConfigError(f"{key} applies to kind resnet with init set, got {features!r}")
    where = f"{key}={features.init!r}"
    if is_init_uri(features.init):
        state = _download(features.init, tracking_uri, where)
    else:
        state = load_encoder_file(features.init, where=where)
    state = encoder_state(state)
    try:
        architecture_of(state)
        check_architecture(features.resnet(), state, where=where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return state
