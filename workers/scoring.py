"""The two stages of batch scoring as plain classes (``pipeline.score`` turns them into Ray actors).

* :class:`ScorerWorker` — loads the model, reads each slide's low-resolution view and tissue cells
  (``workers.patches.lowres_input``), runs the scorer and the hard top-k selection (on the GPU when there is
  one). Output per slide: a :class:`ScoredSlide` dict with the cell scores, the grid shape and the K chosen
  cells (small: no pixels).
* :class:`ClassifierWorker` — reads the chosen patches at full resolution from the store
  (``workers.patches.PatchReader``: only the chunks they touch), runs the feature network and the aggregator
  on the CPU for a batch of slides at once, and writes a heatmap PNG of the scores over the thumbnail. Output
  per slide: a prediction row (see :data:`ROW_FIELDS`).

Both catch errors per slide and return them as ``status="error"`` records, so one corrupt store never loses
the rest of its batch. Both accept the model as a checkpoint dict (``pipeline.model_io.checkpoint_dict``, what
the driver ships to actors so they never touch MLflow) or as a URI / checkpoint path.

Test hook: ``crash_once=(slide_id, marker_path)`` makes the worker kill its own process (``os._exit``) the
first time it reaches ``slide_id`` (when ``marker_path`` does not exist yet; it is created just before), to
test that Ray restarts the actor and retries its work.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["ROW_FIELDS", "ScorerWorker", "ClassifierWorker", "error_row", "heatmap_image", "write_heatmap"]

log = logging.getLogger(__name__)

# the fixed columns of a prediction row (plus prob_<class> per class)
ROW_FIELDS = ("slide_id", "status", "error", "prediction", "probability", "probabilities", "patches", "heatmap",
              "seconds", "store", "model", "scored_at")


def _load(model: Any):
    """``(model, ModelConfig, class_names)`` from a checkpoint dict, a checkpoint path or an MLflow URI."""
    from pipeline.model_io import load_model, model_from_checkpoint

    if isinstance(model, Mapping):
        return model_from_checkpoint(model)
    if isinstance(model, (str, Path)):
        return load_model(str(model))
    raise TypeError(f"model must be a checkpoint dict, a checkpoint path or an MLflow model URI, got "
                    f"{type(model).__name__}")


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _maybe_crash(crash_once: tuple[str, str] | None, slide_id: str) -> None:
    if crash_once is None or slide_id != crash_once[0]:
        return
    marker = Path(crash_once[1])
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"pid {os.getpid()} crashed on {slide_id}\n")
    log.warning("test hook: killing this worker process (pid %d) on slide %s", os.getpid(), slide_id)
    os._exit(17)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def error_row(slide_id: str, store: str, error: str, *, model: str = "", seconds: float = 0.0) -> dict[str, Any]:
    """A prediction row for a slide that could not be scored."""
    return {"slide_id": slide_id, "status": "error", "error": error, "prediction": None, "probability": None,
            "probabilities": {}, "patches": [], "heatmap": None, "seconds": float(seconds), "store": str(store),
            "model": model, "scored_at": _now()}


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(int(threads))


class ScorerWorker:
    """Scorer stage: low-res view -> cell scores -> hard top-k cells.

    Args:
        model: checkpoint dict, checkpoint path or MLflow model URI.
        device: ``"cuda"``/``"cpu"``/None (None: CUDA when available).
        threads: torch CPU threads (None: leave as is).
        crash_once: test hook, see the module docstring.
    """

    def __init__(self, model: Any, *, device: str | None = None, threads: int | None = None,
                 crash_once: tuple[str, str] | None = None):
        _set_threads(threads)
        self.model, self.cfg, self.class_names = _load(model)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cuda", "cpu") and not str(device).startswith("cuda:"):
            raise ValueError(f"device must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}")
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.crash_once = tuple(crash_once) if crash_once else None

    def score_one(self, slide_id: str, store_path: str) -> dict[str, Any]:
        """Score one slide; returns ``{"slide_id", "store", "status": "ok", "scores" float32 [N] (-inf = not a
        candidate), "grid_shape" (Gh, Gw), "cells" int64 [K] (chosen cells, increasing), "slot_weights" float32
        [K] or None, "seconds"}`` or ``{..., "status": "error", "error": "..."}``."""
        from workers.patches import lowres_input
        from workers.store import SlideStore

        _maybe_crash(self.crash_once, slide_id)
        t0 = time.perf_counter()
        try:
            store = SlideStore(store_path)
            lowres, cell_mask = lowres_input(store, self.cfg)
            with torch.inference_mode():
                scores = self.model.score(lowres[None].to(self.device), cell_mask[None].to(self.device))
                sel = self.model.select(scores, training=False)
            cells = sel.primary[0].cpu().numpy().astype(np.int64)
            slot_w = None if sel.slot_weights is None else sel.slot_weights[0].float().cpu().numpy()
            return {"slide_id": slide_id, "store": str(store_path), "status": "ok",
                    "scores": scores[0].float().cpu().numpy(), "grid_shape": tuple(int(g) for g in cell_mask.shape),
                    "cells": cells, "slot_weights": slot_w, "seconds": time.perf_counter() - t0,
                    "device": str(self.device)}
        except Exception as exc:  # noqa: BLE001 - one bad slide must not take the batch down
            log.warning("scoring %s failed: %s", slide_id, _describe(exc))
            log.debug("%s", traceback.format_exc())
            return {"slide_id": slide_id, "store": str(store_path), "status": "error",
                    "error": f"scorer: {_describe(exc)}", "seconds": time.perf_counter() - t0}

    def score_batch(self, items: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """:meth:`score_one` for each ``(slide_id, store_path)``."""
        return [self.score_one(sid, path) for sid, path in items]

    def ping(self) -> str:
        return str(self.device)


def heatmap_image(thumb: np.ndarray, level0_size: tuple[int, int], scores_grid: np.ndarray, stride: int,
                  patch_size: int, coords_l0: np.ndarray, *, alpha: float = 0.5, min_side: int = 256) -> np.ndarray:
    """Scores over the thumbnail with the chosen patches outlined.

    Args:
        thumb: ``(h, w, 3)`` uint8 thumbnail covering level-0 ``(0, 0, W, H)``.
        level0_size: ``(W, H)``.
        scores_grid: ``(Gh, Gw)`` float, NaN (or inf) where the cell was not a candidate (no overlay there).
        stride, patch_size: grid geometry in level-0 pixels; cell ``(r, c)`` colours ``[c*stride, (c+1)*stride)``.
        coords_l0: ``(K, 2)`` level-0 ``(x, y)`` of the chosen patches (outlined in cyan).
        alpha: overlay opacity.
        min_side: the image is upscaled (nearest, integer factor) until its shorter side is at least this.

    Returns:
        ``(h', w', 3)`` uint8.
    """
    from matplotlib import colormaps

    if thumb.ndim != 3 or thumb.shape[2] != 3:
        raise ValueError(f"thumb must be (h, w, 3), got {thumb.shape}")
    factor = max(1, int(np.ceil(min_side / max(1, min(thumb.shape[:2])))))
    img = np.repeat(np.repeat(thumb, factor, 0), factor, 1).astype(np.float32)
    h, w = img.shape[:2]
    W, H = level0_size
    sx, sy = W / w, H / h  # level-0 pixels per output pixel
    xs = ((np.arange(w) + 0.5) * sx // stride).astype(np.int64)
    ys = ((np.arange(h) + 0.5) * sy // stride).astype(np.int64)
    gh, gw = scores_grid.shape
    inside = (ys[:, None] < gh) & (xs[None, :] < gw)
    s = scores_grid[np.minimum(ys, gh - 1)][:, np.minimum(xs, gw - 1)].astype(np.float64)
    valid = inside & np.isfinite(s)
    if valid.any():
        lo, hi = float(s[valid].min()), float(s[valid].max())
        norm = (s - lo) / (hi - lo) if hi > lo else np.full_like(s, 0.5)
        rgba = colormaps["inferno"](np.clip(np.nan_to_num(norm), 0, 1))[..., :3] * 255.0
        img[valid] = (1 - alpha) * img[valid] + alpha * rgba[valid]
    out = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    lw = max(1, min(h, w) // 200)
    for x, y in np.asarray(coords_l0, dtype=np.float64).reshape(-1, 2):
        x0, y0 = int(x / sx), int(y / sy)
        x1, y1 = int(np.ceil((x + patch_size) / sx)) - 1, int(np.ceil((y + patch_size) / sy)) - 1
        x0, x1 = np.clip([x0, x1], 0, w - 1)
        y0, y1 = np.clip([y0, y1], 0, h - 1)
        cyan = np.array([0, 255, 255], dtype=np.uint8)
        out[y0:y0 + lw, x0:x1 + 1] = cyan
        out[max(y1 - lw + 1, 0):y1 + 1, x0:x1 + 1] = cyan
        out[y0:y1 + 1, x0:x0 + lw] = cyan
        out[y0:y1 + 1, max(x1 - lw + 1, 0):x1 + 1] = cyan
    return out


def write_heatmap(path: str | Path, image: np.ndarray) -> Path:
    """Write an RGB uint8 image as PNG (atomically)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    Image.fromarray(image).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


