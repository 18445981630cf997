"""Linear probe of a frozen patch encoder: self-supervised pretraining (``foveate pretrain``) against a random init.

On a synthetic ``objects`` (or, ``--family shapes``, ``shapes``: the crops are the glyphs) archive
(``foveate synth --task objects|shapes``; synth + ingest once, as
``benchmarks/robustness.py`` prepares its data), every informative object of a slide's ground-truth sidecar
(``<slide>.json``, ``structures``: level-0 box and ``kind``) gives one crop of the model's patch size centred on it,
read from the store by :class:`workers.patches.PatchReader` at ``model.geometry.patch_input``. Each encoder embeds the
crops (frozen, eval mode); a multinomial logistic regression (L-BFGS, L2) is fitted on the crops of the first
``1 - test_fraction`` of the slides and scored on the rest: accuracy of the object's kind, and the slide vote (the
share of held-out slides whose objects' predicted kinds have the slide's majority kind as their strict mode: the bag
accuracy those per-object calls allow). ``--at cell`` probes each object's best grid cell instead (most overlap, the
best-centred of equal ones: the patch a perfect selection reads); ``--at recentred`` that cell's read moved onto the
ink it holds (:mod:`workers.recentre`, ``model.geometry.recentre``). Encoders compared:

* ``random``: the ResNet of ``model.features`` at its seeded initialisation (what training starts from without
  ``init``);
* ``pretrained``: the same ResNet after ``--epochs`` of :class:`workers.pretrain.Pretrainer` on the stores
  (``--objective``; one in-process worker, the numerics of one ``foveate pretrain`` worker), or the encoder given
  with ``--encoder`` (a ``state_dict`` file, ``runs:/<run_id>`` or ``models:/...`` of a ``foveate pretrain`` run).

Tiny case (a couple of minutes on two cores)::

    python benchmarks/pretrain_probe.py --count 8 --size 2048 --epochs 2 --json /tmp/probe.json

Prints a table (encoder, objective, epochs, crops train/test, accuracy) and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import torch

from benchmarks.robustness import TASKS, Task, overlap_areas, prepare_data

PROBE_AT = ("centred", "cell", "recentred")


def placement(xy: np.ndarray, patch: int, objs: list[dict]) -> np.ndarray:
    """``[n, 2]``: per object, the L-infinity distance (level-0 px) from its box's centre to the centre of the
    ``patch``-px read at top-left ``xy[n, 2]``, and 1.0 when the box lies whole inside the read."""
    box = np.array([[o["x"], o["y"], o["x"] + o["width"], o["y"] + o["height"]] for o in objs], dtype=np.float64)
    xy = np.asarray(xy, dtype=np.float64)
    centre = (box[:, :2] + box[:, 2:]) / 2.0
    off = np.abs(xy + patch / 2.0 - centre).max(1)
    whole = (box[:, :2] >= xy).all(1) & (box[:, 2:] <= xy + patch).all(1)
    return np.stack([off, whole.astype(np.float64)], 1)


def object_crops(stores: Path, model_cfg, at: str = "centred") -> list[tuple[str, torch.Tensor, list[str], np.ndarray]]:
    """Per store (sorted): ``(slide_id, uint8 crops [n, 3, s, s], kinds, placement [n, 2])`` of its sidecar's
    informative objects (:func:`placement` of each read); ``at="centred"``: a patch centred on each object;
    ``"cell"``: the grid cell that overlaps the object most, the best-centred of equal ones (the patch a perfect
    selection reads); ``"recentred"``: that cell's read moved as ``model.geometry.recentre`` moves it."""
    if at not in PROBE_AT:
        raise ValueError(f"at must be one of {PROBE_AT}, got {at!r}")
    import pandas as pd

    from pipeline.synthetic.tiff import sidecar_path
    from workers.patches import PatchGrid, PatchReader, lowres_view, slide_geometry
    from workers.recentre import Recentring
    from workers.store import SlideStore

    man = pd.read_parquet(stores / "manifest.parquet")
    out = []
    for slide_id, source in sorted(zip(man["slide_id"], man["source"])):
        store = SlideStore(stores / f"{slide_id}.zarr")
        side = json.loads(sidecar_path(source).read_text())
        objs = [o for o in side["structures"] if "kind" in o]
        if not objs:
            continue
        geo = slide_geometry(store, model_cfg)
        grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
        reader = PatchReader(store, grid, geo.patch_input)
        p = geo.patch_size
        if at in ("cell", "recentred"):
            cell_xy = grid.cell_xy_l0(torch.arange(grid.num_cells)).numpy()  # [N, 2] top-left corners
            area = overlap_areas(cell_xy, p, objs)  # [N, B]
            centre = np.array([[o["x"] + o["width"] / 2.0, o["y"] + o["height"] / 2.0] for o in objs])
            off = np.abs((cell_xy[:, None, :] + p / 2.0) - centre[None]).sum(-1)  # L1, cell centre to object centre
            # most overlap; among equal overlaps (a small object inside several cells) the best-centred cell
            best = torch.from_numpy((area - off / (4.0 * p)).argmax(0))
            xy = grid.cell_xy_l0(best)
            shift = None
            if at == "recentred":  # the read moved onto the ink's centre of mass, as model.geometry.recentre does
                lowres, cell_mask = lowres_view(store, model_cfg, geo)
                shift = Recentring.from_view(lowres, cell_mask, p, geo.stride, geo.scorer_downsample)(xy)
                xy = xy + shift
            crops = reader.read(best, offsets_l0=shift)
        else:
            xy = torch.tensor(
                [[round(o["x"] + o["width"] / 2 - p / 2), round(o["y"] + o["height"] / 2 - p / 2)] for o in objs]
            )
            crops = reader.read(torch.zeros(len(objs), dtype=torch.long), offsets_l0=xy)  # cell 0 moved onto each
        out.append((slide_id, crops, [str(o["kind"]) for o in objs], placement(xy.numpy(), p, objs)))
    return out


