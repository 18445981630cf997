"""Tile latency of ``foveate view`` through HTTP on a large synthetic store.

Writes one ``--width`` x ``--height`` store (zstd, ``--chunk``-px chunks, power-of-two pyramid down to 1024 px)
strip by strip (never the whole slide in memory: level 0 is written in bands of ``--band`` rows, each lower
level from bands of the level above), starts ``foveate view`` on it as a separate process, and requests
``--tiles`` random 256-px tiles per level group through one keep-alive HTTP connection:

* cold: the first request of each tile (cut from the store and encoded; chunk files may be in the OS page cache
  since the store was just written),
* warm: the same tiles again (from the server's LRU of encoded tiles).

Prints a table (median, p95 in ms) and writes JSON.

    python benchmarks/tiles.py                                  # 32768 x 16384 (0.54 gigapixel)
    python benchmarks/tiles.py --width 8192 --height 8192 --tiles 50 --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np


def _band(y0: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Rows ``y0 .. y0+h`` of a smooth stained-looking texture with a little noise (compresses like tissue)."""
    yy = np.arange(y0, y0 + h, dtype=np.float32)[:, None]
    xx = np.arange(w, dtype=np.float32)[None, :]
    base = 0.5 + 0.25 * np.sin(xx / 97.0) * np.cos(yy / 131.0) + 0.25 * np.sin((xx + yy) / 409.0)
    rng = np.random.default_rng(seed + y0)
    noise = rng.integers(0, 24, (h, w), dtype=np.uint8)
    out = np.empty((h, w, 3), np.uint8)
    out[..., 0] = (150 + 80 * base).astype(np.uint8) + noise // 2
    out[..., 1] = (60 + 90 * base).astype(np.uint8) + noise
    out[..., 2] = (130 + 70 * base).astype(np.uint8) + noise // 2
    return out


