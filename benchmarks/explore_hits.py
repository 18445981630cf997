"""Diagnostic: how often do exploration draws land on a ground-truth object (and on a distractor)?

For the first ``--slides`` training slides of a synthetic task, ``--draws`` cells per slide are drawn as the
evidence-distillation exploration draws them (``workers.patches.cell_strata``: a stratum uniformly, then a cell in
it; 0 strata = uniform over tissue cells) and checked against the synth sidecar's boxes (``robustness.hits_of``).

Usage: python benchmarks/explore_hits.py --stores STORES [--strata 0,8,32] [--set model.scorer_downsample=8]
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import robustness as R
import torch

from pipeline.config import load_config
from pipeline.model_io import with_num_classes
from pipeline.train import TrainConfig
from workers.patches import cell_strata, prepare_slide


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True)
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--strata", default="0,8,32")
    p.add_argument("--slides", type=int, default=20)
    p.add_argument("--draws", type=int, default=400)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    split = R.load_split(a.config, Path(a.stores), a.set)
    cfg = load_config(TrainConfig, ROOT / "configs" / f"{a.config}.yaml", a.set)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    rng = np.random.default_rng(0)
    print("strata  object  distractor")
    for n_strata in (int(s) for s in a.strata.split(",")):
        obj = dis = n = 0
        for rec in split.train[: a.slides]:
            si = prepare_slide(rec.store, mcfg)
            mask = si.cell_mask.flatten().numpy()
            if n_strata:
                st = cell_strata(si.lowres_u8, tuple(si.cell_mask.shape), n_strata).flatten().numpy()
                labels = [s for s in np.unique(st[mask]) if s >= 0]
                draws = [rng.choice(np.flatnonzero((st == rng.choice(labels)) & mask)) for _ in range(a.draws)]
            else:
                draws = rng.choice(np.flatnonzero(mask), a.draws)
            xy = si.grid.cell_xy_l0(torch.tensor(np.asarray(draws))).numpy()
            patch = int(si.grid.patch_size)
            obj += R.hits_of(xy, patch, split.boxes[rec.store])[0].sum()
            dis += R.hits_of(xy, patch, split.distractors[rec.store])[0].sum()
            n += len(draws)
        print(f"{n_strata:6d}  {obj / n:.4f}  {dis / n:.4f}", flush=True)


if __name__ == "__main__":
    main()
