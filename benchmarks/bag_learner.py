"""Diagnostic: can a config's classifier learn the label of a majority-of-glyphs task (``foveate synth --task
shapes``) from the glyphs themselves, given only slide labels? The scorer is taken out of the question.

Each slide becomes a fixed bag of K = 8 crops: one per glyph of its sidecar (5), centred on the glyph and shifted by
up to +-``--shift`` px each time it is read (the grid of stride 32 puts a glyph anywhere within +-16 px of its best
cell's centre), and 3 random tissue crops away from every glyph. The config's feature network + aggregator
(``model.classify``) is trained on the bags with the slide label (AdamW, the trainer's warm-up + cosine schedule,
``--batch`` bags per step). Reported per ``--every`` epochs: bag accuracy / AUC on the training bags and on the
held-out bags (the split of ``foveate train``), and *inst*: the per-glyph accuracy of the aggregator's head on each
glyph crop alone (a bag of one) against the glyph's own class.

Options that isolate a cause: ``--supervised`` trains on the glyph classes instead (the upper bound of the features);
``--bag-forward`` embeds one bag per forward call (BatchNorm statistics over one slide's 8 patches, as
``foveate train`` does) instead of ``--batch`` bags at once; ``--run-std`` standardises the features with running
statistics before the aggregator; ``--set model.features.norm=batch`` etc. change the config.

The crops are cached per data folder in ``benchmarks/_work/bag_learner_<name>.pt`` (the first run reads them).

Usage: python benchmarks/bag_learner.py --data benchmarks/_work/robustness/data/shapes-binary-384x3072
       [--config perturbed_mean] [--epochs 40] [--set model.features.norm=batch] [--bag-forward] [--seed 0]
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

C = 128  # cached crop side
FILL = 3


def build_cache(task_dir: Path, out: Path, config: str) -> None:
    import robustness as rb

    from workers.store import SlideStore

    split = rb.load_split(config, task_dir / "stores", [])
    rng = np.random.default_rng(0)
    res = {}
    for part, recs in (("train", split.train), ("test", split.test)):
        xs, gcls, ys = [], [], []
        for rec in recs:
            st = SlideStore(rec.store)
            boxes = split.boxes[rec.store]
            crops, cl = [], []
            for b in boxes:
                x0, y0 = int(round(b["cx"])) - C // 2, int(round(b["cy"])) - C // 2
                crops.append(st.read_region((x0, y0), 0, (C, C)))
                cl.append(b["class_index"])
            mask, ds = st.tissue_mask()
            ty, tx = np.nonzero(mask)
            got = 0
            while got < FILL:
                i = rng.integers(len(ty))
                x0 = int((tx[i] + 0.5) * ds) - C // 2
                y0 = int((ty[i] + 0.5) * ds) - C // 2
                if any(abs(x0 + C / 2 - b["cx"]) < C and abs(y0 + C / 2 - b["cy"]) < C for b in boxes):
                    continue
                crops.append(st.read_region((x0, y0), 0, (C, C)))
                cl.append(-1)
                got += 1
            xs.append(np.stack(crops))
            gcls.append(cl)
            ys.append(rec.target)
        res[part] = {
            "x": torch.from_numpy(np.stack(xs)).permute(0, 1, 4, 2, 3).contiguous(),
            "g": torch.tensor(gcls),
            "y": torch.tensor(ys),
        }
        print(part, res[part]["x"].shape, flush=True)
    torch.save(res, out)


def view(x, patch, inp, shift, gen):
    """x uint8 [B, K, 3, C, C] -> float [B, K, 3, inp, inp]: a patch x patch window shifted by up to +-shift."""
    b, k = x.shape[:2]
    c0 = (C - patch) // 2
    if shift:
        off = torch.randint(-shift, shift + 1, (b, k, 2), generator=gen)
    else:
        off = torch.zeros(b, k, 2, dtype=torch.long)
    out = torch.empty(b, k, 3, patch, patch, dtype=torch.uint8)
    for i in range(b):
        for j in range(k):
            oy, ox = c0 + int(off[i, j, 0]), c0 + int(off[i, j, 1])
            out[i, j] = x[i, j, :, oy : oy + patch, ox : ox + patch]
    f = out.float().div(255.0)
    if inp != patch:
        f = F.interpolate(f.flatten(0, 1), size=(inp, inp), mode="area" if inp < patch else "bilinear")
        f = f.view(b, k, 3, inp, inp)
    return f


def run(args, cache):
    from operators.checkpoint import build_model, with_num_classes
    from pipeline.config import load_config
    from pipeline.train import TrainConfig, classification_metrics, lr_factor

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = load_config(TrainConfig, ROOT / "configs" / f"{args.config}.yaml", args.set)
    mcfg = with_num_classes(cfg.model, 2)
    model, mcfg = build_model(mcfg)
    tr, te = cache["train"], cache["test"]
    if args.ntrain:
        tr = {k: v[: args.ntrain] for k, v in tr.items()}
    n = len(tr["y"])
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    acc = args.batch
    total = args.epochs * math.ceil(n / acc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, 2, 0.5))
    pos = torch.full((1, 8, 2), 0.5)
    RS = {"m": None, "v": None}

    def logits_of(xb):
        b, k = xb.shape[:2]
        feats = model.embed(xb.flatten(0, 1)).view(b, k, -1)
        if args.run_std:
            if model.training:
                with torch.no_grad():
                    f2 = feats.flatten(0, 1)
                    if RS["m"] is None:
                        RS["m"], RS["v"] = f2.mean(0), f2.var(0)
                    else:
                        RS["m"].lerp_(f2.mean(0), 0.05)
                        RS["v"].lerp_(f2.var(0), 0.05)
            feats = (feats - RS["m"]) / (RS["v"] + 1e-5).sqrt()
        if args.feat_ln:
            feats = F.layer_norm(feats, feats.shape[-1:])
        feats = feats * args.pool_scale
        return model.aggregate(feats, pos.expand(b, k, 2)), feats

    def evaluate(d):
        model.eval()
        with torch.no_grad():
            xb = view(d["x"], args.patch, args.inp, 0, gen)
            lg, feats = logits_of(xb)
            probs = lg.softmax(-1).numpy()
            inst = model.aggregate_each(feats.flatten(0, 1)).view(len(d["y"]), -1, 2)
        m = classification_metrics(d["y"].tolist(), probs)
        g = d["g"]
        gl = g >= 0
        inst_acc = float((inst.argmax(-1)[gl] == g[gl]).float().mean())
        return m["accuracy"], m["auc"], inst_acc

    t0 = time.time()
    rows = []
    for ep in range(args.epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        for s in range(0, n, acc):
            idx = order[s : s + acc]
            xb = view(tr["x"][idx], args.patch, args.inp, args.shift, gen)
            if args.flip:
                if torch.rand(1, generator=gen) < 0.5:
                    xb = xb.flip(-1)
                xb = torch.rot90(xb, int(torch.randint(4, (1,), generator=gen)), dims=(-2, -1))
            if args.bag_forward:
                lg = torch.cat([logits_of(xb[i : i + 1])[0] for i in range(len(idx))])
                feats = None
            else:
                lg, feats = logits_of(xb)
            loss = F.cross_entropy(lg, tr["y"][idx])
            if args.inst:
                il = model.aggregate_each(feats.flatten(0, 1))
                loss = loss + args.inst * F.cross_entropy(il, tr["y"][idx].repeat_interleave(xb.shape[1]))
            if args.inst_only:
                il = model.aggregate_each(feats.flatten(0, 1))
                loss = F.cross_entropy(il, tr["y"][idx].repeat_interleave(xb.shape[1]))
            if args.supervised:  # strong supervision upper bound: glyph class per crop
                il = model.aggregate_each(feats.flatten(0, 1))
                g = tr["g"][idx].flatten()
                loss = F.cross_entropy(il[g >= 0], g[g >= 0])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
        if (ep + 1) % args.every == 0 or ep + 1 == args.epochs:
            a_tr = evaluate(tr)
            a_te = evaluate(te)
            rows.append(
                {
                    "epoch": ep + 1,
                    "train": dict(zip(("accuracy", "auc", "inst"), a_tr)),
                    "test": dict(zip(("accuracy", "auc", "inst"), a_te)),
                }
            )
            print(
                f"ep {ep + 1:3d} train acc {a_tr[0]:.3f} auc {a_tr[1]:.3f} inst {a_tr[2]:.3f} | test acc {a_te[0]:.3f} "
                f"auc {a_te[1]:.3f} inst {a_te[2]:.3f} | {time.time() - t0:.0f}s",
                flush=True,
            )
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a benchmarks/robustness.py data folder (slides/ and stores/)")
    p.add_argument("--config", default="perturbed_mean")
    p.add_argument("--patch", type=int, default=64, help="crop side in level-0 px")
    p.add_argument("--inp", type=int, default=0, help="network input side (0: --patch)")
    p.add_argument("--shift", type=int, default=16, help="max crop shift in px")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--inst", type=float, default=0.0, help="weight of a per-crop loss with the slide label")
    p.add_argument("--supervised", action="store_true", help="train on the glyph classes (upper bound of the features)")
    p.add_argument("--flip", action="store_true", help="random flip + rot90 of each batch")
    p.add_argument("--feat-ln", action="store_true", help="layer-normalise each feature vector before the aggregator")
    p.add_argument("--inst-only", action="store_true", help="train only the per-crop loss with the slide label")
    p.add_argument(
        "--bag-forward",
        action="store_true",
        help="one bag per forward call (BatchNorm over one slide, as foveate train)",
    )
    p.add_argument(
        "--run-std", action="store_true", help="standardise features with running statistics before the aggregator"
    )
    p.add_argument(
        "--pool-scale", type=float, default=1.0, help="multiply the features by this before the aggregator (8: a sum)"
    )
    p.add_argument("--ntrain", type=int, default=0, help="use only the first N training bags (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--json", default=None, help="write the per-epoch rows here")
    args = p.parse_args()
    args.inp = args.inp or args.patch
    torch.set_num_threads(1)
    d = Path(args.data)
    cp = ROOT / "benchmarks" / "_work" / f"bag_learner_{d.resolve().name}.pt"
    if not cp.is_file():
        cp.parent.mkdir(parents=True, exist_ok=True)
        build_cache(d, cp, args.config)
    cache = torch.load(cp)
    print(json.dumps({k: v for k, v in vars(args).items()}), flush=True)
    rows = run(args, cache)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "epochs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
