"""The two stages of batch scoring as plain classes (``pipeline.score`` turns them into Ray actors).

* :class:`ScorerWorker` — loads the model, reads each slide's low-resolution view and tissue cells
  (``workers.patches.lowres_view``, uint8), runs the scorer and the hard top-k selection (on the GPU when there is
  one). Output per slide: a :class:`ScoredSlide` dict with the cell scores, the grid shape and the K chosen
  cells (small: no pixels), and the store's hand-off (``SlideStore.handoff``: its verified metadata, a few KB).
* :class:`ClassifierWorker` — rebuilds the store from that hand-off (``SlideStore.from_handoff``: no request, so
  each store is opened and verified once per scoring, one listing per level), reads the chosen patches at full
  resolution from the store (``workers.patches.PatchReader``: only the chunks they touch), runs the feature
  network and the aggregator on the CPU for a batch of slides at once, and writes a heatmap PNG of the scores
  over the thumbnail. Output per slide: a prediction row (see :data:`ROW_FIELDS`).

Coordinates (cells, ``patches`` boxes, heatmap outlines) are level-0 pixels; the frames: :mod:`workers.frames`.

Both catch errors per slide and return them as ``status="error"`` records, so one corrupt store never loses
the rest of its batch. Both accept the model as a checkpoint dict (``operators.checkpoint.checkpoint_dict``, what
the driver ships to actors so they never touch MLflow) or as a local checkpoint path.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers import storage
from workers.frames import Box
from workers.reports import heatmap_image, score_grid, slide_heatmap, write_heatmap

__all__ = [
    "MPP_TOLERANCE",
    "PRECISIONS",
    "ROW_FIELDS",
    "ScorerWorker",
    "ClassifierWorker",
    "error_row",
    "heatmap_image",
    "resolve_precision",
    "write_heatmap",
]

log = logging.getLogger(__name__)

MPP_TOLERANCE = 0.1  # relative difference of store and training mpp beyond which scoring warns / refuses

PRECISIONS = ("auto", "fp32", "bf16")  # the scoring stages' arithmetic (``precision=``)

# the fixed columns of a prediction row (plus prob_<class> per class)
ROW_FIELDS = (
    "slide_id",
    "status",
    "error",
    "prediction",
    "probability",
    "probabilities",
    "patches",
    "heatmap",
    "seconds",
    "store",
    "model",
    "scored_at",
)


def _load(model: Any):
    """``(model, ModelConfig, class_names)`` from a checkpoint dict or a local checkpoint path (file or model
    directory). MLflow URIs are resolved on the driver (``pipeline.mlflow_model.load_model``)."""
    from operators.checkpoint import load_local, model_from_checkpoint

    if isinstance(model, Mapping):
        return model_from_checkpoint(model)
    if isinstance(model, (str, Path)):
        if ":/" in str(model):
            raise ValueError(
                f"model {str(model)!r}: workers load checkpoint dicts or local paths; resolve "
                "MLflow URIs on the driver (pipeline.mlflow_model.load_model)"
            )
        return load_local(model)
    raise TypeError(f"model must be a checkpoint dict or a local checkpoint path, got {type(model).__name__}")


def _gated(model: Any) -> bool:
    """The model has a fitted cell gate (``model.experimental.gate_candidates``): the scorer stage hands on the
    gate's candidates, the classifier stage keeps those the gate keeps."""
    gate = getattr(model, "gate", None)
    return gate is not None and gate.is_fitted


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def error_row(slide_id: str, store: str, error: str, *, model: str = "", seconds: float = 0.0) -> dict[str, Any]:
    """A prediction row for a slide that could not be scored."""
    return {
        "slide_id": slide_id,
        "status": "error",
        "error": error,
        "prediction": None,
        "probability": None,
        "probabilities": {},
        "patches": [],
        "heatmap": None,
        "seconds": float(seconds),
        "store": str(store),
        "model": model,
        "scored_at": _now(),
    }


