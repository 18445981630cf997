"""The foveate slide store: one OME-NGFF 0.5 multiscale image per slide, Zarr v3 format.

Layout of ``STORE_DIR/<slide_id>.zarr``::

    zarr.json                 group; attributes {"ome": {"version": "0.5", "multiscales": [...],
                                                         "omero": {...RGB rendering, see ngff_omero...}},
                                                 "foveate": {...metadata, see StoreMeta...}}
    0/, 1/, ...               uint8 arrays (c=3, y, x), chunks (3, tile, tile) (ingest's zstd levels store
                              each chunk interleaved through zarr's standard ``transpose`` codec, order
                              (1, 2, 0), then zstd; JPEG levels use ``foveate.jpeg``); level l is level 0
                              downsampled by ``downsamples[l]`` (powers of two, or the source's own
                              pyramid factors for the JPEG passthrough)
    labels/tissue/0, 1, ...   uint8 (1, y, x) tissue mask (1 = tissue), an NGFF label image with one level per
                              image level (as ome-zarr-models requires); the mask is computed at the image's
                              smallest level (``StoreMeta.tissue_downsample``) and the other label levels are
                              its nearest-neighbour resamplings. ``SlideStore.tissue_mask`` reads that level.
                              (Older stores have a single label level ``0``; readers handle both.)
    foveate_complete.json     completion marker, written last; a store without it is incomplete. It records
                              each level's chunk inventory and the sha256 of every ``zarr.json`` (metadata),
                              so a store whose chunks or metadata changed afterwards is reported damaged.

Every chunk of a store written by this version ends with its crc32c (zarr's ``crc32c`` codec, last in each
array's chain; a shard's index carries one too), so flipped bits fail the read with a
:class:`workers.chunks.ChunkChecksumError` naming the store, array and chunk.

Coordinates: everything public is in level-0 pixels (the frames are defined once, in :mod:`workers.frames`).
Arrays are channel-first ``(c, y, x)`` as NGFF requires; :meth:`SlideStore.read_region` returns channel-last
``(h, w, 3)`` uint8 like a PIL image.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from workers import storage
from workers.chunks import add_checksum, read_checked
from workers.pyramid import downsample2x, pyramid_shapes  # (pyramid_shapes re-exported)

__all__ = [
    "COMPLETE_MARKER",
    "chunk_inventory",
    "integrity_checks",
    "metadata_digests",
    "read_every_chunk",
    "verify_store",
    "StoreMeta",
    "SlideStore",
    "is_complete",
    "pyramid_shapes",
    "ngff_multiscales",
    "ngff_omero",
    "register_codecs",
    "write_store_from_array",
    "create_image_level",
    "write_store_metadata",
    "mark_complete",
    "write_tissue_labels",
    "installed_version",
]

COMPLETE_MARKER = "foveate_complete.json"
TISSUE_LABEL = "tissue"


def register_codecs() -> None:
    """Register extra codecs (JPEG through imagecodecs) so stores written with them can be read.

    Idempotent; every reader calls it. Where foveate is installed, zarr also loads the codec through the
    ``zarr.codecs`` entry point (``pyproject.toml``), so external readers need no import; both register the same
    class under the same name.
    """
    try:  # the JPEG chunk codec lives beside the writer; importing registers it with zarr
        from workers import codecs as _codecs  # noqa: F401
    except ImportError:  # pragma: no cover - optional
        pass


@dataclass(frozen=True)
class StoreMeta:
    """Slide-level metadata stored under the group's ``foveate`` attribute."""

    slide_id: str
    source: str
    vendor: str
    level0_size: tuple[int, int]  # (width, height) of level 0 *in the store* (after any --mpp resampling)
    tile_size: int
    downsamples: tuple[float, ...]
    mpp: tuple[float, float] | None  # (x, y) microns per pixel of store level 0; None if unknown
    source_mpp: tuple[float, float] | None = None
    fingerprint: str = ""
    codec: str = "zstd"
    foveate_version: str = ""
    tissue_downsample: float | None = None
    tissue_fraction: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["level0_size"] = list(self.level0_size)
        d["downsamples"] = list(self.downsamples)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoreMeta:
        d = dict(d)
        d["level0_size"] = tuple(d["level0_size"])
        d["downsamples"] = tuple(float(x) for x in d["downsamples"])
        for k in ("mpp", "source_mpp"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        known = {f for f in cls.__dataclass_fields__}
        extra = dict(d.pop("extra", {}) or {})
        extra.update({k: v for k, v in d.items() if k not in known})
        return cls(**{k: v for k, v in d.items() if k in known}, extra=extra)


def ngff_multiscales(
    name: str,
    downsamples: list[float] | tuple[float, ...],
    mpp: tuple[float, float] | None,
    *,
    channel_axis: bool = True,
) -> list[dict[str, Any]]:
    """NGFF 0.5 ``multiscales`` for arrays ``"0", "1", ...`` with axes (c, y, x)."""
    mx, my = mpp if mpp is not None else (1.0, 1.0)
    unit = {"unit": "micrometer"} if mpp is not None else {}
    axes = ([{"name": "c", "type": "channel"}] if channel_axis else []) + [
        {"name": "y", "type": "space", **unit},
        {"name": "x", "type": "space", **unit},
    ]
    datasets = []
    for i, ds in enumerate(downsamples):
        scale = ([1.0] if channel_axis else []) + [float(my * ds), float(mx * ds)]
        datasets.append({"path": str(i), "coordinateTransformations": [{"type": "scale", "scale": scale}]})
    return [{"name": name, "axes": axes, "datasets": datasets}]


_RGB_CHANNELS = (("red", "FF0000"), ("green", "00FF00"), ("blue", "0000FF"))


def ngff_omero() -> dict[str, Any]:
    """NGFF ``omero`` rendering block of a store image: channels 0, 1, 2 shown as red, green and blue over the
    full uint8 range, all active, in colour (``rdefs.model: "color"``), so that viewers (napari through
    ome-zarr-py, OMERO, vizarr) show the slide in colour instead of three grey channels.

    In NGFF 0.5 it sits in the ``ome`` attributes beside ``multiscales`` (a transitional key of the
    specification; ome-zarr-models' v05 ``Image`` accepts it, ome-zarr-py reads channel names from ``label``,
    colours, visibility from ``active`` and contrast limits from ``window`` start/end)."""
    return {
        "channels": [
            {
                "label": name,
                "color": color,
                "active": True,
                "coefficient": 1,
                "family": "linear",
                "inverted": False,
                "window": {"start": 0, "end": 255, "min": 0, "max": 255},
            }
            for name, color in _RGB_CHANNELS
        ],
        "rdefs": {"model": "color"},
    }


def _as_store(where: Any) -> Any:
    """A zarr store: ``where`` itself when it is one, else the store at the path/URL ``where``."""
    if hasattr(where, "list_prefix") and hasattr(where, "set"):
        return where
    return storage.open_store(where, read_only=True)


def _store_name(store: Any) -> str:
    root = getattr(store, "root", None)
    if root is not None:
        return str(root)
    fs, path = getattr(store, "fs", None), getattr(store, "path", "")
    protocol = getattr(fs, "protocol", "")
    protocol = protocol[0] if isinstance(protocol, tuple | list) else protocol
    return f"{protocol}://{path}" if protocol else str(path)


def is_complete(path: str | Path | Any) -> bool:
    """True when the store at ``path`` (a path, URL or zarr store) carries its completion marker (written last
    by ingest)."""
    try:
        return storage.exists(_as_store(path), COMPLETE_MARKER)
    except FileNotFoundError:
        return False


class SlideStore:
    """Read access to one slide store (the contract every stage after ingest uses).

    Args:
        path: ``.../<slide_id>.zarr``: a local path or an object-storage URL (:mod:`workers.storage`).
        require_complete: raise ``ValueError`` for a store without its completion marker.

    ``location`` is the normalised path or URL (a string); ``path`` is a :class:`~pathlib.Path` for a local
    store and the URL string otherwise. ``verified``: whether this open proved the store complete and whole
    (``require_complete``). Opening costs one listing per level; another process that needs the same store again
    rebuilds it from :meth:`handoff` with :meth:`from_handoff` instead (no request at all).
    """

    def __init__(self, path: str | Path, *, require_complete: bool = True):
        self.location = storage.normalize(path)
        self.path: Path | str = storage.local_path(self.location) or self.location
        self.store = storage.open_store(self.location, read_only=True)
        if not storage.exists(self.store, "zarr.json"):
            raise FileNotFoundError(f"no slide store at {self.path}")
        if require_complete and not is_complete(self.store):
            raise ValueError(f"slide store {self.path} is incomplete (no {COMPLETE_MARKER}); re-run ingest")
        register_codecs()
        try:
            group = zarr.open_group(store=self.store, mode="r", zarr_format=3)
        except Exception as exc:
            group, open_error = None, exc
        if require_complete:
            problems = verify_store(self.store, group=group)  # without a group it names the metadata error
            if problems:
                raise ValueError(
                    f"slide store {self.path} is damaged: {'; '.join(problems)}; re-ingest it (foveate ingest "
                    "--overwrite) or check it with foveate verify"
                )
        if group is None:
            raise ValueError(
                f"slide store {self.path}: unreadable metadata ({type(open_error).__name__}: {open_error})"
            ) from open_error
        self.group = group
        attrs = dict(self.group.attrs)
        if "foveate" not in attrs:
            raise ValueError(f"{self.path} is not a foveate store (no 'foveate' attribute)")
        self.meta = StoreMeta.from_json(attrs["foveate"])
        self.levels = [self.group[str(i)] for i in range(len(self.meta.downsamples))]
        self.verified = bool(require_complete)

    # ------------------------------------------------------------------ hand-off
    def handoff(self) -> dict[str, Any]:
        """What another process needs to read this store without opening and verifying it again: a small
        JSON-able dict (``location``, ``verified``, the group's and each image level's zarr metadata; a few KB).

        The scoring stages use it: the scorer opens and verifies each store once and hands this on with the
        slide, and the classifier rebuilds the store with :meth:`from_handoff` (no listing, no metadata read).
        """
        return {
            "location": self.location,
            "verified": self.verified,
            "group": self.group.metadata.to_dict(),
            "levels": [a.metadata.to_dict() for a in self.levels],
        }

    @classmethod
    def from_handoff(cls, handoff: Mapping[str, Any]) -> SlideStore:
        """The store that :meth:`handoff` described, rebuilt from its metadata without any request to the store
        (no existence check, completion check, listing or metadata read: the pixels are read when asked for).

        Args:
            handoff: the dict :meth:`handoff` returned (in this or another process).

        Raises:
            TypeError: ``handoff`` is not a mapping.
            ValueError: it lacks a key :meth:`handoff` writes, or its metadata is not a foveate store's.
        """
        from zarr.core.array import AsyncArray
        from zarr.core.group import AsyncGroup
        from zarr.storage import StorePath

        if not isinstance(handoff, Mapping):
            raise TypeError(f"handoff must be the dict SlideStore.handoff() returns, got {type(handoff).__name__}")
        missing = [k for k in ("location", "verified", "group", "levels") if k not in handoff]
        if missing:
            raise ValueError(
                f"handoff lacks {', '.join(missing)}; expected the dict SlideStore.handoff() returns (keys "
                f"location, verified, group, levels), got keys {sorted(handoff)}"
            )
        out = cls.__new__(cls)
        out.location = storage.normalize(handoff["location"])
        out.path = storage.local_path(out.location) or out.location
        out.store = storage.open_store(out.location, read_only=True)
        register_codecs()
        try:
            group = zarr.Group(AsyncGroup.from_dict(StorePath(out.store, ""), dict(handoff["group"])))
            levels = [
                zarr.Array(AsyncArray.from_dict(StorePath(out.store, str(i)), dict(d)))
                for i, d in enumerate(handoff["levels"])
            ]
            meta = StoreMeta.from_json(dict(group.attrs)["foveate"])
        except Exception as exc:
            raise ValueError(
                f"handoff of {out.path}: not the metadata of a foveate store ({type(exc).__name__}: {exc})"
            ) from exc
        if len(levels) != len(meta.downsamples):
            raise ValueError(
                f"handoff of {out.path}: {len(levels)} level(s) of metadata for a store of "
                f"{len(meta.downsamples)} level(s)"
            )
        out.group, out.meta, out.levels = group, meta, levels
        out.verified = bool(handoff["verified"])
        return out

    # ------------------------------------------------------------------ geometry
    @property
    def slide_id(self) -> str:
        return self.meta.slide_id

    @property
    def level_count(self) -> int:
        return len(self.levels)

    @property
    def downsamples(self) -> tuple[float, ...]:
        return self.meta.downsamples

    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 (width, height)."""
        return self.meta.level0_size

    @property
    def level_dimensions(self) -> list[tuple[int, int]]:
        return [(int(a.shape[2]), int(a.shape[1])) for a in self.levels]

    @property
    def tile_size(self) -> int:
        return self.meta.tile_size

    def best_level_for_downsample(self, downsample: float) -> int:
        """Largest level whose downsample is <= ``downsample`` (OpenSlide's rule)."""
        best = 0
        for i, ds in enumerate(self.downsamples):
            if ds <= downsample + 1e-9:
                best = i
        return best

    # ------------------------------------------------------------------ pixels
    def read_level(self, level: int) -> np.ndarray:
        """Whole level as (h, w, 3) uint8. Only for low-resolution levels."""
        arr = self.levels[level]
        block = read_checked(arr, (slice(None),) * 3, str(self.path))
        return np.ascontiguousarray(np.moveaxis(block, 0, -1))

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """Like OpenSlide: ``location`` (x, y) in level-0 pixels, ``size`` (w, h) in ``level`` pixels.

        Returns (h, w, 3) uint8; pixels outside the slide are white. Reads only the chunks touched.
        """
        if not (0 <= level < self.level_count):
            raise ValueError(f"level must be in [0, {self.level_count}), got {level}")
        w, h = int(size[0]), int(size[1])
        if w < 0 or h < 0:
            raise ValueError(f"size must be non-negative (width, height), got {size!r}")
        ds = self.downsamples[level]
        x_l = int(math.floor(location[0] / ds))
        y_l = int(math.floor(location[1] / ds))
        arr = self.levels[level]
        H, W = int(arr.shape[1]), int(arr.shape[2])
        out = np.full((h, w, 3), 255, dtype=np.uint8)
        x0, y0 = max(x_l, 0), max(y_l, 0)
        x1, y1 = min(x_l + w, W), min(y_l + h, H)
        if x1 > x0 and y1 > y0:
            block = read_checked(arr, (slice(None), slice(y0, y1), slice(x0, x1)), str(self.path))
            out[y0 - y_l : y1 - y_l, x0 - x_l : x1 - x_l] = np.moveaxis(block, 0, -1)
        return out

    # ------------------------------------------------------------------ tissue
    def tissue_mask(self) -> tuple[np.ndarray, float]:
        """(mask (h, w) bool, downsample of the mask relative to level 0), at the resolution it was computed."""
        tg = self.group[f"labels/{TISSUE_LABEL}"]
        paths = [d["path"] for d in dict(tg.attrs).get("ome", {}).get("multiscales", [{}])[0].get("datasets", [])] or [
            "0"
        ]
        lab = tg[paths[-1]]
        mask = read_checked(lab, (slice(None),) * lab.ndim, str(self.path))
        if mask.ndim == 3:
            mask = mask[0]
        ds = self.meta.tissue_downsample
        if ds is None:
            ds = self.dimensions[0] / mask.shape[1]
        return mask.astype(bool), float(ds)

    def __repr__(self) -> str:
        return f"SlideStore({str(self.path)!r}, levels={self.level_dimensions})"


def installed_version() -> str:
    """The installed ``foveate`` distribution's version (what a store records when its writer was not given
    one; the commands pass ``pipeline.__version__`` down)."""
    from importlib import metadata

    try:
        return metadata.version("foveate")
    except metadata.PackageNotFoundError:  # a source tree (ray job --working-dir)
        return "0.1.0"


def write_store_metadata(
    group: Any,
    *,
    slide_id: str,
    source: str,
    vendor: str,
    level_shapes: list[tuple[int, int]],
    downsamples: list[float] | tuple[float, ...],
    mpp: tuple[float, float] | None,
    tile_size: int,
    codec: str,
    version: str,
    source_mpp: tuple[float, float] | None = None,
    fingerprint: str = "",
    extra: dict[str, Any] | None = None,
    shard_labels: bool = True,
) -> StoreMeta:
    """Finish a store whose image levels are written: the tissue mask (from the smallest level) as NGFF labels,
    and the NGFF ``multiscales``, the ``omero`` RGB rendering (:func:`ngff_omero`) and foveate metadata as group
    attributes. Returns the metadata (then
    :func:`mark_complete`)."""
    from workers.tissue import tissue_mask

    last = len(level_shapes) - 1
    low = np.asarray(group[str(last)][...])
    mask = tissue_mask(np.ascontiguousarray(np.moveaxis(low, 0, -1)))
    write_tissue_labels(
        group, mask, [tuple(x) for x in level_shapes], list(downsamples), mpp, shard_chunks=8 if shard_labels else None
    )
    meta = StoreMeta(
        slide_id=slide_id,
        source=source,
        vendor=vendor,
        level0_size=tuple(level_shapes[0]),
        tile_size=tile_size,
        downsamples=tuple(float(d) for d in downsamples),
        mpp=mpp,
        source_mpp=source_mpp,
        fingerprint=fingerprint,
        codec=codec,
        foveate_version=version,
        tissue_downsample=float(downsamples[last]),
        tissue_fraction=float(mask.mean()),
        extra=dict(extra or {}),
    )
    group.attrs.update(
        {
            "ome": {
                "version": "0.5",
                "multiscales": ngff_multiscales(slide_id, list(downsamples), mpp),
                "omero": ngff_omero(),
            },
            "foveate": meta.to_json(),
        }
    )
    return meta


def chunk_inventory(path: str | Path | Any, levels: int) -> dict[str, dict[str, Any]]:
    """What each image level of the store at ``path`` (path, URL or zarr store) holds: ``{"<level>": {"chunks":
    n, "digest": sha256 of the sorted chunk keys}}`` — the chunk objects, or the shard objects of a sharded
    level (keys relative to the level; ``zarr.json`` excluded). One listing per level."""
    import hashlib

    store = _as_store(path)
    out = {}
    for lv in range(int(levels)):
        prefix = f"{lv}/"
        keys = sorted(k[len(prefix) :] for k in storage.list_keys(store, prefix) if k != f"{lv}/zarr.json")
        out[str(lv)] = {"chunks": len(keys), "digest": hashlib.sha256("\n".join(keys).encode()).hexdigest()}
    return out


def _metadata_keys(levels: int) -> list[str]:
    """The ``zarr.json`` keys of a store of ``levels`` image levels: the group, each image level, the labels group,
    the tissue label image and its levels."""
    tissue = f"labels/{TISSUE_LABEL}"
    return [
        "zarr.json",
        *(f"{lv}/zarr.json" for lv in range(int(levels))),
        "labels/zarr.json",
        f"{tissue}/zarr.json",
        *(f"{tissue}/{lv}/zarr.json" for lv in range(int(levels))),
    ]


def metadata_digests(path: str | Path | Any, levels: int) -> dict[str, str]:
    """``{key: sha256 hex}`` of every ``zarr.json`` of the store at ``path`` (path, URL or zarr store) that exists
    (:func:`_metadata_keys`; the reads run concurrently)."""
    import asyncio
    import hashlib

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    store = _as_store(path)
    keys = _metadata_keys(levels)

    async def _all() -> list[Any]:
        return await asyncio.gather(*(store.get(k, prototype=default_buffer_prototype()) for k in keys))

    return {k: hashlib.sha256(b.to_bytes()).hexdigest() for k, b in zip(keys, sync(_all())) if b is not None}


def mark_complete(path: str | Path | Any, slide_id: str, levels: int, *, durable: bool = True, **fields: Any) -> None:
    """Write the completion marker (last: a store with it is complete). It records the chunk inventory of
    every level (:func:`chunk_inventory`) and the sha256 of every ``zarr.json`` (:func:`metadata_digests`), so
    :func:`verify_store` can prove the store whole and its metadata unchanged. ``path``: a path, URL or writable
    zarr store.

    The marker is one atomic key write (a renamed temporary file on a local disk, one PUT on object storage).
    On a local disk everything written before it (metadata, tissue mask; the image chunks were synced by the
    tiler) is made durable first, and the marker itself after (``syncfs``; not when ``durable`` is false)."""
    store = path if hasattr(path, "set") else storage.open_store(path)
    body = {
        "slide_id": slide_id,
        "levels": int(levels),
        **fields,
        "inventory": chunk_inventory(store, levels),
        "metadata": metadata_digests(store, levels),
    }
    if durable:
        storage.sync_local(store)
    storage.put_bytes(store, {COMPLETE_MARKER: json.dumps(body, indent=1).encode()})
    if durable:
        storage.sync_local(store)


def _store_arrays(group: Any, levels: int) -> list[Any]:
    """The image levels and the tissue label levels of a store's group (those that exist)."""
    out = [group[str(lv)] for lv in range(int(levels))]
    try:
        tg = group[f"labels/{TISSUE_LABEL}"]
        out += [a for _, a in sorted(tg.arrays(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1)]
    except KeyError:
        pass
    return out


def integrity_checks(path: str | Path | Any) -> dict[str, bool]:
    """Which integrity checks the store at ``path`` supports: ``inventory`` (its marker lists each level's chunk
    objects), ``metadata`` (its marker records the sha256 of each ``zarr.json``) and ``checksums`` (every image
    and label array ends its codec chain with ``crc32c``). Stores written before these existed lack them: they
    still open, and those checks are simply not possible. All False when the store is unreadable."""
    out = {"inventory": False, "metadata": False, "checksums": False}
    try:
        store = _as_store(path)
        body = json.loads(storage.get_bytes(store, COMPLETE_MARKER) or b"{}")
        out["inventory"], out["metadata"] = "inventory" in body, "metadata" in body
        register_codecs()
        group = zarr.open_group(store=store, mode="r", zarr_format=3)
        levels = int(body.get("levels") or len(dict(group.attrs)["foveate"]["downsamples"]))
        out["checksums"] = all(_array_has_checksum(a) for a in _store_arrays(group, levels))
    except Exception:
        pass
    return out


def _array_has_checksum(arr: Any) -> bool:
    from zarr.codecs import Crc32cCodec, ShardingCodec

    codecs = tuple(arr.metadata.codecs)
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        codecs = tuple(codecs[0].codecs)
    return bool(codecs) and isinstance(codecs[-1], Crc32cCodec)


def read_every_chunk(group: Any, levels: int, where: str, *, limit: int = 20) -> list[str]:
    """Read and decode every stored chunk of every image and label array (one shard, or one chunk, at a time):
    the problems found (at most ``limit``), each naming the array and the chunk (``foveate verify --deep``)."""
    problems: list[str] = []
    for arr in _store_arrays(group, levels):
        outer = tuple(int(v) for v in (getattr(arr, "shards", None) or arr.chunks))
        grid = [range(0, int(n), c) for n, c in zip(arr.shape, outer)]
        for starts in itertools.product(*grid):
            sel = tuple(slice(o, min(o + c, int(n))) for o, c, n in zip(starts, outer, arr.shape))
            try:
                read_checked(arr, sel, where)
            except Exception as exc:
                text = str(exc) if where in str(exc) else f"{where}: array {arr.path}, block at {list(starts)}: {exc}"
                problems.append(f"{type(exc).__name__}: {text[:300]}")
                if len(problems) >= limit:
                    return [*problems, "(further chunks not read)"]
    return problems


def verify_store(path: str | Path | Any, *, group: Any = None, deep: bool = False) -> list[str]:
    """Problems of the store at ``path`` (a path, URL or zarr store; ``[]``: whole): no or unreadable
    completion marker, unreadable metadata, a ``zarr.json`` whose sha256 differs from the one the marker records
    (rewritten or damaged metadata), or a level whose chunk (shard) objects differ from the marker's inventory
    (missing or extra). A marker without an inventory or digests (stores written before they existed) is not a
    problem (:func:`integrity_checks` says which checks were possible). ``group``: the store's zarr group when the
    caller has already opened it (not opened again). ``deep``: also read every chunk of every array
    (:func:`read_every_chunk`; a chunk whose crc32c does not match, or that does not decode, is a problem)."""
    try:
        store = _as_store(path)
        if not storage.exists(store, "zarr.json"):
            return [f"no slide store at {path if isinstance(path, str | Path) else _store_name(store)}"]
        raw = storage.get_bytes(store, COMPLETE_MARKER)
    except FileNotFoundError:
        return [f"no slide store at {path}"]
    if raw is None:
        return [f"incomplete: no {COMPLETE_MARKER} (ingest did not finish; re-run ingest)"]
    try:
        body = json.loads(raw)
        levels = int(body["levels"])
    except Exception as exc:
        return [f"unreadable {COMPLETE_MARKER}: {type(exc).__name__}: {exc}"]
    problems = []
    try:
        register_codecs()
        if group is None:
            group = zarr.open_group(store=store, mode="r", zarr_format=3)
        attrs = dict(group.attrs)
        if "foveate" not in attrs:
            problems.append("not a foveate store (no 'foveate' attribute in zarr.json)")
    except Exception as exc:
        group = None
        problems.append(f"unreadable metadata: {type(exc).__name__}: {str(exc)[:200]}")
    digests = body.get("metadata")
    if isinstance(digests, dict):
        found_digests = metadata_digests(store, levels)
        for key in sorted(digests):
            if key not in found_digests:
                problems.append(f"{key} is missing (the completion marker records its digest)")
            elif found_digests[key] != digests[key]:
                problems.append(f"{key} changed after ingest (its sha256 differs from the completion marker's)")
    expected = body.get("inventory")
    if expected is not None:
        found = chunk_inventory(store, levels)
        for lv in sorted(expected, key=int):
            e, f = expected[lv], found.get(lv, {"chunks": 0, "digest": ""})
            if e != f:
                problems.append(
                    f"level {lv}: {f['chunks']} chunk object(s) in the store, the completion marker lists "
                    f"{e['chunks']}" + (" (same count, other keys)" if f["chunks"] == e["chunks"] else "")
                )
    if deep and group is not None:
        try:
            problems += read_every_chunk(group, levels, _store_name(store))
        except Exception as exc:  # metadata that opens but does not describe readable arrays
            problems.append(f"arrays unreadable: {type(exc).__name__}: {str(exc)[:200]}")
    return problems


def create_image_level(group: Any, level: int, size: tuple[int, int], tile_size: int) -> Any:
    """Create image level ``level`` of ``size = (width, height)`` in a store's zarr ``group`` as
    :func:`write_store_from_array` writes it: uint8 ``(c, y, x)``, ``tile_size`` chunks, zstd + crc32c, white fill."""
    w, h = (int(v) for v in size)
    return group.create_array(
        str(level),
        shape=(3, h, w),
        chunks=(3, tile_size, tile_size),
        dtype="uint8",
        compressors=[zarr.codecs.ZstdCodec(level=3), zarr.codecs.Crc32cCodec()],
        fill_value=255,
        dimension_names=("c", "y", "x"),
    )


def write_store_from_array(
    path: str | Path,
    rgb: np.ndarray,
    *,
    slide_id: str | None = None,
    mpp: tuple[float, float] | None = (0.5, 0.5),
    tile_size: int = 256,
    min_size: int = 1024,
    source: str = "<array>",
    extra: dict[str, Any] | None = None,
    version: str | None = None,
) -> SlideStore:
    """Write an in-memory (h, w, 3) uint8 image as a complete store (zstd, power-of-two pyramid).

    For tests and small synthetic data; archives go through ``foveate ingest``. ``path``: a local path or a URL.
    """
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"rgb must be (h, w, 3) uint8, got {rgb.shape} {rgb.dtype}")
    loc = storage.normalize(path)
    slide_id = slide_id or storage.basename(loc).removesuffix(".zarr")
    h, w = rgb.shape[:2]
    shapes = pyramid_shapes((w, h), min_size=min_size)
    downsamples = tuple(float(ds) for ds, _ in shapes)
    storage.remove_tree(loc)
    store = storage.open_store(loc)
    group = zarr.open_group(store=store, mode="w", zarr_format=3)
    level = np.ascontiguousarray(rgb)
    for i, (_, (lw, lh)) in enumerate(shapes):
        if i:
            level = downsample2x(level)[:lh, :lw]
        create_image_level(group, i, (lw, lh), tile_size)[...] = np.moveaxis(level, -1, 0)
    write_store_metadata(
        group,
        slide_id=slide_id,
        source=source,
        vendor="array",
        level_shapes=[s for _, s in shapes],
        downsamples=downsamples,
        mpp=mpp,
        source_mpp=mpp,
        tile_size=tile_size,
        codec="zstd",
        version=version or installed_version(),
        extra=extra,
    )
    mark_complete(store, slide_id, len(downsamples))
    return SlideStore(loc)


def _nearest_block(mask: np.ndarray, ys: np.ndarray, xs: np.ndarray, y0: int, x0: int, factor: float) -> np.ndarray:
    """``mask[np.ix_(ys, xs)]`` for the nearest-neighbour indices of :func:`write_tissue_labels`; with an integer
    upsampling ``factor`` (``ys == (y0 + arange) // factor``) by repeating the covered mask cells instead of a
    fancy-indexed gather (several times faster for a 1024^2 label chunk)."""
    f = int(factor)
    if f >= 1 and f == factor and ys[0] == y0 // f and xs[0] == x0 // f:
        sub = mask[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]
        oy, ox = y0 - ys[0] * f, x0 - xs[0] * f
        rep = np.repeat(np.repeat(sub, f, axis=0), f, axis=1)[oy : oy + len(ys), ox : ox + len(xs)]
        if rep.shape == (len(ys), len(xs)):
            return rep
    return mask[np.ix_(ys, xs)]


def write_tissue_labels(
    group: Any,
    mask: np.ndarray,
    level_shapes: list[tuple[int, int]],
    downsamples: list[float] | tuple[float, ...],
    mpp: tuple[float, float] | None,
    *,
    chunk: int = 1024,
    shard_chunks: int | None = 8,
) -> None:
    """Write ``labels/tissue`` as an NGFF label image with one level per image level.

    Args:
        group: the store's zarr group (writable).
        mask: (h, w) bool mask computed at the image's *last* level (``level_shapes[-1]``).
        level_shapes: (width, height) of every image level; downsamples: their factors.
        mpp: level-0 microns per pixel (for the NGFF scales) or None.

    Label level ``j`` is the nearest-neighbour resampling of ``mask`` to level ``j``'s shape. Chunks that
    are all background are not written; all-tissue chunks share one encoded byte string, so even a
    full-resolution label level costs little. With ``shard_chunks`` each level is sharded (zarr v3 sharding,
    shards of ``shard_chunks x shard_chunks`` chunks, cut to the level): a few objects per level instead of
    one per chunk (None: one object per chunk).
    """
    import imagecodecs

    from workers.chunks import encode_shard

    mask = np.asarray(mask, dtype=np.uint8)
    mh, mw = mask.shape
    if (mw, mh) != tuple(level_shapes[-1]):
        raise ValueError(
            f"mask shape {(mh, mw)} must be the last level's (height, width) {tuple(level_shapes[-1])[::-1]}"
        )
    if "labels" in group:
        del group["labels"]
    labels = group.create_group("labels")
    labels.attrs["ome"] = {"version": "0.5", "labels": [TISSUE_LABEL]}
    tg = labels.create_group(TISSUE_LABEL)
    dm = float(downsamples[-1])
    ones_cache: dict[tuple[int, int], bytes] = {}
    for j, ((w, h), dj) in enumerate(zip(level_shapes, downsamples)):
        ch = min(chunk, h), min(chunk, w)
        # chunks per shard along y and x (the whole level when it is smaller than one shard)
        ns = (min(shard_chunks, -(-h // ch[0])), min(shard_chunks, -(-w // ch[1]))) if shard_chunks else (1, 1)
        arr = tg.create_array(
            str(j),
            shape=(1, h, w),
            chunks=(1, *ch),
            shards=(1, ns[0] * ch[0], ns[1] * ch[1]) if shard_chunks else None,
            dtype="uint8",
            fill_value=0,
            compressors=[zarr.codecs.ZstdCodec(level=3), zarr.codecs.Crc32cCodec()],
            dimension_names=("c", "y", "x"),
        )
        if j == len(level_shapes) - 1:
            arr[...] = mask[None]
            continue
        iy = np.minimum(((np.arange(h) + 0.5) * (float(dj) / dm)).astype(np.int64), mh - 1)
        ix = np.minimum(((np.arange(w) + 0.5) * (float(dj) / dm)).astype(np.int64), mw - 1)
        prefix = "/".join(p for p in (group.path, "labels", TISSUE_LABEL, str(j), "c", "0") if p)
        shard_row: dict[tuple[int, int], bytes] = {}
        rows_y = list(enumerate(range(0, h, ch[0])))
        for cy, y0 in rows_y:
            ys = iy[y0 : y0 + ch[0]]
            row: dict[str, bytes] = {}
            for cx, x0 in enumerate(range(0, w, ch[1])):
                xs = ix[x0 : x0 + ch[1]]
                sub = mask[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]
                if not sub.any():
                    continue
                if sub.all():
                    key = (len(ys), len(xs))
                    if key not in ones_cache:
                        full = np.zeros(ch, np.uint8)
                        full[: len(ys), : len(xs)] = 1
                        ones_cache[key] = add_checksum(imagecodecs.zstd_encode(full, level=3))
                    data = ones_cache[key]
                else:
                    full = np.zeros(ch, np.uint8)
                    full[: len(ys), : len(xs)] = _nearest_block(mask, ys, xs, y0, x0, dm / float(dj))
                    data = add_checksum(imagecodecs.zstd_encode(full, level=3))
                row[f"{prefix}/{cy}/{cx}"] = data
                shard_row[(cy, cx)] = data
            if not shard_chunks:
                storage.put_bytes(group.store, row)  # through zarr's store API, one row of chunks at a time
                continue
            if (cy + 1) % ns[0] and cy != rows_y[-1][0]:
                continue
            # a row of shards is complete: one object per shard (same bytes as zarr's ShardingCodec)
            sy = cy // ns[0]
            by_shard: dict[int, dict[tuple[int, int], bytes]] = {}
            for (ky, kx), data in shard_row.items():
                by_shard.setdefault(kx // ns[1], {})[(ky - sy * ns[0], kx % ns[1])] = data
            storage.put_bytes(
                group.store, {f"{prefix}/{sy}/{sx}": encode_shard(d, ns) for sx, d in by_shard.items() if d}
            )
            shard_row = {}
    tg.attrs["ome"] = {
        "version": "0.5",
        "image-label": {
            "version": "0.5",
            "colors": [{"label-value": 1, "rgba": [0, 160, 0, 128]}],
            "source": {"image": "../../"},
        },
        "multiscales": ngff_multiscales(TISSUE_LABEL, list(downsamples), mpp),
    }
