"""Session 30 diagnostic: how much of a training bag lies on the informative objects, per way of drawing it.

For a trained checkpoint and the training slides of its robustness task, draws each slide's bag as training does
(same model, same scores) with the hard top-k (inference), the perturbed top-k of the config (slot modes, S = 1)
and attention sampling variants, and prints per variant: the accuracy of the model on those bags, the fraction of
slots that overlap an informative object (sidecar boxes) and the distinct cells per bag.

Usage: python benchmarks/results/objects_v2/s30/bagcomp.py CHECKPOINT CONFIG STORES [N_SLIDES]
"""

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

import torch
from robustness import hits_of, load_split

from operators.model_io import load_checkpoint
from workers.patches import forward_slide, prepare_slide

VARIANTS = {
    "hard top-k": dict(training=False),
    "perturbed (S=1)": dict(training=True, sel=dict(selector="perturbed")),
    "attention T=0.05, replace": dict(
        training=True,
        sel=dict(selector="attention", attention_temperature=0.05, replace=True, attention_weights="uniform"),
    ),
    "attention T=0.02, replace": dict(
        training=True,
        sel=dict(selector="attention", attention_temperature=0.02, replace=True, attention_weights="uniform"),
    ),
    "attention T=0.05, no replace": dict(
        training=True, sel=dict(selector="attention", attention_temperature=0.05, attention_weights="uniform")
    ),
}


def main() -> None:
    ckpt, config, stores = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    model, _, _ = load_checkpoint(ckpt)
    model.eval()
    split = load_split(config, stores, [])
    base = model.cfg
    for name, v in VARIANTS.items():
        g = torch.Generator().manual_seed(0)
        ok = on = distinct = 0.0
        for rec in split.train[:n]:
            model.cfg = dataclasses.replace(base, **v.get("sel", {}))
            with torch.no_grad():
                out = forward_slide(model, rec.store, training=v["training"], generator=g, sigma=base.sigma)
            grid = prepare_slide(rec.store, model.cfg).grid
            cells = out.cell_indices.cpu()
            hit, _ = hits_of(grid.cell_xy_l0(cells).numpy(), grid.patch_size, split.boxes[rec.store])
            on += float(hit.mean())
            ok += int(out.logits.argmax()) == rec.target
            distinct += len(set(cells.tolist()))
        m = min(n, len(split.train))
        print(f"{name:30s} accuracy {ok / m:.3f}  slots on objects {on / m:.3f}  distinct cells {distinct / m:.2f}")


if __name__ == "__main__":
    main()
