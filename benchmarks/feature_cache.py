"""Benchmark: seconds per training epoch with a frozen encoder, the frozen-feature cache off vs on.

``workers.trainer.Trainer`` in-process (no Ray, no MLflow) on a small synthetic archive, epochs 1..E with
``feature_cache`` None and then a fresh cache folder; the cache needs ``model.augment.color_jitter`` 0 in training,
so both runs set it (and ``model.features.freeze`` true). Prepare the archive once::

  python -m pipeline synth benchmarks/_work/feature_cache/raw --count 8 --size 4096 --task objects
  python -m pipeline ingest benchmarks/_work/feature_cache/raw/labels.csv --out benchmarks/_work/feature_cache/stores
  python benchmarks/feature_cache.py --stores benchmarks/_work/feature_cache/stores

Prints a table (seconds per epoch, encoder patches per epoch, cache hits) and writes
``benchmarks/results/feature_cache.json``.
"""

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from pipeline.config import load_config
from pipeline.data import build_slide_table, shard
from pipeline.train import TrainConfig
from workers.patches import clear_cache
from workers.trainer import Trainer


class Counting(torch.nn.Module):
    """The feature network, counting the patches it encodes."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.feature_dim, self.patches = inner, inner.feature_dim, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.patches += int(x.shape[0])
        return self.inner(x)


def run(cfg: TrainConfig, records, epochs: int, cache: Path | None) -> list[dict]:
    clear_cache()  # the low-res views are read again in epoch 1 of each run
    model_cfg = dataclasses.replace(cfg.model, num_classes=max(r.target for r in records) + 1)
    trainer = Trainer(
        model_cfg, cfg.optim, cfg.schedule, slides_per_epoch=len(records), seed=cfg.seed, feature_cache=cache
    )
    counter = Counting(trainer.model.features)
    trainer.model.features = counter
    rows = []
    for e in range(epochs):
        before, n0 = trainer.train_seconds, counter.patches
        h0 = trainer.feature_cache.hits if trainer.feature_cache else 0
        trainer.train_epoch(shard(records, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed))
        rows.append(
            {
                "epoch": e + 1,
                "seconds": trainer.train_seconds - before,
                "encoded_patches": counter.patches - n0,
                "cache_hits": (trainer.feature_cache.hits if trainer.feature_cache else 0) - h0,
            }
        )
        print(f"cache {'on ' if cache else 'off'} epoch {e + 1}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="lapsum", help="a name in configs/ or a YAML path")
    p.add_argument("--stores", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/feature_cache.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = a.config if a.config.endswith(".yaml") else f"{ROOT}/configs/{a.config}.yaml"
    sets = ["model.features.freeze=true", "model.augment.color_jitter=0", *a.set]
    cfg = load_config(TrainConfig, path, [f"data.stores={a.stores}", "data.labels=manifest", *sets])
    records = build_slide_table(cfg.data).records  # every slide trains: the cache's effect, not a model's accuracy
    t0 = time.perf_counter()
    off = run(cfg, records, a.epochs, None)
    with tempfile.TemporaryDirectory(prefix="foveate-feature-cache-") as tmp:
        on = run(cfg, records, a.epochs, Path(tmp))
        cache_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    print(f"\n{'epoch':>5} {'off s':>8} {'on s':>8} {'speed-up':>8} {'encoded off':>11} {'encoded on':>10} {'hits':>6}")
    for r0, r1 in zip(off, on):
        print(
            f"{r0['epoch']:>5} {r0['seconds']:>8.1f} {r1['seconds']:>8.1f} {r0['seconds'] / r1['seconds']:>7.2f}x "
            f"{r0['encoded_patches']:>11} {r1['encoded_patches']:>10} {r1['cache_hits']:>6}"
        )
    out = {
        "config": a.config,
        "set": sets,
        "stores": a.stores,
        "slides": len(records),
        "epochs": a.epochs,
        "threads": a.threads,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "cache_off": off,
        "cache_on": on,
        "cache_bytes": cache_bytes,
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
