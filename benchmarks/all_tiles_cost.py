"""Benchmark: what a training step of the all-tiles baseline costs on the slides of a store folder.

The all-tiles (CLAM-style) baseline of ``benchmarks/accuracy.py`` (``tiles_mean``: the feature ResNet of the
config on *every* tissue tile of the model's grid at full resolution, mean-pooled, a linear head, trained end to
end) cannot be trained on slides of 16k px and more on this machine: a slide's tiles alone are ~0.8 GB of uint8
at 16384² and 64-px tiles. This script measures, on ``--slides`` slides of ``--stores``, one such training step
per slide — the tissue tiles read from the store, then forward + backward of the ResNet over all of them in
chunks (activations of one chunk alive at a time: the features are recomputed chunk by chunk in the backward,
the cheapest exact way to fit) and an optimiser step — and extrapolates the train time of ``--epochs`` epochs
over ``--train-slides`` slides. Prints a table and writes JSON.

Usage: python benchmarks/all_tiles_cost.py --stores DIR [--config perturbed_mean] [--slides 2] [--epochs 20]
       [--train-slides N] [--chunk 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch


def step_cost(store: str, model_cfg, chunk: int) -> dict[str, float]:
    """One all-tiles training step on one slide: seconds to read its tissue tiles, seconds of forward + backward
    + optimiser step, the tile count."""
    from accuracy import TilesMean  # the all-tiles baseline of benchmarks/accuracy.py

    from workers.patches import prepare_slide

    t0 = time.perf_counter()
    si = prepare_slide(store, model_cfg, cache=False)
    cells = torch.nonzero(si.cell_mask.flatten()).flatten()
    pieces = [si.reader.read(cells[i : i + chunk]) for i in range(0, len(cells), chunk)]  # uint8 chunks
    read_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = TilesMean(model_cfg.features.resnet())
    features, head = model.features, model.head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t1 = time.perf_counter()
    with torch.no_grad():  # pass 1: the pooled features (no activations kept)
        pooled = sum(features(p.float().div_(255.0)).sum(0) for p in pieces) / len(cells)
    pooled.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(head(pooled[None]), torch.tensor([1]))
    loss.backward()
    g = pooled.grad / len(cells)
    for p in pieces:  # pass 2: recompute each chunk with activations and back-propagate its share
        (features(p.float().div_(255.0)).sum(0) * g).sum().backward()
    opt.step()
    compute_s = time.perf_counter() - t1
    return {"tiles": float(len(cells)), "read_seconds": read_s, "compute_seconds": compute_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True, help="a folder of Zarr slide stores (with manifest.parquet)")
    p.add_argument("--config", default="perturbed_mean", help="config in configs/ whose model (grid, ResNet) to use")
    p.add_argument("--slides", type=int, default=2, help="slides to measure (default 2)")
    p.add_argument("--epochs", type=int, default=20, help="epochs to extrapolate to (default 20)")
    p.add_argument("--train-slides", type=int, default=None, help="training slides to extrapolate to (default: all)")
    p.add_argument("--chunk", type=int, default=256, help="tiles per forward chunk (default 256)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from pipeline.config import load_config
    from pipeline.data import build_slide_table
    from pipeline.train import TrainConfig

    cfg = load_config(
        TrainConfig, ROOT / "configs" / f"{args.config}.yaml", [f"data.stores={args.stores}", "data.labels=manifest"]
    )
    records = build_slide_table(cfg.data).records
    if args.slides < 1 or args.slides > len(records):
        raise ValueError(f"--slides must be in [1, {len(records)}] (slides in {args.stores}), got {args.slides}")
    rows = []
    for rec in records[: args.slides]:
        r = step_cost(rec.store, cfg.model, args.chunk)
        r["slide"] = Path(rec.store).name
        rows.append(r)
        print(
            f"{r['slide']}: {r['tiles']:.0f} tissue tiles, read {r['read_seconds']:.1f} s, "
            f"forward + backward {r['compute_seconds']:.1f} s",
            flush=True,
        )
    n = len(rows)
    per_step = sum(r["read_seconds"] + r["compute_seconds"] for r in rows) / n
    compute = sum(r["compute_seconds"] for r in rows) / n
    train_slides = args.train_slides or len(records)
    out = {
        "command": "python benchmarks/all_tiles_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.platform()}",
        "torch": torch.__version__,
        "threads": 1,
        "rows": rows,
        "seconds_per_slide_step": per_step,
        "compute_seconds_per_slide_step": compute,
        "train_slides": train_slides,
        "epochs": args.epochs,
        "extrapolated_train_seconds": per_step * train_slides * args.epochs,
        "extrapolated_train_seconds_tiles_cached": compute * train_slides * args.epochs,
    }
    print(
        f"all tiles: {per_step:.1f} s per slide-step ({compute:.1f} s compute); {args.epochs} epochs x "
        f"{train_slides} slides = {out['extrapolated_train_seconds'] / 3600:.2f} h "
        f"({out['extrapolated_train_seconds_tiles_cached'] / 3600:.2f} h with the tiles cached in memory)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