def write_large_store(path: Path, width: int, height: int, *, chunk: int = 256, band: int = 2048) -> float:
    """Write the store band by band; returns seconds."""
    import zarr

    from workers.pyramid import downsample2x, pyramid_shapes
    from workers.store import mark_complete, write_store_metadata

    t0 = time.perf_counter()
    shapes = pyramid_shapes((width, height), min_size=1024)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    arrays = []
    for i, (_, (lw, lh)) in enumerate(shapes):
        arrays.append(
            group.create_array(
                str(i),
                shape=(3, lh, lw),
                chunks=(3, chunk, chunk),
                dtype="uint8",
                compressors=[zarr.codecs.ZstdCodec(level=3)],
                fill_value=255,
                dimension_names=("c", "y", "x"),
            )
        )
    band = max(chunk, band // chunk * chunk)
    for y0 in range(0, height, band):  # level 0
        h = min(band, height - y0)
        arrays[0][:, y0 : y0 + h, :] = np.moveaxis(_band(y0, h, width), -1, 0)
    for i in range(1, len(shapes)):  # each level from the one above, in bands of 2*band rows
        prev, cur = arrays[i - 1], arrays[i]
        lh, lw = cur.shape[1], cur.shape[2]
        for y0 in range(0, lh, band):
            h = min(band, lh - y0)
            src = np.moveaxis(prev[:, 2 * y0 : 2 * (y0 + h), :], 0, -1)
            cur[:, y0 : y0 + h, :] = np.moveaxis(downsample2x(np.ascontiguousarray(src))[:h, :lw], -1, 0)
    write_store_metadata(
        group,
        slide_id=path.name.removesuffix(".zarr"),
        source="<benchmarks/tiles.py>",
        vendor="array",
        level_shapes=[s for _, s in shapes],
        downsamples=tuple(float(ds) for ds, _ in shapes),
        mpp=(0.5, 0.5),
        tile_size=chunk,
        codec="zstd",
        version="bench",
    )
    mark_complete(path, path.name.removesuffix(".zarr"), len(shapes))
    return time.perf_counter() - t0


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": len(a), "median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=32768)
    ap.add_argument("--height", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=256, help="store chunk side (px)")
    ap.add_argument("--band", type=int, default=2048, help="rows written at once")
    ap.add_argument("--tiles", type=int, default=200, help="random tiles per level group")
    ap.add_argument("--format", default="jpg", choices=["jpg", "png"])
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "_work" / "tiles"))
    ap.add_argument("--keep", action="store_true", help="keep the store (reused by a later run of the same size)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(args.work)
    stores = work / "stores"
    store = stores / f"bench-{args.width}x{args.height}-c{args.chunk}.zarr"
    write_s = None
    if not (store / "foveate_complete.json").is_file():
        shutil.rmtree(store, ignore_errors=True)
        stores.mkdir(parents=True, exist_ok=True)
        print(f"writing {store} ({args.width * args.height / 1e9:.2f} gigapixel) ...", flush=True)
        write_s = write_large_store(store, args.width, args.height, chunk=args.chunk, band=args.band)
        print(f"written in {write_s:.1f} s", flush=True)
    from workers.store import SlideStore

    s = SlideStore(store)
    levels = s.level_dimensions
    sid = store.name.removesuffix(".zarr")
    disk_mb = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**20

    cmd = [sys.executable, "-m", "pipeline", "view", str(stores), "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://([\d.]+):(\d+)/", line)
        if not m:
            raise SystemExit(f"foveate view printed no address: {line!r}")
        conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=60)

        def get(url: str) -> float:
            t = time.perf_counter()
            conn.request("GET", url)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200 or not body:
                raise SystemExit(f"{url}: HTTP {r.status} {body[:200]!r}")
            return (time.perf_counter() - t) * 1000

        get(f"/api/slide/{sid}")
        rng = np.random.default_rng(0)
        groups = {"level 0": [0], "middle levels": list(range(1, max(2, len(levels) - 1))), "all levels": None}
        results = []
        for name, lvs in groups.items():
            lvs = list(range(len(levels))) if lvs is None else [lv for lv in lvs if lv < len(levels)]
            urls = []
            seen = set()
            while len(urls) < args.tiles:
                lv = int(rng.choice(lvs))
                w, h = levels[lv]
                c, r = int(rng.integers(0, -(-w // 256))), int(rng.integers(0, -(-h // 256)))
                key = (lv, c, r)
                if key in seen:
                    if len(seen) >= sum(-(-levels[v][0] // 256) * -(-levels[v][1] // 256) for v in lvs):
                        break
                    continue
                seen.add(key)
                urls.append(f"/tiles/{sid}/{lv}/{c}/{r}.{args.format}")
            if name == "all levels":  # tiles not requested yet in the groups above would be cold; warm only
                cold = None
                for u in urls:
                    get(u)
            else:
                cold = _stats([get(u) for u in urls])
            warm = _stats([get(u) for u in urls])
            results.append({"group": name, "levels": lvs, "cold": cold, "warm": warm})
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    out = {
        "store": {"width": args.width, "height": args.height, "chunk": args.chunk, "levels": len(levels)},
        "gigapixel": args.width * args.height / 1e9,
        "disk_mb": disk_mb,
        "write_s": write_s,
        "format": args.format,
        "tiles_per_group": args.tiles,
        "results": results,
        "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.python_version()}",
    }
    print(
        f"\n{args.width} x {args.height} ({out['gigapixel']:.2f} GP, {len(levels)} levels, {disk_mb:.0f} MB), "
        f"{args.format} tiles"
    )
    print(f"{'group':<15} {'n':>4} {'cold median':>12} {'cold p95':>9} {'warm median':>12} {'warm p95':>9}  (ms)")
    for r in results:
        c = r["cold"] or {}
        cm = f"{c['median_ms']:.1f}" if c else "-"
        cp = f"{c['p95_ms']:.1f}" if c else "-"
        w = r["warm"]
        print(f"{r['group']:<15} {w['n']:>4} {cm:>12} {cp:>9} {w['median_ms']:>12.2f} {w['p95_ms']:>9.2f}")
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
