"""Tiny stores for the training tests: labelled 256x256 slides, the class carried by a 16x16 checkerboard's
contrast (0: no checkerboard); one 512x512 slide with two small rare structures (:func:`rare_structures_store`;
five views of it: :func:`rare_structures_views`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from workers.store import write_store_from_array


def checker_stores(root: Path, classes: list[str], contrasts: list[int], count: int = 6) -> tuple[Path, Path]:
    """``count`` stores ``s00.zarr ...`` in ``root``, slide ``i`` of class ``i % len(classes)`` with a checkerboard of
    that class's contrast; returns ``(root, labels.csv)``."""
    rows = []
    for i in range(count):
        rng = np.random.default_rng(i)
        img = np.full((256, 256, 3), 240, np.uint8)
        img[32:224, 32:224] = (200, 120, 180)
        img[32:224, 32:224] += rng.integers(0, 20, (192, 192, 1), dtype=np.uint8)
        label = i % len(classes)
        if contrasts[label]:
            y = 64 + 16 * (i % 4)
            blk = (np.indices((16, 16)).sum(0) % 2 * contrasts[label]).astype(np.uint8)
            img[y : y + 16, 96:112] = blk[..., None]
        write_store_from_array(root / f"s{i:02d}.zarr", img, tile_size=64, min_size=64)
        rows.append({"slide_id": f"s{i:02d}", "label": classes[label]})
    labels = root / "labels.csv"
    pd.DataFrame(rows).to_csv(labels, index=False)
    return root, labels


def rare_structures_image() -> np.ndarray:
    """uint8 ``[512, 512, 3]``: noisy pink tissue inside a 32-px white margin with two dark 40-px squares, the rare
    structures, at ``(x, y)`` = (96, 96) and (384, 320) (cells 1*8+1 and 5*8+6 of the 8x8 grid of 64-px cells)."""
    rng = np.random.default_rng(0)
    img = np.full((512, 512, 3), 240, np.uint8)
    img[32:480, 32:480] = np.clip(np.array([200, 130, 185]) + rng.integers(-12, 12, (448, 448, 3)), 0, 255)
    for y, x in [(96, 96), (320, 384)]:
        img[y : y + 40, x : x + 40] = (60, 30, 100)  # two rare dark structures
    return img


def rare_structures_store(path: Path):
    """:func:`rare_structures_image` as a real Zarr store at ``path`` (128 px tiles); returns the opened store."""
    return write_store_from_array(path, rare_structures_image(), tile_size=128, min_size=64)


def rare_structures_views(root: Path) -> list[SimpleNamespace]:
    """Five stores ``root/s{i}.zarr`` of :func:`rare_structures_image` seen five ways (as is, flipped up-down and
    left-right, rolled 200 px along x and 300 px along y): slide records ``(store, target = i % 2)``."""
    img = rare_structures_image()
    recs = []
    for i, view in enumerate((img, img[::-1], img[:, ::-1], np.roll(img, 200, axis=1), np.roll(img, 300, axis=0))):
        write_store_from_array(root / f"s{i}.zarr", np.ascontiguousarray(view), tile_size=128, min_size=64)
        recs.append(SimpleNamespace(store=str(root / f"s{i}.zarr"), target=i % 2))
    return recs
