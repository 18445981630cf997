"""Benchmark: seconds of training (the trainer's ``train_seconds``: the training loop of ``foveate train`` on one
worker, without Ray/MLflow start-up or evaluation) for E epochs of a config on a task's stores, per epoch and in
all — the figure the reliable-discovery issue's compute bar is about.

The code measured is the checkout this script is run from, or ``ROOT`` (a git worktree of another commit), so two
commits can be compared on the same stores side by side (one run per core):

  python benchmarks/train_speed.py --config perturbed_mean --stores WORKDIR/data/objects-binary-128x4096/stores
  ROOT=/tmp/old python benchmarks/train_speed.py ... --json old.json   # beside the same command on HEAD

``--device cuda`` trains on the GPU (the trainer's next-step slide prefetch as always); each epoch's line and the
JSON give slide-steps per second (training slides / train seconds). Stores without an ingest manifest (e.g.
``benchmarks/array_stores.py``'s) take their labels from a CSV: ``--set data.labels=STORES/labels.csv``.

  python benchmarks/train_speed.py --config demo --stores S --epochs 3 --device cuda --set data.labels=S/labels.csv

Prints one line per epoch and writes JSON (config, stores, device, per-epoch and total train seconds, slide-steps
per second, the commit).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.environ.get("ROOT", str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, ROOT)

import torch

torch.set_num_threads(1)

from pipeline.config import load_config
from pipeline.data import build_slide_table, shard, split_train_val
from pipeline.train import TrainConfig
from workers.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="perturbed_mean", help="a name in configs/ or a YAML path")
    p.add_argument("--stores", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda; default cpu)")
    p.add_argument("--json", help="output JSON")
    a = p.parse_args()
    path = a.config if a.config.endswith(".yaml") else f"{ROOT}/configs/{a.config}.yaml"
    cfg = load_config(
        TrainConfig,
        path,
        [f"data.stores={a.stores}", "data.labels=manifest", f"optim.epochs={a.epochs}", *a.set],
    )
    table = build_slide_table(cfg.data)
    train, _ = split_train_val(table.records, cfg.data.val_fraction, cfg.data.seed)
    model_cfg = dataclasses.replace(cfg.model, num_classes=table.num_classes)
    trainer = Trainer(model_cfg, cfg.optim, cfg.schedule, slides_per_epoch=len(train), seed=cfg.seed, device=a.device)
    per_epoch = []
    for e in range(a.epochs):
        before = trainer.train_seconds
        trainer.train_epoch(shard(train, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed))
        per_epoch.append(trainer.train_seconds - before)
        print(
            f"epoch {e + 1} {per_epoch[-1]:.1f} s, {len(train) / per_epoch[-1]:.2f} slide-steps/s "
            f"(total {trainer.train_seconds:.1f} s)",
            flush=True,
        )
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out = {
        "commit": commit.stdout.strip() or None,
        "config": a.config,
        "set": a.set,
        "stores": a.stores,
        "train_slides": len(train),
        "epochs": a.epochs,
        "epoch_seconds": per_epoch,
        "train_seconds": trainer.train_seconds,
        "device": a.device,
        "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
        "slide_steps_per_second": [len(train) / t for t in per_epoch],
    }
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
