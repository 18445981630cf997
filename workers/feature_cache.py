"""Cache of frozen-encoder patch features on disk, so later epochs skip the patch read, decode and encoder.

With a frozen feature network (``model.features.freeze`` true, or ``kind: torchscript``) a cell's features are a
function of its pixels alone, so :class:`FeatureCache` keeps, per slide store, a Zarr array ``features
[num_cells, D]`` (float32 by default, or float16) and a boolean ``filled [num_cells]``; features are written as
they are computed and read back for cells already filled (:func:`workers.slide_forward.forward_slide`). A
store's arrays are loaded into memory when first used (lookups are in memory; writes update both, whole chunks).

The cache lives in ``<root>/<key>/worker<rank>/<store>``: ``key`` is a digest of everything that changes the
features (:func:`feature_key`: the encoder's weights, or the TorchScript file's digest, the features config with
its mean/std, the model's patch geometry and the parameters' dtype), so another encoder or geometry gets a fresh
cache, never stale features. Each training worker writes its own folder (a slide can move between workers from
one epoch to the next, and two processes writing one Zarr chunk could lose each other's writes), so writes need
no locks; within a worker the features are written before the ``filled`` flags.

When it is used (the rule, also in ``FeaturesConfig``'s and ``TrainConfig``'s docstrings and docs/model.md):
evaluation always (hard top-k, no augmentation); training only without pixel augmentation
(``model.augment.color_jitter`` 0: jittered patches have other features), and the selected slots only when each
is one cell (``S = 1``: hard, sinkhorn, lapsum, attention; the perturbed selector's soft patches mix the pixels
of several cells and still go through the encoder, while its extra reads use the cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FeatureCache", "feature_key", "features_frozen"]

log = logging.getLogger(__name__)

_CHUNK_CELLS = 1024


def features_frozen(cfg: Any) -> bool:
    """The model config's feature network is frozen (``freeze`` true, or a TorchScript encoder)."""
    return cfg.features.weights_fixed


def _encoder_digest(features: torch.nn.Module) -> str:
    h = hashlib.sha256()
    ts = getattr(features, "_sha256", None)  # TorchScriptEncoder: the file's digest (its state dict omits the module)
    if ts is not None:
        h.update(str(ts).encode())
    for name, t in sorted(features.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def feature_key(model: Any) -> dict[str, Any]:
    """What the cached features depend on: the encoder (weights digest), the features config (kind, mean/std,
    input size...), the model's patch geometry and the dtype the model runs in."""
    import dataclasses

    f = dataclasses.asdict(model.cfg.features)
    f.pop("init", None)  # the weights digest covers where they came from
    f.pop("path", None)
    dtype = next(model.parameters()).dtype
    return {
        "encoder": _encoder_digest(model.features),
        "features": f,
        "geometry": [repr(v) for v in model.cfg.geometry_key()],
        "dtype": str(dtype),
    }


class FeatureCache:
    """Per-store Zarr arrays of frozen features (see the module docstring).

    Args:
        root: the cache folder (e.g. ``<run dir>/feature_cache``).
        model: the :class:`~operators.model.FoveateModel` whose (frozen) encoder's features are cached.
        worker: this worker's rank (its own sub-folder).
        dtype: ``"float32"`` (default; cached features equal recomputed ones) or ``"float16"`` (half the disk).

    Raises:
        ValueError: the model's feature network is not frozen.
    """

    def __init__(self, root: str | Path, model: Any, *, worker: int = 0, dtype: str = "float32"):
        if not features_frozen(model.cfg):
            raise ValueError("FeatureCache needs a frozen feature network (model.features.freeze or kind torchscript)")
        if dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}")
        self.key = feature_key(model)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.root = Path(root)
        self.dir = self.root / digest / f"worker{int(worker)}"
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.root / digest / "key.json"
        if not key_file.exists():
            key_file.write_text(json.dumps(self.key, indent=1, sort_keys=True))
        self.dim = int(model.feature_dim)
        self.dtype = dtype
        # location -> (features, filled, in-memory copies of both: lookups never touch the disk after the first)
        self._stores: dict[str, tuple[Any, Any, np.ndarray, np.ndarray]] = {}
        self.hits = 0
        self.misses = 0
        self.jitter_noted = False  # the "not used in training under colour jitter" line was logged

    def _arrays(self, location: str, num_cells: int) -> tuple[Any, Any, np.ndarray, np.ndarray]:
        got = self._stores.get(location)
        if got is not None:
            return got
        import zarr

        name = hashlib.sha256(location.encode()).hexdigest()[:24]
        group = zarr.open_group(str(self.dir / name), mode="a")
        if "features" in group and group["features"].shape == (num_cells, self.dim):
            feats, filled = group["features"], group["filled"]
        else:
            group.attrs["store"] = location
            chunk = min(_CHUNK_CELLS, max(1, num_cells))
            feats = group.create_array(
                "features", shape=(num_cells, self.dim), chunks=(chunk, self.dim), dtype=self.dtype, overwrite=True
            )
            filled = group.create_array(
                "filled", shape=(num_cells,), chunks=(chunk,), dtype="bool", fill_value=False, overwrite=True
            )
        got = (feats, filled, np.asarray(filled[:], dtype=bool), np.asarray(feats[:], dtype=np.float32))
        self._stores[location] = got
        return got

    def lookup(self, location: str, num_cells: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached features of distinct ``cells[M]``: ``(hit[M] bool, features[hit.sum(), D] float32)``."""
        _, _, filled, mem = self._arrays(location, num_cells)
        idx = cells.cpu().numpy().astype(np.int64)
        hit = filled[idx]
        n = int(hit.sum())
        self.hits += n
        self.misses += len(idx) - n
        return torch.from_numpy(hit), torch.from_numpy(mem[idx[hit]])

    def write(self, location: str, num_cells: int, cells: torch.Tensor, values: torch.Tensor) -> None:
        """Store the features ``values[M, D]`` of distinct ``cells[M]`` (features first, then the flags)."""
        if cells.numel() == 0:
            return
        feats, filled_arr, filled, mem = self._arrays(location, num_cells)
        idx = cells.cpu().numpy().astype(np.int64)
        order = np.argsort(idx)
        idx = idx[order]
        mem[idx] = values.detach().to("cpu", torch.float32).numpy()[order].astype(self.dtype)
        filled[idx] = True
        # whole chunks from the in-memory copies, one slice per array (much cheaper than scattered writes)
        chunk = feats.chunks[0]
        lo, hi = int(idx[0]) // chunk * chunk, min(num_cells, (int(idx[-1]) // chunk + 1) * chunk)
        feats[lo:hi] = mem[lo:hi].astype(self.dtype)
        filled_arr[lo:hi] = filled[lo:hi]
