"""A fresh classifier trained on a gated checkpoint's bags: the second phase without the first, beside the oracle.

A gated checkpoint (``model.experimental.gate_candidates`` > 0) fixes the scorer and the gate's encoder, so every
slide's candidates (its top local maxima) and their gate features are fixed. This script reads them once for the
training and held-out slides of the split, makes each slide's bag by one of the rules below, and trains the
oracle's classifier (``benchmarks/robustness.py``'s :func:`robustness.run_oracle`: the config's feature network +
aggregator from scratch, AdamW, the trainer's warm-up + cosine, ``optim.accumulate`` bags per step, augmented as
``foveate train`` does) on the training slides' bags, then tests it on the held-out slides' bags made by the same
rule. The oracle's own bags are a rule too, so each row differs from the oracle only in its bags, on the same
slides and the same training. No validation split: every training slide of the split trains, as in the oracle.

Bag rules (``--bags``, comma-separated, one row each):
  ``gate``      one k-means fit of the gate (``--clusters``, seeding ``--seeding``), fitted on the top
                ``gate_candidates`` of the training slides, applied to the top ``gate_candidates`` (as shipped);
  ``union``     ``--fits`` fits, any of them keeping a cell (``model.experimental.gate_fits``), applied to the top
                ``--keep-from`` (``model.experimental.gate_keep_from``);
  ``topN``      a slide's first N candidates, no gate (e.g. ``top8``: what the plain two-phase run reads);
  ``oracle``    :func:`robustness.oracle_cells` (the ground-truth cells);
  ``X+pure``    rule X with every patch that misses the slide's informative boxes dropped (ground truth: what X
                would give without filler; a slide left empty keeps its best-scored cell).

Usage: python benchmarks/gate_bags.py --stores DATA/stores --checkpoint RUN/model.pt [...] --bags gate,union,oracle
       [--config perturbed_mean] [--set model.augment.symmetry=flips ...] [--epochs 40] [--seed 0] [--json OUT]
(``--config`` and ``--set`` make the classifier, as ``robustness.py --oracle`` does; the split is the config's.)
``--as-trainer --loop-split 0.2 --epochs 70`` train as the loop's second phase does (the trainer's per-module clip and
moving average, the 214 training slides of ``robustness.py --val-fraction 0.2``, its epochs after the switch) but to
the end, without a validation split; ``--curve`` adds the held-out accuracy after every epoch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np
import torch

__all__ = ["rule_keep", "train_rule", "loop_split", "main"]


def rule_keep(
    rule: str, table: dict[str, list], split, *, fit_on: int, clusters: int, seeding: int, fits: int, keep_from: int
) -> list[np.ndarray]:
    """Per slide of ``table`` (:func:`gate_refit.candidate_table`) the indices of the candidates the bag rule keeps
    (any rule of the module docstring but ``oracle``)."""
    from gate_refit import fit_gate
    from robustness import overlaps

    base, _, pure = rule.partition("+")
    if pure and pure != "pure":
        raise ValueError(f"a bag rule is X or X+pure, got {rule!r}")
    if base.startswith("top") and base[3:].isdigit() and int(base[3:]) > 0:
        keep = [np.arange(min(int(base[3:]), len(f))) for f in table["features"]]
    elif base in ("gate", "union"):
        f, m = (1, fit_on) if base == "gate" else (fits, keep_from)
        gate, _ = fit_gate(table, clusters, seeding, f, fit_on)
        keep = [np.flatnonzero(gate.keep_by_votes(gate.vote_counts(feat[:m])).numpy()) for feat in table["features"]]
    else:
        raise ValueError(f"unknown bag rule {rule!r}: expected gate, union, topN, oracle, each optionally +pure")
    if pure:
        out = []
        for i, k in enumerate(keep):
            on = overlaps(table["xy"][i][k], table["patch"][i], split.boxes[table["store"][i]]).any(1)
            out.append(k[on] if on.any() else k[:1])
        keep = out
    return keep


def train_rule(
    config: str,
    overrides: list[str],
    split,
    seed: int,
    epochs: int,
    train_items,
    test_items,
    *,
    as_trainer: bool = False,
    curve: bool = False,
    val_items=None,
) -> dict:
    """:func:`robustness.run_oracle`'s training on given bags (``[(patches uint8 [K, 3, p, p], positions [K, 2],
    target)]``): held-out and training accuracy / AUC. ``as_trainer``: clipped and averaged as the trainer does
    (:func:`robustness.fit_bags`); ``curve``: also the held-out accuracy and AUC after every epoch
    (``test_curve``, before the final refresh of the feature statistics); ``val_items``: bags of slides that do not
    train (the loop's validation split): their accuracy and mean cross-entropy at the end (``val_accuracy``,
    ``val_loss``; with ``curve`` also after every epoch, ``val_curve``)."""
    from robustness import config_path, fit_bags, predict_bags, refresh_bag_statistics

    from operators.checkpoint import build_model, with_num_classes
    from pipeline.config import load_config
    from pipeline.train import TrainConfig, classification_metrics

    cfg = load_config(TrainConfig, config_path(config), overrides)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    torch.manual_seed(seed)
    model, mcfg = build_model(mcfg)
    rng = np.random.default_rng(seed)
    points: list[list[float]] = []
    val_points: list[list[float]] = []

    def val_metrics(m) -> tuple[float, float]:
        ys, probs = predict_bags(m, val_items)
        loss = float(np.mean([-np.log(max(p[y], 1e-12)) for y, p in zip(ys, probs)]))
        return classification_metrics(ys, probs)["accuracy"], loss

    def after(epoch, m):
        r = classification_metrics(*predict_bags(m, test_items))
        points.append([epoch + 1, r["accuracy"], r["auc"]])
        if val_items:
            val_points.append([epoch + 1, *val_metrics(m)])

    t0 = time.perf_counter()
    model = fit_bags(
        model,
        cfg.optim,
        lambda _epoch: train_items,
        epochs,
        rng,
        as_trainer=as_trainer,
        after_epoch=after if curve else None,
    )
    refresh_bag_statistics(model, train_items)
    m = classification_metrics(*predict_bags(model, test_items))
    tr = classification_metrics(*predict_bags(model, train_items))
    return {
        "test_accuracy": m["accuracy"],
        "test_auc": m["auc"],
        "train_accuracy": tr["accuracy"],
        "train_seconds": time.perf_counter() - t0,
        **({"test_curve": points} if curve else {}),
        **(dict(zip(("val_accuracy", "val_loss"), val_metrics(model))) if val_items else {}),
        **({"val_curve": val_points} if curve and val_items else {}),
    }


def loop_split(split, fraction: float, config: str, overrides: list[str]):
    """``(split, validation records)``: ``split`` with its training slides cut to those ``robustness.py
    --in-process --val-fraction fraction`` trains on (the same stratified draw, seeded by ``data.seed + 1``), the
    held-out slides as they are, and the training slides the loop validates on."""
    from robustness import config_path

    from pipeline.config import load_config
    from pipeline.data import split_train_val
    from pipeline.train import TrainConfig

    cfg = load_config(TrainConfig, config_path(config), overrides)
    train, val = split_train_val(split.train, fraction, cfg.data.seed + 1)
    return dataclasses.replace(split, train=train), val


def _oracle_items(config: str, overrides: list[str], split, seed: int, val_stores: frozenset = frozenset()):
    from robustness import config_path, oracle_cells

    from operators.checkpoint import with_num_classes
    from pipeline.config import load_config
    from pipeline.train import TrainConfig
    from workers.patches import prepare_slide

    cfg = load_config(TrainConfig, config_path(config), overrides)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    rng = np.random.default_rng(seed)
    out = {"train": [], "test": [], "val": []}
    for part, recs in (("train", split.train), ("test", split.test)):
        for rec in recs:
            si = prepare_slide(rec.store, mcfg)
            cells = torch.from_numpy(oracle_cells(si, split.boxes[rec.store], mcfg.selection.k, rng))
            out["val" if rec.store in val_stores else part].append(
                (si.reader.read(cells), si.grid.cell_centres(cells), rec.target)
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    from gate_refit import candidate_table
    from robustness import bag_row, checkpoint_result, load_split

    from operators.checkpoint import load_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", type=Path, required=True, help="the synthesised stores folder (with the manifest)")
    p.add_argument("--checkpoint", type=Path, nargs="+", required=True, help="gated model.pt files")
    p.add_argument("--bags", default="gate,oracle", help="bag rules, comma-separated (see the module docstring)")
    p.add_argument("--clusters", type=int, default=16)
    p.add_argument("--seeding", type=int, default=0, help="the gate's k-means seeding (default 0)")
    p.add_argument("--fits", type=int, default=8, help="the union's k-means fits (default 8)")
    p.add_argument("--keep-from", type=int, default=24, help="the union's candidates per slide (default 24)")
    p.add_argument("--config", default="perturbed_mean", help="the classifier's config and the split's")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="key=value for the classifier")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="the classifier's initialisation and draws")
    p.add_argument(
        "--as-trainer",
        action="store_true",
        help="clip and average the weights as the trainer does (optim.clip, optim.ema_epochs); default: as the oracle",
    )
    p.add_argument(
        "--loop-split",
        type=float,
        default=0.0,
        metavar="F",
        help="train on the training slides robustness.py --val-fraction F trains on (the rest of them unused); "
        "default 0: all of them, as the oracle",
    )
    p.add_argument("--curve", action="store_true", help="the held-out accuracy after every epoch (test_curve)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0.0 <= args.loop_split < 1.0:
        p.error(f"--loop-split must be in [0, 1), got {args.loop_split}")
    torch.set_num_threads(1)
    split = load_split(args.config, args.stores, args.overrides)
    val_stores: frozenset[str] = frozenset()
    if args.loop_split > 0:  # the validation slides ride with the held-out ones through the table, then part
        split, val = loop_split(split, args.loop_split, args.config, args.overrides)
        val_stores = frozenset(r.store for r in val)
        split = dataclasses.replace(split, test=[*val, *split.test])
    result = checkpoint_result("gate_bags.py", argv)
    rules = [r for r in args.bags.split(",") if r]
    oracle = None
    print(
        f"{'checkpoint':30s} {'bags':14s} {'test acc':>8s} {'AUC':>6s} {'train':>6s} {'hit':>6s} {'recall':>6s} "
        f"{'decid.':>6s} {'size':>5s} {'s':>5s}",
        flush=True,
    )
    for ck in args.checkpoint:
        model, _, _ = load_checkpoint(ck)
        if model.gate is None:
            raise SystemExit(f"{ck} has no cluster gate (model.experimental.gate_candidates is 0)")
        fit_on = model.cfg.experimental.gate_candidates
        n = max(args.keep_from, fit_on, *[int(r.split("+")[0][3:]) for r in rules if r.startswith("top")])
        table = candidate_table(model, split, n, pixels=True)
        entry = {"checkpoint": ck.parent.name, "rows": {}}
        for rule in rules:
            if rule == "oracle":
                if oracle is None:
                    oracle = _oracle_items(args.config, args.overrides, split, args.seed, val_stores)
                items, bag_stats = oracle, {}
            else:
                keep = rule_keep(
                    rule,
                    table,
                    split,
                    fit_on=fit_on,
                    clusters=args.clusters,
                    seeding=args.seeding,
                    fits=args.fits,
                    keep_from=args.keep_from,
                )
                items = {"train": [], "test": [], "val": []}
                stats = []
                for i, k in enumerate(keep):
                    kt = torch.from_numpy(k)
                    part, target = table["split"][i], table["target"][i]
                    part = "val" if table["store"][i] in val_stores else part
                    items[part].append((table["pixels"][i][kt], table["positions"][i][kt], target))
                    if part == "test":
                        boxes = split.boxes[table["store"][i]]
                        r = bag_row(table["xy"][i][k], table["patch"][i], boxes, split.class_names[target])
                        r["size"] = float(len(k))
                        stats.append(r)
                bag_stats = {
                    key: float(np.mean([r[key] for r in stats if key in r]))
                    for key in ("hit_rate", "object_recall", "decidable", "size")
                    if any(key in r for r in stats)
                }
            row = {
                **train_rule(
                    args.config,
                    args.overrides,
                    split,
                    args.seed,
                    args.epochs,
                    items["train"],
                    items["test"],
                    as_trainer=args.as_trainer,
                    curve=args.curve,
                    val_items=items.get("val"),
                ),
                **bag_stats,
            }
            entry["rows"][rule] = row
            print(
                f"{ck.parent.name[-30:]:30s} {rule:14s} {row['test_accuracy']:8.3f} {row['test_auc']:6.3f} "
                f"{row['train_accuracy']:6.3f} {row.get('hit_rate', float('nan')):6.3f} "
                f"{row.get('object_recall', float('nan')):6.3f} {row.get('decidable', float('nan')):6.3f} "
                f"{row.get('size', float('nan')):5.1f} {row['train_seconds']:5.0f}",
                flush=True,
            )
            if args.json:  # written after every row: a long run's rows are kept
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({**result, "checkpoints": [*result["checkpoints"], entry]}, indent=1))
        result["checkpoints"].append(entry)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
