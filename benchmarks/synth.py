"""Benchmark: time and peak RSS of writing one synthetic slide (``pipeline.synthetic.write_synthetic_slide``).

Usage: python benchmarks/synth.py [--size 32768] [--format svs] [--out DIR] [--json FILE]
Prints a table and writes JSON. Peak RSS is the process's ru_maxrss (includes the interpreter and imports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--format", default="svs", choices=("svs", "tiff"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for the slide (default: a temporary one, deleted)")
    p.add_argument("--json", default="benchmarks/synth.json")
    args = p.parse_args()
    from pipeline.synthetic import write_synthetic_slide

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_{args.size}.{args.format}"
        t0, c0 = time.perf_counter(), time.process_time()
        info = write_synthetic_slide(path, width=args.size, height=args.size, label=1, seed=args.seed, fmt=args.format)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        size_mb = path.stat().st_size / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mp = args.size * args.size / 1e6
    res = {
        "size": args.size,
        "format": args.format,
        "megapixels": mp,
        "levels": len(info["levels"]),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "mp_per_s": round(mp / wall, 1),
        "file_mb": round(size_mb, 1),
        "peak_rss_mb": round(rss, 1),
        "rss_after_imports_mb": round(rss0, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
    print("| size | format | MP | levels | wall s | CPU s | MP/s | file MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.size} | {args.format} | {mp:.0f} | {res['levels']} | {wall:.1f} | {cpu:.1f} | {mp / wall:.1f} "
        f"| {size_mb:.0f} | {rss:.0f} |"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
