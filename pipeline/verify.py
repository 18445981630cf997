"""``foveate verify STORES``: check every slide store of a folder against its completion marker.

A store is *whole* when its completion marker is readable, its metadata opens, and every image level holds
exactly the chunk (shard) objects the marker's inventory lists (:func:`workers.store.verify_store`). Stores written
before the inventory existed are checked for the marker and metadata only (reported as ``ok (no
inventory)``). Exit code 1 when any store is damaged or incomplete, so scripts can gate on it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workers.store import COMPLETE_MARKER, verify_store

__all__ = ["verify", "add_arguments", "run"]


def verify(stores: str | Path) -> list[dict[str, object]]:
    """One ``{"slide_id", "store", "status": "ok" | "damaged", "problems": [...], "inventory": bool}`` per
    ``*.zarr`` folder in ``stores`` (sorted)."""
    from workers import storage

    root = storage.normalize(stores)
    if not storage.is_url(root) and not Path(root).is_dir():
        raise FileNotFoundError(f"STORES: no such directory {root!r}")
    rows = []
    for name, loc in storage.children(root, ".zarr"):
        store = storage.open_store(loc, read_only=True)
        problems = verify_store(store)
        inventory = False
        try:
            inventory = "inventory" in json.loads(storage.get_bytes(store, COMPLETE_MARKER) or b"{}")
        except Exception:
            pass
        rows.append(
            {
                "slide_id": name[: -len(".zarr")],
                "store": loc,
                "status": "damaged" if problems else "ok",
                "problems": problems,
                "inventory": inventory,
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", help="folder or URL of <slide_id>.zarr stores (foveate ingest's --out)")


def run(args: argparse.Namespace) -> int:
    rows = verify(args.stores)
    for r in rows:
        note = "" if r["inventory"] or r["status"] != "ok" else " (no inventory: marker and metadata only)"
        print(f"{r['slide_id']}: {r['status']}{note}" + (f" — {'; '.join(r['problems'])}" if r["problems"] else ""))
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows)} store(s) in {args.stores}: {len(rows) - len(bad)} ok, {len(bad)} damaged or incomplete")
    return 1 if bad else 0
