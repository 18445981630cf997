"""The training loop of 68f6686's benchmarks/selection_hits.py (the code when issue 10 was opened), without its
per-epoch evaluation and hit counting: seconds of training for 20 epochs of a config on a task's stores.

Usage: git worktree add /tmp/open 68f6686 && cd /tmp/open && \
       ROOT=/tmp/open python <this file> --stores STORES [--config perturbed_mean] [--epochs 20]
(the issue-open code and its configs; compare with benchmarks/train_speed.py on HEAD run beside it)."""

import argparse
import json
import math
import os
import sys
import time

ROOT = os.environ.get("ROOT", "/tmp/open")
sys.path.insert(0, ROOT)
import numpy as np
import torch

torch.set_num_threads(1)
from operators.model import FoveateModel
from pipeline.config import load_config
from pipeline.data import build_slide_table, split_train_val
from pipeline.train import TrainConfig, lr_factor, sigma_at
from workers.patches import forward_slide
from workers.store import SlideStore

p = argparse.ArgumentParser()
p.add_argument("--config", default="perturbed_mean")
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--stores", required=True)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
cfg = load_config(
    TrainConfig,
    f"{ROOT}/configs/{a.config}.yaml",
    [
        f"data.stores={a.stores}",
        "data.labels=manifest",
        "data.val_fraction=0.3",
        f"data.seed={a.seed}",
        f"optim.epochs={a.epochs}",
    ],
)
table = build_slide_table(cfg.data)
tr, te = split_train_val(table.records, 0.3, a.seed)
torch.manual_seed(cfg.seed)
from pipeline.model_io import with_num_classes

model = FoveateModel(with_num_classes(cfg.model, table.num_classes))
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
acc = cfg.optim.accumulate
spe = math.ceil(len(tr) / acc)
total = spe * cfg.optim.epochs
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, cfg.optim.warmup, cfg.optim.min_lr_ratio))
gen = torch.Generator()
gen.manual_seed(cfg.seed * 1000)
stores = {r.store: SlideStore(r.store) for r in tr + te}
rng = np.random.default_rng(a.seed)
step = 0
train_s = 0.0
for ep in range(cfg.optim.epochs):
    t0 = time.perf_counter()
    model.train()
    order = rng.permutation(len(tr))
    for s in range(spe):
        batch = [tr[i] for i in order[s * acc : (s + 1) * acc]]
        sigma = sigma_at(step, total, cfg.schedule.sigma_start, cfg.schedule.sigma_end)
        opt.zero_grad(set_to_none=True)
        for rec in batch:
            out = forward_slide(model, stores[rec.store], training=True, sigma=sigma, generator=gen)
            ce = torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([rec.target]))
            loss = ce + sum(v.sum() for v in out.aux_losses.values())
            (loss / len(batch)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e9)
        opt.step()
        sched.step()
        step += 1
    train_s += time.perf_counter() - t0
    print(f"ep {ep + 1} train {train_s:.1f}s", flush=True)
print(
    json.dumps(
        {"code": "68f6686", "config": a.config, "stores": a.stores, "epochs": a.epochs, "train_seconds": train_s}
    )
)
