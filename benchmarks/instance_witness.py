"""Diagnostic: how fast can a patch-level head learn *which* patches carry a slide's label, as a function of the
witness rate (the fraction of read patches that show an informative object)?

This isolates the evidence-distillation signal (``operators/evidence.py``) from selection. From the training
split of an ``objects`` task (``foveate synth --task objects``), every tissue cell that overlaps an informative
object and up to 60 distractor and 60 plain-tissue cells per slide are read once (full resolution, the model's
``patch_size``). Each step draws one training slide and a bag of ``--bag`` of its cells: each cell is an object
cell with probability ``--witness``, a distractor cell with probability ``--distractors``, plain tissue
otherwise. A fresh feature network (the config's ResNet) is trained on the bag with the slide label:

* ``--mode naive``: the instance head of evidence distillation (every patch inherits the slide label);
* ``--mode attn``: gated attention-MIL over the bag (Ilse et al. 2018); the "confidence" column is then the
  mean attention logit.

Every ``--every`` steps it prints, on the held-out slides' object / distractor / plain cells, the mean instance
confidence (``1 - H/log C``) and the instance accuracy against the slide label. An object patch agrees with its
slide label only as often as its kind is the majority kind (about 70 % in the binary task), so the attainable
accuracy on object cells is ~0.7 and on the others 0.5.

Usage: python benchmarks/instance_witness.py --stores STORES --witness 0.04 --steps 4000 [--mode attn]
       [--distractors 0.3] [--lr 1e-3] [--ssl-steps N] [--config perturbed_mean]

``--ssl-steps N``: first N steps of SimCLR-style contrastive pre-training of the feature network on the read
cells (shifts, colour jitter, noise; no flips or rotations, which would change a kind).
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

from operators.evidence import instance_confidence
from operators.model import FoveateModel
from pipeline.config import load_config
from pipeline.data import build_slide_table, split_train_val
from pipeline.train import TrainConfig
from workers.patches import prepare_slide


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", required=True)
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--witness", type=float, required=True, help="probability that a bag cell is an object cell")
    p.add_argument("--distractors", type=float, default=0.3, help="probability that a bag cell is a distractor")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--bag", type=int, default=24)
    p.add_argument("--mode", choices=("naive", "attn"), default="naive")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ssl-steps", type=int, default=0)
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
    rng = np.random.default_rng(a.seed)
    patch = mc.geometry.patch_size

    def cells_of(rec):
        si = prepare_slide(rec.store, mc)
        cand = torch.nonzero(si.cell_mask.flatten()).flatten()
        xy = si.grid.cell_xy_l0(cand).numpy()
        key = str(Path(rec.store).resolve())
        ob = hits_of(xy, patch, objects[key])[0]
        di = hits_of(xy, patch, distractors[key])[0] & ~ob
        groups = {}
        for name, m in (("obj", ob), ("dis", di), ("bg", ~ob & ~di)):
            c = cand[torch.from_numpy(m)]
            if name != "obj" and len(c) > 60:
                c = c[torch.from_numpy(rng.choice(len(c), 60, replace=False))]
            groups[name] = si.reader.read(c).float() / 255.0 if len(c) else torch.zeros(0, 3, patch, patch)
        return groups, rec.target

    t0 = time.time()
    train, test = [cells_of(r) for r in tr], [cells_of(r) for r in te]
    print(f"read {time.time() - t0:.0f}s; object cells per slide {np.mean([len(g['obj']) for g, _ in train]):.1f}")
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

    if a.ssl_steps:
        proj = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        opt = torch.optim.Adam([*model.features.parameters(), *proj.parameters()], lr=a.lr)
        pool = torch.cat([torch.cat([g["obj"], g["dis"], g["bg"]]) for g, _ in train])

        def aug(x):
            n = len(x)
            dx, dy = rng.integers(0, 9, 2)
            x = F.pad(x, (4, 4, 4, 4), mode="reflect")[:, :, dy : dy + patch, dx : dx + patch]
            x = x * (1 + 0.2 * (torch.rand(n, 3, 1, 1) - 0.5)) + 0.1 * (torch.rand(n, 3, 1, 1) - 0.5)
            return (x + 0.03 * torch.randn_like(x)).clamp(0, 1)

        for s in range(a.ssl_steps):
            x = pool[torch.from_numpy(rng.integers(0, len(pool), 64))]
            z = F.normalize(proj(model.features(torch.cat([aug(x), aug(x)]))), dim=1)
            sim = (z @ z.T / 0.2).fill_diagonal_(-1e9)
            loss = F.cross_entropy(sim, torch.cat([torch.arange(64, 128), torch.arange(0, 64)]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if s % a.every == 0:
                print(f"ssl {s} loss {loss.item():.3f} t {time.time() - t0:.0f}s", flush=True)

    params = [*model.features.parameters(), *model.instance_head.parameters(), *att.parameters()]
    opt = torch.optim.Adam(params, lr=a.lr)

    def evaluate() -> str:
        model.eval()
        parts = []
        with torch.no_grad():
            for name in ("obj", "dis", "bg"):
                conf, acc = [], []
                for g, y in test:
                    if len(g[name]):
                        h = model.features(g[name])
                        lg = att["cls"](h) if a.mode == "attn" else model.instance_head(h)
                        c = att_logit(h) if a.mode == "attn" else instance_confidence(lg)
                        conf.append(c.mean().item())
                        acc.append((lg.argmax(1) == y).float().mean().item())
                parts.append(f"{name}: conf {np.mean(conf):.3f} acc {np.mean(acc):.2f}")
        model.train()
        return " ".join(parts)

    for step in range(a.steps + 1):
        if step % a.every == 0:
            print(f"step {step} {evaluate()} t {time.time() - t0:.0f}s", flush=True)
        g, y = train[rng.integers(len(train))]
        n_o = rng.binomial(a.bag, a.witness) if len(g["obj"]) else 0
        n_d = rng.binomial(a.bag - n_o, min(1.0, a.distractors / max(1e-9, 1 - a.witness)))
        parts = [
            g[k][torch.from_numpy(rng.integers(0, len(g[k]), n))]
            for k, n in (("obj", n_o), ("dis", n_d), ("bg", a.bag - n_o - n_d))
            if n and len(g[k])
        ]
        h = model.features(torch.cat(parts))
        if a.mode == "attn":
            w = torch.softmax(att_logit(h), 0)
            loss = F.cross_entropy(att["cls"]((w[:, None] * h).sum(0, keepdim=True)), torch.tensor([y]))
        else:
            lg = model.instance_head(h)
            loss = F.cross_entropy(lg, torch.full((len(h),), y))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
