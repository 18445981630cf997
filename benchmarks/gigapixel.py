"""Gigapixel training and scoring: seconds and peak memory per slide against the slide's size.

For each ``--sizes`` side S: one synthetic slide of S x S pixels (``foveate synth``, cached in ``--work-dir``) is
ingested (``foveate ingest --codec jpeg``, cached), then each measurement runs in a fresh Python process, so its
peak RSS (``ru_maxrss``) is that measurement's alone:

* ``train``: one training slide-step of ``--config`` (default ``configs/demo.yaml``: 1/16 scorer, K = 8,
  64-px patches, evidence distillation on): the low-res read (``prepare_slide``), forward (scorer, selection,
  patch reading, features, aggregation, evidence terms), backward and an Adam step, timed after one warm-up
  step on the same slide (the low-res view is then cached, as in an epoch after the first);
* ``score``: the same model at inference (hard top-k, ``torch.inference_mode``) on the slide, after a warm-up.

Each is run with every ``--tiles`` value of ``model.scorer.tile`` (0 = the whole low-res view at once, the path
before tiling). One torch thread (``--threads``). Reported per size: grid cells, low-res view size, bytes of the
store read per slide (the low-res level the scorer reads, and the level-0 chunks the read patches touch) against
the store's total, and per measurement seconds and peak RSS.

    python benchmarks/gigapixel.py --sizes 32768,65536 --json benchmarks/results/gigapixel.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def prepare(size: int, work: Path) -> Path:
    """synth + ingest once; returns the store path."""
    d = work / f"s{size}"
    if not (d / "READY").is_file():
        py = sys.executable
        subprocess.run(
            [py, "-m", "pipeline", "synth", str(d / "slides"), "--count", "1", "--size", str(size), "--seed", "0"],
            check=True,
            cwd=REPO,
        )
        subprocess.run(
            [py, "-m", "pipeline", "ingest", str(d / "slides" / "labels.csv"), "--out", str(d / "stores")]
            + ["--codec", "jpeg", "--workers", "1"],
            check=True,
            cwd=REPO,
        )
        (d / "READY").write_text("")
    (store,) = sorted((d / "stores").glob("*.zarr"))
    return store


def measure(kind: str, store: str, config: str, tile: int, threads: int, sets: list[str] = ()) -> dict:
    """One measurement in this process (called in a fresh subprocess)."""
    import dataclasses

    import torch

    torch.set_num_threads(threads)
    from operators.model import FoveateModel
    from pipeline.config import load_config, resolve_config_path
    from pipeline.train import TrainConfig
    from workers.patches import prepare_slide
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore

    cfg = load_config(TrainConfig, resolve_config_path(config), [*sets, f"model.scorer.tile={tile}"])
    mc = dataclasses.replace(cfg.model, num_classes=2)
    torch.manual_seed(0)
    model = FoveateModel(mc)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    slide = prepare_slide(store, mc)
    t_prepare = time.perf_counter() - t
    rss_prepare = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak so far: imports + low-res read
    gen = torch.Generator().manual_seed(0)
    out: dict = {
        "kind": kind,
        "tile": tile,
        "prepare_seconds": t_prepare,
        "grid_cells": slide.grid.num_cells,
        "lowres_hw": list(slide.lowres_u8.shape[1:]),
        "rss_after_imports_mb": rss0,
        "prepare_peak_rss_mb": rss_prepare,
    }
    if kind == "train":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        model.train()
        times = []
        for _ in range(2):  # warm-up, then the timed step
            t = time.perf_counter()
            o = forward_slide(model, slide, training=True, generator=gen, target=1)
            loss = torch.nn.functional.cross_entropy(o.logits, torch.tensor([1])) + sum(o.aux_losses.values())
            t_fwd = time.perf_counter() - t
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append((time.perf_counter() - t, t_fwd))
        out.update(step_seconds=times[-1][0], forward_seconds=times[-1][1], cells_read=o.info["cells_read"])
        cells = torch.cat([o.cell_indices.cpu()])
    else:
        model.eval()
        times = []
        with torch.inference_mode():
            for _ in range(2):
                t = time.perf_counter()
                o = forward_slide(model, slide, training=False)
                times.append(time.perf_counter() - t)
        out.update(score_seconds=times[-1], cells_read=o.info["cells_read"])
        cells = o.cell_indices.cpu()
    # bytes: the low-res level the scorer reads; the level-0 chunk files the chosen patches touch (selection only)
    st = SlideStore(store)
    level = st.best_level_for_downsample(slide.geometry.scorer_downsample)
    root = Path(store)
    out["lowres_level"] = level
    out["lowres_level_bytes"] = du(root / str(level))
    tile_px = int(st.levels[0].chunks[-1])
    touched = set()
    for x, y in slide.grid.cell_xy_l0(cells).tolist():
        for cy in range(int(y) // tile_px, (int(y) + slide.grid.patch_size - 1) // tile_px + 1):
            for cx in range(int(x) // tile_px, (int(x) + slide.grid.patch_size - 1) // tile_px + 1):
                touched.add((cy, cx))
    from workers.chunks import local_chunk_reader

    chunk_files = local_chunk_reader(st.levels[0])  # the stored bytes of each inner chunk, sharded or not
    out["level0_bytes_selected"] = (  # None: a layout only zarr reads (not one ingest writes)
        None if chunk_files is None else sum(len(chunk_files.encoded(cy, cx) or b"") for cy, cx in touched)
    )
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="32768", help="comma-separated slide sides (default 32768 = 1.07 GP)")
    p.add_argument("--tiles", default="0,1024", help="model.scorer.tile values (0 = whole view; default 0,1024)")
    p.add_argument("--config", default="demo")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    p.add_argument("--work-dir", default=str(REPO / "benchmarks" / "_work" / "gigapixel"))
    p.add_argument("--json", default=None)
    p.add_argument("--measure", choices=("train", "score"), help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--tile", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, a.store, a.config, a.tile, a.threads, a.set)))
        return 0
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results = {
        "command": "python benchmarks/gigapixel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch threads {a.threads}",
        "sizes": {},
    }
    for size in [int(s) for s in a.sizes.split(",") if s]:
        store = prepare(size, work)
        entry = {"megapixels": size * size / 1e6, "store_bytes": du(store), "runs": []}
        for tile in [int(t) for t in a.tiles.split(",") if t]:
            for kind in ("train", "score"):
                cmd = [sys.executable, __file__, "--measure", kind, "--store", str(store), "--tile", str(tile)]
                cmd += ["--config", a.config, "--threads", str(a.threads)] + [f"--set={x}" for x in a.set]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if proc.returncode != 0:
                    r = {"kind": kind, "tile": tile, "error": proc.stderr.strip().splitlines()[-1:]}
                else:
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                entry["runs"].append(r)
                print(json.dumps({"size": size, **r}), flush=True)
        results["sizes"][str(size)] = entry
    print(f"\n{results['machine']}")
    print(
        "| slide | cells | low-res | tile | train s/step | train peak MB | score s | score peak MB | low-res level MB | level-0 read KB | store MB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, e in results["sizes"].items():
        by = {(r["kind"], r["tile"]): r for r in e["runs"]}
        for tile in sorted({r["tile"] for r in e["runs"]}):
            tr, sc = by.get(("train", tile), {}), by.get(("score", tile), {})
            any_r = tr if "grid_cells" in tr else sc

            def f(r, k, fmt):
                return fmt.format(r[k]) if k in r else ("error" if "error" in r else "-")

            print(
                f"| {int(size) ** 2 / 1e9:.2f} GP ({size}²) | {any_r.get('grid_cells', '-')} | "
                f"{'x'.join(map(str, any_r.get('lowres_hw', [])))} | {tile} | {f(tr, 'step_seconds', '{:.2f}')} | "
                f"{f(tr, 'peak_rss_mb', '{:.0f}')} | {f(sc, 'score_seconds', '{:.2f}')} | {f(sc, 'peak_rss_mb', '{:.0f}')} | "
                f"{any_r.get('lowres_level_bytes', 0) / 1e6:.1f} | {(any_r.get('level0_bytes_selected') or 0) / 1e3:.0f} | "
                f"{e['store_bytes'] / 1e6:.0f} |"
            )
    out = Path(a.json) if a.json else work / "gigapixel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