class ClassifierWorker:
    """Patch reading + features + aggregation stage (CPU), and the heatmap.

    Args:
        model: checkpoint dict, checkpoint path or MLflow model URI.
        heatmap_dir: where ``<slide_id>.png`` heatmaps go (None: no heatmaps).
        model_name: recorded in each row's ``model`` field (the URI the driver was given).
        threads: torch CPU threads (None: leave as is).
        crash_once: test hook, see the module docstring.
    """

    def __init__(self, model: Any, *, heatmap_dir: str | Path | None = None, model_name: str = "",
                 threads: int | None = None, crash_once: tuple[str, str] | None = None):
        _set_threads(threads)
        self.model, self.cfg, self.class_names = _load(model)
        self.model.to("cpu").eval()
        self.heatmap_dir = Path(heatmap_dir) if heatmap_dir is not None else None
        self.model_name = str(model_name)
        self.crash_once = tuple(crash_once) if crash_once else None

    def _prepare(self, item: Mapping[str, Any]):
        from workers.patches import PatchGrid, PatchReader
        from workers.store import SlideStore

        store = SlideStore(item["store"])
        grid = PatchGrid.from_store(store, self.cfg.patch_size, self.cfg.stride_l0)
        if tuple(grid.shape) != tuple(item["grid_shape"]):
            raise ValueError(f"grid shape {grid.shape} differs from the scorer's {tuple(item['grid_shape'])}")
        cells = torch.from_numpy(np.array(item["cells"], dtype=np.int64))
        pix = PatchReader(store, grid).read(cells)  # uint8 [K, 3, p, p], only the chunks they touch
        positions = grid.cell_centres(cells)  # [K, 2]
        coords = grid.cell_xy_l0(cells).numpy()  # [K, 2]
        return store, grid, pix, positions, coords

    def classify_batch(self, items: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Prediction rows for scorer outputs ``items`` (error items pass through as error rows)."""
        rows: list[dict[str, Any] | None] = [None] * len(items)
        ready = []  # (index, store, grid, pix, positions, coords, t_read)
        for i, item in enumerate(items):
            _maybe_crash(self.crash_once, item["slide_id"])
            if item.get("status") != "ok":
                rows[i] = error_row(item["slide_id"], item["store"], item.get("error", "unknown error"),
                                    model=self.model_name, seconds=item.get("seconds", 0.0))
                continue
            t0 = time.perf_counter()
            try:
                ready.append((i, *self._prepare(item), time.perf_counter() - t0))
            except Exception as exc:  # noqa: BLE001
                log.warning("reading patches of %s failed: %s", item["slide_id"], _describe(exc))
                rows[i] = error_row(item["slide_id"], item["store"], f"patches: {_describe(exc)}",
                                    model=self.model_name, seconds=item.get("seconds", 0.0) + time.perf_counter() - t0)
        if ready:
            t0 = time.perf_counter()
            probs = self._classify([r[3] for r in ready], [r[4] for r in ready],
                                   [items[r[0]].get("slot_weights") for r in ready])
            per_slide = (time.perf_counter() - t0) / len(ready)
            for (i, store, grid, _pix, _pos, coords, t_read), p in zip(ready, probs):
                item = items[i]
                t1 = time.perf_counter()
                try:
                    rows[i] = self._row(item, store, grid, coords, p)
                    rows[i]["seconds"] = float(item.get("seconds", 0.0) + t_read + per_slide + time.perf_counter() - t1)
                except Exception as exc:  # noqa: BLE001
                    rows[i] = error_row(item["slide_id"], item["store"], f"output: {_describe(exc)}",
                                        model=self.model_name, seconds=item.get("seconds", 0.0))
        return rows  # type: ignore[return-value]

    def _classify(self, pixes: list[torch.Tensor], positions: list[torch.Tensor],
                  slot_weights: list[np.ndarray | None]) -> np.ndarray:
        """Class probabilities ``[B, C]`` of B slides: one feature-network call over all ``B*K`` patches, one
        aggregator call over the B slides."""
        b, k = len(pixes), pixes[0].shape[0]
        patches = torch.stack(pixes).to(torch.float32).div_(255.0)  # [B, K, 3, p, p]
        pos = torch.stack(positions).to(torch.float32)
        weights = None
        if slot_weights[0] is not None:
            weights = torch.stack([torch.as_tensor(np.asarray(w, dtype=np.float32)) for w in slot_weights])
        with torch.inference_mode():
            feats = self.model.embed(patches.flatten(0, 1)).view(b, k, -1)
            logits = self.model.aggregate(feats, pos, weights)
            return torch.softmax(logits.float(), dim=-1).numpy()

    def _row(self, item: Mapping[str, Any], store, grid, coords: np.ndarray, probs: np.ndarray) -> dict[str, Any]:
        scores = np.asarray(item["scores"], dtype=np.float32)
        cells = np.asarray(item["cells"], dtype=np.int64)
        cls = int(np.argmax(probs))
        p = self.cfg.patch_size
        patches = [{"x": int(x), "y": int(y), "w": p, "h": p, "score": float(scores[c])}
                   for (x, y), c in zip(coords, cells)]
        heatmap = None
        if self.heatmap_dir is not None:
            grid_scores = np.where(np.isfinite(scores), scores, np.nan).reshape(grid.shape)
            thumb = store.read_level(store.level_count - 1)
            img = heatmap_image(thumb, store.dimensions, grid_scores, grid.stride, p, coords)
            heatmap = str(write_heatmap(self.heatmap_dir / f"{item['slide_id']}.png", img).resolve())
        return {"slide_id": item["slide_id"], "status": "ok", "error": None,
                "prediction": self.class_names[cls], "probability": float(probs[cls]),
                "probabilities": {name: float(v) for name, v in zip(self.class_names, probs)},
                "patches": patches, "heatmap": heatmap, "seconds": 0.0, "store": str(item["store"]),
                "model": self.model_name, "scored_at": _now()}

    def ping(self) -> str:
        return "cpu"
