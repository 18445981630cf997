"""The ingest manifest: ``STORE_DIR/manifest.parquet`` (and ``manifest.csv`` for humans).

One row per input slide; a re-run updates the rows of the slides it saw and keeps the others.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workers import storage

__all__ = ["MANIFEST_COLUMNS", "merge_manifest", "read_manifest"]

MANIFEST_COLUMNS = [
    "slide_id",
    "source",
    "status",
    "error",
    "width",
    "height",
    "mpp",
    "mpp_missing",
    "tissue_fraction",
    "seconds",
    "vendor",
    "codec",
    "levels",
    "regions",
    "regions_resumed",
    "store",
]


def read_manifest(store_dir: str | Path):
    """The manifest as a pandas DataFrame (empty with the standard columns when there is none); ``store_dir``:
    a folder or an object-storage URL."""
    import io

    import pandas as pd

    if storage.is_url(store_dir):
        fs, path = storage.filesystem(str(store_dir))
        try:
            return pd.read_parquet(io.BytesIO(fs.cat_file(f"{path}/manifest.parquet")))
        except FileNotFoundError:
            return pd.DataFrame(columns=MANIFEST_COLUMNS)
    p = Path(store_dir) / "manifest.parquet"
    if p.is_file():
        return pd.read_parquet(p)
    return pd.DataFrame(columns=MANIFEST_COLUMNS)


def merge_manifest(store_dir: str | Path, rows: Iterable[dict[str, Any]]):
    """Merge ``rows`` (keyed by slide_id) into the manifest and write Parquet + CSV atomically."""
    import pandas as pd

    old = read_manifest(store_dir)
    new = pd.DataFrame(list(rows))
    if new.empty:
        return old
    if not old.empty:
        old = old[~old["slide_id"].isin(set(new["slide_id"]))]
        df = pd.concat([old, new], ignore_index=True)
    else:
        df = new
    cols = [c for c in MANIFEST_COLUMNS if c in df.columns] + [c for c in df.columns if c not in MANIFEST_COLUMNS]
    df = df[cols].sort_values("slide_id", kind="stable").reset_index(drop=True)
    for c in ("width", "height", "levels", "regions", "regions_resumed"):
        if c in df.columns:
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    if "mpp_missing" in df.columns:
        df["mpp_missing"] = df["mpp_missing"].astype("boolean")
    for c in df.columns:  # carried CSV columns can mix types across runs; keep Parquet happy
        if df[c].dtype == object:
            df[c] = df[c].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else str(v))
    if storage.is_url(store_dir):  # one PUT per file: atomic
        import io

        fs, path = storage.filesystem(str(store_dir))
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        fs.pipe_file(f"{path}/manifest.parquet", buf.getvalue())
        fs.pipe_file(f"{path}/manifest.csv", df.to_csv(index=False).encode())
        return df
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    # both files are written in full beside their targets, synced, then renamed: a failure (a full disk, a
    # read-only folder, an interrupt) leaves the previous manifest as it was and no temporary behind
    tmps = {name: store_dir / f".{name}.tmp{os.getpid()}" for name in ("manifest.parquet", "manifest.csv")}
    try:
        df.to_parquet(tmps["manifest.parquet"], index=False)
        df.to_csv(tmps["manifest.csv"], index=False)
        for tmp in tmps.values():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        for name, tmp in tmps.items():
            os.replace(tmp, store_dir / name)
    except OSError as exc:
        _remove(tmps.values())
        raise OSError(
            exc.errno,
            f"cannot write the manifest {store_dir / 'manifest.parquet'}: {exc.strerror or exc}",
            str(store_dir / "manifest.parquet"),
        ) from exc
    except BaseException:
        _remove(tmps.values())
        raise
    return df


def _remove(paths: Iterable[Path]) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