def _store_of(item: Mapping[str, Any]):
    """The slide store of a scorer output ``item``: rebuilt from the scorer's ``store_handoff`` (the store the
    scorer opened and verified: no second open, listing or verification), else opened and verified here (items
    without a verified hand-off)."""
    from workers.store import SlideStore

    handoff = item.get("store_handoff")
    if not handoff or not handoff.get("verified"):
        return SlideStore(item["store"])
    if storage.normalize(handoff["location"]) != storage.normalize(item["store"]):
        raise ValueError(
            f"the scorer's store hand-off names {handoff['location']!r}, the slide's store is {item['store']!r}"
        )
    return SlideStore.from_handoff(handoff)


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(int(threads))


def _device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu") and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}")
    return torch.device(device)


def _prefetch(prefetch: Any) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(
            f"prefetch must be an int >= 0 (reader threads; 0: read in the calling thread), got {prefetch!r}"
        )
    return prefetch


def resolve_precision(precision: str) -> str:
    """``"fp32"`` or ``"bf16"`` for a scoring stage's ``precision``.

    ``"auto"`` is ``"fp32"``; ``"bf16"`` runs the scorer and the feature network under ``torch.autocast`` in
    bfloat16 (on the CPU too, where it is mostly slower: for checks), the selection and the softmax in float32.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return "fp32" if precision == "auto" else precision


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _in_order(fn, items: list, pool: ThreadPoolExecutor | None) -> Iterator:
    """``fn(*item)`` for each item, in order; with a pool, all submitted at once (reads overlap the caller's
    work on the results as they come)."""
    if pool is None:
        for item in items:
            yield fn(*item)
        return
    futures = [pool.submit(fn, *item) for item in items]
    for f in futures:
        yield f.result()


class _Stage:
    """What both stages set up: torch threads, device, precision, reader threads, the model on the device."""

    def __init__(
        self, model: Any, *, device: str | None, threads: int | None, precision: str, prefetch: int, readers: str
    ):
        _set_threads(threads)
        self.device = _device(device)
        self.precision = resolve_precision(precision)
        self.prefetch = _prefetch(prefetch)
        self.model, self.cfg, self.class_names = _load(model)
        self.model.to(self.device).eval()
        if self.device.type == "cuda":
            self.model.to(memory_format=torch.channels_last)
        self._pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix=readers) if self.prefetch else None


def _key(view: Mapping[str, Any]) -> tuple:
    """Views that one scorer call can take together: the same low-res and grid shapes and geometry."""
    return (tuple(view["lowres"].shape), tuple(view["cell_mask"].shape), view["geo"])


class ScorerWorker(_Stage):
    """Scorer stage: low-res view -> cell scores -> hard top-k cells.

    A batch's low-res views are read by ``prefetch`` threads while the model scores the views already read; views
    of the same shape and geometry (an archive scanned alike) are scored in one call of up to ``batch`` slides.

    Args:
        model: checkpoint dict or local checkpoint path.
        device: ``"cuda"``/``"cuda:N"``/``"cpu"``/None (None: CUDA when available).
        threads: torch CPU threads (None: leave as is).
        strict_mpp: refuse (an error row) a store at another mpp than the model's, instead of a warning.
        precision: ``"auto"``, ``"fp32"`` or ``"bf16"`` (:func:`resolve_precision`).
        prefetch: reader threads for the low-res views (0: read in the calling thread).
        batch: the most slides in one scorer call.
    """

    def __init__(
        self,
        model: Any,
        *,
        device: str | None = None,
        threads: int | None = None,
        strict_mpp: bool = False,
        precision: str = "auto",
        prefetch: int = 2,
        batch: int = 8,
    ):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1 (slides per scorer call), got {batch!r}")
        self.batch = batch
        self.strict_mpp = bool(strict_mpp)
        super().__init__(
            model, device=device, threads=threads, precision=precision, prefetch=prefetch, readers="lowres"
        )

    def score_one(self, slide_id: str, store_path: str) -> dict[str, Any]:
        """Score one slide; returns ``{"slide_id", "store", "status": "ok", "scores" float32 [N] (-inf = not a
        candidate), "grid_shape" (Gh, Gw), "cells" int64 [K] (chosen cells, increasing), "offsets" int64 [K, 2]
        (level-0 shifts of their reads, ``model.geometry.recentre``) or None, "slot_weights" float32 [K] or None,
        "seconds", "timing" {"read", "score"} (seconds of the low-res read and of this slide's share of the
        scorer call)}`` or ``{..., "status": "error", "error": "..."}``."""
        return self.score_batch([(slide_id, store_path)])[0]

    def score_batch(self, items: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """:meth:`score_one` for each ``(slide_id, store_path)``, in order."""
        out: list[dict[str, Any]] = []
        group: list[dict[str, Any]] = []
        for view in _in_order(self._read_view, list(items), self._pool):
            if group and (view.get("status") == "error" or len(group) >= self.batch or _key(view) != _key(group[0])):
                out.extend(self._score_group(group))
                group = []
            if view.get("status") == "error":
                out.append(view)
            else:
                group.append(view)
        if group:
            out.extend(self._score_group(group))
        return out

    def _read_view(self, slide_id: str, store_path: str) -> dict[str, Any]:
        """The CPU half: open the store, its geometry, low-res view and tissue cells (or an error item)."""
        from workers.patches import lowres_view, slide_geometry
        from workers.store import SlideStore

        t0 = time.perf_counter()
        try:
            store = SlideStore(store_path)
            self._check_mpp(slide_id, store)
            geo = slide_geometry(store, self.cfg)  # µm settings: this slide's pixels (no mpp: an error row)
            lowres, cell_mask = lowres_view(store, self.cfg, geo)  # uint8, converted per scorer tile
            return {
                "slide_id": slide_id,
                "store_path": store_path,
                "store": store,
                "geo": geo,
                "lowres": lowres,
                "cell_mask": cell_mask,
                "t_read": time.perf_counter() - t0,
            }
        except Exception as exc:
            return self._error(slide_id, store_path, exc, time.perf_counter() - t0)

    def _error(self, slide_id: str, store_path: str, exc: BaseException, seconds: float) -> dict[str, Any]:
        log.warning("scoring %s failed: %s", slide_id, _describe(exc))
        log.debug("%s", traceback.format_exc())
        return {
            "slide_id": slide_id,
            "store": str(store_path),
            "status": "error",
            "error": f"scorer: {_describe(exc)}",
            "seconds": seconds,
        }

    def _score_group(self, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The model half on views of one shape and geometry: one scorer call; where it fails, slide by slide (so
        only the slide that fails gets an error item)."""
        t0 = time.perf_counter()
        try:
            picks = self._pick(views)
        except Exception as exc:
            if len(views) > 1:
                return [item for v in views for item in self._score_group([v])]
            v = views[0]
            return [self._error(v["slide_id"], v["store_path"], exc, v["t_read"] + time.perf_counter() - t0)]
        share = (time.perf_counter() - t0) / len(views)
        out = []
        for v, (scores, cells, slot_w) in zip(views, picks):
            t1 = time.perf_counter()
            try:
                out.append(self._item(v, scores, cells, slot_w, share + time.perf_counter() - t1))
            except Exception as exc:
                out.append(self._error(v["slide_id"], v["store_path"], exc, v["t_read"] + share))
        return out

    def _pick(self, views: list[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Scores ``[N]``, chosen cells ``[K]`` and slot weights (or None) of each view, from one scorer call."""
        shape = tuple(views[0]["cell_mask"].shape)
        lowres = torch.stack([v["lowres"] for v in views]).to(self.device, non_blocking=True)
        mask = torch.stack([v["cell_mask"] for v in views]).to(self.device, non_blocking=True)
        gated = _gated(self.model)
        out = []
        with torch.inference_mode():
            with _autocast(self.device, self.precision):
                scores = self.model.score(lowres, mask, views[0]["geo"])
            scores = scores.float()
            if gated:  # the gate's candidates, best first; the classifier stage keeps the gate's choice
                from workers.slide_forward import gate_candidates

                for i in range(len(views)):
                    cells_t, _ = gate_candidates(self.model, scores[i : i + 1], shape)
                    out.append((cells_t.numpy().astype(np.int64), None))
            else:
                sel = self.model.select(self.model.local_maxima(scores, shape), training=False)
                primary = sel.primary.cpu().numpy().astype(np.int64)
                weights = None if sel.slot_weights is None else sel.slot_weights.float().cpu().numpy()
                out = [(primary[i], None if weights is None else weights[i]) for i in range(len(views))]
            scores_np = scores.cpu().numpy()
        return [(scores_np[i], cells, w) for i, (cells, w) in enumerate(out)]

    def _item(
        self, view: dict[str, Any], scores: np.ndarray, cells: np.ndarray, slot_w: np.ndarray | None, t_score: float
    ) -> dict[str, Any]:
        from workers.patches import PatchGrid, recentring

        store, geo = view["store"], view["geo"]
        shifts = recentring(self.cfg, geo, view["lowres"], view["cell_mask"])  # model.geometry.recentre
        if shifts is not None:
            grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
            shifts = shifts(grid.cell_xy_l0(torch.from_numpy(cells))).numpy()
        return {
            "slide_id": view["slide_id"],
            "store": str(view["store_path"]),
            "status": "ok",
            "scores": scores,
            "grid_shape": tuple(int(g) for g in view["cell_mask"].shape),
            "cells": cells,
            "offsets": shifts,
            "slot_weights": slot_w,
            "gated": _gated(self.model),
            "seconds": view["t_read"] + t_score,
            "timing": {"read": view["t_read"], "score": t_score},
            "device": str(self.device),
            "precision": self.precision,
            "store_handoff": store.handoff(),  # the classifier reads the store without opening it again
        }

    def _check_mpp(self, slide_id: str, store) -> None:
        """A store at another resolution than the model was trained at (> :data:`MPP_TOLERANCE` apart): a
        warning, or with ``strict_mpp`` an error (the slide's row then says why). Not for a model whose patch
        size and scorer resolution are both in µm (``GeometryConfig.physical``): it adapts to each slide's mpp."""
        trained = getattr(self.cfg, "mpp", None)
        mpp = store.meta.mpp[0] if store.meta.mpp else None
        if self.cfg.geometry.physical or trained is None or mpp is None or abs(mpp / trained - 1.0) <= MPP_TOLERANCE:
            return
        px = [k for k in ("patch_size", "scorer_downsample") if getattr(self.cfg.geometry, k) is not None]
        msg = (
            f"store mpp {mpp:g} differs from the model's training mpp {trained:g} by more than "
            f"{MPP_TOLERANCE:.0%} ({' and '.join(px)} {'are' if len(px) > 1 else 'is'} level-0 pixels); "
            f"re-ingest at --mpp {trained:g}"
        )
        if self.strict_mpp:
            raise ValueError(msg)
        log.warning("%s: %s", slide_id, msg)

    def ping(self) -> str:
        return str(self.device)


class ClassifierWorker(_Stage):
    """Patch reading + features + aggregation stage (the CPU unless told), and the heatmap.

    A batch's patches are read by ``prefetch`` threads (each slide's K reads touch only their chunks), then the
    feature network runs once over all the batch's patches.

    Args:
        model: checkpoint dict or local checkpoint path.
        heatmap_dir: where ``<slide_id>.png`` heatmaps go (None: no heatmaps).
        ngff_dir: where ``<slide_id>.zarr`` OME-Zarr overlays go (scores + chosen patches on the slide's NGFF
            frame, :mod:`workers.ngff_overlay`; None: none).
        model_name: recorded in each row's ``model`` field (the URI the driver was given).
        threads: torch CPU threads (None: leave as is).
        device: where the feature network and aggregator run (``"cpu"``, ``"cuda"``, ``"cuda:N"``; None: CUDA
            when available).
        precision: ``"auto"``, ``"fp32"`` or ``"bf16"`` (:func:`resolve_precision`).
        prefetch: reader threads for the patches (0: read in the calling thread).
    """

    def __init__(
        self,
        model: Any,
        *,
        heatmap_dir: str | Path | None = None,
        model_name: str = "",
        threads: int | None = None,
        ngff_dir: str | Path | None = None,
        device: str | None = "cpu",
        precision: str = "auto",
        prefetch: int = 2,
    ):
        super().__init__(
            model, device=device, threads=threads, precision=precision, prefetch=prefetch, readers="patches"
        )
        self.heatmap_dir = storage.normalize(heatmap_dir) if heatmap_dir is not None else None
        self.ngff_dir = storage.normalize(ngff_dir) if ngff_dir is not None else None
        self.model_name = str(model_name)
        self.last_timing: dict[str, float] = {}  # seconds of the last classify_batch: read, classify, output

    def _prepare(self, item: Mapping[str, Any]):
        from workers.patches import PatchGrid, PatchReader, slide_geometry

        store = _store_of(item)
        geo = slide_geometry(store, self.cfg)
        grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
        if tuple(grid.shape) != tuple(item["grid_shape"]):
            raise ValueError(f"grid shape {grid.shape} differs from the scorer's {tuple(item['grid_shape'])}")
        cells = torch.from_numpy(np.array(item["cells"], dtype=np.int64))
        # uint8 [K, 3, s, s] (s = geo.patch_input), only the chunks they touch
        shifts = item.get("offsets")  # model.geometry.recentre: the scorer stage's shifts of each read
        shifts = None if shifts is None else torch.from_numpy(np.asarray(shifts, dtype=np.int64).reshape(-1, 2))
        pix = PatchReader(store, grid, geo.patch_input).read(cells, offsets_l0=shifts)
        weights = item.get("slot_weights")
        if item.get("gated"):  # the cell gate's candidates: keep the gate's choice, in increasing cell order
            from workers.slide_forward import gate_keep

            if not _gated(self.model):
                raise ValueError("the scorer stage handed on cell-gate candidates; this model has no fitted gate")
            with torch.inference_mode(), _autocast(self.device, self.precision):
                keep, bag_w = gate_keep(
                    self.model, self.model.gate_encode(pix.to(self.device, torch.float32).div_(255.0))
                )
            idx = torch.nonzero(keep.cpu()).flatten()
            idx = idx[cells[idx].argsort()]
            cells, pix = cells[idx], pix[idx]
            shifts = None if shifts is None else shifts[idx]
            weights = None if bag_w is None else bag_w.float().cpu()[idx].numpy()
        positions = grid.cell_centres(cells)  # [K, 2]
        coords = grid.cell_xy_l0(cells).numpy()  # [K, 2] where each patch was read
        if shifts is not None:
            coords = coords + shifts.numpy()
        return store, grid, pix, positions, coords, cells.numpy(), weights

    def classify_batch(self, items: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Prediction rows for scorer outputs ``items`` (error items pass through as error rows)."""
        rows: list[dict[str, Any] | None] = [None] * len(items)
        ready = []  # (index, store, grid, pix, positions, coords, cells, weights, t_read)
        todo = []
        for i, item in enumerate(items):
            if item.get("status") != "ok":
                rows[i] = error_row(
                    item["slide_id"],
                    item["store"],
                    item.get("error", "unknown error"),
                    model=self.model_name,
                    seconds=item.get("seconds", 0.0),
                )
            else:
                todo.append((i, item))
        t_start = time.perf_counter()
        for i, item, prepared, t_read in _in_order(self._prepare_timed, todo, self._pool):
            if isinstance(prepared, Exception):
                log.warning("reading patches of %s failed: %s", item["slide_id"], _describe(prepared))
                rows[i] = error_row(
                    item["slide_id"],
                    item["store"],
                    f"patches: {_describe(prepared)}",
                    model=self.model_name,
                    seconds=item.get("seconds", 0.0) + t_read,
                )
            else:
                ready.append((i, *prepared, t_read))
        timing = {"read": time.perf_counter() - t_start, "classify": 0.0, "output": 0.0}
        if ready:
            t0 = time.perf_counter()
            probs = self._classify([r[3] for r in ready], [r[4] for r in ready], [r[7] for r in ready])
            timing["classify"] = time.perf_counter() - t0
            per_slide = timing["classify"] / len(ready)
            for (i, store, grid, _pix, _pos, coords, cells, _w, t_read), p in zip(ready, probs):
                item = items[i]
                t1 = time.perf_counter()
                try:
                    rows[i] = self._row(item, store, grid, coords, p, cells)
                    rows[i]["seconds"] = float(item.get("seconds", 0.0) + t_read + per_slide + time.perf_counter() - t1)
                except Exception as exc:
                    rows[i] = error_row(
                        item["slide_id"],
                        item["store"],
                        f"output: {_describe(exc)}",
                        model=self.model_name,
                        seconds=item.get("seconds", 0.0),
                    )
                timing["output"] += time.perf_counter() - t1
        self.last_timing = timing
        return rows  # type: ignore[return-value]

    def _prepare_timed(self, i: int, item: Mapping[str, Any]) -> tuple[int, Mapping[str, Any], Any, float]:
        """``(i, item, _prepare(item) or the exception it raised, seconds)``: runs in a reader thread."""
        t0 = time.perf_counter()
        try:
            return i, item, self._prepare(item), time.perf_counter() - t0
        except Exception as exc:
            return i, item, exc, time.perf_counter() - t0

    def _classify(
        self, pixes: list[torch.Tensor], positions: list[torch.Tensor], slot_weights: list[np.ndarray | None]
    ) -> np.ndarray:
        """Class probabilities ``[B, C]`` of B slides: one feature-network call over all ``B*K`` patches, one
        aggregator call over the B slides (one call per slide where their K differ: a cell gate's bags)."""
        if len({int(p.shape[0]) for p in pixes}) > 1:
            return np.concatenate([self._classify([p], [q], [w]) for p, q, w in zip(pixes, positions, slot_weights)])
        b, k = len(pixes), pixes[0].shape[0]
        patches = torch.stack(pixes).to(self.device, non_blocking=True).to(torch.float32).div_(255.0)  # [B, K, 3, p, p]
        pos = torch.stack(positions).to(self.device, torch.float32)
        weights = None
        if slot_weights[0] is not None:
            weights = torch.stack([torch.as_tensor(np.asarray(w, dtype=np.float32)) for w in slot_weights])
            weights = weights.to(self.device)
        with torch.inference_mode():
            with _autocast(self.device, self.precision):
                feats = self.model.embed(patches.flatten(0, 1)).view(b, k, -1)
                logits = self.model.aggregate(feats, pos, weights)
            return torch.softmax(logits.float(), dim=-1).cpu().numpy()

    def _row(
        self, item: Mapping[str, Any], store, grid, coords: np.ndarray, probs: np.ndarray, cells: np.ndarray
    ) -> dict[str, Any]:
        scores = np.asarray(item["scores"], dtype=np.float32)
        cells = np.asarray(cells, dtype=np.int64)
        cls = int(np.argmax(probs))
        p = grid.patch_size  # this slide's level-0 pixels (µm patches: per slide)
        patches = [
            {**Box(int(x), int(y), p, p).as_dict(), "score": float(scores[c])}  # level-0 boxes
            for (x, y), c in zip(coords, cells)
        ]
        heatmap = None
        drawn = self.ngff_dir is not None or self.heatmap_dir is not None
        sgrid = score_grid(scores, grid.shape) if drawn else None
        if self.ngff_dir is not None:
            from workers.ngff_overlay import write_score_overlay

            ranked = cells[np.argsort(-np.nan_to_num(scores[cells], nan=-np.inf), kind="stable")]
            write_score_overlay(
                storage.join(self.ngff_dir, f"{item['slide_id']}.zarr"),
                sgrid,
                ranked,
                stride=grid.stride,
                mpp=store.meta.mpp,
                name=str(item["slide_id"]),
            )
        if self.heatmap_dir is not None:
            img = slide_heatmap(store, sgrid, grid.stride, p, coords)
            heatmap = str(write_heatmap(storage.join(self.heatmap_dir, f"{item['slide_id']}.png"), img))
        return {
            "slide_id": item["slide_id"],
            "status": "ok",
            "error": None,
            "prediction": self.class_names[cls],
            "probability": float(probs[cls]),
            "probabilities": {name: float(v) for name, v in zip(self.class_names, probs)},
            "patches": patches,
            "heatmap": heatmap,
            "seconds": 0.0,
            "store": str(item["store"]),
            "model": self.model_name,
            "scored_at": _now(),
        }

    def ping(self) -> str:
        return str(self.device)
