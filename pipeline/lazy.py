"""Slide stores and scoring heatmaps as lazy dask arrays, for notebooks, napari and ome-zarr-py users.

:func:`open_store` opens one slide store (``foveate ingest``'s ``<slide_id>.zarr``, a local path or an object-storage
URL such as ``s3://bucket/stores/slide.zarr``, through :mod:`workers.storage`) and returns a :class:`LazyImage`:
one :class:`dask.array.Array` per pyramid level plus what places it in the slide's frame (downsample, µm per
pixel and the NGFF coordinate transform of each level). :func:`open_heatmap` does the same for one scoring
heatmap (``foveate score``'s ``<out stem>_ngff/<slide_id>.zarr``: the scorer's cell scores on the slide's NGFF
frame, :mod:`workers.ngff_overlay`), :func:`open_heatmaps` for every heatmap of a predictions file.

Axes: every array is channel-first ``(c, y, x)`` as NGFF requires (``levels[l][:, y0:y1, x0:x1]`` is a window of
level ``l``); a slide level is ``uint8`` RGB, 3 channels; a heatmap level is ``float32`` scores, 1 channel (NaN
where a cell was no candidate). ``napari.imshow(img.levels, channel_axis=0)`` or ``numpy.moveaxis(a, 0, -1)``
give channel-last views. Nothing is read until a dask array is computed; each dask chunk is one zarr shard of the
store (one chunk when the store is not sharded), read with zarr, so a computed window equals what the store's own
reads (``workers.store.SlideStore.read_region``) return for it.

    from pipeline import open_store, open_heatmaps

    img = open_store("stores/slide-1a2b3c4d.zarr")
    thumb = img.levels[-1].compute()  # (3, h, w) uint8
    heat = open_heatmaps("preds/p.parquet")["slide-1a2b3c4d"]
    scores = heat.levels[0][0].compute()  # (Gh, Gw) float32, one pixel per grid cell (heat.downsamples[0] px)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers import storage

__all__ = ["LazyImage", "open_store", "open_heatmap", "open_heatmaps"]

log = logging.getLogger(__name__)

AXES = ("c", "y", "x")


@dataclass(frozen=True)
class LazyImage:
    """A multiscale NGFF image (a slide store or a scoring heatmap) as lazy dask arrays.

    Attributes:
        location: the store's normalised local path or URL.
        name: the NGFF ``multiscales`` name (a slide store's slide id; a heatmap's slide id).
        axes: the axis names of every level, ``("c", "y", "x")``.
        units: the unit of each axis: ``(None, "micrometer", "micrometer")`` when the store knows its mpp,
            ``(None, None, None)`` when its spatial unit is level-0 pixels.
        levels: one dask array per level, shape ``(c, y, x)`` (level 0 first, finest).
        downsamples: level-0 pixels of the slide per pixel of each level (a slide: ``1, 2, 4, ...``; a heatmap:
            the patch grid's stride), or None for a heatmap in µm whose slide's mpp was not given.
        mpp: ``(x, y)`` micrometres per pixel of each level, or None per level when the store has no mpp.
        scale: each level's NGFF ``scale`` transform, in axis order ``(c, y, x)`` (µm or level-0 pixels per pixel).
        translation: each level's NGFF ``translation``, in axis order (zeros when the store has none).
        labels: the NGFF label images by name, each one dask array ``(1, y, x)`` per level: ``"tissue"`` of a
            slide store (uint8, 1 = tissue), ``"patches"`` of a heatmap (uint16, the rank of each chosen cell, 1 =
            highest score, 0 elsewhere).
        meta: a slide store's foveate metadata (:class:`workers.store.StoreMeta`); None for a heatmap.
    """

    location: str
    name: str
    axes: tuple[str, ...]
    units: tuple[str | None, ...]
    levels: tuple[Any, ...]
    downsamples: tuple[float, ...] | None
    mpp: tuple[tuple[float, float] | None, ...]
    scale: tuple[tuple[float, ...], ...]
    translation: tuple[tuple[float, ...], ...]
    labels: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    meta: Any = None


def _location(value: Any, what: str, expected: str) -> str:
    """``value`` as a normalised location, or a TypeError/ValueError naming ``what`` and ``expected``."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{what} must be {expected} (a str or os.PathLike), got {type(value).__name__}: {value!r}")
    if not str(value):
        raise ValueError(f"{what} must be {expected}, got an empty string")
    return storage.normalize(value)


