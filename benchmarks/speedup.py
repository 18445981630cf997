"""Benchmark: seconds per training step, foveated model vs a CNN over the whole image at full resolution.

Same images for both: a synthetic H&E-like slide of S x S level-0 pixels written as a real store
(``workers.store.write_store_from_array``, pyramid down to ``--min-size`` 64 px), S = 1024 (1 MP) and 8192
(64 MP) by default.

* foveated: one training step of ``FoveateModel`` (perturbed top-k, K = 10 as in Cordonnier et al. 2021,
  patch 64, scorer at 1/16, the feature ResNet of ``configs/perturbed_mean.yaml``): ``forward_slide``
  (low-res read + scorer + selection + reading the chosen patches at full resolution + features +
  aggregation) + backward + AdamW step. The per-process low-res cache is cleared before every step, so
  each step pays its own reads.
* full-resolution CNN: the *same* feature ResNet + a linear head on the whole level-0 image, global mean
  pool, one step (forward + backward + AdamW) on the image as a tensor (reading level 0 from the store is
  timed separately, not included). Up to ``--whole-max-mp`` megapixels the image goes through in one piece.
  Above that (64 MP needs tens of GB of activations) it is streamed in 1024 x 1024 tiles: pass 1 (no
  grad) gets the pooled features and the loss gradient, pass 2 re-runs forward + backward per tile. The
  time reported is pass 2 + the head and optimizer (the FLOPs of one whole-image forward + backward; the
  extra pass-1 forward is excluded), so it is a lower bound on a whole-image step. ``--tile-fraction f``
  runs pass 2 on a fraction of the tiles and scales by the tile count (stated in the output).

Usage: python benchmarks/speedup.py [--quick] [--sizes 1024,8192] [--steps 3] [--json FILE]
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch


def synthetic_image(size: int, seed: int = 0) -> np.ndarray:
    """(size, size, 3) uint8: white background, a few pink tissue blobs with noise and darker spots."""
    rng = np.random.default_rng(seed)
    low = 64
    yy, xx = np.mgrid[0:low, 0:low] / low
    field = np.zeros((low, low))
    for _ in range(5):
        cx, cy, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.15, 0.3)
        field += np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))
    mask_low = field > 0.6
    rep = math.ceil(size / low)
    mask = np.kron(mask_low, np.ones((rep, rep), dtype=bool))[:size, :size]
    img = np.full((size, size, 3), 245, np.uint8)
    pink = np.array([222, 140, 190], np.uint8)
    noise = rng.integers(0, 24, (size, size), dtype=np.uint8)
    for c in range(3):
        ch = img[..., c]
        ch[mask] = pink[c] - noise[mask]
    for _ in range(max(4, size // 256)):  # dark "nuclei" clusters
        x, y = rng.integers(0, size - 64, 2)
        if mask[y + 32, x + 32]:
            img[y : y + 48, x : x + 48] = (110, 70, 150)
    return img


def model_config(k: int):
    import yaml

    from operators.model_config import ModelConfig
    from pipeline.config import from_dict

    data = yaml.safe_load((ROOT / "configs" / "perturbed_mean.yaml").read_text())["model"]
    data.update({"k": k, "selector": "perturbed", "aggregator": "mean"})
    return from_dict(ModelConfig, data)


def time_foveated(store, cfg, steps: int, seed: int = 0) -> dict:
    from operators.model import FoveateModel
    from workers.patches import clear_cache
    from workers.slide_forward import forward_slide

    torch.manual_seed(seed)
    model = FoveateModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    target = torch.tensor([1])
    times, reads = [], []
    for i in range(steps + 1):  # the first step warms up (allocations, imports)
        clear_cache()
        t0 = time.perf_counter()
        out = forward_slide(model, store, training=True, sigma=0.05, generator=gen)
        loss = torch.nn.functional.cross_entropy(out.logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
            reads.append(out.info.get("cells_read", float("nan")))
    return {
        "seconds_per_step": float(np.median(times)),
        "all": times,
        "cells_read": float(np.mean(reads)),
        "grid_cells": out.info.get("num_cells"),
    }


def _features_and_head(cfg, seed: int = 0):
    from operators.resnet import ResNet

    torch.manual_seed(seed)
    net = ResNet(cfg.features.resnet()).train()
    head = torch.nn.Linear(cfg.features.feature_dim, 2)
    opt = torch.optim.AdamW(list(net.parameters()) + list(head.parameters()), lr=1e-3)
    return net, head, opt


def time_fullres_cnn(
    image: np.ndarray, cfg, steps: int, whole_max_mp: float, tile: int = 1024, tile_fraction: float = 1.0
) -> dict:
    net, head, opt = _features_and_head(cfg)
    x = torch.from_numpy(image).permute(2, 0, 1)[None].to(torch.float32).div_(255.0)
    target = torch.tensor([1])
    mp = image.shape[0] * image.shape[1] / 1e6
    times, mode = [], "whole image"
    if mp <= whole_max_mp:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            logits = head(net(x))
            loss = torch.nn.functional.cross_entropy(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i:
                times.append(time.perf_counter() - t0)
        return {
            "seconds_per_step": float(np.median(times)),
            "all": times,
            "mode": mode,
            "tiles_measured": 1,
            "tiles": 1,
        }
    H, W = image.shape[:2]
    boxes = [(y, xx) for y in range(0, H, tile) for xx in range(0, W, tile)]
    n_meas = max(1, int(round(len(boxes) * tile_fraction)))
    sel = boxes[:: max(1, len(boxes) // n_meas)][:n_meas]
    areas = torch.tensor([min(tile, H - y) * min(tile, W - xx) for y, xx in boxes], dtype=torch.float32)
    mode = f"tile-streamed {tile}x{tile}, pass 2 on {len(sel)}/{len(boxes)} tiles" + (
        f", scaled x{len(boxes) / len(sel):.2f}" if len(sel) < len(boxes) else ""
    )
    for i in range(steps + 1):
        # pass 1 (not timed): pooled features of the whole image -> dL/d(pooled)
        with torch.no_grad():
            pooled = sum(
                net(x[:, :, y : y + tile, xx : xx + tile]) * (a / areas.sum()) for (y, xx), a in zip(boxes, areas)
            )
        pooled = pooled.detach().requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(head(pooled), target)
        loss.backward()
        g = pooled.grad
        t_tiles = time.perf_counter()
        for y, xx in sel:
            a = min(tile, H - y) * min(tile, W - xx)
            f = net(x[:, :, y : y + tile, xx : xx + tile]) * (a / float(areas.sum()))
            f.backward(g)
        tile_time = (time.perf_counter() - t_tiles) * (len(boxes) / len(sel))
        t1 = time.perf_counter()
        opt.step()
        dt = (t_tiles - t0) + tile_time + (time.perf_counter() - t1)
        if i:
            times.append(dt)
    return {
        "seconds_per_step": float(np.median(times)),
        "all": times,
        "mode": mode,
        "tiles_measured": len(sel),
        "tiles": len(boxes),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,8192", help="slide sides in pixels (default 1024,8192 = 1 MP, 64 MP)")
    p.add_argument("--k", type=int, default=10, help="patches per slide (default 10, as Cordonnier et al.)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per model (after one warm-up step)")
    p.add_argument("--whole-max-mp", type=float, default=4.0, help="largest image run through the CNN in one piece")
    p.add_argument("--tile-fraction", type=float, default=1.0, help="fraction of tiles timed in tile-streamed mode")
    p.add_argument(
        "--min-size",
        type=int,
        default=64,
        help="store pyramid down to this side, as `foveate ingest --min-size` (default 64, so a 1 MP "
        "store has a 1/16 level for the scorer; ingest's default 1024 would leave 1 MP slides "
        "with level 0 only)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads for both models (default 1)")
    p.add_argument("--quick", action="store_true", help="1 timed step each; 64 MP CNN on 1/8 of the tiles, scaled")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "speedup.json"))
    args = p.parse_args()
    if args.quick:
        args.steps = 1
        args.tile_fraction = min(args.tile_fraction, 0.125)
    torch.set_num_threads(args.threads)
    from workers.store import write_store_from_array

    cfg = model_config(args.k)
    rows = []
    with tempfile.TemporaryDirectory(prefix="foveate-speedup-") as tmp:
        for size in [int(s) for s in args.sizes.split(",")]:
            img = synthetic_image(size)
            t0 = time.perf_counter()
            store = write_store_from_array(Path(tmp) / f"s{size}.zarr", img, min_size=args.min_size)
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            full = store.read_level(0)
            t_read = time.perf_counter() - t0
            del full
            fov = time_foveated(store, cfg, args.steps)
            cnn = time_fullres_cnn(img, cfg, args.steps, args.whole_max_mp, tile_fraction=args.tile_fraction)
            row = {
                "size": size,
                "megapixels": size * size / 1e6,
                "k": args.k,
                "patch_size": cfg.patch_size,
                "foveated_s_per_step": fov["seconds_per_step"],
                "foveated_steps": fov["all"],
                "cells_read_per_step": fov["cells_read"],
                "grid_cells": fov["grid_cells"],
                "cnn_s_per_step": cnn["seconds_per_step"],
                "cnn_steps": cnn["all"],
                "cnn_mode": cnn["mode"],
                "cnn_level0_read_s": t_read,
                "store_write_s": t_write,
                "speedup": cnn["seconds_per_step"] / fov["seconds_per_step"],
            }
            row["goal"] = 5.0 if size * size <= 1.5e6 else 50.0
            row["goal_met"] = row["speedup"] >= row["goal"]
            rows.append(row)
            print(
                f"{size}x{size}: foveated {row['foveated_s_per_step']:.3f} s/step, CNN {row['cnn_s_per_step']:.2f} s/step "
                f"({row['cnn_mode']}), speedup {row['speedup']:.1f}x",
                flush=True,
            )
            del img
    print()
    print(
        f"{'image':>12} {'MP':>6} {'foveated s/step':>16} {'full-res CNN s/step':>20} {'speedup':>8} {'goal':>6}  CNN mode"
    )
    for r in rows:
        print(
            f"{r['size']:>5}x{r['size']:<6} {r['megapixels']:>6.1f} {r['foveated_s_per_step']:>16.3f} "
            f"{r['cnn_s_per_step']:>20.2f} {r['speedup']:>7.1f}x {('>=' + str(int(r['goal'])) + 'x'):>6} "
            f"{'met' if r['goal_met'] else 'NOT met'}; {r['cnn_mode']}"
        )
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.platform()}",
        "torch": torch.__version__,
        "threads": args.threads,
        "quick": args.quick,
        "steps": args.steps,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
