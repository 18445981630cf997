"""Diagnostic: how fast does the classifier (a config's feature network + aggregator) learn a synthetic task from
patches a perfect scorer would read? Prints held-out accuracy per epoch.

Bags are the ground-truth cells of ``benchmarks/robustness.py --oracle`` (per informative object its best cell, then
other overlapping cells, then random tissue cells up to K), fixed per slide. ``--objects N`` instead keeps N object
cells (one per object) and fills the bag with random tissue cells drawn afresh each epoch (a scorer that is only
partly on the objects); ``--noise-epochs E`` first trains E epochs on random tissue cells (a scorer that has not
found anything yet), under one LR schedule over all epochs. Held-out accuracy is always on the fixed oracle bags.

Usage: python benchmarks/oracle_curve.py --stores STORES [--config perturbed_mean] [--epochs 20] [--objects 3]
       [--noise-epochs 10] [--seed 0] [--set key=value ...]
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

torch.set_num_threads(1)
import robustness as R

from operators.checkpoint import build_model, with_num_classes
from pipeline.config import load_config
from pipeline.train import TrainConfig, classification_metrics
from workers.patches import prepare_slide
from workers.strata import rare_cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True)
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objects", type=int, default=0, help="object cells per bag, rest random (0: the oracle bag)")
    p.add_argument("--noise-epochs", type=int, default=0, help="epochs on random tissue cells first")
    p.add_argument(
        "--rare",
        type=int,
        default=0,
        help="bags of this many cells from the slide's rarest low-resolution appearance strata (label-free; "
        "``--strata``), fixed per slide, in training and for a second held-out accuracy",
    )
    p.add_argument("--strata", type=int, default=64)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()

    split = R.load_split(a.config, Path(a.stores), a.set)
    cfg = load_config(TrainConfig, ROOT / "configs" / f"{a.config}.yaml", a.set)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    torch.manual_seed(a.seed)
    model, mcfg = build_model(mcfg)
    rng = np.random.default_rng(a.seed)

    def bag(rec, kind: str):
        si = prepare_slide(rec.store, mcfg)
        boxes = split.boxes[rec.store]
        tissue = np.flatnonzero(si.cell_mask.flatten().numpy())
        if kind == "oracle":
            cells = R.oracle_cells(si, boxes, mcfg.selection.k, rng)
        elif kind == "rare":
            cells = rare_cells(si.lowres_u8, si.cell_mask, a.rare, a.strata)
            rare_hits[rec.store] = R.hits_of(R._cell_boxes(si.grid, cells), mcfg.geometry.patch_size, boxes)[0].mean()
        elif kind == "noise":
            cells = rng.choice(tissue, size=mcfg.selection.k, replace=False)
        else:
            best = R.oracle_cells(si, boxes, len(boxes), rng)[: a.objects]
            rest = rng.choice(np.setdiff1d(tissue, best), size=mcfg.selection.k - len(best), replace=False)
            cells = np.concatenate([best, rest])[rng.permutation(mcfg.selection.k)]
        cells = torch.from_numpy(np.asarray(cells, np.int64))
        return si.reader.read(cells), si.grid.cell_centres(cells), rec.target

    rare_hits: dict[str, float] = {}  # store -> fraction of its rare bag on an informative object
    train_oracle = [bag(r, "rare" if a.rare else "oracle") for r in split.train]
    test = [bag(r, "oracle") for r in split.test]
    test_rare = [bag(r, "rare") for r in split.test] if a.rare else []
    if a.rare:
        hit = np.mean([rare_hits[r.store] for r in split.test])
        print(f"rare bags: {hit:.3f} of their cells on an object (held-out slides)")

    def phase(epoch: int) -> str:
        return "noise" if epoch < a.noise_epochs else ("diluted" if a.objects else "oracle")

    def epoch_bags(epoch: int) -> list:
        return train_oracle if phase(epoch) == "oracle" else [bag(r, phase(epoch)) for r in split.train]

    t0 = time.perf_counter()

    def report(epoch: int, loss: float) -> None:
        m = classification_metrics(*R.predict_bags(model, test))
        rare = ""
        if test_rare:
            mr = classification_metrics(*R.predict_bags(model, test_rare))
            rare = f"rare-bag acc {mr['accuracy']:.2f} auc {mr['auc']:.2f} "
        print(
            f"ep {epoch + 1} {phase(epoch)} loss {loss:.3f} test acc {m['accuracy']:.2f} auc {m['auc']:.2f} {rare}"
            f"t {time.perf_counter() - t0:.0f}s",
            flush=True,
        )

    R.fit_bags(model, cfg.optim, epoch_bags, a.noise_epochs + a.epochs, rng, on_epoch=report)


if __name__ == "__main__":
    main()