def _transforms(dataset: Mapping[str, Any], ndim: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(scale, translation)`` of one NGFF ``datasets`` entry (identity where a transform is absent)."""
    scale, translation = (1.0,) * ndim, (0.0,) * ndim
    for t in dataset.get("coordinateTransformations", []):
        if t.get("type") == "scale":
            scale = tuple(float(v) for v in t["scale"])
        elif t.get("type") == "translation":
            translation = tuple(float(v) for v in t["translation"])
    return scale, translation


def _dask(arr: Any, name: str) -> Any:
    """A dask array over zarr array ``arr``: one dask chunk per shard (per chunk when not sharded)."""
    import dask.array as da

    chunks = getattr(arr, "shards", None) or arr.chunks
    return da.from_array(arr, chunks=chunks, name=name, lock=False, asarray=False, fancy=False)


def _token(*parts: Any) -> str:
    from dask.base import tokenize

    return tokenize(*parts)


def _multiscale(group: Any, location: str) -> tuple[dict[str, Any], list[Any]]:
    """The first NGFF ``multiscales`` entry of ``group`` and its arrays (level 0 first)."""
    ms = (dict(group.attrs).get("ome") or {}).get("multiscales") or []
    if not ms or not ms[0].get("datasets"):
        raise ValueError(f"{location}: no NGFF multiscales image (no 'ome.multiscales' datasets in its zarr.json)")
    arrays = [group[d["path"]] for d in ms[0]["datasets"]]
    for d, a in zip(ms[0]["datasets"], arrays):
        if len(a.shape) != len(AXES):
            raise ValueError(f"{location}: level {d['path']!r} has shape {a.shape}, expected 3 axes {AXES}")
    return ms[0], arrays


def _units(ms: Mapping[str, Any]) -> tuple[str | None, ...]:
    axes = ms.get("axes") or [{"name": a} for a in AXES]
    names = tuple(a.get("name") for a in axes)
    if names != AXES:
        raise ValueError(f"NGFF axes {names}, expected {AXES}")
    return tuple(a.get("unit") for a in axes)


def _labels(group: Any, location: str, token: str) -> dict[str, tuple[Any, ...]]:
    """Every NGFF label image of ``group`` as dask arrays per level."""
    if "labels" not in group:
        return {}
    out = {}
    for name in (dict(group["labels"].attrs).get("ome") or {}).get("labels", []):
        ms, arrays = _multiscale(group[f"labels/{name}"], f"{location}/labels/{name}")
        out[name] = tuple(_dask(a, f"foveate-label-{name}-{d['path']}-{token}") for d, a in zip(ms["datasets"], arrays))
    return out


def open_store(path_or_url: str | os.PathLike) -> LazyImage:
    """One slide store as lazy dask arrays, per level, with its µm per pixel and NGFF transforms.

    The store is opened and verified once (``workers.store.SlideStore``: complete, every chunk object the
    completion marker lists present; one listing per level); nothing else is read until an array is computed.

    Args:
        path_or_url: a ``<slide_id>.zarr`` slide store: a local path or a URL (``s3://bucket/stores/x.zarr``;
            credentials and endpoint from the environment, as everywhere in foveate: ``docs/store-format.md``).

    Returns:
        A :class:`LazyImage`: ``levels[l]`` uint8 ``(3, h_l, w_l)``; ``downsamples`` the store's;
        ``mpp[l] = (mpp_x * ds_l, mpp_y * ds_l)``; ``scale``/``translation`` as the store's NGFF metadata gives
        them; ``labels["tissue"]``; ``meta`` its :class:`workers.store.StoreMeta`.

    Raises:
        TypeError: ``path_or_url`` is not a path or URL string.
        ValueError: no slide store there, or an incomplete, damaged or non-foveate one (the message says which).
    """
    from workers.store import SlideStore

    expected = "a slide store's path or URL (<slide_id>.zarr, as foveate ingest writes it)"
    loc = _location(path_or_url, "path_or_url", expected)
    try:
        store = SlideStore(loc)
    except FileNotFoundError as exc:
        raise ValueError(f"path_or_url must be {expected}; {loc!r} has none ({exc})") from None
    ms, arrays = _multiscale(store.group, loc)
    if len(arrays) != store.level_count:
        raise ValueError(
            f"{loc}: the NGFF multiscales lists {len(arrays)} level(s), the foveate metadata {store.level_count}"
        )
    token = _token(loc, store.meta.to_json(), [a.metadata.to_dict() for a in arrays])
    transforms = [_transforms(d, len(AXES)) for d in ms["datasets"]]
    mpp = store.meta.mpp
    return LazyImage(
        location=loc,
        name=str(ms.get("name") or store.slide_id),
        axes=AXES,
        units=_units(ms),
        levels=tuple(_dask(a, f"foveate-{store.slide_id}-{d['path']}-{token}") for d, a in zip(ms["datasets"], arrays)),
        downsamples=tuple(store.downsamples),
        mpp=tuple((mpp[0] * ds, mpp[1] * ds) if mpp else None for ds in store.downsamples),
        scale=tuple(s for s, _ in transforms),
        translation=tuple(t for _, t in transforms),
        labels=_labels(store.group, loc, token),
        meta=store.meta,
    )


def _slide_mpp(slide: Any) -> tuple[float, float] | None:
    """Level-0 ``(x, y)`` mpp of ``slide``: a :class:`LazyImage` of a slide store, a ``SlideStore`` or an
    ``(x, y)`` pair."""
    meta = getattr(slide, "meta", None)
    if meta is not None and hasattr(meta, "mpp"):
        return tuple(meta.mpp) if meta.mpp else None
    if isinstance(slide, tuple | list) and len(slide) == 2 and all(isinstance(v, int | float) for v in slide):
        return float(slide[0]), float(slide[1])
    raise TypeError(
        "slide must be the slide store's LazyImage (open_store), a workers.store.SlideStore or its level-0 (x, y) "
        f"mpp, got {type(slide).__name__}: {slide!r}"
    )


def open_heatmap(path_or_url: str | os.PathLike, *, slide: Any = None) -> LazyImage:
    """One scoring heatmap (``<out stem>_ngff/<slide_id>.zarr`` beside ``foveate score``'s predictions) as lazy
    dask arrays.

    Args:
        path_or_url: the heatmap's ``.zarr`` (local path or URL).
        slide: its slide, to give ``downsamples`` (level-0 pixels per heatmap pixel, the patch grid's stride)
            of a heatmap in µm: the slide store's :class:`LazyImage`, a ``workers.store.SlideStore``, or its
            level-0 ``(x, y)`` mpp. Not needed when the heatmap is in level-0 pixels (a slide without mpp).

    Returns:
        A :class:`LazyImage` of one level: float32 ``(1, Gh, Gw)`` cell scores (NaN: not a candidate), one pixel
        per grid cell; ``scale`` its NGFF scale (``stride * mpp`` µm, or ``stride`` level-0 pixels);
        ``labels["patches"]`` the chosen cells' ranks; ``meta`` None.

    Raises:
        TypeError: ``path_or_url`` is not a path or URL string, or ``slide`` none of the kinds above.
        ValueError: no heatmap there (no zarr group, or a slide store: open those with :func:`open_store`).
    """
    import zarr

    expected = "a scoring heatmap's path or URL (<out stem>_ngff/<slide_id>.zarr, as foveate score writes it)"
    loc = _location(path_or_url, "path_or_url", expected)
    slide_mpp = None if slide is None else _slide_mpp(slide)
    store = storage.open_store(loc, read_only=True)
    try:
        present = storage.exists(store, "zarr.json")
    except FileNotFoundError:
        present = False
    if not present:
        raise ValueError(f"path_or_url must be {expected}; {loc!r} has no zarr.json")
    try:
        group = zarr.open_group(store=store, mode="r", zarr_format=3)
    except Exception as exc:
        raise ValueError(f"{loc}: unreadable zarr metadata ({type(exc).__name__}: {exc})") from exc
    if "foveate" in dict(group.attrs):
        raise ValueError(f"path_or_url must be {expected}; {loc!r} is a slide store: open it with open_store")
    ms, arrays = _multiscale(group, loc)
    units = _units(ms)
    transforms = [_transforms(d, len(AXES)) for d in ms["datasets"]]
    scales = [s for s, _ in transforms]
    if units[2] == "micrometer":
        mpp = tuple((s[2], s[1]) for s in scales)
        downsamples = None if slide_mpp is None else tuple(s[2] / slide_mpp[0] for s in scales)
    else:  # level-0 pixels
        mpp = (None,) * len(scales)
        downsamples = tuple(s[2] for s in scales)
    token = _token(loc, dict(group.attrs), [a.metadata.to_dict() for a in arrays])
    return LazyImage(
        location=loc,
        name=str(ms.get("name") or storage.basename(loc).removesuffix(".zarr")),
        axes=AXES,
        units=units,
        levels=tuple(_dask(a, f"foveate-heatmap-{d['path']}-{token}") for d, a in zip(ms["datasets"], arrays)),
        downsamples=downsamples,
        mpp=mpp,
        scale=tuple(scales),
        translation=tuple(t for _, t in transforms),
        labels=_labels(group, loc, token),
        meta=None,
    )


def _store_mpp(location: str) -> tuple[float, float] | None:
    """A slide store's level-0 mpp from its metadata alone (one read of its zarr.json; None when unreadable)."""
    import zarr

    try:
        group = zarr.open_group(store=storage.open_store(location, read_only=True), mode="r", zarr_format=3)
        mpp = dict(group.attrs)["foveate"].get("mpp")
    except Exception as exc:  # a moved or removed store: the heatmap still opens, without downsamples
        log.debug("no mpp from %s: %s", location, exc)
        return None
    return (float(mpp[0]), float(mpp[1])) if mpp else None


def open_heatmaps(predictions: str | os.PathLike) -> dict[str, LazyImage]:
    """Every scoring heatmap of a predictions file, by slide id (:func:`open_heatmap` each).

    Args:
        predictions: ``foveate score``'s ``--out`` (``.parquet``, local path or URL): its heatmaps are the
            ``<out stem>_ngff/<slide_id>.zarr`` beside it, one per ``ok`` row (the slide store each row names
            gives the heatmap's ``downsamples``: its zarr.json is read once); or that ``_ngff`` folder itself
            (then ``downsamples`` is None for heatmaps in µm).

    Returns:
        ``{slide_id: LazyImage}`` in the file's row order (the folder's: by name). A row without a heatmap (scored
        with ``--no-heatmaps``, or an error row) has no entry.

    Raises:
        TypeError: ``predictions`` is not a path or URL string.
        ValueError: no predictions file or heatmap folder there, or ``ok`` rows but none of their heatmaps.
    """
    from pipeline.predictions import read_predictions

    expected = "a foveate score predictions file (.parquet) or its <out stem>_ngff folder, as a path or URL"
    loc = _location(predictions, "predictions", expected)
    if not loc.endswith(".parquet"):
        found = storage.children(loc, ".zarr")
        if not found:
            raise ValueError(f"predictions must be {expected}; {loc!r} holds no <slide_id>.zarr heatmap")
        return {name.removesuffix(".zarr"): open_heatmap(path) for name, path in found}
    if not storage.file_exists(loc):
        raise ValueError(f"predictions must be {expected}; there is no file {loc!r}")
    rows = [r for r in read_predictions(loc, option="predictions") if r.get("status") == "ok"]
    folder = storage.sibling(loc, storage.basename(loc).removesuffix(".parquet") + "_ngff")
    out: dict[str, LazyImage] = {}
    for row in rows:
        path = storage.join(folder, f"{row['slide_id']}.zarr")
        if not storage.file_exists(storage.join(path, "zarr.json")):
            continue
        out[row["slide_id"]] = open_heatmap(path, slide=_store_mpp(row["store"]) if row.get("store") else None)
    if rows and not out:
        raise ValueError(
            f"{loc}: {len(rows)} ok row(s) but no heatmap in {folder} (scored with --no-heatmaps?); expected "
            "<slide_id>.zarr there"
        )
    log.debug("%d heatmap(s) of %d ok row(s) in %s", len(out), len(rows), loc)
    return out
