"""Benchmark: test accuracy and train time of the selection models against two baselines.

The task comes from ``foveate synth``: every slide has 3..6 dark round structures; in a positive slide they
carry a 2-pixel checkerboard, in a negative one they are flat, and the texture averages away exactly at 1/4
scale and below, so the label is legible only at full resolution. Pipeline: ``foveate synth`` -> ``foveate
ingest`` -> the same deterministic train/test split (``pipeline.data.split_train_val``, stratified; the
"validation" split of ``foveate train`` is used as the held-out test set, never for model selection: the
model after the last epoch is evaluated).

Models:
* the selection models, trained with ``foveate train`` (Ray Train, MLflow) from ``configs/``:
  perturbed top-k + transformer, perturbed top-k + mean, attention sampling, LapSum;
* ``tiles_mean`` (CLAM-style baseline): the same feature ResNet on *all* tissue tiles (the model's grid and
  tissue threshold) at full resolution, mean-pooled, linear head, trained end to end (to bound CPU time a
  training step uses at most ``--max-tiles`` random tissue tiles of the slide; evaluation uses all of them);
* ``lowres_cnn``: a CNN on the downsampled whole slide (the scorer's 1/16 view), global pooling, linear head.

Usage: python benchmarks/accuracy.py [--quick] [--count N] [--size S] [--epochs E] [--models ...]
Prints a table and writes JSON (default benchmarks/results/accuracy.json).
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

import numpy as np
import torch

SELECTION = {
    "perturbed_transformer": "perturbed top-k + transformer",
    "perturbed_mean": "perturbed top-k + mean",
    "attention_sampling": "attention sampling",
    "lapsum": "LapSum",
}
BASELINES = {
    "tiles_mean": "mean of all tissue tiles (CLAM-style)",
    "lowres_cnn": "CNN on the downsampled slide",
}


def _stage(argv: list[str]) -> None:
    from pipeline.cli import main

    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"foveate {' '.join(argv)} exited with {rc}")


def prepare_data(workdir: Path, count: int, size: str, seed: int) -> Path:
    slides, stores = workdir / "slides", workdir / "stores"
    if not (slides / "labels.csv").is_file():
        _stage(["synth", str(slides), "--count", str(count), "--size", size, "--format", "tiff", "--seed", str(seed)])
    _stage(["ingest", str(slides / "labels.csv"), "--out", str(stores), "--workers", "2"])
    return stores


def load_cfg(name: str, overrides: list[str]):
    from pipeline.config import load_config
    from pipeline.train import TrainConfig

    return load_config(TrainConfig, ROOT / "configs" / f"{name}.yaml", overrides)


# ---------------------------------------------------------------------------------------------- baselines
class LowresCNN(torch.nn.Module):
    """4 conv layers with a max-pool (like the scorer), global mean+max pooling, linear head."""

    def __init__(self, channels: int = 32, num_classes: int = 2):
        super().__init__()
        c = channels
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c, 2 * c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(2 * c, 2 * c, 3, padding=1),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(4 * c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(torch.cat([h.mean((2, 3)), h.amax((2, 3))], 1))


class TilesMean(torch.nn.Module):
    """Feature ResNet on every tile, mean over tiles, linear head."""

    def __init__(self, features_cfg, num_classes: int = 2):
        super().__init__()
        from operators.resnet import ResNet

        self.features = ResNet(features_cfg)
        self.head = torch.nn.Linear(features_cfg.feature_dim, num_classes)

    def forward(self, tiles: torch.Tensor, chunk: int = 128) -> torch.Tensor:
        feats = torch.cat([self.features(tiles[i : i + chunk]) for i in range(0, len(tiles), chunk)])
        return self.head(feats.mean(0, keepdim=True))


def _fit_eval(
    model, train_items, test_items, epochs: int, lr: float, accumulate: int, seed: int, forward_train, forward_eval
) -> dict:
    from pipeline.train import classification_metrics

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    rng = np.random.default_rng(seed)
    total = epochs * int(np.ceil(len(train_items) / accumulate))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(total, 1))
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        order = rng.permutation(len(train_items))
        for s in range(0, len(order), accumulate):
            opt.zero_grad(set_to_none=True)
            batch = order[s : s + accumulate]
            for i in batch:
                x, y = train_items[i]
                loss = torch.nn.functional.cross_entropy(forward_train(model, x, rng), torch.tensor([y]))
                (loss / len(batch)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    train_s = time.perf_counter() - t0
    model.eval()
    probs, ys = [], []
    with torch.no_grad():
        for x, y in test_items:
            probs.append(torch.softmax(forward_eval(model, x), -1)[0].numpy())
            ys.append(y)
    m = classification_metrics(ys, np.array(probs))
    return {"test_accuracy": m["accuracy"], "test_auc": m["auc"], "train_seconds": train_s}


def run_baseline(name: str, train_recs, test_recs, model_cfg, epochs: int, max_tiles: int, seed: int) -> dict:
    from workers.patches import prepare_slide

    torch.manual_seed(seed)
    t_load = time.perf_counter()
    if name == "lowres_cnn":

        def item(rec):
            return prepare_slide(rec.store, model_cfg).lowres[None], rec.target

        model = LowresCNN()
        fwd = lambda m, x, rng: m(x)
        fwd_eval = lambda m, x: m(x)
        lr = 3e-3
    else:

        def item(rec):
            si = prepare_slide(rec.store, model_cfg)
            cells = torch.nonzero(si.cell_mask.flatten()).flatten()
            if len(cells) == 0:
                cells = torch.arange(si.grid.num_cells)
            return si.reader.read(cells), rec.target  # uint8 [T, 3, p, p], read once

        model = TilesMean(model_cfg.features.resnet())

        def fwd(m, x, rng):
            idx = rng.choice(len(x), size=min(max_tiles, len(x)), replace=False)
            return m(x[torch.from_numpy(np.sort(idx))].float().div_(255.0))

        def fwd_eval(m, x):
            return m(x.float().div_(255.0))

        lr = 2e-3
    train_items = [item(r) for r in train_recs]
    test_items = [item(r) for r in test_recs]
    load_s = time.perf_counter() - t_load
    out = _fit_eval(model, train_items, test_items, epochs, lr, 4, seed, fwd, fwd_eval)
    out["load_seconds"] = load_s
    if name == "tiles_mean":
        out["tiles_per_slide"] = float(np.mean([len(x) for x, _ in train_items + test_items]))
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small task: 32 slides of 2048 px, 20 epochs, 64 tiles/step")
    p.add_argument("--count", type=int, default=80, help="synthetic slides (default 80)")
    p.add_argument("--size", default="2048:3072", help="slide side(s), as foveate synth --size (default 2048:3072)")
    p.add_argument("--epochs", type=int, default=30, help="epochs for every model (default 30)")
    p.add_argument("--test-fraction", type=float, default=0.3, help="held-out fraction per class (default 0.3)")
    p.add_argument("--max-tiles", type=int, default=256, help="tiles per training step of tiles_mean (default 256)")
    p.add_argument("--models", default=",".join([*SELECTION, *BASELINES]), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=str(ROOT / "benchmarks" / "_work" / "accuracy"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "accuracy.json"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra train-config override")
    args = p.parse_args()
    if args.quick:
        args.count, args.size, args.epochs, args.max_tiles = min(args.count, 32), "2048", min(args.epochs, 20), 64
    import logging

    from pipeline.cli import configure_logging

    configure_logging(0)
    logging.getLogger("ray").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # one thread everywhere: OpenMP spin-waits badly on a shared, oversubscribed CPU
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SELECTION and m not in BASELINES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {[*SELECTION, *BASELINES]}")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
    t0 = time.perf_counter()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        stores = prepare_data(workdir, args.count, args.size, args.seed)
        data_s = time.perf_counter() - t0
        common = [
            f"data.stores={stores}",
            "data.labels=manifest",
            f"data.val_fraction={args.test_fraction}",
            f"data.seed={args.seed}",
            f"optim.epochs={args.epochs}",
            "tracking.experiment=foveate-accuracy",
            f"workdir={workdir}",
            "threads=1",
            *args.overrides,
        ]
        from pipeline.data import build_slide_table, split_train_val
        from pipeline.train import train

        base_cfg = load_cfg("perturbed_mean", common)
        table = build_slide_table(base_cfg.data)
        train_recs, test_recs = split_train_val(table.records, args.test_fraction, args.seed)
        rows = []
        for name in models:
            t1 = time.perf_counter()
            if name in SELECTION:
                stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
                res = train(load_cfg(name, [*common, f"tracking.run_name={name}-{stamp}"]))
                m = res.metrics
                row = {
                    "model": name,
                    "description": SELECTION[name],
                    "test_accuracy": m.get("val_accuracy"),
                    "test_auc": m.get("val_auc"),
                    "train_seconds": m.get("train_seconds"),
                    "mlflow_run_id": res.run_id,
                }
            else:
                row = {
                    "model": name,
                    "description": BASELINES[name],
                    **run_baseline(name, train_recs, test_recs, base_cfg.model, args.epochs, args.max_tiles, args.seed),
                }
            row["wall_seconds"] = time.perf_counter() - t1
            rows.append(row)
            print(
                f"{name}: test accuracy {row['test_accuracy']:.3f}, AUC {row['test_auc']:.3f}, "
                f"train {row['train_seconds']:.1f}s (wall {row['wall_seconds']:.1f}s)",
                flush=True,
            )
    finally:
        ray.shutdown()
    sel = [r["test_accuracy"] for r in rows if r["model"] in SELECTION]
    low = [r["test_accuracy"] for r in rows if r["model"] == "lowres_cnn"]
    goals = {
        "selection_models_ge_0.90": bool(sel) and min(sel) >= 0.9,
        "lowres_cnn_le_0.60": bool(low) and low[0] <= 0.6,
    }
    print()
    print(
        f"{len(train_recs)} train / {len(test_recs)} test slides ({args.count} x {args.size} px), {args.epochs} epochs"
    )
    print(f"{'model':<24} {'test acc':>9} {'test AUC':>9} {'train s':>9} {'wall s':>8}")
    for r in rows:
        print(
            f"{r['model']:<24} {r['test_accuracy']:>9.3f} {r['test_auc']:>9.3f} {r['train_seconds']:>9.1f} {r['wall_seconds']:>8.1f}"
        )
    print("goals:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.platform()}",
        "torch": torch.__version__,
        "quick": args.quick,
        "count": args.count,
        "size": args.size,
        "epochs": args.epochs,
        "train_slides": len(train_recs),
        "test_slides": len(test_recs),
        "data_seconds": data_s,
        "rows": rows,
        "goals": goals,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
