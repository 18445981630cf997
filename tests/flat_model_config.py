"""Model configs for tests, written with the flat keys of earlier versions and their defaults.

Many tests were written when ``ModelConfig`` was one flat class whose defaults were the plain operators (no
evidence losses, no NMS, a 128-px grid without overlap, ``selection_grad`` 1, ...); they check those operators.
:func:`flat_config` builds today's sectioned :class:`~operators.model_config.ModelConfig` from such flat keys with
those defaults, through the same :func:`~operators.model_config.upgrade_flat_keys` that loads old configs and
checkpoints; :func:`flat_replace` is ``dataclasses.replace`` with flat keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from operators.config import from_dict, to_dict
from operators.model_config import FLAT_KEYS, ModelConfig, upgrade_flat_keys

__all__ = ["FLAT_DEFAULTS", "flat_config", "flat_replace"]

# the flat defaults of earlier versions (the plain operators); patch_size / scorer_downsample default to 128 / 16
FLAT_DEFAULTS: dict[str, Any] = {
    "tissue_threshold": 0.1,
    "k": 8,
    "selector": "perturbed",
    "num_samples": 500,
    "sigma": 0.05,
    "control_variate": False,
    "epsilon": 0.01,
    "sinkhorn_max_iter": 200,
    "alpha": 0.05,
    "replace": False,
    "entropy_weight": 0.01,
    "attention_temperature": 0.05,
    "mask_extra": 0,
    "gates": "mask",
    "attention_weights": "estimator",
    "attention_draw": "sample",
    "soft_draw": "topk",
    "selection_grad": 1.0,
    "nms_radius": 0,
    "nms_ties": "keep",
    "color_jitter": 0.0,
    "explore_cells": 0,
    "explore_strata": 0,
    "rare_cells": 0,
    "rare_strata": 64,
    "rare_weight": 1.0,
    "neutral_cells": 0,
    "neutral_weight": 1.0,
    "instance_weight": 0.0,
    "rank_weight": 0.0,
    "rank_temperature": 0.1,
    "evidence": "confidence",
    "evidence_gamma": 1.0,
    "max_support": 4,
    "aggregator": "mean",
    "aggregator_hidden": 128,
    "gated": True,
    "mil_attention": "softmax",
    "transformer_layers": 2,
    "transformer_heads": 4,
    "position_frequencies": 8,
    "transformer_readout": "mean",
    "mean_skip": False,
    "dropout": 0.0,
}
_SCORER = {"channels": 32, "num_layers": 4, "pool": "mean"}
_FEATURES = {"widths": [16, 32, 64, 128], "blocks": [1, 1, 1, 1], "feature_dim": 128}


def flat_config(**kw: Any) -> ModelConfig:
    """A :class:`ModelConfig` from flat keys (``k=4, selector="sinkhorn", patch_size=32, ...``) on the flat
    defaults of earlier versions; ``scorer`` / ``features`` mappings are merged over those defaults."""
    flat = {**FLAT_DEFAULTS, **kw}
    for name, defaults in (("scorer", _SCORER), ("features", _FEATURES)):
        given = kw.get(name)
        if dataclasses.is_dataclass(given):
            given = to_dict(given)
        flat[name] = {**defaults, **dict(given or {})}
    if flat.get("patch_size_um") is None:
        flat.setdefault("patch_size", 128)
        flat["patch_size"] = 128 if flat["patch_size"] is None else flat["patch_size"]
        if flat.get("stride") is None:
            flat["stride"] = flat["patch_size"]
    elif flat.get("stride_um") is None:
        flat["stride_um"] = flat["patch_size_um"]
    if flat.get("scorer_mpp") is None and flat.get("scorer_downsample") is None:
        flat["scorer_downsample"] = 16.0
    data, _ = upgrade_flat_keys(flat)
    return from_dict(ModelConfig, data)


def flat_replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    """``dataclasses.replace`` with flat keys: each is set at its place (all places for a key several sections
    share, e.g. ``mask_extra``); each section is replaced once, with all its changes."""
    changes: dict[str, Any] = {}
    for key, value in kw.items():
        if key == "stride" and value is None:
            value = kw.get("patch_size", cfg.geometry.patch_size)
        for target in FLAT_KEYS.get(key, (key,)):
            *parents, last = target.split(".")
            node = changes
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
    return _apply(cfg, changes)


def _apply(obj: Any, changes: dict[str, Any]) -> Any:
    new = {}
    for name, value in changes.items():
        cur = getattr(obj, name)
        new[name] = _apply(cur, value) if dataclasses.is_dataclass(cur) and isinstance(value, dict) else value
    return dataclasses.replace(obj, **new)
