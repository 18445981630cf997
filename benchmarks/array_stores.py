"""Slide stores made straight from arrays, for benchmarks on a machine without OpenSlide or Ray (a lent GPU machine).

:func:`make_archive` writes ``count`` stores of the checker family (``pipeline.synthetic.checker``, the demo's
family, label from the layout) and a ``labels.csv`` (``slide_id``, ``label``): each slide of side ``size`` is a
rendered ``tile``-pixel checker slide repeated ``size / tile`` times in each direction, written with the layout of
``workers.store.write_store_from_array`` (zstd + crc32c chunks, power-of-two pyramid, tissue labels, complete
marker). Where the tile covers whole chunks (levels whose tile side is a multiple of the chunk side) the first
tile's chunk files are written once and hard-linked at every repeat, so a gigapixel store takes seconds and little
disk; the reads, chunk by chunk, are those of any store of that size (from the page cache once written).

    python benchmarks/array_stores.py OUT --count 8 --size 32768     # eight 1.07-GP stores + labels.csv
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = ["checker_tile", "tiled_store", "make_archive"]


def checker_tile(seed: int, side: int, label: int) -> np.ndarray:
    """A rendered checker-family slide ``(side, side, 3)`` uint8 of class ``label``."""
    from pipeline.synthetic.checker import make_layout, render_region

    return render_region(make_layout(side, side, label, seed), 0, 0, side, side)


def tiled_store(path: Path, tile: np.ndarray, reps: int, *, slide_id: str, chunk: int = 256, mpp: float = 0.5):
    """Write a complete store whose level 0 is ``tile`` repeated ``reps x reps`` times; returns its path."""
    import shutil

    import zarr

    from workers.pyramid import downsample2x, pyramid_shapes
    from workers.store import create_image_level, installed_version, mark_complete, write_store_metadata

    th, tw = tile.shape[:2]
    if th != tw or th % chunk:
        raise ValueError(f"tile must be square with a side that is a multiple of {chunk}, got {tile.shape}")
    side = th * reps
    shapes = pyramid_shapes((side, side), min_size=1024)
    shutil.rmtree(path, ignore_errors=True)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    small = np.ascontiguousarray(tile)
    for i, (_, (lw, lh)) in enumerate(shapes):
        if i:
            small = downsample2x(small)
        a = create_image_level(group, i, (lw, lh), chunk)
        t = small.shape[0]
        if t % chunk or t >= lh:  # small levels: the whole level at once
            level = np.tile(small, (lh // t + 1, lw // t + 1, 1))[:lh, :lw]
            a[...] = np.moveaxis(level, -1, 0)
            continue
        a[:, :t, :t] = np.moveaxis(small, -1, 0)  # the first tile's chunks, then links at every repeat
        per = t // chunk
        base = path / str(i) / "c" / "0"
        for cy in range(per):
            for cx in range(per):
                src = base / str(cy) / str(cx)
                if not src.is_file():  # an all-background chunk is not written
                    continue
                for ry in range(lh // t):
                    for rx in range(lw // t):
                        if ry == rx == 0:
                            continue
                        dst = base / str(cy + ry * per) / str(cx + rx * per)
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        os.link(src, dst)
    write_store_metadata(
        group,
        slide_id=slide_id,
        source="<tiled array>",
        vendor="array",
        level_shapes=[s for _, s in shapes],
        downsamples=tuple(float(ds) for ds, _ in shapes),
        mpp=(mpp, mpp),
        source_mpp=(mpp, mpp),
        tile_size=chunk,
        codec="zstd",
        version=installed_version(),
    )
    mark_complete(str(path), slide_id, len(shapes))
    return path


def _one(args: tuple) -> str:
    out, i, size, tile_side, seed, mpp = args
    label = i % 2
    tile = checker_tile(seed * 1000 + i, tile_side, label)
    tiled_store(Path(out) / f"s{i:04d}.zarr", tile, size // tile_side, slide_id=f"s{i:04d}", mpp=mpp)
    return f"s{i:04d},{label}"


def make_archive(
    out: Path, count: int, size: int, *, tile: int = 2048, seed: int = 0, jobs: int = 1, mpp: float = 0.5
) -> Path:
    """``count`` tiled checker stores of side ``size`` (level-0 ``mpp``) in ``out`` and ``out/labels.csv``; returns
    ``out``. The tissue mask drops pieces under 0.1 % of its level's area, so at 32768 px a 2048-px tile's tissue
    can vanish from the mask (the scorer then takes every cell): use ``tile=4096`` there."""
    if size % tile:
        raise ValueError(f"size must be a multiple of the tile side {tile}, got {size}")
    out.mkdir(parents=True, exist_ok=True)
    work = [(str(out), i, size, tile, seed, mpp) for i in range(count)]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_one, work))
    else:
        rows = [_one(w) for w in work]
    (out / "labels.csv").write_text("slide_id,label\n" + "\n".join(rows) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--tile", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--mpp", type=float, default=0.5)
    a = p.parse_args(argv)
    make_archive(Path(a.out), a.count, a.size, tile=a.tile, seed=a.seed, jobs=a.jobs, mpp=a.mpp)
    print(f"{a.count} stores of {a.size} px in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
