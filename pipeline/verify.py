"""``foveate verify STORES [STORES ...]``: check slide stores against their completion markers.

Each argument is a folder of ``<slide_id>.zarr`` stores (``foveate ingest``'s ``--out``) or one store (a
``*.zarr`` folder, or any folder holding ``zarr.json`` or the completion marker), local or a URL.

A store is *whole* when its completion marker is readable, its metadata opens, and every image level holds
exactly the chunk (shard) objects the marker's inventory lists (:func:`workers.store.verify_store`). Stores written
before the inventory existed are checked for the marker and metadata only (reported as ``ok (no
inventory)``). Exit code 1 when any store is damaged or incomplete, and when nothing was checked (no store in
the arguments), so scripts can gate on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.store import COMPLETE_MARKER, verify_store

__all__ = ["verify", "add_arguments", "run"]


def _is_store(location: str) -> bool:
    """A ``*.zarr`` folder, or a folder with a store's own files (a store named otherwise)."""
    from workers import storage

    if storage.basename(location).endswith(".zarr"):
        return True
    return any(storage.file_exists(storage.join(location, n)) for n in ("zarr.json", COMPLETE_MARKER))


def verify(stores: str | Path) -> list[dict[str, object]]:
    """One ``{"slide_id", "store", "status": "ok" | "damaged", "problems": [...], "inventory": bool}`` per
    ``*.zarr`` folder in ``stores`` (sorted), or the one row of ``stores`` when it is a store itself.

    Raises:
        FileNotFoundError: a local ``stores`` that does not exist.
    """
    from workers import storage

    root = storage.normalize(stores)
    if not storage.is_url(root) and not Path(root).is_dir():
        raise FileNotFoundError(f"STORES: no such directory {root!r} (a folder of <slide_id>.zarr stores or a store)")
    found = [(storage.basename(root), root)] if _is_store(root) else storage.children(root, ".zarr")
    rows = []
    for name, loc in found:
        store = storage.open_store(loc, read_only=True)
        problems = verify_store(store)
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


def run(args: argparse.Namespace) -> int:
    targets = args.stores if isinstance(args.stores, list | tuple) else [args.stores]
    rows = []
    for target in targets:
        rows += verify(target)
    for r in rows:
        note = "" if r["inventory"] or r["status"] != "ok" else " (no inventory: marker and metadata only)"
        print(f"{r['slide_id']}: {r['status']}{note}" + (f" — {'; '.join(r['problems'])}" if r["problems"] else ""))
    bad = [r for r in rows if r["status"] != "ok"]
    where = " ".join(str(t) for t in targets)
    if not rows:
        print(f"no <slide_id>.zarr store in {where}: nothing was checked", file=sys.stderr)
        return 1
    print(f"{len(rows)} store(s) in {where}: {len(rows) - len(bad)} ok, {len(bad)} damaged or incomplete")
    return 1 if bad else 0
