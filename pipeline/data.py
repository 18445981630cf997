"""The slide table for training: which stores, which labels, which split, which worker.

A slide is trainable when ``STORE_DIR/<slide_id>.zarr`` is a complete store (see ``workers/store.py``)
and it has a label. Labels come from either

* the ingest manifest, ``STORE_DIR/manifest.parquet`` (columns ``slide_id``, ``source``, ``status`` and the
  label column that ingest carried through from the archive's ``labels.csv``), with ``labels: manifest``;
* or a CSV file with a ``slide_id`` column (or a ``path`` column naming the source slide file, matched
  against the manifest's ``source`` or else the file name's stem) and the label column.

Labels are strings; any number of classes (two = binary). Class names map to indices in a fixed order
(given in the config, else numeric order when every label is an integer, else sorted), and that mapping
is saved with the model. The train/validation split is stratified per class and depends only on the
set of slide ids and the seed. :func:`shard` gives each Ray Train worker an equal-length share of an
epoch (padded by wrapping round) so every worker makes the same number of optimizer steps.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

from operators.errors import ConfigError
from operators.model_config import LABEL_SYMMETRIES
from workers import storage
from workers.store import is_complete

__all__ = [
    "MANIFEST_NAME",
    "DataConfig",
    "SlideRecord",
    "SlideTable",
    "load_labels",
    "order_classes",
    "build_slide_table",
    "split_train_val",
    "shard",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.parquet"
_FAILED_STATUSES = {"failed", "error", "errored", "incomplete"}


@dataclass(frozen=True)
class DataConfig:
    """Where the slides and labels are, and how to split them.

    Attributes:
        stores: directory holding ``<slide_id>.zarr`` stores (written by ``foveate ingest``); on a cluster,
            a shared filesystem path every worker can read.
        labels: ``"manifest"`` (the label column of ``<stores>/manifest.parquet``) or a CSV path.
        label_column: name of the label column in the manifest or CSV.
        val_fraction: fraction of each class held out for validation (0 = no validation set).
        seed: seed of the split and of the per-epoch slide order.
        classes: optional explicit class order (class name -> index = position); every label must be in it.
        label_symmetry: the symmetries of the square every label keeps, as the one who knows the task states it
            (:data:`operators.model_config.LABEL_SYMMETRIES`): ``dihedral`` where orientation and handedness carry
            no label (stained tissue, most cell and gland morphology), ``flips`` where horizontal against vertical
            does, ``rot180`` where mirrors change a label too (diagonals, handed shapes), ``none`` where any turn
            does, ``unknown`` (default) where nobody has said. ``model.augment.symmetry: auto`` draws from it;
            an explicit augmentation larger than it is an error. ``foveate synth`` writes each family's in
            ``archive.json``.
    """

    stores: str = "stores"
    labels: str = "manifest"
    label_column: str = "label"
    val_fraction: float = 0.25
    seed: int = 0
    classes: tuple[str, ...] = ()
    label_symmetry: str = "unknown"

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction: got {self.val_fraction!r}, must be in [0, 1)")
        if self.label_symmetry not in LABEL_SYMMETRIES:
            raise ConfigError(f"data.label_symmetry: got {self.label_symmetry!r}, must be one of {LABEL_SYMMETRIES}")


@dataclass(frozen=True)
class SlideRecord:
    """One labelled slide: its id, its store's absolute path, its label and class index."""

    slide_id: str
    store: str
    label: str
    target: int


@dataclass(frozen=True)
class SlideTable:
    """All labelled slides with complete stores, and the class names (index = position)."""

    records: tuple[SlideRecord, ...]
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def _label_str(value: object) -> str | None:
    """A label cell as a clean string (``1.0`` from a float column becomes ``"1"``); None when empty."""
    if value is None:
        return None
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():
            return str(int(value))
    text = str(value).strip()
    return text or None


