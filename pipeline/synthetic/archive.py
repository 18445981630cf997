"""The archive driver (``foveate synth``): a folder of synthetic slides of one task family plus ``labels.csv``.

Draws each slide's label, size and seed from the archive's seed, writes the slides
(:func:`pipeline.synthetic.tiff.write_synthetic_slide`, in this process or a pool of processes), the label
table and ``archive.json`` (the family, its classes and the symmetry its labels keep).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.archive_info import ARCHIVE_INFO
from pipeline.synthetic.checker import MAX_SIDE, MIN_SIDE, _check_int
from pipeline.synthetic.tasks import check_task, task_class_names, task_label_symmetry
from pipeline.synthetic.tiff import EXTENSIONS, level_dimensions, write_synthetic_slide

__all__ = ["ARCHIVE_FORMATS", "ARCHIVE_INFO", "parse_size", "synth_archive", "write_archive_info"]

log = logging.getLogger(__name__)

ARCHIVE_FORMATS = ("svs", "tiff", "mixed")


def parse_size(size: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """Size spec -> ``((wmin, wmax), (hmin, hmax))``.

    Accepts an int (square), ``"4096"``, ``"6000x4000"``, a range ``"2048:8192"`` (width and height
    each drawn from it), a ``(lo, hi)`` tuple (range) or the same nested. Sides in [2000, 100000].
    """

    def side(v: Any) -> int:
        try:
            iv = int(str(v).strip()) if not isinstance(v, (int, np.integer)) or isinstance(v, bool) else int(v)
        except ValueError:
            raise ValueError(
                f"size must be N, WxH or LO:HI with integer sides in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}"
            ) from None
        if isinstance(v, bool) or not MIN_SIDE <= iv <= MAX_SIDE:
            raise ValueError(f"size sides must be integers in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}")
        return iv

    if isinstance(size, str):
        s = size.strip().lower()
        if ":" in s:
            lo_s, _, hi_s = s.partition(":")
            lo, hi = side(lo_s), side(hi_s)
            rng = (lo, hi)
        elif "x" in s:
            w_s, _, h_s = s.partition("x")
            w, h = side(w_s), side(h_s)
            return (w, w), (h, h)
        else:
            v = side(s)
            return (v, v), (v, v)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        lo, hi = side(size[0]), side(size[1])
        rng = (lo, hi)
    elif isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        v = side(size)
        return (v, v), (v, v)
    else:
        raise ValueError(f"size must be N, WxH or LO:HI with integer sides in [{MIN_SIDE}, {MAX_SIDE}], got {size!r}")
    if rng[0] > rng[1]:
        raise ValueError(f"size range LO:HI needs LO <= HI, got {size!r}")
    return rng, rng


def synth_archive(
    out_dir: str | os.PathLike,
    *,
    count: int,
    size: Any = 4096,
    fmt: str = "svs",
    seed: int = 0,
    positive_fraction: float = 0.5,
    tile_size: int = 256,
    mpp: float = 0.25,
    quality: int = 90,
    progress: Callable[[int, str], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    task: str = "checker",
    classes: int = 2,
    jobs: int = 1,
):
    """Write ``count`` synthetic slides into ``out_dir`` plus ``labels.csv`` (columns ``path,label``).

    ``path`` holds absolute paths. Exactly ``floor(count * positive_fraction + 0.5)`` slides are positive,
    in an order shuffled by ``seed``. ``fmt="mixed"`` alternates SVS (even index) and TIFF (odd).
    Slide ``i`` is ``synth_{i:05d}.svs|.tiff`` with seed drawn from ``(seed, i)``; files are overwritten.
    Same arguments -> same bytes.

    Args:
        out_dir: created if missing.
        count: number of slides, 1..100000.
        size: see :func:`parse_size`.
        fmt: "svs", "tiff" or "mixed".
        seed: non-negative int.
        positive_fraction: in [0, 1].
        tile_size, mpp, quality: see :func:`pipeline.synthetic.tiff.write_synthetic_slide`.
        progress: called as ``progress(n_tiles, slide_name)`` as tiles are written.
        on_total: called once with the total number of tiles (all slides, all levels) before writing.
        task: ``"checker"`` (default), ``"objects"`` (:func:`pipeline.synthetic.objects.make_objects_layout`) or
            ``"shapes"`` (:func:`pipeline.synthetic.shapes.make_shapes_layout`). For ``objects`` and ``shapes`` the
            classes are balanced (``count // classes`` slides each, the remainder to the first classes, in an
            order shuffled by ``seed``), ``positive_fraction`` is ignored and ``label`` holds the class
            *name* (the majority kind or glyph, e.g. ``horizontal``, ``ring``).
        classes: number of classes: ``objects`` in [2, 5], ``shapes`` in [2, 10], ``checker`` 2.
        jobs: slides written at once, each in its own process (1..256; default 1: in this process). The bytes
            do not depend on it (every slide has its own seed); with ``jobs > 1`` ``progress`` is called once
            per slide, when it is complete, with all of its tiles.

    Returns:
        pandas.DataFrame with columns ``path`` (absolute, str) and ``label`` (int; the class name for
        ``objects`` and ``shapes``), as in labels.csv.
    """
    import pandas as pd

    task, classes = check_task(task, classes)
    count = _check_int("count", count, 1, 100_000)
    if fmt not in ARCHIVE_FORMATS:
        raise ValueError(f"fmt must be one of {ARCHIVE_FORMATS}, got {fmt!r}")
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    if (
        isinstance(positive_fraction, bool)
        or not isinstance(positive_fraction, (int, float))
        or not 0.0 <= float(positive_fraction) <= 1.0
    ):
        raise ValueError(f"positive_fraction must be a number in [0, 1], got {positive_fraction!r}")
    (wlo, whi), (hlo, hhi) = parse_size(size)
    tile_size = _check_int("tile_size", tile_size, 64, 2048)
    if tile_size % 16:
        raise ValueError(f"tile_size must be a multiple of 16 in [64, 2048], got {tile_size}")
    quality = _check_int("quality", quality, 1, 100)
    if isinstance(mpp, bool) or not isinstance(mpp, (int, float)) or not (0 < float(mpp) <= 100):
        raise ValueError(f"mpp must be a number in (0, 100], got {mpp!r}")
    jobs = _check_int("jobs", jobs, 1, 256)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    class_names = task_class_names(task, classes)
    if class_names is not None:  # objects, shapes: balanced classes; labels.csv holds the class names
        names = list(class_names)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x0B1EC7, classes]))
        labels = np.arange(count, dtype=np.int64) % classes
    else:
        names = None
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA4C1]))
        n_pos = int(math.floor(count * float(positive_fraction) + 0.5))  # round half up (not to even)
        labels = np.zeros(count, np.int64)
        labels[:n_pos] = 1
    rng.shuffle(labels)
    widths = rng.integers(wlo, whi + 1, size=count)
    heights = rng.integers(hlo, hhi + 1, size=count)
    slide_seeds = rng.integers(0, 2**62, size=count)
    fmts = [("svs" if i % 2 == 0 else "tiff") if fmt == "mixed" else fmt for i in range(count)]

    def n_tiles(w: int, h: int) -> int:
        return sum(-(-lw // tile_size) * -(-lh // tile_size) for lw, lh in level_dimensions(w, h))

    if on_total is not None:
        on_total(int(sum(n_tiles(int(w), int(h)) for w, h in zip(widths, heights))))

    def slide_kwargs(i: int) -> dict[str, Any]:
        return dict(
            path=out / f"synth_{i:05d}{EXTENSIONS[fmts[i]]}",
            width=int(widths[i]),
            height=int(heights[i]),
            label=int(labels[i]),
            seed=int(slide_seeds[i]),
            fmt=fmts[i],
            tile_size=tile_size,
            mpp=float(mpp),
            quality=quality,
            task=task,
            classes=classes,
        )

    def row(i: int, info: dict[str, Any]) -> dict[str, Any]:
        log.debug(
            "wrote %s (%dx%d, label %s) in %.1fs",
            Path(info["path"]).name,
            info["width"],
            info["height"],
            info["label"],
            info["seconds"],
        )
        return {"path": info["path"], "label": int(labels[i]) if names is None else names[int(labels[i])]}

    rows: list[dict[str, Any]] = []
    if jobs == 1 or count == 1:
        for i in range(count):
            kw = slide_kwargs(i)
            name = kw["path"].name
            cb = (lambda n, _name=name: progress(n, _name)) if progress is not None else None
            rows.append(row(i, write_synthetic_slide(progress=cb, **kw)))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        # spawn: a forked child would inherit the caller's threads' locks (progress bars, loggers)
        with cf.ProcessPoolExecutor(max_workers=min(jobs, count), mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(write_synthetic_slide, **slide_kwargs(i)): i for i in range(count)}
            infos: dict[int, dict[str, Any]] = {}
            try:
                for fut in cf.as_completed(futures):
                    i = futures[fut]
                    infos[i] = fut.result()
                    if progress is not None:
                        progress(n_tiles(int(widths[i]), int(heights[i])), Path(infos[i]["path"]).name)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # slides not yet started are not written
                raise
        rows = [row(i, infos[i]) for i in range(count)]
    df = pd.DataFrame(rows, columns=["path", "label"])
    df.to_csv(out / "labels.csv", index=False)
    write_archive_info(out, task, classes)
    return df


def write_archive_info(out_dir: Path, task: str, classes: int) -> dict[str, Any]:
    """Write ``<out_dir>/archive.json``: the family, its classes and what its labels keep (``label_symmetry``, for
    ``data.label_symmetry``); returns the written dict."""
    info = {
        "task": task,
        "classes": int(classes),
        "class_names": list(task_class_names(task, classes) or ("0", "1")),
        "label_symmetry": task_label_symmetry(task, classes),
    }
    tmp = Path(out_dir) / f".{ARCHIVE_INFO}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(Path(out_dir) / ARCHIVE_INFO)
    return info
