"""``foveate synth OUT_DIR``: write synthetic slides (Aperio SVS / generic tiled TIFF) and ``labels.csv``.

The work is done by :mod:`workers.synth`; this module is the command line around it.
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
    parser.add_argument("--size", default="4096",
                        help="level-0 size: N (square), WxH, or LO:HI (width and height each drawn from the range); "
                             "sides in [2000, 100000] (default 4096)")
    parser.add_argument("--format", dest="fmt", choices=("svs", "tiff", "mixed"), default="svs",
                        help="svs (Aperio), tiff (generic pyramidal TIFF) or mixed (alternating) (default svs)")
    parser.add_argument("--seed", type=int, default=0, help="seed; same arguments give the same bytes (default 0)")
    parser.add_argument("--positive-fraction", type=float, default=0.5,
                        help="fraction of label-1 slides, exact up to rounding (default 0.5)")
    parser.add_argument("--tile-size", type=int, default=256, help="JPEG tile side, multiple of 16 (default 256)")
    parser.add_argument("--mpp", type=float, default=0.25, help="microns per pixel at level 0 (default 0.25)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default 90)")


def run(args: argparse.Namespace) -> int:
    from pipeline.progress import Progress
    from workers.synth import synth_archive

    out = Path(args.out_dir)
    bar = Progress(None, "synth", unit="tile")
    try:
        df = synth_archive(out, count=args.count, size=args.size, fmt=args.fmt, seed=args.seed,
                           positive_fraction=args.positive_fraction, tile_size=args.tile_size, mpp=args.mpp,
                           quality=args.quality, progress=lambda n, name: bar.update(n, postfix=name),
                           on_total=bar.set_total)
    finally:
        bar.close()
    n_pos = int(df["label"].sum())
    print(f"wrote {len(df)} slides ({n_pos} positive, {len(df) - n_pos} negative) and {out / 'labels.csv'}")
    return 0
