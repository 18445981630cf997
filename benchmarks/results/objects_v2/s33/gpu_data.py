"""Device-machine data prep without Ray: ``foveate synth`` (``--jobs``) then every slide through the plain
``workers.tiler.Tiler.ingest_slide`` in a process pool, and the manifest via ``pipeline.ingest_manifest``
(the same stores and rows ``foveate ingest --codec jpeg`` writes; Ray is not installed on the device machine).

Usage: python gpu_data.py OUT --count 128 --size 4096 --classes 2 [--jobs 16]
"""

import argparse
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))


def _one(args):
    out, sf = args
    from workers.tiler import IngestOptions, Tiler

    t0 = time.perf_counter()
    t = Tiler(out, IngestOptions(codec="jpeg"))
    try:
        row = t.ingest_slide(sf)
        spath = t.store_path(sf.slide_id)
    finally:
        t.close()
    return {"slide_id": sf.slide_id, "source": sf.source, **sf.carried, "status": "ok", "error": None,
            "seconds": time.perf_counter() - t0, "store": spath, **row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--classes", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=16)
    a = ap.parse_args()
    out = Path(a.out)
    slides, stores = out / "slides", out / "stores"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline", "synth", str(slides), "--count", str(a.count), "--size",
                    str(a.size), "--format", "tiff", "--seed", "0", "--task", "objects", "--classes",
                    str(a.classes), "--jobs", str(a.jobs)], check=True, cwd=ROOT)
    t1 = time.perf_counter()
    from pipeline.ingest_inputs import discover_inputs
    from pipeline.ingest_manifest import merge_manifest

    inputs = discover_inputs([slides / "labels.csv"])
    stores.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(_one, [(str(stores), sf) for sf in inputs]))
    merge_manifest(stores, rows)
    print(f"[data] {len(rows)} slides: synth {t1 - t0:.0f}s, ingest {time.perf_counter() - t1:.0f}s", flush=True)


if __name__ == "__main__":
    main()
