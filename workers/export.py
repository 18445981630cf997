"""Prediction rows as GeoJSON for slide viewers (QuPath): the K patches the model chose, as boxes.

One ``foveate score`` row (:data:`workers.scoring.ROW_FIELDS`) becomes one GeoJSON ``FeatureCollection`` in
**level-0 pixel coordinates** (x to the right, y down, origin at the slide's top-left corner; the frames:
:mod:`workers.frames`) — exactly what QuPath's *File > Import objects from file* (or dropping the file on the
open slide) expects. Each chosen patch is a rectangular ``Polygon`` (closed ring, counter-clockwise by the
right-hand rule of RFC 7946 when y is read upwards) whose corners are the row's box ``x, y, x + w, y + h``
(a patch covers the pixels ``[x, x + w) x [y, y + h)``; a box of a grid that overhangs the slide is kept as is).
These are the *store's* level-0 pixels: they line up with the source slide QuPath opens unless ingest resampled
level 0 (``--mpp``), in which case they must be scaled by ``mpp_store / mpp_source``.

Properties follow QuPath's GeoJSON reader (``PathObjectTypeAdapters``, QuPath >= 0.4):

- ``objectType: "annotation"``. Annotations rather than detections because these are a handful of boxes a
  person should look at: QuPath lists annotations by name in the *Annotations* pane (click "rank 1" to jump
  to the patch), draws them in their class colour regardless of the "show detections" switch, shows their
  measurements in the annotation table, and keeps them as top-level objects. Detections are meant for
  thousands of small objects (cells, tiles): not listed by name, hidden with the detection layer, and drawn
  under annotations. ``isLocked: true`` keeps a click from moving a box away from what the model read.
- ``classification``: ``{"name": <prediction>, "color": [r, g, b]}`` (the slide's predicted class; one colour
  per class, :func:`class_colors`).
- ``name``: ``"rank <i>"``; rank 1 is the patch with the highest scorer score (the row lists its patches in
  grid order; ties keep that order).
- ``measurements`` (numbers only: QuPath reads them as doubles): ``rank``, ``score`` (the scorer's score of
  the patch's cell; left out when not finite), ``probability`` (of the predicted class).
- ``metadata`` (strings, shown by QuPath for objects that keep metadata): ``slide_id``, ``prediction``.
- The same five values as plain properties (``rank``, ``score``, ``prediction``, ``probability``,
  ``slide_id``) for other GeoJSON readers (geopandas, QGIS); QuPath ignores keys it does not know.
- ``id``: a UUID derived from the model, the scoring time, the slide and the rank (QuPath >= 0.4 keeps it as
  the object id): the same row always gives the same ids, another scoring gives new ones.

Not exported: the scorer heatmap as tiles. A predictions row holds the chosen patches and the *path* of the
heatmap PNG (a rendering with a colour map), not the per-cell scores, so cells above a threshold cannot be
recovered from it without re-running the scorer; this module does not invent them.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["OBJECT_TYPE", "PALETTE", "class_colors", "geojson_filename", "prediction_features"]

log = logging.getLogger(__name__)

OBJECT_TYPE = "annotation"
# colour-blind-safe qualitative palette (matplotlib's tab10), one colour per class in model order
PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
_ID_NAMESPACE = uuid.UUID("6f0c3a52-5d1e-4c57-9a3e-0f6f7a2b9c11")  # foveate's namespace for object ids
_SAFE_ID = re.compile(r"[^/\\\x00]+")


def geojson_filename(slide_id: Any) -> str:
    """``<slide_id>.geojson``, refusing a slide id that could name a file outside the output folder.

    Raises:
        ValueError: ``slide_id`` is empty, ``.`` or ``..``, or contains ``/``, ``\\`` or a NUL byte.
        TypeError: ``slide_id`` is not a string.
    """
    if not isinstance(slide_id, str):
        raise TypeError(f"slide_id must be a string, got {type(slide_id).__name__}")
    if slide_id in (".", "..") or not _SAFE_ID.fullmatch(slide_id):
        raise ValueError(
            f"slide_id {slide_id!r} cannot be a file name inside the output folder (expected a name without "
            "'/', '\\' or NUL that is not '.' or '..')"
        )
    return f"{slide_id}.geojson"


def class_colors(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[int]]:
    """One ``[r, g, b]`` per class name, in the order the classes first appear in the rows' ``probabilities``
    (the model's class order) and then as predictions; :data:`PALETTE` repeats after ten classes."""
    names: list[str] = []
    for r in rows:
        for name in [*(r.get("probabilities") or {}), r.get("prediction")]:
            if name is not None and str(name) not in names:
                names.append(str(name))
    return {n: list(PALETTE[i % len(PALETTE)]) for i, n in enumerate(names)}


def _finite(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _box(p: Mapping[str, Any]) -> tuple[int, int, int, int]:
    try:
        x, y, w, h = (int(p[k]) for k in ("x", "y", "w", "h"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a patch must have integer x, y, w, h (level-0 pixels), got {dict(p)!r}") from exc
    if w <= 0 or h <= 0:
        raise ValueError(f"a patch must have positive w and h, got {dict(p)!r}")
    return x, y, w, h


def _ranked(patches: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Highest score first; stable (grid order for ties), patches without a finite score last."""
    key = lambda p: -s if (s := _finite(p.get("score"))) is not None else math.inf
    return sorted(patches, key=key)


def prediction_features(row: Mapping[str, Any], colors: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """The GeoJSON ``FeatureCollection`` of one ``status == "ok"`` prediction row (see the module doc).

    Args:
        row: a row of a predictions file (``pipeline.predictions.read_predictions``) or of
            ``workers.scoring.ClassifierWorker.classify_batch``.
        colors: class name -> ``[r, g, b]`` (default :func:`class_colors` of this row alone; pass the colours
            of all rows so that a class has one colour across slides).

    Returns:
        A JSON-serialisable dict (``json.dump(..., allow_nan=False)`` works: no NaN or infinity).

    Raises:
        ValueError: the row is not an ``ok`` row, or a patch is not a box with positive size.
        TypeError: ``row`` is not a mapping.
    """
    if not isinstance(row, Mapping):
        raise TypeError(f"row must be a mapping (a predictions row), got {type(row).__name__}")
    slide_id = row.get("slide_id")
    if row.get("status") != "ok":
        raise ValueError(
            f"slide {slide_id!r}: only rows with status 'ok' have patches to export, got status {row.get('status')!r}"
        )
    prediction = None if row.get("prediction") is None else str(row["prediction"])
    probability = _finite(row.get("probability"))
    colors = class_colors([row]) if colors is None else colors
    classification = None
    if prediction is not None:
        classification = {"name": prediction, "color": [int(c) for c in colors.get(prediction, PALETTE[0])]}
    features = []
    for rank, p in enumerate(_ranked(list(row.get("patches") or [])), start=1):
        x, y, w, h = _box(p)
        score = _finite(p.get("score"))
        ring = [[x, y], [x + w, y], [x + w, y + h], [x, y + h], [x, y]]
        measurements = {"rank": rank, "score": score, "probability": probability}
        object_id = uuid.uuid5(_ID_NAMESPACE, f"{row.get('model')}|{row.get('scored_at')}|{slide_id}|{rank}")
        properties: dict[str, Any] = {
            "objectType": OBJECT_TYPE,
            "name": f"rank {rank}",
            "isLocked": True,
            "measurements": {k: v for k, v in measurements.items() if v is not None},
            "metadata": {"slide_id": str(slide_id), **({"prediction": prediction} if prediction else {})},
            "rank": rank,
            "score": score,
            "prediction": prediction,
            "probability": probability,
            "slide_id": str(slide_id),
        }
        if classification is not None:
            properties["classification"] = classification
        features.append(
            {
                "type": "Feature",
                "id": str(object_id),
                "geometry": {"type": "Polygon", "coordinates": [ring]},
                "properties": properties,
            }
        )
    return {"type": "FeatureCollection", "features": features}
