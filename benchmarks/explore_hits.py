"""Diagnostic: how often do exploration draws land on a ground-truth object (and on a distractor)?

For the first ``--slides`` training slides of a synthetic task, cells are drawn as the evidence-distillation
exploration draws them (``workers.strata.cell_strata``: a stratum uniformly, then a cell in
it; 0 strata = uniform over tissue cells) and checked against the synth sidecar's boxes (``robustness.hits_of``).
The draws are the trainer's own (``workers.patches.draw_cells``): ``--steps`` slide-steps of ``--cells``
distinct cells each.

Usage: python benchmarks/explore_hits.py --stores STORES [--strata 0,8,32] [--set model.geometry.scorer_downsample=8]
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import robustness as R
import torch

from operators.checkpoint import with_num_classes
from pipeline.config import load_config
from pipeline.train import TrainConfig
from workers.patches import prepare_slide
from workers.strata import cell_strata, draw_cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True)
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--strata", default="0,8,32")
    p.add_argument("--slides", type=int, default=20)
    p.add_argument("--steps", type=int, default=50, help="slide-steps per slide (default 50)")
    p.add_argument("--cells", type=int, default=8, help="exploration cells per slide-step (default 8)")
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    split = R.load_split(a.config, Path(a.stores), a.set)
    cfg = load_config(TrainConfig, ROOT / "configs" / f"{a.config}.yaml", a.set)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    gen = torch.Generator().manual_seed(0)
    print("strata  object  distractor")
    for n_strata in (int(s) for s in a.strata.split(",")):
        obj = dis = n = 0
        for rec in split.train[: a.slides]:
            si = prepare_slide(rec.store, mcfg)
            mask = si.cell_mask.flatten()
            scores = torch.where(mask, 0.0, float("-inf"))  # every tissue cell a candidate, as in training
            strata = cell_strata(si.lowres_u8, tuple(si.cell_mask.shape), n_strata) if n_strata else None
            draws = torch.cat([draw_cells(scores, a.cells, gen, strata) for _ in range(a.steps)])
            xy = si.grid.cell_xy_l0(draws).numpy()
            patch = int(si.grid.patch_size)
            obj += R.hits_of(xy, patch, split.boxes[rec.store])[0].sum()
            dis += R.hits_of(xy, patch, split.distractors[rec.store])[0].sum()
            n += len(draws)
        print(f"{n_strata:6d}  {obj / n:.4f}  {dis / n:.4f}", flush=True)


if __name__ == "__main__":
    main()
