"""The predictions file of ``foveate score``: its Parquet schema, reading it back, and the writer.

One row per slide (columns :data:`workers.scoring.ROW_FIELDS` plus ``prob_<class>`` per class): ``slide_id``,
``status`` (``ok``/``error``), ``error``, ``prediction`` (class name), ``probability`` (of the predicted class),
``probabilities`` (class -> probability), ``patches`` (the K chosen patches: level-0 ``x, y, w, h`` and their
``score``, see :mod:`workers.frames`), ``heatmap`` (PNG path), ``seconds``, ``store``, ``model``, ``scored_at``.
:class:`PredictionWriter` rewrites the file atomically (temp file + fsync + rename) as rows arrive; the file's
key-value metadata (:func:`read_metadata`) names the model that wrote it (``foveate.model``,
``foveate.model_digest``: :func:`operators.checkpoint.checkpoint_digest`), so a resumed run can refuse another model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["list_stores", "read_predictions", "read_metadata", "PredictionWriter", "schema", "prob_column"]


def list_stores(stores_dir: str | Path) -> list[tuple[str, str]]:
    """``[(slide_id, store path)]`` of every ``*.zarr`` directory in ``stores_dir``, sorted by slide id
    (complete or not: an incomplete store gets an error row)."""
    from workers import storage

    root = storage.normalize(stores_dir)
    if not storage.is_url(root):
        if not Path(root).is_dir():
            raise FileNotFoundError(f"--stores: no such directory {root!r}")
        return sorted((name[: -len(".zarr")], loc) for name, loc in storage.children(root, ".zarr"))
    from workers.bucket_check import check_location, describe_failure

    # refused credentials, a dead endpoint, no such bucket: one line naming bucket, endpoint and credential source
    check_location(root, what=f"--stores {root!r}")
    try:
        found = storage.children(root, ".zarr")
    except (ValueError, ImportError):
        raise
    except Exception as exc:
        raise ValueError(describe_failure(root, exc, what=f"--stores {root!r}")) from exc
    return sorted((name[: -len(".zarr")], loc) for name, loc in found)


def schema(prob_columns: list[str]):
    import pyarrow as pa

    patch = pa.struct(
        [("x", pa.int64()), ("y", pa.int64()), ("w", pa.int64()), ("h", pa.int64()), ("score", pa.float64())]
    )
    fields = [
        ("slide_id", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("prediction", pa.string()),
        ("probability", pa.float64()),
        ("probabilities", pa.map_(pa.string(), pa.float64())),
        ("patches", pa.list_(patch)),
        ("heatmap", pa.string()),
        ("seconds", pa.float64()),
        ("store", pa.string()),
        ("model", pa.string()),
        ("scored_at", pa.string()),
    ]
    fields += [(c, pa.float64()) for c in prob_columns]
    return pa.schema(fields)


def prob_column(name: str) -> str:
    return f"prob_{name}"


def read_predictions(path: str | Path, *, option: str = "--out") -> list[dict[str, Any]]:
    """The rows of an existing predictions file (``[]`` if there is none).

    Args:
        path: the Parquet file.
        option: the command-line option that named it, for error messages (``--out`` of ``foveate score``,
            ``--predictions`` of ``foveate export``).

    Raises:
        ValueError: the file exists but is not a readable predictions file.
    """
    import io

    import pyarrow.parquet as pq

    from workers import storage

    raw = storage.read_file(path)
    if raw is None:
        return []
    path = storage.normalize(path)
    advice = "; move it away or choose another --out" if option == "--out" else ""
    try:
        table = pq.read_table(io.BytesIO(raw))
    except Exception as exc:
        raise ValueError(
            f"{option} {str(path)!r} exists but is not a readable predictions file ({exc}){advice}"
        ) from exc
    if "slide_id" not in table.column_names or "status" not in table.column_names:
        raise ValueError(f"{option} {str(path)!r} is not a foveate predictions file (no slide_id/status columns)")
    rows = table.to_pylist()
    for r in rows:  # map columns come back as lists of (key, value) pairs
        if isinstance(r.get("probabilities"), list):
            r["probabilities"] = dict(r["probabilities"])
    return rows


def read_metadata(path: str | Path) -> dict[str, str]:
    """The key-value metadata of an existing predictions file (``{}`` if there is none or no file)."""
    import io

    import pyarrow.parquet as pq

    from workers import storage

    raw = storage.read_file(path)
    if raw is None:
        return {}
    meta = pq.read_schema(io.BytesIO(raw)).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if not k.startswith(b"ARROW:") and k != b"pandas"}


class PredictionWriter:
    """Holds the rows (one per slide id) and rewrites the Parquet file atomically.

    Args:
        path: the output file.
        rows: rows to start from (e.g. those of an earlier run that are kept).
        flush_every_s: :meth:`add` rewrites the file when at least this long has passed since the last write.
    """

    def __init__(
        self,
        path: str | Path,
        rows: list[dict[str, Any]] = (),
        *,
        flush_every_s: float = 2.0,
        metadata: dict[str, str] | None = None,
    ):
        from workers import storage

        self.path = storage.local_path(path) or storage.normalize(path)  # a Path, or an object-storage URL
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}  # Parquet key-value metadata
        self.rows: dict[str, dict[str, Any]] = {}
        for r in rows:
            self.rows[r["slide_id"]] = r
        self.flush_every_s = float(flush_every_s)
        self._last = 0.0
        self._dirty = False
        self.writes = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["slide_id"]] = row
        self._dirty = True
        if time.monotonic() - self._last >= self.flush_every_s:
            self.flush()

    def table(self):
        """The rows as a pyarrow Table (sorted by slide id)."""
        import pyarrow as pa

        rows = [self.rows[k] for k in sorted(self.rows)]
        prob_cols = sorted({prob_column(n) for r in rows for n in (r.get("probabilities") or {})})
        out = []
        for r in rows:
            d = {
                k: r.get(k)
                for k in (
                    "slide_id",
                    "status",
                    "error",
                    "prediction",
                    "probability",
                    "heatmap",
                    "seconds",
                    "store",
                    "model",
                    "scored_at",
                )
            }
            probs = r.get("probabilities") or {}
            d["probabilities"] = list(probs.items())
            d["patches"] = list(r.get("patches") or [])
            for c in prob_cols:
                d[c] = None
            for name, v in probs.items():
                d[prob_column(name)] = float(v)
            out.append(d)
        sch = schema(prob_cols)
        if self.metadata:
            sch = sch.with_metadata(self.metadata)
        return pa.Table.from_pylist(out, schema=sch)

    def flush(self, force: bool = False) -> None:
        """Rewrite the file (temp file, fsync, rename) if anything changed (or ``force``)."""
        import pyarrow.parquet as pq

        if not (self._dirty or force):
            return
        if isinstance(self.path, str):  # object storage: one PUT replaces the object atomically
            import io

            from workers import storage

            buf = io.BytesIO()
            pq.write_table(self.table(), buf)
            storage.write_file(self.path, buf.getvalue())
            self._last = time.monotonic()
            self._dirty = False
            self.writes += 1
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        pq.write_table(self.table(), tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._last = time.monotonic()
        self._dirty = False
        self.writes += 1
