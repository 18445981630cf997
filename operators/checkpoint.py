"""Checkpoints of trained foveate models: plain dicts of tensors and plain values (no MLflow here).

A checkpoint (``*.pt``) is a dict that ``torch.load(path, weights_only=True)`` reads::

    {"format": "foveate-model/1",
     "state_dict": {name: tensor, ...},        # FoveateModel.state_dict()
     "model_config": {...},                    # operators.model.ModelConfig as a plain dict
     "class_names": ["benign", "tumour"],      # class index -> name
     "train_config": {...} or None,            # the full resolved TrainConfig, for the record
     "metadata": {...},                        # e.g. run id, epoch
     "torchscript": uint8 tensor}              # only with model.features.kind: torchscript (below)

Both the driver (``pipeline.mlflow_model`` adds MLflow logging and loading by URI) and the actors
(``workers.scoring``, ``pipeline.train_loop``) use this module; the model is always rebuilt from the
checkpoint (Python code is never unpickled).

A model whose feature network is a TorchScript file (``model.features.kind: torchscript``,
:mod:`operators.encoders`) carries that file's bytes under ``"torchscript"`` as a 1-D uint8 tensor (written as they
are; ``bytes`` would grow by about half under ``torch.save``'s pickle protocol 2) and the encoder's frozen weights
are not repeated in ``state_dict`` (that would double the checkpoint); the model is
rebuilt with ``torch.jit.load`` of those bytes, so the file need not exist where the checkpoint is loaded. A
TorchScript module is TorchScript code run by the TorchScript interpreter (not Python; loading it unpickles no
Python object), yet still code: load checkpoints from sources you trust.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from operators.config import from_dict, to_dict

__all__ = [
    "checkpoint_digest",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "checkpoint_dict",
    "save_checkpoint",
    "model_from_checkpoint",
    "load_checkpoint",
    "load_local",
    "find_checkpoint",
    "build_model",
    "with_num_classes",
]

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


def build_model(model_config: Any, *, torchscript: Any = None):
    """A fresh ``FoveateModel`` from a ``ModelConfig`` or its plain-dict form (``torchscript``: a checkpoint's
    TorchScript bytes, for ``model.features.kind: torchscript``)."""
    from operators.model import FoveateModel
    from operators.model_config import ModelConfig

    if isinstance(model_config, Mapping):
        from operators.model_config import upgrade_flat_keys

        # checkpoints written before the sectioned config hold every flat key: converted silently (exactly)
        model_config = from_dict(ModelConfig, upgrade_flat_keys(model_config)[0])
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig or a mapping, got {type(model_config).__name__}")
    return FoveateModel(model_config, torchscript=torchscript), model_config


def checkpoint_dict(
    model: torch.nn.Module,
    model_config: Any,
    class_names: list[str] | tuple[str, ...],
    *,
    train_config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint content (tensors on CPU, everything else plain; a TorchScript encoder's file as bytes).

    The encoder's initial weights (``model.features.init``) are in the state dict: the checkpoint's model config has
    ``init: null`` (so it loads without that file) and its metadata records the source as ``features_init``."""
    config, init = _without_init(to_dict(model_config))
    meta = to_dict(dict(metadata or {}))
    if init is not None:
        meta.setdefault("features_init", init)
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": config,
        "class_names": [str(c) for c in class_names],
        "train_config": to_dict(dict(train_config)) if train_config is not None else None,
        "metadata": meta,
    }
    encoder = getattr(model, "features", None)
    if callable(getattr(encoder, "torchscript_bytes", None)):  # operators.encoders.TorchScriptEncoder
        from operators.encoders import as_tensor

        ckpt["torchscript"] = as_tensor(encoder.torchscript_bytes())
    return ckpt


def _without_init(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A model config mapping with ``features.init`` (or its older name ``weights``) unset, and the value it had:
    a checkpoint's weights are its state dict, never the initial file again."""
    config = dict(config)
    features = config.get("features")
    if not isinstance(features, Mapping):
        return config, None
    features = dict(features)
    init = None
    for key in ("init", "weights"):
        if features.get(key) is not None:
            init = init or str(features[key])
            features[key] = None
    config["features"] = features
    experimental = config.get("experimental")
    if isinstance(experimental, Mapping) and experimental.get("gate_encoder") is not None:
        config["experimental"] = dict(experimental, gate_encoder=None)  # its weights: the state dict's gate.encoder
    return config, init


def save_checkpoint(
    path: str | Path, model: torch.nn.Module, model_config: Any, class_names: list[str] | tuple[str, ...], **kwargs: Any
) -> Path:
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
    data = ckpt.get("torchscript")
    if data is not None:
        from operators.encoders import as_bytes

        data = as_bytes(data)
    model, cfg = build_model(_without_init(ckpt["model_config"])[0], torchscript=data)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model, cfg, list(ckpt["class_names"])


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu"):
    """``(model, ModelConfig, class_names)`` from a checkpoint file, read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # pickled objects (weights_only refuses them), a truncated or foreign file
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{path} is not a foveate model checkpoint: torch.load(weights_only=True) cannot read it ({first}). "
            "foveate only loads checkpoints of plain tensors and config written by foveate train / "
            "operators.checkpoint.save_checkpoint, and never unpickles code"
        ) from None
    return model_from_checkpoint(ckpt)


def find_checkpoint(root: Path) -> Path | None:
    if root.is_file():
        return root
    for candidate in (
        root / "artifacts" / CHECKPOINT_NAME,
        root / "extra_files" / CHECKPOINT_NAME,
        root / "checkpoint" / CHECKPOINT_NAME,
        root / CHECKPOINT_NAME,
    ):
        if candidate.is_file():
            return candidate
    found = sorted(root.rglob(CHECKPOINT_NAME))
    return found[0] if found else None


def load_local(path: str | Path, *, map_location: str | torch.device = "cpu"):
    """``(model, ModelConfig, class_names)`` from a local checkpoint file or a directory holding one (e.g. a
    downloaded MLflow model)."""
    text = str(path)
    local = Path(text).expanduser()
    if not local.exists():
        raise FileNotFoundError(f"model {text!r}: no such checkpoint file or model directory")
    ckpt = find_checkpoint(local)
    if ckpt is None:
        raise ValueError(f"model {text!r}: no {CHECKPOINT_NAME} in this directory")
    return load_checkpoint(ckpt, map_location=map_location)


def checkpoint_digest(ckpt: Mapping[str, Any]) -> str:
    """SHA-256 of what makes a checkpoint's predictions: its model config, class names and every tensor of its
    state dict (name, dtype, shape, bytes; in name order), and the embedded TorchScript file's bytes if any. Equal for
    the same weights however they were saved or loaded; training metadata does not enter."""
    import hashlib
    import json

    h = hashlib.sha256()
    h.update(json.dumps(ckpt.get("model_config"), sort_keys=True, default=str).encode())
    h.update(json.dumps([str(c) for c in ckpt.get("class_names", [])]).encode())
    for name in sorted(ckpt["state_dict"]):
        t = ckpt["state_dict"][name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if ckpt.get("torchscript") is not None:
        from operators.encoders import as_bytes

        h.update(b"torchscript|" + hashlib.sha256(as_bytes(ckpt["torchscript"])).digest())
    return h.hexdigest()
