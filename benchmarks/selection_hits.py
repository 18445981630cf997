"""Diagnostic: train one selection model in-process (no Ray/MLflow; the trainer's loss, optimiser, schedules and
seeds) on the stores of a ``benchmarks/accuracy.py`` run and print per epoch: training cross-entropy, the
attention entropy relative to uniform (``Hrel``, attention sampling), the fraction of chosen patches that
overlap a synthetic structure (``trainhit`` while training, ``testhit`` for hard top-k on the held-out split,
from the ``foveate synth`` ground-truth sidecars; diagnostic only, never used for training), the median
gradient norm of the scorer and of all parameters, and held-out accuracy/AUC.

Usage: python benchmarks/selection_hits.py --config attention_sampling --stores WORKDIR/stores [--gseed N]
       [--epochs E] [--set key=value ...]   (``--gseed`` changes only the slide order and the selection noise)
"""
import sys, json, time, math, argparse
import os
from pathlib import Path
ROOT = os.environ.get("ROOT", str(Path(__file__).resolve().parents[1])); sys.path.insert(0, ROOT)
import numpy as np, torch
torch.set_num_threads(1)
from pipeline.config import load_config
from pipeline.train import TrainConfig, classification_metrics, lr_factor, sigma_at
from pipeline.data import build_slide_table, split_train_val
from operators.model import FoveateModel
from workers.patches import forward_slide, prepare_slide
from workers.store import SlideStore
import pandas as pd

p = argparse.ArgumentParser()
p.add_argument("--config", default="attention_sampling")
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--set", action="append", default=[])
p.add_argument("--stores", required=True)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--gseed", type=int, default=0)
a = p.parse_args()
cfg = load_config(TrainConfig, f"{ROOT}/configs/{a.config}.yaml",
                  [f"data.stores={a.stores}", "data.labels=manifest", "data.val_fraction=0.3", f"data.seed={a.seed}",
                   f"optim.epochs={a.epochs}", *a.set])
table = build_slide_table(cfg.data)
tr, te = split_train_val(table.records, 0.3, a.seed)
man = pd.read_csv(f"{a.stores}/manifest.csv")
# ground-truth structures (diagnostic only)
src_of = {str(__import__("pathlib").Path(r.store).resolve()): r.source for r in man.itertuples()}
def structs(rec):
    return json.load(open(src_of[str(__import__("pathlib").Path(rec.store).resolve())] + ".json"))["structures"]
S = {r.store: structs(r) for r in tr + te}
P = cfg.model.patch_size
def hits(rec, coords):
    ss = S[rec.store]; h = 0
    for x, y in coords.tolist():
        h += any(x < s["x"] + s["width"] and s["x"] < x + P and y < s["y"] + s["height"] and s["y"] < y + P for s in ss)
    return h / len(coords)
torch.manual_seed(cfg.seed)
from pipeline.model_io import with_num_classes
model = FoveateModel(with_num_classes(cfg.model, 2))
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
acc = cfg.optim.accumulate
spe = math.ceil(len(tr) / acc); total = spe * cfg.optim.epochs
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, cfg.optim.warmup, cfg.optim.min_lr_ratio))
gen = torch.Generator(); gen.manual_seed(cfg.seed * 1000 + a.gseed)
stores = {r.store: SlideStore(r.store) for r in tr + te}
rng = np.random.default_rng(a.seed + a.gseed)
step = 0
t0 = time.time()
for ep in range(cfg.optim.epochs):
    model.train()
    order = rng.permutation(len(tr))
    ce_s, ent_s, hit_s, n, gn_sc, gn_all, clipfrac = 0, 0, 0, 0, [], [], []
    auxs = {}
    for s in range(spe):
        batch = [tr[i] for i in order[s * acc:(s + 1) * acc]]
        sigma = sigma_at(step, total, cfg.schedule.sigma_start, cfg.schedule.sigma_end)
        opt.zero_grad(set_to_none=True)
        for rec in batch:
            out = forward_slide(model, stores[rec.store], training=True, sigma=sigma, generator=gen, target=rec.target)
            ce = torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([rec.target]))
            loss = ce + sum(v.sum() for v in out.aux_losses.values())
            (loss / len(batch)).backward()
            ce_s += float(ce.detach()); n += 1
            for kk, vv in out.aux_losses.items():
                auxs[kk] = auxs.get(kk, 0.0) + float(vv.detach().sum())
            if "instance_confidence" in out.info:
                auxs["conf"] = auxs.get("conf", 0.0) + out.info["instance_confidence"]
            hit_s += hits(rec, out.coords_l0)
            if "attention_entropy" in out.selection.aux:
                ent_s += float(out.selection.aux["attention_entropy"].mean()) / math.log(float(out.info["num_candidates"]))
        gsc = torch.sqrt(sum((q.grad ** 2).sum() for q in model.scorer.parameters() if q.grad is not None))
        gn_sc.append(float(gsc))
        g = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e9))
        gn_all.append(g)
        opt.step(); sched.step(); step += 1
    model.eval()
    probs, ys, thit = [], [], 0
    with torch.no_grad():
        for rec in te:
            out = forward_slide(model, stores[rec.store], training=False, sigma=0.0)
            probs.append(torch.softmax(out.logits.reshape(1, -1), -1)[0].numpy()); ys.append(rec.target)
            thit += hits(rec, out.coords_l0)
    m = classification_metrics(ys, np.array(probs))
    print(f"ep {ep+1:2d} ce {ce_s/n:.3f} Hrel {ent_s/n:.3f} trainhit {hit_s/n:.2f} testhit {thit/len(te):.2f} "
          f"|g_scorer| {np.median(gn_sc):.3g} |g| {np.median(gn_all):.3g} test acc {m['accuracy']:.2f} auc {m['auc']:.2f} "
          f"t {time.time()-t0:.0f}s " + " ".join(f"{kk} {vv/n:.3f}" for kk, vv in auxs.items()), flush=True)
