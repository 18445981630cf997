"""What the per-chunk crc32c costs: ingest throughput and read latency of stores written with and without it.

One synthetic SVS slide (``pipeline.synthetic``, 256-px JPEG tiles, quality 90; cached in ``--work-dir``) is ingested
in this process by one :class:`workers.tiler.Tiler` (zstd level 1, sharded, one thread, no Ray), once with
``IngestOptions(checksum=True)`` (the default: every chunk ends with its crc32c) and once with ``checksum=False``,
alternating for ``--repeat`` rounds; MP/s is level-0 megapixels per second of wall clock (plan to completion marker),
the median over the rounds. Then, on each store, ``--reads`` random level-0 patches of ``--patch`` px are read two
ways: ``SlideStore.read_region`` (through zarr) and the patch reader's direct path (:class:`workers.chunks.
LocalChunkReader`, the chunks a patch touches), each timed per call (median and p95, in ms).

    python benchmarks/checksum_cost.py --size 8192 --repeat 3 --json benchmarks/results/checksum_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ingest_once(src: Path, out: Path, checksum: bool) -> dict:
    from pipeline.ingest_inputs import discover_inputs
    from workers.tiler import IngestOptions, Tiler

    shutil.rmtree(out, ignore_errors=True)
    (inp,) = discover_inputs([src])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    tiler = Tiler(out, IngestOptions(codec="zstd", zstd_level=1, checksum=checksum))
    row = tiler.ingest_slide(inp)
    tiler.close()
    seconds = time.perf_counter() - t0
    mp = row["width"] * row["height"] / 1e6
    # the store relative to the work folder: no absolute path in the JSON
    store = f"{out.name}/{inp.slide_id}"
    return {"seconds": seconds, "mp_per_s": mp / seconds, "load_avg_before": load, "store": store}


def read_latency(store_path: str, reads: int, patch: int, seed: int = 0) -> dict:
    import numpy as np

    from workers.chunks import local_chunk_reader
    from workers.store import SlideStore

    st = SlideStore(store_path + ".zarr")
    w, h = st.dimensions
    rng = np.random.default_rng(seed)
    xy = [(int(rng.integers(0, w - patch)), int(rng.integers(0, h - patch))) for _ in range(reads)]
    zarr_ms = []
    for x, y in xy:
        t0 = time.perf_counter()
        st.read_region((x, y), 0, (patch, patch))
        zarr_ms.append((time.perf_counter() - t0) * 1e3)
    reader = local_chunk_reader(st.levels[0])
    t = reader.chunk[0]
    direct_ms = []
    for x, y in xy:
        t0 = time.perf_counter()
        for cy in range(y // t, (y + patch - 1) // t + 1):
            for cx in range(x // t, (x + patch - 1) // t + 1):
                reader.read(cy, cx)
        direct_ms.append((time.perf_counter() - t0) * 1e3)

    def summary(ms):
        ms = sorted(ms)
        return {"median_ms": statistics.median(ms), "p95_ms": ms[int(0.95 * (len(ms) - 1))]}

    return {"read_region": summary(zarr_ms), "direct": summary(direct_ms), "checksum": reader.checksum}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=8192, help="slide side in pixels (default 8192)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--reads", type=int, default=400)
    p.add_argument("--patch", type=int, default=224)
    p.add_argument("--work-dir", default=str(REPO / "benchmarks" / "_work" / "checksum_cost"))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from pipeline.synthetic import write_synthetic_slide

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"synth_{a.size}.svs"
    if not src.exists():
        write_synthetic_slide(src, width=a.size, height=a.size, label=1, seed=7, fmt="svs", tile_size=256, quality=90)
    runs: dict[str, list[dict]] = {"crc32c": [], "none": []}
    for _ in range(a.repeat):
        for name, checksum in (("crc32c", True), ("none", False)):
            runs[name].append(ingest_once(src, work / f"stores_{name}", checksum))
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "size": a.size,
        "repeat": a.repeat,
        "ingest": {
            name: {"median_mp_per_s": statistics.median(r["mp_per_s"] for r in rs), "runs": rs}
            for name, rs in runs.items()
        },
        "read": {name: read_latency(str(work / rs[-1]["store"]), a.reads, a.patch) for name, rs in runs.items()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
