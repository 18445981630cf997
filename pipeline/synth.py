"""``foveate synth OUT_DIR``: write synthetic slides (Aperio SVS / generic tiled TIFF) and ``labels.csv``.

Three task families (``--task``): ``checker`` (default; binary), ``objects`` (``--classes 2..5``) and ``shapes``
(``--classes 2..10``); see :mod:`pipeline.synthetic`.

The work is done by :mod:`pipeline.synthetic`; this module is the command line around it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output folder (created if missing)")
    parser.add_argument("--count", type=int, default=4, help="number of slides (default 4)")
    parser.add_argument(
        "--task",
        choices=("checker", "objects", "shapes"),
        default="checker",
        help="task family: checker (3..6 dark round structures, label = checkerboard vs flat "
        "texture inside them), objects (label = the kind of the majority of 3..6 small "
        "textured objects among 20..60 textured distractor strokes/rings) or shapes (label = the "
        "glyph of the majority, 3 of 5, of small distorted ink drawings among 30..80 ink scribbles "
        "per megapixel of tissue) (default checker)",
    )
    parser.add_argument(
        "--classes",
        type=int,
        default=None,
        help="number of classes: 2..5 for --task objects, 2..10 for --task shapes (default 4); checker is binary (2)",
    )
    parser.add_argument(
        "--size",
        default=None,
        help="level-0 size: N (square), WxH, or LO:HI (width and height each drawn from the range); "
        "sides in [2000, 100000] (default 4096; 8192 for --task objects and shapes)",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=("svs", "tiff", "mixed"),
        default="svs",
        help="svs (Aperio), tiff (generic pyramidal TIFF) or mixed (alternating) (default svs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed; same arguments give the same bytes (default 0)")
    parser.add_argument(
        "--positive-fraction",
        type=float,
        default=None,
        help="fraction of label-1 slides, exact up to rounding (default 0.5; checker only: "
        "the objects and shapes tasks have balanced classes)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="slides written at once, one process each (default 1); the bytes do not depend on it",
    )
    parser.add_argument("--tile-size", type=int, default=256, help="JPEG tile side, multiple of 16 (default 256)")
    parser.add_argument("--mpp", type=float, default=0.25, help="microns per pixel at level 0 (default 0.25)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default 90)")


def run(args: argparse.Namespace) -> int:
    from pipeline.progress import Progress
    from pipeline.synthetic.archive import synth_archive
    from pipeline.synthetic.objects import OBJECTS_DEFAULT_SIZE
    from pipeline.synthetic.shapes import SHAPES_DEFAULT_CLASSES, SHAPES_DEFAULT_SIZE
    from pipeline.synthetic.tasks import check_task

    task = args.task
    default_classes = {"objects": 4, "shapes": SHAPES_DEFAULT_CLASSES}.get(task, 2)
    classes = args.classes if args.classes is not None else default_classes
    check_task(task, classes)  # ValueError naming what is allowed
    if task != "checker" and args.positive_fraction is not None:
        raise ValueError(f"--positive-fraction applies to --task checker only (the {task} task has balanced classes)")
    default_size = {"objects": OBJECTS_DEFAULT_SIZE, "shapes": SHAPES_DEFAULT_SIZE}.get(task, 4096)
    size = args.size if args.size is not None else str(default_size)
    positive_fraction = 0.5 if args.positive_fraction is None else args.positive_fraction
    out = Path(args.out_dir)
    bar = Progress(None, "synth", unit="tile")
    try:
        df = synth_archive(
            out,
            count=args.count,
            size=size,
            fmt=args.fmt,
            seed=args.seed,
            positive_fraction=positive_fraction,
            tile_size=args.tile_size,
            mpp=args.mpp,
            quality=args.quality,
            progress=lambda n, name: bar.update(n, postfix=name),
            on_total=bar.set_total,
            task=task,
            classes=classes,
            jobs=args.jobs,
        )
    finally:
        bar.close()
    from pipeline.synthetic.tasks import task_label_symmetry

    label_symmetry = task_label_symmetry(task, classes)
    print(
        f"the labels keep the symmetry {label_symmetry!r} "
        f"(train with --set data.label_symmetry={label_symmetry}; {out / 'archive.json'})"
    )
    if task != "checker":
        counts = df["label"].value_counts()
        per = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        print(f"wrote {len(df)} slides ({per}) and {out / 'labels.csv'}")
        return 0
    n_pos = int(df["label"].sum())
    print(f"wrote {len(df)} slides ({n_pos} positive, {len(df) - n_pos} negative) and {out / 'labels.csv'}")
    return 0
