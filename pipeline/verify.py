"""``foveate verify STORES [STORES ...]``: check slide stores against their completion markers.

Each argument is a folder of ``<slide_id>.zarr`` stores (``foveate ingest``'s ``--out``) or one store (a
``*.zarr`` folder, or any folder holding ``zarr.json`` or the completion marker), local or a URL.

A store is *whole* when its completion marker is readable, its metadata opens, and every image level holds
exactly the chunk (shard) objects the marker's inventory lists (:func:`workers.store.verify_store`). Stores written
before the inventory existed are checked for the marker and metadata only (reported as ``ok (no
inventory)``). The marker also records the sha256 of every ``zarr.json``: metadata rewritten after ingest (a shape
changed with valid JSON) is damage. ``--deep`` also reads and decodes every chunk of every array: a chunk whose
crc32c does not match its bytes (or that does not decode) is named. Stores written before digests or chunk checksums
existed are checked for what they carry, and their line says which check was not possible. Exit code 1 when any
store is damaged or incomplete, and when nothing was checked (no store in the arguments), so scripts can gate on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.store import COMPLETE_MARKER, integrity_checks, verify_store

__all__ = ["verify", "add_arguments", "run"]


def _is_store(location: str) -> bool:
    """A ``*.zarr`` folder, or a folder with a store's own files (a store named otherwise)."""
    from workers import storage

    if storage.basename(location).endswith(".zarr"):
        return True
    return any(storage.file_exists(storage.join(location, n)) for n in ("zarr.json", COMPLETE_MARKER))


def verify(stores: str | Path, *, deep: bool = False) -> list[dict[str, object]]:
    """One ``{"slide_id", "store", "status": "ok" | "damaged", "problems": [...], "inventory": bool, "checks":
    {...}}`` per ``*.zarr`` folder in ``stores`` (sorted), or the one row of ``stores`` when it is a store itself
    (``checks``: :func:`workers.store.integrity_checks`). ``deep``: also read every chunk of every array.

    Raises:
        FileNotFoundError: a local ``stores`` that does not exist.
        ValueError: object storage that refuses the credentials, does not answer or has no such bucket (one line).
    """
    from workers import storage

    root = storage.normalize(stores)
    if not storage.is_url(root) and not Path(root).is_dir():
        raise FileNotFoundError(f"STORES: no such directory {root!r} (a folder of <slide_id>.zarr stores or a store)")
    if storage.is_url(root):
        from workers.bucket_check import check_location

        # refused credentials, a dead endpoint, no such bucket: one line naming bucket, endpoint and credentials
        check_location(root, what=f"STORES {root!r}")
    found = [(storage.basename(root), root)] if _is_store(root) else storage.children(root, ".zarr")
    rows = []
    for name, loc in found:
        store = storage.open_store(loc, read_only=True)
        problems = verify_store(store, deep=deep)
        inventory = False
        try:
            inventory = "inventory" in json.loads(storage.get_bytes(store, COMPLETE_MARKER) or b"{}")
        except Exception:
            pass
        rows.append(
            {
                "slide_id": name.removesuffix(".zarr"),
                "store": loc,
                "status": "damaged" if problems else "ok",
                "problems": problems,
                "inventory": inventory,
                "checks": integrity_checks(store),
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "stores",
        nargs="+",
        metavar="STORES",
        help="folder or URL of <slide_id>.zarr stores (foveate ingest's --out), or one store",
    )
    parser.add_argument(
        "--deep",
        action="store_true",
        help="also read and decode every chunk of every array (checks each chunk's crc32c; reads the whole store)",
    )


def run(args: argparse.Namespace) -> int:
    targets = args.stores if isinstance(args.stores, list | tuple) else [args.stores]
    deep = bool(getattr(args, "deep", False))
    rows = []
    for target in targets:
        rows += verify(target, deep=deep)
    for r in rows:
        note = _not_checked(r, deep) if r["status"] == "ok" else ""
        print(f"{r['slide_id']}: {r['status']}{note}" + (f" — {'; '.join(r['problems'])}" if r["problems"] else ""))
    bad = [r for r in rows if r["status"] != "ok"]
    where = " ".join(str(t) for t in targets)
    if not rows:
        print(f"no <slide_id>.zarr store in {where}: nothing was checked", file=sys.stderr)
        return 1
    print(f"{len(rows)} store(s) in {where}: {len(rows) - len(bad)} ok, {len(bad)} damaged or incomplete")
    return 1 if bad else 0


def _not_checked(row: dict, deep: bool) -> str:
    """What a store written before a check existed could not be checked for ("" when everything was)."""
    checks = row.get("checks") or {}
    missing = []
    if not row["inventory"]:
        missing.append("no inventory: marker and metadata only")
    if not checks.get("metadata"):
        missing.append("no metadata digests: zarr.json not compared")
    if deep and not checks.get("checksums"):
        missing.append("no chunk checksums: chunks decoded, bit flips not detectable")
    return f" ({'; '.join(missing)})" if missing else ""
