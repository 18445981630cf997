"""Benchmark: what `foveate tune` finds against the shipped default, and what ASHA saves over running every trial.

On one task of ``benchmarks/robustness.py`` (its data, its train / held-out split):

1. The search sees the **training slides only** (a labels CSV of them, ``data.labels``); its trials validate on a
   split of those (the config's ``data.val_fraction``), so no held-out slide takes part in any choice.
2. ``pipeline.tune.tune`` with ``--trials`` samples of ``--space``, ASHA (``--grace-period``), ``--epochs`` per
   trial at most, ``--search-seed``; with ``--fifo`` the **same trials** (the same seed: checked) again without
   early stopping. Reported: wall seconds, trial-epochs run, the trials' states, and the CPU-hours the search held
   (wall x the CPUs its concurrent trials asked for: an upper bound).
3. The best trial's ``best.yaml`` and the shipped config each trained on all the training slides for
   ``--final-epochs`` over ``--seeds`` (``run_training_in_process``: the trainer of ``foveate train`` on one
   worker; early stopping on ``--final-val-fraction`` of the training slides) and tested on the held-out slides:
   accuracy / AUC per seed, and the median.

    python benchmarks/tune.py --task objects-binary-quick --trials 4 --epochs 2 --final-epochs 2 --seeds 0,1 --fifo
    python benchmarks/tune.py --task shapes-binary --config perturbed_mean --trials 16 --epochs 20 --seeds 0,1,2,3,4 \\
        --fifo --json benchmarks/results/tune_shapes.json

Prints a table and writes JSON (``--json``). Every training logs to ``WORKDIR/logs``; MLflow goes to a sqlite file in
``WORKDIR`` unless ``MLFLOW_TRACKING_URI`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

DEFAULT_SPACE = ROOT / "benchmarks" / "tune_space.yaml"


def training_labels(split, path: Path) -> Path:
    """A labels CSV (``slide_id,label``) of the split's training slides only: the search's whole data."""
    rows = ["slide_id,label"] + [f"{rec.slide_id},{split.class_names[rec.target]}" for rec in split.train]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def search_row(result, wall: float, cpus_held: float) -> dict:
    """What one search did: wall seconds, trial-epochs, states, CPU-hours held, the best trial."""
    states: dict[str, int] = {}
    for r in result.rows:
        states[r.state] = states.get(r.state, 0) + 1
    return {
        "wall_seconds": wall,
        "trial_epochs": sum(r.epochs for r in result.rows),
        "states": states,
        "cpu_hours_held": wall * cpus_held / 3600.0,
        "trials": [
            {"number": r.number, "values": r.values, "state": r.state, "epochs": r.epochs, "metric": r.metric}
            for r in result.rows
        ],
        "best": None if result.best is None else {"values": result.best.values, "metric": result.best.metric},
        "best_config": result.best_config,
    }


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--task", default="objects-binary-quick", help="a task of benchmarks/robustness.py")
    p.add_argument("--config", default="perturbed_mean", help="the shipped config searched around (configs/NAME)")
    p.add_argument("--space", default=str(DEFAULT_SPACE), help=f"search space YAML (default {DEFAULT_SPACE.name})")
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--epochs", type=int, default=20, help="epochs per trial at most (optim.epochs)")
    p.add_argument("--grace-period", type=int, default=2)
    p.add_argument("--metric", default="val_auc")
    p.add_argument("--max-concurrent", type=int, default=None)
    p.add_argument("--search-seed", type=int, default=0)
    p.add_argument("--fifo", action="store_true", help="also run the same trials to completion (no early stopping)")
    p.add_argument("--final-epochs", type=int, default=None, help="epochs of the final trainings (default --epochs)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the final trainings (default 0-4)")
    p.add_argument(
        "--final-val-fraction",
        type=float,
        default=0.2,
        help="share of the training slides the final trainings validate (and stop early) on (default 0.2)",
    )
    p.add_argument("--count", type=int, default=None)
    p.add_argument("--size", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workdir", default=str(ROOT / "benchmarks" / "_work" / "tune"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import robustness as rb

    from pipeline.config import load_config
    from pipeline.train_config import TrainConfig
    from pipeline.tune import sampled_values, tune
    from pipeline.tune_space import load_space

    workdir = Path(args.workdir).resolve()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
    (task,) = rb.resolve_tasks(args.task, args.count, args.size)
    stores = rb.prepare_data(task, workdir)
    split = rb.load_split(args.config, stores, args.overrides)
    labels = training_labels(split, workdir / "search" / task.key / "train_labels.csv")
    base = load_config(
        TrainConfig,
        ROOT / "configs" / f"{args.config}.yaml",
        [
            f"data.stores={stores}",
            f"data.labels={labels}",
            f"optim.epochs={args.epochs}",
            f"workdir={workdir}",
            "tracking.experiment=tune-benchmark",
            *args.overrides,
        ],
    )
    space = load_space(args.space, base)
    expected = sampled_values(space, args.trials, args.search_seed)
    cpus_held = float(base.cpus_per_worker) * float(args.max_concurrent or os.cpu_count() or 1)
    searches = {}
    for scheduler in ["asha"] + (["fifo"] if args.fifo else []):
        t0 = time.perf_counter()
        result = tune(
            base,
            space,
            trials=args.trials,
            scheduler=scheduler,
            metric=args.metric,
            mode="min" if args.metric.endswith("loss") else "max",
            max_concurrent=args.max_concurrent,
            grace_period=args.grace_period,
            out=workdir / "search" / task.key / f"{scheduler}-seed{args.search_seed}",
            search_seed=args.search_seed,
        )
        searches[scheduler] = search_row(result, time.perf_counter() - t0, cpus_held)
        sampled = [t["values"] for t in searches[scheduler]["trials"]]
        if sampled != expected:
            raise RuntimeError(f"the {scheduler} search sampled other trials than the seed gives: {sampled}")
        print(f"[{scheduler}] {json.dumps({k: v for k, v in searches[scheduler].items() if k != 'trials'})}")
    best_config = searches["asha"]["best_config"]
    final_epochs = args.final_epochs or args.epochs
    finals: dict[str, list[dict]] = {"default": [], "tuned": []}
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        for which, config in (("default", args.config), ("tuned", best_config)):
            if config is None:
                continue
            name = f"{task.key}-{which}-s{seed}"
            res = rb.run_training_in_process(
                config,
                stores,
                seed,
                [f"optim.epochs={final_epochs}", *args.overrides],
                workdir,
                name,
                workdir / "logs" / f"{name}.log",
                val_fraction=args.final_val_fraction,
            )
            ev = rb.evaluate_checkpoint(res["checkpoint"], split)  # the held-out slides (the metrics: validation's)
            finals[which].append(
                {
                    "seed": seed,
                    "test_accuracy": ev["eval_accuracy"],
                    "test_auc": ev["eval_auc"],
                    "stop_reason": res["stop_reason"],
                    "best_epoch": res["metrics"].get("best_epoch"),
                }
            )
            print(
                f"{which} seed {seed}: held-out accuracy {ev['eval_accuracy']:.3f} AUC {ev['eval_auc']:.3f}", flush=True
            )
    summary = {
        which: {
            "median_accuracy": median([r["test_accuracy"] for r in rows]),
            "median_auc": median([r["test_auc"] for r in rows]),
        }
        for which, rows in finals.items()
    }
    if "fifo" in searches:
        a, f = searches["asha"], searches["fifo"]
        summary["asha_speedup_wall"] = f["wall_seconds"] / a["wall_seconds"]
        summary["asha_speedup_trial_epochs"] = f["trial_epochs"] / max(a["trial_epochs"], 1)
    print(f"\n{task.key}, {args.config}, {args.trials} trials x <= {args.epochs} epochs, final {final_epochs} epochs")
    print(f"{'search':>6} {'wall s':>8} {'trial-epochs':>12} {'CPU-h held':>10}  states")
    for name, s in searches.items():
        print(
            f"{name:>6} {s['wall_seconds']:>8.0f} {s['trial_epochs']:>12} {s['cpu_hours_held']:>10.2f}  {s['states']}"
        )
    for which, rows in finals.items():
        accs = " ".join(f"{r['test_accuracy']:.3f}" for r in rows if r["test_accuracy"] is not None)
        print(f"{which:>8}: held-out accuracy {accs} (median {summary[which]['median_accuracy']})")
    if args.json:
        out = {
            "task": task.__dict__,
            "config": args.config,
            "space": space.as_dict(),
            "trials": args.trials,
            "epochs": args.epochs,
            "grace_period": args.grace_period,
            "metric": args.metric,
            "search_seed": args.search_seed,
            "final_epochs": final_epochs,
            "final_val_fraction": args.final_val_fraction,
            "overrides": args.overrides,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "searches": searches,
            "finals": finals,
            "summary": summary,
        }
        for s in out["searches"].values():
            s["best_config"] = s["best_config"] and "best.yaml"  # no machine paths in results
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
