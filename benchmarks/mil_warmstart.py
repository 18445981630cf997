"""Diagnostic: a multiple-instance warm start on cached exploration cells, then distilling its attention into
the scorer — does it point the scorer at small, rare evidence before any selection training?

For every slide of an ``objects`` task (``foveate synth --task objects``) ``--cells`` cells are drawn once with
the stratified exploration of evidence distillation (``workers.strata.cell_strata`` + ``draw_cells``: no
ground truth) and read at full resolution into memory. Phase 1 trains a fresh feature network with a gated
attention-MIL head (Ilse et al. 2018) on bags of ``--bag`` cached cells with the slide label. Phase 2 trains the
scorer (on the low-resolution view) with the evidence rank loss to order the cached cells of a slide like the
MIL attention (targets detached). Ground truth is used only to report: the attention on object / distractor /
plain cells of the held-out slides, the MIL accuracy on held-out slides (bag = all their cached cells), and the
scorer's hard top-K on held-out slides: fraction of chosen cells on an object (hits) and of objects touched
(recall).

Usage: python benchmarks/mil_warmstart.py --stores STORES [--cells 256] [--strata 32] [--bag 64]
       [--steps 2000] [--scorer-steps 500] [--set model.geometry.scorer_downsample=8]
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from robustness import hits_of
from selection_hits import structure_boxes

from operators.evidence import evidence_rank_loss
from operators.model import FoveateModel
from pipeline.config import load_config
from pipeline.data import build_slide_table, split_train_val
from pipeline.train import TrainConfig
from workers.patches import prepare_slide
from workers.strata import cell_strata, draw_cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True)
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--cells", type=int, default=256)
    p.add_argument("--strata", type=int, default=32)
    p.add_argument("--bag", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--scorer-steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    path = a.config if a.config.endswith(".yaml") else f"{ROOT}/configs/{a.config}.yaml"
    cfg = load_config(TrainConfig, path, [f"data.stores={a.stores}", "data.labels=manifest", *a.set])
    table = build_slide_table(cfg.data)
    tr, te = split_train_val(table.records, cfg.data.val_fraction, cfg.data.seed)
    mc = dataclasses.replace(
        cfg.model,
        num_classes=table.num_classes,
        evidence=dataclasses.replace(cfg.model.evidence, instance_weight=1.0),
    )
    objects, distractors = structure_boxes(a.stores), structure_boxes(a.stores, "distractors")
    gen = torch.Generator().manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    patch = mc.geometry.patch_size

    def cache(rec):
        si = prepare_slide(rec.store, mc)
        mask = si.cell_mask.flatten()
        base = torch.where(mask, torch.zeros(mask.shape), torch.full(mask.shape, float("-inf")))
        strata = cell_strata(si.lowres, tuple(si.cell_mask.shape), a.strata)
        cells = draw_cells(base, a.cells, gen, strata)
        key = str(Path(rec.store).resolve())
        xy = si.grid.cell_xy_l0(cells).numpy()
        ob = hits_of(xy, patch, objects[key])[0]
        di = hits_of(xy, patch, distractors[key])[0] & ~ob
        # every tissue cell's kind, for the scorer's recall
        cand = torch.nonzero(mask).flatten()
        return {
            "pix": si.reader.read(cells),
            "cells": cells,
            "kind": np.where(ob, 0, np.where(di, 1, 2)),
            "y": rec.target,
            "lowres": si.lowres,
            "mask": si.cell_mask,
            "grid": si.grid,
            "key": key,
            "n_cand": len(cand),
        }

    t0 = time.time()
    train, test = [cache(r) for r in tr], [cache(r) for r in te]
    frac = np.mean([np.mean(s["kind"] == 0) for s in train])
    print(
        f"cached {a.cells} cells x {len(train) + len(test)} slides in {time.time() - t0:.0f}s; object cells {frac:.3f}"
    )
    torch.manual_seed(a.seed)
    model = FoveateModel(mc)
    d = model.feature_dim
    att = torch.nn.ModuleDict(
        {
            "V": torch.nn.Linear(d, 32),
            "U": torch.nn.Linear(d, 32),
            "w": torch.nn.Linear(32, 1),
            "cls": torch.nn.Linear(d, table.num_classes),
        }
    )

    def att_logit(h):
        return att["w"](torch.tanh(att["V"](h)) * torch.sigmoid(att["U"](h)))[:, 0]

    def mil(h):
        w = torch.softmax(att_logit(h), 0)
        return att["cls"]((w[:, None] * h).sum(0, keepdim=True)), w

    opt = torch.optim.Adam([*model.features.parameters(), *att.parameters()], lr=a.lr)

    def evaluate() -> str:
        model.eval()
        acc, share, lg = [], [], {0: [], 1: [], 2: []}
        with torch.no_grad():
            for s in test:
                h = model.features(s["pix"].float() / 255.0)
                out, w = mil(h)
                acc.append(int(out.argmax(1)) == s["y"])
                a_l = att_logit(h).numpy()
                for k in (0, 1, 2):
                    if (s["kind"] == k).any():
                        lg[k].append(a_l[s["kind"] == k].mean())
                share.append(float(w[torch.from_numpy(s["kind"] == 0)].sum()))
        model.train()
        return (
            f"test acc {np.mean(acc):.2f} attn-logit obj {np.mean(lg[0]):.3f} dis {np.mean(lg[1]):.3f} "
            f"bg {np.mean(lg[2]):.3f} obj attn share {np.mean(share):.3f}"
        )

    for step in range(a.steps + 1):
        if step % a.every == 0:
            print(f"mil step {step} {evaluate()} t {time.time() - t0:.0f}s", flush=True)
        if step == a.steps:
            break
        s = train[rng.integers(len(train))]
        idx = torch.from_numpy(rng.choice(len(s["pix"]), min(a.bag, len(s["pix"])), replace=False))
        out, _ = mil(model.features(s["pix"][idx].float() / 255.0))
        loss = F.cross_entropy(out, torch.tensor([s["y"]]))
        opt.zero_grad()
        loss.backward()
        opt.step()

    # phase 2: scorer distillation of the attention on the cached cells
    model.eval()
    with torch.no_grad():
        for s in train + test:
            s["target"] = att_logit(model.features(s["pix"].float() / 255.0))
    sopt = torch.optim.Adam(model.scorer.parameters(), lr=a.lr)

    def scorer_eval() -> str:
        hits, recall = [], []
        with torch.no_grad():
            for s in test:
                sc = model.score(s["lowres"][None], s["mask"][None])[0]
                top = sc.topk(mc.selection.k).indices
                h, touched = hits_of(s["grid"].cell_xy_l0(top).numpy(), patch, objects[s["key"]])
                hits.append(h.mean())
                recall.append(touched / max(1, len(objects[s["key"]])))
        return f"scorer top-{mc.selection.k}: hits {np.mean(hits):.3f} recall {np.mean(recall):.2f}"

    for step in range(a.scorer_steps + 1):
        if step % a.every == 0:
            print(f"scorer step {step} {scorer_eval()} t {time.time() - t0:.0f}s", flush=True)
        if step == a.scorer_steps:
            break
        s = train[rng.integers(len(train))]
        sc = model.score(s["lowres"][None], s["mask"][None])[0, s["cells"]]
        tgt = s["target"]
        ev = (tgt - tgt.min()) / (tgt.max() - tgt.min() + 1e-6)
        loss = evidence_rank_loss(sc, ev, temperature=mc.evidence.rank_temperature)
        sopt.zero_grad()
        loss.backward()
        sopt.step()


if __name__ == "__main__":
    main()
