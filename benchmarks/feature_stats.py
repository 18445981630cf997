"""Trained checkpoints re-tested with the exact feature statistics of their training slides.

A model with ``model.features.standardise`` standardises its patch features with running statistics that follow
the last ~20 training slides (``operators.resnet.RunningStandardise``). ``foveate train`` now ends by setting them
to the exact mean and variance of the exported model's features on the training slides (eval mode, hard
selection: ``Trainer.refresh_feature_stats``). This script does the same to checkpoints written before (by
``benchmarks/robustness.py`` or ``foveate train``) and tests each on the held-out slides of the run's split twice:
with the statistics it was saved with, and with the refreshed ones. No training: a checkpoint takes under a minute
on one core for a 384-slide archive. ``shift`` is how far the mean moved, in running standard deviations (median and
max over the features); ``var_ratio`` the median of new variance over old.

Usage: python benchmarks/feature_stats.py --stores DATA/stores --checkpoint RUN/model.pt [...]
       [--config perturbed_mean] [--json OUT.json]
(``DATA``: a folder ``benchmarks/robustness.py`` synthesised, e.g. ``<workdir>/data/shapes-binary-384x3072-v2``.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch

__all__ = ["refresh_on_slides", "retest", "main"]


@torch.no_grad()
def refresh_on_slides(model, records) -> int:
    """Set ``model.feature_norm`` to the exact statistics of its features on ``records`` (eval mode, hard
    selection, one forward per slide, as the trainer's refresh); returns the rows counted (0: no standardisation)."""
    from operators.resnet import feature_moments, set_exact_statistics
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore

    if getattr(model, "feature_norm", None) is None:
        return 0
    model.eval()
    with feature_moments(model.feature_norm) as moments:
        for rec in records:
            forward_slide(model, SlideStore(rec.store), training=False, sigma=0.0)
    return set_exact_statistics(model.feature_norm, moments)


def retest(model, split) -> dict[str, float]:
    """Held-out accuracy / AUC of ``model`` as saved and after :func:`refresh_on_slides` on the training slides."""
    from robustness import evaluate_model

    before = evaluate_model(model, split)
    norm = model.feature_norm
    old_mean, old_var = norm.mean.clone(), norm.var.clone()
    rows = refresh_on_slides(model, split.train)
    after = evaluate_model(model, split)
    shift = ((norm.mean - old_mean) / old_var.sqrt()).abs()
    return {
        "accuracy": before["eval_accuracy"],
        "auc": before["eval_auc"],
        "refreshed_accuracy": after["eval_accuracy"],
        "refreshed_auc": after["eval_auc"],
        "rows": rows,
        "shift_median": float(shift.median()),
        "shift_max": float(shift.max()),
        "var_ratio": float((norm.var / old_var).median()),
    }


def main(argv: list[str] | None = None) -> dict:
    from robustness import checkpoint_result, load_split

    from operators.checkpoint import load_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", type=Path, required=True, help="the synthesised stores folder (with the manifest)")
    p.add_argument("--checkpoint", type=Path, nargs="+", required=True, help="model.pt files")
    p.add_argument("--config", default="perturbed_mean", help="the config whose data split the runs used")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = {ck: load_checkpoint(ck)[0] for ck in args.checkpoint}  # every one checked before the slides are read
    for ck, model in models.items():
        if model.feature_norm is None:
            raise SystemExit(f"{ck} has no feature standardisation (model.features.standardise is false)")
    split = load_split(args.config, args.stores, [])
    result = checkpoint_result("feature_stats.py", argv)
    print(f"{'checkpoint':40s}  accuracy (AUC)  refreshed (AUC)  shift med/max  var ratio")
    for ck, model in models.items():
        row = {"checkpoint": ck.parent.name, **retest(model, split)}
        result["checkpoints"].append(row)
        print(
            f"{ck.parent.name[-40:]:40s}  {row['accuracy']:.3f} ({row['auc']:.3f})   {row['refreshed_accuracy']:.3f} "
            f"({row['refreshed_auc']:.3f})    {row['shift_median']:.2f} / {row['shift_max']:.2f}    "
            f"{row['var_ratio']:.2f}",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
