"""The cluster gate refitted on a trained gated model's own candidates: what its bags hold for other cluster counts.

A gated checkpoint (``model.experimental.gate_candidates`` > 0, written by ``benchmarks/robustness.py`` or
``foveate train``) fixes the scorer and the gate's encoder, so the candidates of every slide and their features are
fixed too. This script computes them once for the training and the held-out slides of the run's split, fits the gate
(:func:`operators.gate.fit_cluster_gate`, as the trainer does at the switch) for each cluster count and several
k-means seedings, and scores the held-out bags against the synth sidecars' boxes: hit rate (share of the bag's
patches on an informative object), object recall, decidable (the touched objects' majority is the label) and the
bag size; ``candidates`` is the same of all the candidates (the ceiling of any gate). No training: a refit takes
seconds, so the gate's settings are compared over seedings on the same scorer, where a training run is one draw.

``--fits 1,8`` also fits each gate as a union of that many k-means fits (``model.experimental.gate_fits``) and
``--keep-from 24`` applies it to each held-out slide's top 24 local maxima while fitting it on the checkpoint's top
``gate_candidates`` (``model.experimental.gate_keep_from``); ``--agree 0,0.5`` keeps a candidate in a gate of F
fits when that share of the fits keeps it (``model.experimental.gate_agree``; 0: any fit).

Usage: python benchmarks/gate_refit.py --stores DATA/stores --checkpoint RUN/model.pt [...] --clusters 16,32
       --seedings 8 [--fits 1,8] [--agree 0,0.5] [--keep-from 24] [--config perturbed_mean] [--json OUT.json]
(``DATA``: a folder ``benchmarks/robustness.py`` synthesised, e.g. ``<workdir>/data/shapes-8class-384x3072-v2``.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np
import torch

__all__ = ["candidate_table", "fit_gate", "refit_rows", "main"]


def candidate_table(model, split, n: int | None = None, pixels: bool = False) -> dict[str, list]:
    """Every train and test slide's top ``n`` gate candidates (None: what the model's gate keeps from,
    :func:`workers.slide_forward.gate_keep_from`): ``{"split", "target", "store", "xy" [n, 2] level-0 top-left,
    "features" [n, D], "scores" [n], "patch"}`` lists, one entry per slide, best first; with ``pixels`` also
    ``"pixels"`` (uint8 ``[n, 3, p, p]``, the reads a gated forward classifies) and ``"positions"`` ``[n, 2]`` (the
    cells' centres)."""
    from robustness import _cell_boxes

    from workers.patches import prepare_slide
    from workers.slide_forward import gate_candidates, score_slide

    keys = ("split", "target", "store", "xy", "features", "scores", "patch") + (
        ("pixels", "positions") if pixels else ()
    )
    out = {k: [] for k in keys}
    model.eval()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for part, records in (("train", split.train), ("test", split.test)):
            for rec in records:
                slide = prepare_slide(rec.store, model.cfg)
                cells, values = gate_candidates(model, score_slide(model, slide), tuple(slide.cell_mask.shape), n)
                u8 = slide.reader.read(cells)  # as workers.slide_forward.read_gate_candidates reads them
                out["split"].append(part)
                out["target"].append(int(rec.target))
                out["store"].append(str(rec.store))
                out["xy"].append(_cell_boxes(slide.grid, cells))
                out["features"].append(model.gate_encode(u8.to(dtype).div(255.0)).cpu().double())
                out["scores"].append(values.cpu().double())
                out["patch"].append(int(slide.grid.patch_size))
                if pixels:
                    out["pixels"].append(u8.cpu())
                    out["positions"].append(slide.grid.cell_centres(cells).cpu())
    return out


def fit_gate(
    table: dict[str, list],
    clusters: int,
    seeding: int,
    fits: int = 1,
    fit_on: int | None = None,
    agree: float = 0.0,
):
    """The gate fitted on the training slides' candidates (their first ``fit_on``; None: all the table has) with
    ``clusters``, ``fits`` k-means fits (a cell kept by the share ``agree`` of them) and the k-means seeding
    ``seeding`` by the trainer's own fit (:func:`workers.trainer.fit_gate_on_slides`, whose seeding is the run's
    seed): ``(CellGate, fit dict)``."""
    from operators.gate import CellGate
    from workers.trainer import fit_gate_on_slides

    slides = [
        (table["store"][i], table["features"][i][:fit_on], table["scores"][i][:fit_on])
        for i, part in enumerate(table["split"])
        if part == "train"
    ]
    gate = CellGate(None, slides[0][1].shape[1], clusters, fits=fits, agree=agree).double()
    return gate, fit_gate_on_slides(gate, slides, seeding)


def refit_rows(
    table: dict[str, list],
    split,
    clusters: int,
    seeding: int,
    fits: int = 1,
    fit_on: int | None = None,
    agree: float = 0.0,
) -> dict[str, float]:
    """:func:`fit_gate`, then the held-out bags (chosen from all the table's candidates of each slide): their mean
    hit rate / object recall / decidable / size, and ``vote_hit_rate``: the share of the bag's weight on an object
    when each kept cell is weighted by the fits that keep it (``model.experimental.gate_weights: votes``)."""
    from robustness import bag_row, overlaps

    gate, fit = fit_gate(table, clusters, seeding, fits, fit_on, agree)
    rows = []
    for i, part in enumerate(table["split"]):
        if part != "test":
            continue
        votes = gate.vote_counts(table["features"][i])
        keep = gate.keep_by_votes(votes).numpy()
        label = split.class_names[table["target"][i]]
        boxes = split.boxes[table["store"][i]]
        row = bag_row(table["xy"][i][keep], table["patch"][i], boxes, label)
        row["size"] = float(keep.sum())
        votes = votes.numpy()[keep].clip(min=1).astype(float)
        on = overlaps(table["xy"][i][keep], table["patch"][i], boxes).any(1)
        row["vote_hit_rate"] = float((votes * on).sum() / votes.sum())
        rows.append(row)
    res = _means(rows, ("hit_rate", "object_recall", "decidable", "size", "vote_hit_rate"))
    res["informative_clusters"] = int(fit["informative"].sum())
    return res


def candidates_row(table: dict[str, list], split) -> dict[str, float]:
    """The held-out slides' candidates, all of them: what a gate that keeps every glyph could hold."""
    from robustness import bag_row

    rows = [
        bag_row(
            table["xy"][i], table["patch"][i], split.boxes[table["store"][i]], split.class_names[table["target"][i]]
        )
        for i, p in enumerate(table["split"])
        if p == "test"
    ]
    return _means(rows, ("hit_rate", "object_recall", "decidable"))


def _means(rows: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """The mean of each key over the rows that have it (``decidable`` needs boxes that name their class)."""
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys if any(k in r for r in rows)}


def _ints(text: str, minimum: int = 2) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def _shares(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    from robustness import checkpoint_result, load_split

    from operators.checkpoint import load_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", type=Path, required=True, help="the synthesised stores folder (with the manifest)")
    p.add_argument("--checkpoint", type=Path, nargs="+", required=True, help="gated model.pt files")
    p.add_argument("--clusters", type=_ints, default=[16, 32], help="cluster counts to fit (default 16,32)")
    p.add_argument("--seedings", type=int, default=8, help="k-means seedings per count (default 8)")
    p.add_argument("--fits", type=lambda t: _ints(t, 1), default=[1], help="k-means fits per gate, a union (default 1)")
    p.add_argument(
        "--agree",
        type=_shares,
        default=[0.0],
        help="with --fits F > 1: the shares of the fits that must keep a candidate, each a row (default 0: any fit)",
    )
    p.add_argument(
        "--keep-from",
        type=int,
        default=0,
        help="the bag from each slide's top N local maxima (default 0: the checkpoint's gate_candidates)",
    )
    p.add_argument("--config", default="perturbed_mean", help="the config whose data split the runs used")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.seedings < 1:
        p.error(f"--seedings must be >= 1, got {args.seedings}")
    if args.keep_from < 0:
        p.error(f"--keep-from must be 0 or a count of candidates, got {args.keep_from}")
    torch.set_num_threads(1)
    split = load_split(args.config, args.stores, [])
    result = checkpoint_result("gate_refit.py", argv)
    print(
        f"{'checkpoint':36s} {'k':>3s} {'F':>2s} {'agree':>4s} hit rate        object recall   decidable       size"
        "              vote-weighted hit rate"
    )
    for ck in args.checkpoint:
        model, _, _ = load_checkpoint(ck)
        if model.gate is None:
            raise SystemExit(f"{ck} has no cluster gate (model.experimental.gate_candidates is 0)")
        fit_on = model.cfg.experimental.gate_candidates
        keep_from = max(args.keep_from, fit_on) if args.keep_from else None
        table = candidate_table(model, split, keep_from)
        entry = {
            "checkpoint": ck.parent.name,
            "fit_on": fit_on,
            "keep_from": keep_from or fit_on,
            "candidates": candidates_row(table, split),
            "fits": {},
        }
        c = entry["candidates"]
        dec = f"{c['decidable']:.3f}" if "decidable" in c else "-"
        print(
            f"{ck.parent.name[-36:]:36s} all          {c['hit_rate']:.3f}           {c['object_recall']:.3f}           {dec}"
        )
        for k in args.clusters:
            for n_fits in args.fits:
                for agree in args.agree if n_fits > 1 else [0.0]:
                    fits = [refit_rows(table, split, k, s, n_fits, fit_on, agree) for s in range(args.seedings)]
                    name = str(k) if n_fits == 1 else f"{k}x{n_fits}" + (f"@{agree:g}" if agree else "")
                    entry["fits"][name] = fits
                    cols = []
                    for key in ("hit_rate", "object_recall", "decidable", "size", "vote_hit_rate"):
                        v = [f[key] for f in fits if key in f]
                        cols.append(f"{np.mean(v):.3f} [{min(v):.2f},{max(v):.2f}]" if v else f"{'-':17s}")
                    print(f"{'':36s} {k:3d} {n_fits:2d} {agree:4.2f}  " + "  ".join(cols))
        result["checkpoints"].append(entry)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