@torch.no_grad()
def embed(encoder: torch.nn.Module, crops: torch.Tensor) -> torch.Tensor:
    encoder.eval()
    return torch.cat([encoder(crops[i : i + 256].float() / 255.0) for i in range(0, crops.shape[0], 256)])


def majority_vote_accuracy(pred: torch.Tensor, true: torch.Tensor, sizes: list[int]) -> float:
    """Share of slides whose objects' predicted kinds have the slide's majority kind as their strict mode (a tie
    counts as wrong): the bag accuracy a perfect selection with this probe as its per-object vote would reach.
    ``pred`` / ``true``: ``[sum(sizes)]`` kinds, slide by slide."""
    right, start = 0, 0
    for n in sizes:
        p, t = pred[start : start + n], true[start : start + n]
        start += n
        label = int(torch.bincount(t).argmax())
        counts = torch.bincount(p, minlength=label + 1)
        others = torch.cat([counts[:label], counts[label + 1 :]])
        right += int(others.numel() == 0 or bool(counts[label] > others.max()))
    return right / max(1, len(sizes))


def probe_predictions(xtr, ytr, xte, classes: int, l2: float = 1e-3, iters: int = 200) -> torch.Tensor:
    """Predicted classes ``[len(xte)]`` of a multinomial logistic regression fitted on standardised ``(xtr, ytr)``."""
    mean, std = xtr.mean(0), xtr.std(0).clamp_min(1e-6)
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    lin = torch.nn.Linear(xtr.shape[1], classes).double()
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(xtr.double()), ytr) + l2 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return lin(xte.double()).argmax(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="benchmarks/work", help="synth/ingest data (kept for reuse)")
    ap.add_argument("--count", type=int, default=16, help="synthetic slides")
    ap.add_argument("--size", default="2048", help="level-0 side of each slide (foveate synth --size)")
    ap.add_argument("--classes", type=int, default=4, help="object kinds (foveate synth --classes)")
    ap.add_argument(
        "--family", choices=("objects", "shapes"), default="objects", help="foveate synth --task (default objects)"
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="training config (model section)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    ap.add_argument("--objective", choices=("simclr", "byol"), default=None, help="default: pretrain.objective")
    ap.add_argument("--epochs", type=int, default=None, help="pretraining epochs (default: pretrain.epochs)")
    ap.add_argument("--encoder", default=None, help="probe this pretrained encoder instead of pretraining here")
    ap.add_argument(
        "--at",
        choices=PROBE_AT,
        default="centred",
        help="the patch per object: centred on it (default), the grid cell overlapping it most (what a perfect "
        "selection reads), or that cell re-centred on its ink (model.geometry.recentre)",
    )
    ap.add_argument("--test-fraction", type=float, default=0.5, help="slides held out for the probe's test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from operators.resnet import ResNet
    from pipeline.config import load_config
    from pipeline.train import TrainConfig, with_training_mpp
    from workers.pretrain import Pretrainer
    from workers.store import SlideStore

    if args.family == "objects":
        task = Task("probe-objects", "objects", args.classes, args.count, args.size, "zstd")
    else:  # named as benchmarks/robustness.py names it, so a --workdir of that benchmark's data is reused
        name = "shapes-binary" if args.classes == 2 else f"shapes-{args.classes}class"
        version = TASKS["shapes-binary"].version  # the family's current drawing (its own data folder)
        task = Task(name, "shapes", args.classes, args.count, args.size, "jpeg", version)
    stores = prepare_data(task, Path(args.workdir).resolve(), seed=args.seed)
    cfg = load_config(TrainConfig, args.config, args.overrides)
    pc = dataclasses.replace(
        cfg.pretrain,
        **{k: v for k, v in (("objective", args.objective), ("epochs", args.epochs)) if v is not None},
        seed=args.seed,
    )
    paths = sorted(str(p) for p in stores.glob("*.zarr"))
    model_cfg = with_training_mpp(cfg.model, [float(SlideStore(p).meta.mpp[0]) for p in paths[:1]])
    features = dataclasses.replace(model_cfg.features, init=None, freeze=False)
    model_cfg = dataclasses.replace(model_cfg, features=features)

    t0 = time.perf_counter()
    per_slide = object_crops(stores, model_cfg, args.at)
    kinds = sorted({k for _, _, ks, _ in per_slide for k in ks})
    where = np.concatenate([pl for *_, pl in per_slide])
    place = {"median_offset_px": float(np.median(where[:, 0])), "whole_inside": float(where[:, 1].mean())}
    n_test = max(1, round(args.test_fraction * len(per_slide)))
    train, test = per_slide[:-n_test], per_slide[-n_test:]

    def stack(part):
        x = torch.cat([c for _, c, _, _ in part])
        y = torch.tensor([kinds.index(k) for _, _, ks, _ in part for k in ks])
        return x, y

    (xtr, ytr), (xte, yte) = stack(train), stack(test)
    print(f"[probe] {len(per_slide)} slides, {len(ytr)} train / {len(yte)} test crops, kinds {kinds}", flush=True)
    print(
        f"[probe] reads ({args.at}): median offset {place['median_offset_px']:.1f} px (L-inf, object centre to read "
        f"centre), object whole inside {place['whole_inside']:.3f}",
        flush=True,
    )

    torch.manual_seed(args.seed)
    random_enc = ResNet(features.resnet())  # the initialisation the Pretrainer starts from (same seed)
    if args.encoder:
        from pipeline.encoder_init import resolve_init

        state = resolve_init(dataclasses.replace(features, init=args.encoder))
        source, objective, epochs = args.encoder, "-", "-"
    else:
        pre = Pretrainer(model_cfg, pc, slides_per_epoch=len(paths))
        t1 = time.perf_counter()
        while pre.epoch < pc.epochs:
            m = pre.run_epoch(paths)
            print(f"[pretrain] epoch {pre.epoch}/{pc.epochs}: loss {m['epoch_loss']:.4f}", flush=True)
        print(f"[pretrain] {time.perf_counter() - t1:.0f}s", flush=True)
        state, source, objective, epochs = pre.encoder_state(), "in-process", pc.objective, pc.epochs
    pretrained = ResNet(features.resnet())
    pretrained.load_state_dict(state)

    rows = []
    for name, enc, obj, ep in (("random", random_enc, "-", 0), ("pretrained", pretrained, objective, epochs)):
        pred = probe_predictions(embed(enc, xtr), ytr, embed(enc, xte), len(kinds))
        acc = float((pred == yte).double().mean())
        vote = majority_vote_accuracy(pred, yte, [len(ks) for _, _, ks, _ in test])
        rows.append(
            {
                "encoder": name,
                "source": source if name == "pretrained" else "seeded init",
                "objective": obj,
                "epochs": ep,
                "train_crops": int(len(ytr)),
                "test_crops": int(len(yte)),
                "classes": len(kinds),
                "accuracy": acc,
                "at": args.at,
                "slide_vote_accuracy": vote,
            }
        )
    chance = float(torch.bincount(yte, minlength=len(kinds)).max()) / max(1, len(yte))
    print(
        f"\n| encoder | objective | epochs | crops ({args.at}) train/test | probe accuracy | slide vote |  "
        f"(majority class: {chance:.3f})"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['encoder']} | {r['objective']} | {r['epochs']} | {r['train_crops']}/{r['test_crops']} | "
            f"{r['accuracy']:.3f} | {r['slide_vote_accuracy']:.3f} |"
        )
    out = {
        "task": dataclasses.asdict(task),
        "config": args.config,
        "overrides": args.overrides,
        # the pretraining this run did; with --encoder none (the encoder's own run holds its settings)
        "pretrain": None if args.encoder else dataclasses.asdict(pc),
        "encoder": args.encoder,
        "features": dataclasses.asdict(features),
        "majority_class": chance,
        "placement": place,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