def _read_manifest(stores_dir: str):
    import io

    import pandas as pd

    if storage.is_url(stores_dir):
        fs, path = storage.filesystem(stores_dir)
        try:
            return pd.read_parquet(io.BytesIO(fs.cat_file(f"{path}/{MANIFEST_NAME}")))
        except FileNotFoundError:
            return None
    path = Path(stores_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    return pd.read_parquet(path)


def load_labels(source: str, stores_dir: str | Path, *, label_column: str = "label") -> dict[str, str]:
    """Map ``slide_id -> label`` from the ingest manifest or a CSV.

    Args:
        source: ``"manifest"`` or the path of a CSV with ``slide_id`` or ``path`` plus ``label_column``.
        stores_dir: the stores directory (its ``manifest.parquet`` resolves CSV ``path`` entries to slide ids).
        label_column: the label column's name.

    Returns:
        ``{slide_id: label}`` for rows with a non-empty label.

    Raises:
        FileNotFoundError: the manifest or CSV is missing.
        ValueError: a required column is missing, or a slide id has two different labels.
    """
    import pandas as pd

    stores_dir = storage.normalize(stores_dir)
    manifest = _read_manifest(stores_dir)
    if source == "manifest":
        if manifest is None:
            raise FileNotFoundError(
                f"labels='manifest' but there is no {storage.join(stores_dir, MANIFEST_NAME)}; run `foveate ingest` "
                f"with a labels.csv, or set data.labels to a CSV path"
            )
        table, where = manifest, storage.join(stores_dir, MANIFEST_NAME)
        if "slide_id" not in table.columns:
            raise ValueError(f"{where}: no 'slide_id' column (columns: {list(table.columns)})")
        if "status" in table.columns:
            failed = table["status"].astype(str).str.lower().isin(_FAILED_STATUSES)
            if failed.any():
                log.warning("%s: skipping %d slide(s) whose ingest failed", where, int(failed.sum()))
            table = table[~failed]
        ids = table["slide_id"].astype(str).tolist()
    else:
        csv = Path(source)
        if not csv.is_file():
            raise FileNotFoundError(f"data.labels: no such CSV file {str(csv)!r} (or use 'manifest')")
        table, where = pd.read_csv(csv, dtype=str, keep_default_na=True), str(csv)
        if "slide_id" in table.columns:
            ids = table["slide_id"].astype(str).str.strip().tolist()
        elif "path" in table.columns:
            ids = [_slide_id_for_path(p, csv.parent, manifest) for p in table["path"].astype(str)]
        else:
            raise ValueError(f"{where}: needs a 'slide_id' or a 'path' column (columns: {list(table.columns)})")
    if label_column not in table.columns:
        raise ValueError(
            f"{where}: no label column {label_column!r} (columns: {list(table.columns)}); set data.label_column"
        )
    labels: dict[str, str] = {}
    for sid, raw in zip(ids, table[label_column].tolist()):
        lab = _label_str(raw)
        if lab is None:
            continue
        if sid in labels and labels[sid] != lab:
            raise ValueError(f"{where}: slide {sid!r} has two labels, {labels[sid]!r} and {lab!r}")
        labels[sid] = lab
    return labels


def _slide_id_for_path(path: str, base: Path, manifest) -> str:
    """The slide id of a source slide path: the manifest's row whose ``source`` is that file, else its stem."""
    p = Path(path.strip())
    if not p.is_absolute():
        p = base / p
    if manifest is not None and "source" in manifest.columns and "slide_id" in manifest.columns:
        resolved = str(p.resolve())
        for sid, src in zip(manifest["slide_id"].astype(str), manifest["source"].astype(str)):
            if src == str(p) or str(Path(src).resolve()) == resolved:
                return sid
    return p.stem


def order_classes(labels: set[str] | list[str], explicit: tuple[str, ...] | list[str] = ()) -> tuple[str, ...]:
    """Class names in index order: ``explicit`` if given (every label must be in it), else numeric order
    when every label is an integer, else sorted."""
    labels = set(labels)
    if explicit:
        explicit = tuple(str(c) for c in explicit)
        if len(set(explicit)) != len(explicit):
            raise ValueError(f"data.classes has duplicates: {list(explicit)}")
        unknown = sorted(labels - set(explicit))
        if unknown:
            raise ValueError(f"labels {unknown} are not in data.classes={list(explicit)}")
        return explicit
    try:
        return tuple(sorted(labels, key=lambda s: (int(s), s)))
    except ValueError:
        return tuple(sorted(labels))


def build_slide_table(cfg: DataConfig) -> SlideTable:
    """Every complete store under ``cfg.stores`` that has a label.

    Raises:
        FileNotFoundError: ``cfg.stores`` is not a directory.
        ValueError: no labelled slides, or fewer than two classes; object storage that refuses the credentials,
            does not answer or has no such bucket (one line).
    """
    stores_dir = storage.normalize(cfg.stores)
    if not storage.is_url(stores_dir) and not Path(stores_dir).is_dir():
        raise FileNotFoundError(f"data.stores: no such directory {str(stores_dir)!r}")
    if storage.is_url(stores_dir):
        from workers.bucket_check import check_location

        # refused credentials, a dead endpoint, no such bucket: one line naming bucket, endpoint and credentials
        check_location(stores_dir, what=f"data.stores {stores_dir!r}")
    labels = load_labels(cfg.labels, stores_dir, label_column=cfg.label_column)
    stores = {name.removesuffix(".zarr"): loc for name, loc in storage.children(stores_dir, ".zarr")}
    incomplete = sorted(s for s, p in stores.items() if not is_complete(p))
    if incomplete:
        log.warning("skipping %d incomplete store(s): %s", len(incomplete), incomplete[:5])
    unlabelled = sorted(s for s in stores if s not in labels)
    if unlabelled:
        log.warning("skipping %d store(s) without a label: %s", len(unlabelled), unlabelled[:5])
    missing = sorted(s for s in labels if s not in stores)
    if missing:
        log.warning("%d labelled slide(s) have no store in %s: %s", len(missing), stores_dir, missing[:5])
    ids = sorted(s for s in stores if s in labels and s not in incomplete)
    if not ids:
        raise ValueError(
            f"no labelled slide with a complete store in {str(stores_dir)!r} "
            f"({len(stores)} store(s), {len(labels)} label(s) from {cfg.labels!r})"
        )
    class_names = order_classes({labels[s] for s in ids}, cfg.classes)
    if len(class_names) < 2:
        raise ValueError(f"need at least two classes to train, got {list(class_names)} over {len(ids)} slide(s)")
    index = {c: i for i, c in enumerate(class_names)}
    records = tuple(SlideRecord(s, str(stores[s]), labels[s], index[labels[s]]) for s in ids)
    return SlideTable(records=records, class_names=class_names)


def split_train_val(
    records: tuple[SlideRecord, ...] | list[SlideRecord], val_fraction: float, seed: int
) -> tuple[list[SlideRecord], list[SlideRecord]]:
    """Stratified, deterministic split: per class, ``round(val_fraction * n)`` slides (at least one and at
    most n-1 when the class has two or more slides and ``val_fraction > 0``) go to validation. Depends only
    on the slide ids, their labels and ``seed``; both lists come back sorted by slide id."""
    if not (0.0 <= float(val_fraction) < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    by_class: dict[int, list[SlideRecord]] = {}
    for r in records:
        by_class.setdefault(r.target, []).append(r)
    train, val = [], []
    for target in sorted(by_class):
        group = sorted(by_class[target], key=lambda r: r.slide_id)
        n = len(group)
        n_val = int(round(val_fraction * n))
        if val_fraction > 0 and n >= 2:
            n_val = min(max(n_val, 1), n - 1)
        elif n < 2:
            n_val = 0
        random.Random(f"{seed}:{target}").shuffle(group)
        val += group[:n_val]
        train += group[n_val:]
    return sorted(train, key=lambda r: r.slide_id), sorted(val, key=lambda r: r.slide_id)


def shard(
    records: list[SlideRecord] | tuple[SlideRecord, ...],
    rank: int,
    world_size: int,
    *,
    epoch: int | None = None,
    seed: int = 0,
) -> list[SlideRecord]:
    """This worker's slides for one epoch.

    With ``epoch`` given the slides are first shuffled by ``(seed, epoch)`` (the same order on every
    worker) and the list is padded by wrapping round to a multiple of ``world_size``, so all workers get
    the same number of slides. With ``epoch=None`` (evaluation) there is no shuffle and no padding.
    """
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    items = list(records)
    if epoch is None:
        return items[rank::world_size]
    if not items:
        return []
    random.Random(f"{seed}:epoch:{epoch}").shuffle(items)
    per = math.ceil(len(items) / world_size)
    padded = [items[i % len(items)] for i in range(per * world_size)]
    return padded[rank::world_size]
