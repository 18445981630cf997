"""Diagnostic: train one selection model in-process with the trainer of ``foveate train`` (``workers.trainer.Trainer``,
one worker: the same loss, optimiser, schedules, slide order and seeds, without Ray/MLflow) on the stores of a
``foveate synth`` task and print per epoch: training cross-entropy; the fraction of chosen patches that overlap a
ground-truth informative structure (``trainhit`` for hard top-k on the training slides, ``testhit`` on the
held-out split; from the synth sidecars, diagnostic only, never used for training); the fraction of informative
structures that some chosen test patch touches (``recall``); the fraction of chosen test patches on a distractor
(``dhit``, objects task); ``vote a/b`` (objects task): the held-out accuracy a texture counter would reach on the
chosen patches, voting by the pixel overlap with the informative objects only (a) or with objects and
distractors (b) — the ceiling of a classifier that reads kinds but cannot tell objects from distractors is b;
the median gradient norm; train and held-out accuracy, held-out AUC; and the mean of
every auxiliary loss term (``loss_instance``, ``loss_rank`` for evidence distillation).

Usage: python benchmarks/selection_hits.py --config attention_sampling --stores WORKDIR/stores [--seed SPLIT]
       [--epochs E] [--set key=value ...]     (``--set seed=S`` changes the initialisation, order and noise)
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.environ.get("ROOT", str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, ROOT)
import dataclasses

import numpy as np
import pandas as pd
import torch

torch.set_num_threads(1)
from pipeline.config import load_config
from pipeline.data import build_slide_table, shard, split_train_val
from pipeline.train import TrainConfig
from workers.metrics import classification_metrics
from workers.slide_forward import forward_slide
from workers.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import hits_of  # the same patch/box overlap as the robustness benchmark


def sidecars(stores: str) -> dict[str, dict]:
    """The synth sidecar (``SLIDE.json``: ground-truth boxes, class names) of every store in the manifest that has
    one, by resolved store path, each read once."""
    man = pd.read_csv(f"{stores}/manifest.csv")
    out = {}
    for r in man.itertuples():
        side = Path(str(r.source) + ".json")
        if side.is_file():
            out[str(Path(r.store).resolve())] = json.loads(side.read_text())
    return out


def structure_boxes(stores: str, which: str = "structures") -> dict[str, list[dict]]:
    """Ground-truth boxes per store path from the synth sidecar: ``structures`` (the informative ones) or
    ``distractors`` (objects task)."""
    return {k: v.get(which, []) for k, v in sidecars(stores).items()}


def pixel_patch_size(model_cfg) -> int:
    """``model.geometry.patch_size`` (level-0 pixels, as the sidecar boxes are); refuses a µm config (``patch_size_um``)."""
    if model_cfg.geometry.patch_size is None:
        raise SystemExit(
            "this diagnostic needs model.geometry.patch_size in level-0 pixels, not model.geometry.patch_size_um"
        )
    return int(model_cfg.geometry.patch_size)


def box_overlap(x: int, y: int, patch: int, box: dict) -> int:
    """Pixels shared by the level-0 patch at ``(x, y)`` (side ``patch``) and a sidecar box."""
    w = min(x + patch, box["x"] + box["width"]) - max(x, box["x"])
    h = min(y + patch, box["y"] + box["height"]) - max(y, box["y"])
    return w * h if w > 0 and h > 0 else 0


def kind_vote(coords, patch: int, boxes: list[dict], names: list[str] | tuple[str, ...]) -> str | None:
    """Diagnostic ceiling of a texture counter: the kind (a name in ``names``) that covers the most bag pixels,
    counting each chosen patch's overlap with the bounding boxes of ``boxes`` (with a ``kind``); None when
    nothing overlaps."""
    votes = np.zeros(len(names))
    for x, y in coords.cpu().numpy().reshape(-1, 2).tolist():
        for b in boxes:
            if b.get("kind") not in names:
                continue
            votes[names.index(b["kind"])] += box_overlap(x, y, patch, b)
    return names[int(votes.argmax())] if votes.sum() > 0 else None


def hit_rate(coords, boxes, patch: int) -> tuple[float, float]:
    """Fraction of patches (level-0 top-left ``coords[K, 2]``) overlapping any box (``robustness.hits_of``), and
    the fraction of the boxes that some patch overlaps (recall)."""
    hits, touched = hits_of(coords.cpu().numpy().reshape(-1, 2), patch, boxes)
    return (float(hits.mean()) if len(hits) else 0.0), (touched / len(boxes) if boxes else 0.0)


def install_gt_scorer(trainer: Trainer, boxes: dict[str, list[dict]], weight: float) -> None:
    """Make ``trainer.model.score`` (and the moving average's, with ``optim.ema_epochs``) return ``(1 - weight) *
    scores + weight * gt`` for the slide being read, ``gt`` = each cell's overlap area with the informative objects
    over the slide's largest (diagnostic only)."""
    from operators.scorer import minmax_normalise
    from workers.patches import prepare_slide

    current: dict[str, object] = {}
    gt_cache: dict[str, torch.Tensor] = {}
    orig_store = trainer._store

    def store(path):
        current["key"] = str(Path(path).resolve())
        current["path"] = path
        return orig_store(path)

    def gt_of(key) -> torch.Tensor:
        if key not in gt_cache:
            si = prepare_slide(trainer._store(current["path"]), trainer.model.cfg)
            g = si.grid
            xy = g.cell_xy_l0(torch.arange(g.num_cells)).numpy().reshape(-1, 2).astype(np.float64)
            p = g.patch_size
            area = np.zeros(len(xy))
            for o in boxes.get(key, []):
                w = np.clip(np.minimum(xy[:, 0] + p, o["x"] + o["width"]) - np.maximum(xy[:, 0], o["x"]), 0, None)
                h = np.clip(np.minimum(xy[:, 1] + p, o["y"] + o["height"]) - np.maximum(xy[:, 1], o["y"]), 0, None)
                area += w * h
            gt_cache[key] = torch.from_numpy(area / max(area.max(), 1.0)).float()
        return gt_cache[key]

    def mixed(orig_score):
        def score(lowres, cell_mask, geometry=None):
            s = orig_score(lowres, cell_mask, geometry)
            gt = gt_of(current["key"]).to(s.device, s.dtype)[None]
            cand = torch.isfinite(s)
            return minmax_normalise((1 - weight) * torch.where(cand, s, 0.0) + weight * gt, cand)

        return score

    trainer._store = store
    for model in {id(m): m for m in (trainer.model, trainer.eval_model)}.values():
        model.score = mixed(model.score)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="attention_sampling", help="a name in configs/ or a YAML path")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--stores", required=True)
    p.add_argument("--seed", type=int, default=0, help="split seed (data.seed)")
    p.add_argument("--val-fraction", type=float, default=0.3)
    p.add_argument("--device", default="cpu", help="where the model trains: cpu (default), cuda or cuda:N")
    p.add_argument(
        "--gt-scorer",
        type=float,
        default=0.0,
        metavar="W",
        help="diagnostic: mix the scorer's scores with the ground truth, (1 - W) * scores + W * (overlap of each "
        "cell with an informative object, relative to the slide's largest) — in training and evaluation — to "
        "see whether the classifier learns when the right cells are read (W = 1: a perfect scorer)",
    )
    p.add_argument(
        "--grad-norms",
        action="store_true",
        help="also print, per epoch, the median gradient norm of each part of the model before clipping",
    )
    p.add_argument(
        "--soft-eval",
        action="store_true",
        help="also the held-out accuracy with the training-time (soft/sampled) selection at sigma_start",
    )
    p.add_argument(
        "--eval-last",
        action="store_true",
        help="evaluate (and print the line of) the last epoch only: the other epochs just train",
    )
    p.add_argument(
        "--save-model",
        metavar="FILE",
        help="also save the trained model (torch.save of {'cfg': model config, 'state': state_dict, 'train': "
        "training stores, 'test': held-out stores}) for offline analysis",
    )
    a = p.parse_args()
    path = a.config if a.config.endswith(".yaml") else f"{ROOT}/configs/{a.config}.yaml"
    cfg = load_config(
        TrainConfig,
        path,
        [
            f"data.stores={a.stores}",
            "data.labels=manifest",
            f"data.val_fraction={a.val_fraction}",
            f"data.seed={a.seed}",
            f"optim.epochs={a.epochs}",
            *a.set,
        ],
    )
    table = build_slide_table(cfg.data)
    tr, te = split_train_val(table.records, cfg.data.val_fraction, cfg.data.seed)
    side = sidecars(a.stores)
    boxes = {k: v.get("structures", []) for k, v in side.items()}
    distractors = {k: v.get("distractors", []) for k, v in side.items()}
    names = {k: v.get("class_names", []) for k, v in side.items()}  # objects task: texture kinds
    model_cfg = dataclasses.replace(cfg.model, num_classes=table.num_classes)
    patch = pixel_patch_size(model_cfg)  # before the trainer is built
    trainer = Trainer(model_cfg, cfg.optim, cfg.schedule, slides_per_epoch=len(tr), seed=cfg.seed, device=a.device)
    if a.gt_scorer > 0:
        install_gt_scorer(trainer, boxes, a.gt_scorer)
    part_norms: dict[str, list[float]] = {}
    if a.grad_norms:
        clip = torch.nn.utils.clip_grad_norm_

        def recording_clip(params, max_norm, *args, **kw):
            for name, child in trainer.model.named_children():
                gs = [q.grad.detach().norm() for q in child.parameters() if q.grad is not None]
                if gs:
                    part_norms.setdefault(name, []).append(float(torch.stack(gs).norm()))
            return clip(params, max_norm, *args, **kw)

        torch.nn.utils.clip_grad_norm_ = recording_clip
    t0 = time.time()
    for _ in range(cfg.optim.epochs):
        aux: dict[str, list[float]] = {}
        grad = []

        def on_step(m, step, aux=aux, grad=grad):
            grad.append(m["grad_norm"])
            for k, v in m.items():
                if k.startswith("loss_"):
                    aux.setdefault(k, []).append(v)

        trainer.on_step = on_step
        ep = trainer.train_epoch(shard(tr, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed))
        if a.eval_last and trainer.epoch < cfg.optim.epochs:
            print(f"ep {trainer.epoch:2d} trained ({time.time() - t0:.0f} s)", flush=True)
            continue
        model = trainer.eval_model
        model.eval()
        res = {}
        with torch.no_grad():
            for name, recs in (("train", tr), ("test", te)):
                probs, ys, hits, recall, dhits, votes = [], [], [], [], [], []
                for rec in recs:
                    out = forward_slide(model, trainer._store(rec.store), training=False)
                    probs.append(torch.softmax(out.logits.reshape(1, -1).float(), -1)[0].cpu().numpy())
                    ys.append(rec.target)
                    key = str(Path(rec.store).resolve())
                    h, r = hit_rate(out.coords_l0, boxes.get(key, []), patch)
                    hits.append(h)
                    recall.append(r)
                    dhits.append(hit_rate(out.coords_l0, distractors.get(key, []), patch)[0])
                    if names.get(key):
                        obj = kind_vote(out.coords_l0, patch, boxes.get(key, []), names[key])
                        allv = kind_vote(
                            out.coords_l0, patch, boxes.get(key, []) + distractors.get(key, []), names[key]
                        )
                        label = table.class_names[rec.target]  # the trainer's class order, not the sidecar's
                        votes.append((obj == label, allv == label))
                res[name] = (
                    classification_metrics(ys, np.array(probs)),
                    float(np.mean(hits)),
                    float(np.mean(recall)),
                    float(np.mean(dhits)),
                    np.mean(votes, axis=0) if votes else None,
                )
        soft = ""
        if a.soft_eval:  # the training-time (soft / sampled) selection at the start sigma, without gradients
            probs, ys = [], []
            gen = torch.Generator(device=trainer.device).manual_seed(12345)
            with torch.no_grad():
                for rec in te:
                    out = forward_slide(
                        model, trainer._store(rec.store), training=True, sigma=cfg.schedule.sigma_start, generator=gen
                    )
                    probs.append(torch.softmax(out.logits.reshape(1, -1).float(), -1)[0].cpu().numpy())
                    ys.append(rec.target)
            soft_acc = classification_metrics(ys, np.array(probs))["accuracy"]
            soft = f"soft acc {soft_acc:.2f} "
        ce = np.mean(aux.get("loss_ce", [ep.loss / max(ep.n, 1)]))
        extra = " ".join(f"{k[5:]} {np.mean(v):.3f}" for k, v in aux.items() if k != "loss_ce")
        m, th, trec, tdh, tvote = res["test"]
        if tvote is not None:  # texture-vote ceilings of the held-out bags: objects only / objects + distractors
            extra += f" vote {tvote[0]:.2f}/{tvote[1]:.2f}"
        if part_norms:
            extra += " |g| by part: " + " ".join(f"{k} {np.median(v):.3g}" for k, v in part_norms.items())
            part_norms.clear()
        print(
            f"ep {trainer.epoch:2d} ce {ce:.3f} trainhit {res['train'][1]:.2f} testhit {th:.2f} recall {trec:.2f} "
            f"dhit {tdh:.2f} |g| {np.median(grad):.3g} train acc {res['train'][0]['accuracy']:.2f} "
            f"test acc {m['accuracy']:.2f} auc {m['auc']:.2f} "
            f"{soft}t {time.time() - t0:.0f}s {extra}",
            flush=True,
        )
    if a.save_model:
        torch.save(
            {
                "cfg": model_cfg,
                "state": trainer.eval_model.state_dict(),
                "train": [r.store for r in tr],
                "test": [r.store for r in te],
                "targets": {r.store: r.target for r in (*tr, *te)},
                "class_names": list(table.class_names),
            },
            a.save_model,
        )
    print(
        json.dumps(
            {
                "train_seconds": trainer.train_seconds,
                "test_accuracy": m["accuracy"],
                "test_auc": m["auc"],
                "test_hits": th,
                "test_recall": trec,
                "test_distractor_hits": tdh,
                **(
                    {"test_vote_objects": float(tvote[0]), "test_vote_all": float(tvote[1])}
                    if tvote is not None
                    else {}
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
