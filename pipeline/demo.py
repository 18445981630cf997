"""``foveate demo``: the whole pipeline on embedded defaults, end to end.

synth ~30 small slides -> ingest into OME-Zarr stores (in-process Ray) -> train briefly with perturbed
top-k (Ray Train, MLflow on a local sqlite file) -> batch-score the stores with the logged model ->
compare the experiment's runs. Everything lives under ``--workdir`` (default ``./foveate-demo``); a
re-run reuses the slides and stores already there (synth is deterministic, ingest skips complete stores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

__all__ = ["add_arguments", "run", "demo", "log_file"]

log = logging.getLogger(__name__)

DEMO_CONFIG = "demo"  # a shipped config (pipeline.config.shipped_config): the checkout's or the installed one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", default="foveate-demo", help="folder for slides, stores, runs and MLflow (default ./foveate-demo)"
    )
    parser.add_argument("--count", type=int, default=32, help="synthetic slides (default 32)")
    parser.add_argument(
        "--size", default="2048", help="slide side(s) in pixels, as for `foveate synth --size` (default 2048)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: configs/demo.yaml)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers for ingest and scoring (default 2)")
    parser.add_argument(
        "--config", default=DEMO_CONFIG, help="training config: a YAML file or a shipped config's name (default demo)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="training config override (repeatable)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of everything random: the synthetic slides, the validation split, the model's "
        "initialisation and the selection noise (default 0)",
    )


def log_file(args: argparse.Namespace) -> Path:
    """Where ``foveate demo`` writes Ray's and MLflow's messages (``pipeline.cli``): ``<workdir>/foveate.log``."""
    return Path(args.workdir).expanduser() / "foveate.log"


def _stage(name: str, argv: list[str]) -> None:
    from pipeline.cli import main

    t0 = time.monotonic()
    log.info("demo: %s", " ".join(["foveate", *argv]))
    status = main(argv)
    if status != 0:
        raise RuntimeError(f"demo stage {name!r} exited with status {status}: foveate {' '.join(argv)}")
    log.info("demo: %s done in %.1fs", name, time.monotonic() - t0)


def demo(
    workdir: str | Path = "foveate-demo",
    *,
    count: int = 32,
    size: str = "2048",
    epochs: int | None = None,
    workers: int = 2,
    config: str | Path = DEMO_CONFIG,
    overrides: list[str] | tuple[str, ...] = (),
    seed: int = 0,
) -> dict:
    """Run the demo; returns a summary dict (paths, run ids, metrics)."""
    if not isinstance(count, int) or count < 4:
        raise ValueError(f"count must be an integer >= 4 (two classes, train and validation), got {count!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    import ray

    from pipeline.archive_info import read_archive_info
    from pipeline.config import load_config
    from pipeline.runtime import init_ray
    from pipeline.tracking import resolve_tracking_uri
    from pipeline.train import TrainConfig, stopping_line, train

    wd = Path(workdir).expanduser().resolve()
    wd.mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(default_dir=wd)  # every stage below logs there
    slides, stores = wd / "slides", wd / "stores"
    compare_dir = wd / "compare"
    t_start = time.monotonic()
    timings: dict[str, float] = {}

    t0 = time.monotonic()
    made_with = {"count": count, "size": str(size), "seed": seed}
    record = wd / "demo_slides.json"
    if (slides / "labels.csv").is_file():
        if record.is_file():
            previous = json.loads(record.read_text())
            if previous != made_with:
                raise ValueError(
                    f"{wd} holds demo slides made with {previous}, not {made_with}: use another "
                    f"--workdir for other demo slides (or delete {slides} and {stores})"
                )
        log.info("demo: reusing synthetic slides in %s", slides)
    else:
        _stage(
            "synth",
            ["synth", str(slides), "--count", str(count), "--size", size, "--format", "mixed", "--seed", str(seed)],
        )
        record.write_text(json.dumps(made_with))
    timings["synth"] = time.monotonic() - t0

    started = init_ray(num_cpus=max(2, workers))  # one Ray for all stages (each command reuses it)
    try:
        t0 = time.monotonic()
        _stage("ingest", ["ingest", str(slides / "labels.csv"), "--out", str(stores), "--workers", str(workers)])
        timings["ingest"] = time.monotonic() - t0

        t0 = time.monotonic()
        # the demo's seed drives everything random: the slides, the split, the initialisation and the selection noise
        ov = [f"data.stores={stores}", "data.labels=manifest", f"seed={seed}", f"data.seed={seed}"]
        stated = (read_archive_info(stores) or {}).get("label_symmetry")  # synth's statement, carried by ingest
        if stated is not None:
            ov.append(f"data.label_symmetry={stated}")
        ov += list(overrides)
        if epochs is not None:
            ov.append(f"optim.epochs={epochs}")
        cfg = load_config(TrainConfig, config, ov)
        result = train(cfg, workdir=wd / "runs")
        timings["train"] = time.monotonic() - t0

        # One predictions file per trained model: `foveate score` resumes into an existing output, so a
        # re-run of the demo (which trains a new model) must not reuse the previous model's rows.
        preds = wd / f"predictions-{result.run_id[:8]}.parquet"
        t0 = time.monotonic()
        _stage(
            "score",
            [
                "score",
                "--model",
                result.model_uri,
                "--stores",
                str(stores),
                "--out",
                str(preds),
                "--workers",
                str(workers),
            ],
        )
        timings["score"] = time.monotonic() - t0

        t0 = time.monotonic()
        _stage("compare", ["compare", "--experiment", result.experiment, "--out", str(compare_dir)])
        timings["compare"] = time.monotonic() - t0
    finally:
        if started:
            ray.shutdown()

    import pandas as pd

    table = pd.read_parquet(preds)
    labels = pd.read_parquet(stores / "manifest.parquet")[["slide_id", "label"]]
    merged = table.merge(labels, on="slide_id", how="left")
    ok = merged[merged["prediction"].notna()] if "prediction" in merged else merged.iloc[0:0]
    accuracy = float((ok["prediction"].astype(str) == ok["label"].astype(str)).mean()) if len(ok) else float("nan")
    summary = {
        "workdir": str(wd),
        "tracking_uri": result.tracking_uri,
        "experiment": result.experiment,
        "run_id": result.run_id,
        "model_uri": result.model_uri,
        "predictions": str(preds),
        "compare": str(compare_dir),
        "slides_scored": int(len(table)),
        "score_accuracy_all_slides": accuracy,
        "val_metrics": {k: v for k, v in result.metrics.items() if k.startswith("val_")},
        "stopping": stopping_line(result.config, result.metrics),
        "seconds": {**{k: round(v, 1) for k, v in timings.items()}, "total": round(time.monotonic() - t_start, 1)},
    }
    return summary


def run(args: argparse.Namespace) -> int:
    s = demo(
        args.workdir,
        count=args.count,
        size=args.size,
        epochs=args.epochs,
        workers=args.workers,
        config=args.config,
        overrides=args.overrides,
        seed=args.seed,
    )
    backend = s["tracking_uri"]
    lines = [
        "",
        "foveate demo finished",
        f"  work dir        {s['workdir']}",
        f"  MLflow          {backend}  experiment {s['experiment']!r}, run {s['run_id']}",
        f"  model           {s['model_uri']}",
        f"  predictions     {s['predictions']}  ({s['slides_scored']} slides; accuracy over all slides "
        f"{s['score_accuracy_all_slides']:.2f}, train and validation together)",
        "  validation      "
        + (", ".join(f"{k}={v:.3f}" for k, v in sorted(s["val_metrics"].items())) or "n/a")
        + " (last epoch)",
        f"  training        {s['stopping'] or 'n/a'}",
        f"  comparison      {s['compare']}",
        "  seconds         " + ", ".join(f"{k} {v}" for k, v in s["seconds"].items()),
        "",
        "Look at it:",
        f"  .venv/bin/mlflow ui --backend-store-uri {backend} --host 127.0.0.1 --port 5000",
        "",
    ]
    print("\n".join(lines), flush=True)
    return 0
