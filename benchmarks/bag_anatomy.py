"""Diagnostic: what the held-out bags of a trained model are made of, and what the classifier says about each patch.

Loads a model saved by ``benchmarks/selection_hits.py --save-model FILE`` (objects task: the synth sidecars give the
informative objects and the distractors), runs the hard top-k selection on the held-out (or training) slides and,
for every chosen patch, records its type (``O`` on an informative object, ``D`` on a distractor, ``B`` background),
its texture kind, its normalised score and the classifier's per-patch prediction (the mean aggregator's head on
that patch alone). Prints:

* the held-out accuracy of the bag as the model aggregates it, and of offline alternatives over the same patches:
  the bag weighed by ``softmax(score / T)``, the top-m patches by score, the informative objects only (an oracle);
* per patch type: count, score mean and spread, the spread of the per-patch logits (how confident the classifier is
  on that type) and how often its argmax is the patch's own kind;
* every misclassified slide with its patches in score order (``type kind : score : predicted kind``).

Usage: python benchmarks/selection_hits.py ... --save-model /tmp/m.pt
       python benchmarks/bag_anatomy.py /tmp/m.pt [--split test|train]
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = os.environ.get("ROOT", str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
from operators.model import FoveateModel
from workers.patches import prepare_slide
from workers.slide_forward import forward_slide

sys.path.insert(0, str(Path(__file__).resolve().parent))
from selection_hits import box_overlap, pixel_patch_size, sidecars


def patch_type(x: int, y: int, p: int, side: dict) -> tuple[str, str | None]:
    """``("O", kind)`` when the patch overlaps an informative object (the largest overlap), else ``("D", kind)``
    for a distractor, else ``("B", None)``."""
    for tag, key in (("O", "structures"), ("D", "distractors")):
        areas = ((box_overlap(x, y, p, b), b.get("kind")) for b in side.get(key, []))
        best = max(areas, key=lambda t: t[0], default=(0, None))
        if best[0] > 0:
            return tag, best[1]
    return "B", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a file written by selection_hits.py --save-model")
    ap.add_argument("--split", choices=("test", "train"), default="test")
    a = ap.parse_args()
    ck = torch.load(a.model, weights_only=False)
    cfg = ck["cfg"]
    if cfg.aggregator not in ("mean", "vote"):
        raise SystemExit(f"per-patch predictions need the mean or vote aggregator, got {cfg.aggregator!r}")
    model = FoveateModel(cfg)
    model.load_state_dict(ck["state"])
    model.eval()
    stores = ck[a.split]
    side = sidecars(str(Path(stores[0]).parent))
    names = ck["class_names"]
    p = pixel_patch_size(cfg)
    rows = []
    with torch.no_grad():
        for st in stores:
            sc = side[str(Path(st).resolve())]
            out = forward_slide(model, st, training=False)
            slide = prepare_slide(st, cfg)
            feats = model.embed(slide.reader.read(out.cell_indices.cpu()).float().div(255.0))
            xy = out.coords_l0.cpu().numpy().reshape(-1, 2).tolist()
            rows.append(
                {
                    "store": st,
                    "target": ck["targets"][st],
                    "bag": out.logits.numpy()[0],
                    "logits": model.aggregator.head(feats).numpy(),  # [K, C]
                    "scores": out.patch_scores.cpu().numpy(),
                    "types": [patch_type(int(x), int(y), p, sc) for x, y in xy],
                }
            )

    def acc(fn) -> float:
        return float(np.mean([int(np.argmax(fn(r))) == r["target"] for r in rows]))

    def softmax_bag(r, t):
        w = np.exp((r["scores"] - r["scores"].max()) / t)
        return (w[:, None] * r["logits"]).sum(0) / w.sum()

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def hard_vote(r):  # majority of the patches' argmaxes; ties broken by the mean logits
        votes = np.bincount(np.argmax(r["logits"], 1), minlength=r["logits"].shape[1]).astype(float)
        return votes + 1e-3 * softmax(r["logits"].mean(0))

    def gate(r, d):  # the chosen patches whose score is within d of the bag's best
        return r["scores"] >= r["scores"].max() - d

    def objects_kept(d):  # share of the chosen informative objects that pass the gate
        o = [gate(r, d)[i] for r in rows for i, t in enumerate(r["types"]) if t[0] == "O"]
        return float(np.mean(o)) if o else float("nan")

    def objects_only(r):
        m = np.array([t[0] == "O" for t in r["types"]])
        return r["logits"][m].mean(0) if m.any() else r["logits"].mean(0)

    print(f"{len(rows)} {a.split} slides, {names}")
    print(f"bag as aggregated      {acc(lambda r: r['bag']):.2f}")
    for t in (0.03, 0.1, 0.3):
        print(f"softmax(score / {t:<4})   {acc(lambda r, t=t: softmax_bag(r, t)):.2f}")
    for m in (3, 4, 5):
        print(f"top {m} by score         {acc(lambda r, m=m: r['logits'][np.argsort(-r['scores'])[:m]].mean(0)):.2f}")
    print(f"objects only (oracle)  {acc(objects_only):.2f}")
    print(f"soft vote (mean prob)  {acc(lambda r: softmax(r['logits']).mean(0)):.2f}")
    print(f"hard vote (argmaxes)   {acc(hard_vote):.2f}")
    print(f"mean log-softmax       {acc(lambda r: np.log(softmax(r['logits'])).mean(0)):.2f}")
    for d in (0.05, 0.08, 0.1, 0.15):
        print(
            f"s >= max - {d:<4}: mean {acc(lambda r, d=d: r['logits'][gate(r, d)].mean(0)):.2f}"
            f" vote {acc(lambda r, d=d: softmax(r['logits'][gate(r, d)]).mean(0)):.2f}"
            f" kept {np.mean([gate(r, d).sum() for r in rows]):.1f}"
            f" objects kept {objects_kept(d):.2f}"
        )
    for tag in "ODB":
        items = [(r["logits"][i], t[1], r["scores"][i]) for r in rows for i, t in enumerate(r["types"]) if t[0] == tag]
        if not items:
            continue
        lg = np.array([it[0] for it in items])
        s = np.array([it[2] for it in items])
        line = f"type {tag}: n {len(items):4d} score {s.mean():.3f} +- {s.std():.3f} logit spread {np.mean(lg.max(1) - lg.min(1)):.2f}"
        if tag != "B":
            line += f" argmax == kind {np.mean([names[int(np.argmax(v))] == k for v, k in zip(lg, [it[1] for it in items])]):.2f}"
        print(line)
    for r in rows:
        pred = int(np.argmax(r["bag"]))
        if pred != r["target"]:
            desc = " ".join(
                f"{r['types'][i][0]}{(r['types'][i][1] or '')[:2]}:{r['scores'][i]:.2f}:{names[int(np.argmax(r['logits'][i]))][:2]}"
                for i in np.argsort(-r["scores"])
            )
            print(f"wrong {Path(r['store']).name} label {names[r['target']]} pred {names[pred]}: {desc}")


if __name__ == "__main__":
    main()
