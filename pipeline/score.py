"""``foveate score``: batch-score an archive of slide stores with a trained model, on Ray (the job and the CLI;
the stages are :mod:`pipeline.score_stages`, the output file :mod:`pipeline.predictions`).

Two stages run as separate Ray actor pools (:mod:`workers.scoring`):

1. **scorer** actors (one per GPU when the cluster has GPUs, else on CPU) read each slide's low-resolution
   view and tissue cells, run the scorer CNN and the hard top-k selection; batches of ``batch_size`` slides
   per call;
2. **classifier** actors (CPU, ``workers`` of them) read the K chosen patches at full resolution (only the
   chunks they touch), run the feature network and the aggregator over a batch of slides at once, and write
   a heatmap PNG per slide.

The driver keeps at most ``max_in_flight`` calls queued per actor and stops feeding the scorers while
scored slides wait for a classifier (backpressure), so memory stays bounded for any archive size.

Output: one row per slide in ``--out`` (Parquet; columns in :data:`workers.scoring.ROW_FIELDS` plus
``prob_<class>`` per class): ``slide_id``, ``status`` (``ok``/``error``), ``error``, ``prediction`` (class
name), ``probability`` (of the predicted class), ``probabilities`` (class -> probability), ``patches`` (the K
chosen patches: level-0 ``x, y, w, h`` and their ``score``), ``heatmap`` (PNG under
``<out stem>_heatmaps/`` beside the output), ``seconds`` (compute time of the slide in both stages),
``store``, ``model``, ``scored_at``. The file is rewritten atomically (temp file + rename) as rows arrive
(at most every ``flush_every_s`` seconds), so a crash keeps the finished rows; a rerun skips slides that
already have an ``ok`` row and retries the failed ones (their error rows are replaced).

Faults: actors are created with ``max_restarts`` and their calls with ``max_task_retries``, so an actor
killed mid-run is restarted and its calls re-run; results are keyed by slide id and written once, so no
slide is lost or scored twice. A call that still fails after Ray's retries is split into single slides and
re-run on a fresh actor; a slide that fails alone gets an error row.

MLflow: one run (tag ``foveate.stage=score``) in ``--experiment`` with the parameters, counts and throughput,
and the predictions file as an artifact.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from operators.errors import ConfigError
from pipeline.config import add_config_arguments, config_from_cli
from pipeline.predictions import PredictionWriter, list_stores, read_metadata, read_predictions
from pipeline.runtime import init_ray
from pipeline.score_stages import run_stages
from pipeline.tracking import resolve_tracking_uri

__all__ = [
    "ScoreConfig",
    "ScoreResult",
    "list_stores",
    "read_predictions",
    "PredictionWriter",
    "score",
    "add_arguments",
    "run",
]

log = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    """What :func:`score` returns."""

    out: Path
    heatmap_dir: Path | None
    total: int  # slides in the stores folder
    skipped: int  # already scored (ok rows kept from an earlier run)
    scored: int  # ok rows written by this run
    failed: int  # error rows written by this run
    seconds: float
    run_id: str | None = None
    tracking_uri: str | None = None
    scorer_device: str = "cpu"
    retried_calls: int = 0
    table: Any = None  # the whole output as a pandas.DataFrame

    def summary(self) -> str:
        lines = [
            f"{self.total} slide(s): {self.scored} scored, {self.failed} failed, {self.skipped} already done "
            f"({self.seconds:.1f} s, scorer on {self.scorer_device})",
            f"predictions: {self.out}",
        ]
        if self.heatmap_dir is not None:
            lines.append(f"heatmaps:    {self.heatmap_dir}")
        if self.run_id:
            lines.append(f"MLflow run:  {self.run_id} at {self.tracking_uri}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class ScoreConfig:
    """Everything ``foveate score`` needs (``--config`` YAML / ``--set`` keys; the flags map onto them; see
    :func:`score` for each field). Validates itself (``ConfigError``)."""

    model: str
    stores: str
    out: str
    workers: int | None = None
    scorer_workers: int | None = None
    address: str | None = None
    batch_size: int = 4
    max_in_flight: int = 2
    heatmaps: bool = True
    experiment: str | None = "foveate-score"
    tracking_uri: str | None = None
    max_restarts: int = 3
    max_task_retries: int = 3
    flush_every_s: float = 2.0
    num_cpus: int | None = None
    overwrite: bool = False
    strict_mpp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"--model must be an MLflow model URI or a checkpoint path, got {self.model!r}")
        for name, value, minimum in (
            ("--workers", self.workers, 1),
            ("--scorer-workers", self.scorer_workers, 1),
            ("--batch-size", self.batch_size, 1),
            ("--max-in-flight", self.max_in_flight, 1),
            ("max_restarts", self.max_restarts, 0),
            ("max_task_retries", self.max_task_retries, 0),
            ("num_cpus", self.num_cpus, 1),
        ):
            if value is None and name in ("--workers", "--scorer-workers", "num_cpus"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if not str(self.out).endswith(".parquet"):
            raise ConfigError(f"--out must be a .parquet file, got {self.out!r}")


# CLI flag (argparse attribute) -> config key
_FLAGS = {
    k: k
    for k in (
        "model",
        "stores",
        "out",
        "workers",
        "scorer_workers",
        "address",
        "batch_size",
        "max_in_flight",
        "heatmaps",
        "experiment",
        "tracking_uri",
        "overwrite",
        "strict_mpp",
    )
}


def score(
    model: str,
    stores: str | Path,
    out: str | Path,
    *,
    workers: int | None = None,
    scorer_workers: int | None = None,
    address: str | None = None,
    batch_size: int = 4,
    max_in_flight: int = 2,
    heatmaps: bool = True,
    experiment: str | None = "foveate-score",
    tracking_uri: str | None = None,
    max_restarts: int = 3,
    max_task_retries: int = 3,
    flush_every_s: float = 2.0,
    num_cpus: int | None = None,
    overwrite: bool = False,
    strict_mpp: bool = False,
    scorer_cls: type | None = None,
    classifier_cls: type | None = None,
) -> ScoreResult:
    """Score every store in ``stores`` with ``model`` and write one row per slide to ``out``.

    Args:
        model: MLflow model URI (``runs:/<id>``, ``runs:/<id>/model``, ``models:/...``) or a local checkpoint
            (``.pt``, loaded with ``torch.load(weights_only=True)``) / MLflow model directory.
        stores: folder of ``<slide_id>.zarr`` stores (``foveate ingest``'s STORE_DIR).
        out: predictions Parquet file (resumed if it exists).
        workers: classifier (patch reading + features + aggregation) actors, CPU (default: the cluster's CPUs
            not taken by CPU scorers, at least 1).
        scorer_workers: scorer actors (default: one per GPU, or 1 without GPUs).
        address: Ray address (default: ``RAY_ADDRESS`` / the job's cluster, else an in-process Ray).
        batch_size: slides per actor call.
        max_in_flight: queued calls per actor.
        heatmaps: write ``<out stem>_heatmaps/<slide_id>.png`` and the OME-Zarr overlay
            ``<out stem>_ngff/<slide_id>.zarr`` (cell scores + chosen patches as a label image on the slide's
            NGFF frame, :mod:`workers.ngff_overlay`; napari-ome-zarr overlays it on the slide store).
        experiment: MLflow experiment of the scoring run (None: no MLflow run).
        tracking_uri: MLflow tracking URI (default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<out dir>/mlflow.db``).
        max_restarts, max_task_retries: Ray fault tolerance of the actors.
        flush_every_s: minimum seconds between rewrites of ``out`` while running.
        num_cpus: CPUs of an in-process Ray (default: all).
        overwrite: start ``out`` afresh. Without it an existing ``out`` is resumed, and only if the same model
            (same checkpoint digest) wrote it: another model is refused with a ValueError.
        strict_mpp: a store whose mpp differs from the model's training mpp (``model.mpp``) by more than 10 %
            gets an error row (default: a warning in the log).
        scorer_cls, classifier_cls: the actor classes (default ``workers.scoring.ScorerWorker`` /
            ``ClassifierWorker``; fault-injection tests pass subclasses).
    """

    ScoreConfig(
        model=str(model) if isinstance(model, (str, Path)) else model,
        stores=str(stores),
        out=str(out),
        workers=workers,
        scorer_workers=scorer_workers,
        address=address,
        batch_size=batch_size,
        max_in_flight=max_in_flight,
        heatmaps=heatmaps,
        experiment=experiment,
        tracking_uri=tracking_uri,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        flush_every_s=flush_every_s,
        num_cpus=num_cpus,
        overwrite=overwrite,
        strict_mpp=strict_mpp,
    )  # validates
    from workers import storage

    out = storage.local_path(out) or storage.normalize(out)  # a Path, or an object-storage URL (a str)
    if isinstance(out, Path):
        from pipeline.outputs import writable_folder

        writable_folder(out.parent, "--out")  # read-only or forbidden: one line before the lock, Ray or MLflow
    else:
        from workers.bucket_check import check_location

        # refused credentials, a dead endpoint, no such bucket: one line before the lock, Ray or MLflow
        check_location(storage.sibling(out, ""), what=f"--out {out!r}")
    from pipeline.locks import output_lock

    with output_lock(out, "foveate score"):  # one writer per predictions file
        return _score_locked(
            model, stores, out, workers, scorer_workers, address, batch_size, max_in_flight, heatmaps,
            experiment, tracking_uri, max_restarts, max_task_retries, flush_every_s, num_cpus, overwrite,
            scorer_cls, classifier_cls, strict_mpp,
        )  # fmt: skip


def _score_locked(
    model, stores, out: Path | str, workers, scorer_workers, address, batch_size, max_in_flight, heatmaps, experiment,
    tracking_uri, max_restarts, max_task_retries, flush_every_s, num_cpus, overwrite, scorer_cls, classifier_cls,
    strict_mpp=False,
) -> ScoreResult:  # fmt: skip
    from pipeline.progress import Progress

    t0 = time.perf_counter()
    all_stores = list_stores(stores)
    if not all_stores:
        raise ValueError(f"--stores {str(stores)!r} has no <slide_id>.zarr stores")
    from workers import storage

    remote = isinstance(out, str)
    try:
        uri = resolve_tracking_uri(tracking_uri, default_dir=storage.sibling(out, "") if remote else out.parent)
    except ValueError:
        # --out on object storage and no tracking URI: fine for a model file and no --experiment (MLflow unused)
        if experiment or ":/" in str(model):
            raise
        uri = None
    from operators.checkpoint import checkpoint_dict, checkpoint_digest
    from pipeline.mlflow_model import load_model

    net, cfg, class_names = load_model(str(model), tracking_uri=uri)
    ckpt = checkpoint_dict(net, cfg, class_names)
    del net
    identity = {"foveate.model": str(model), "foveate.model_digest": checkpoint_digest(ckpt)}
    existing = [] if overwrite else read_predictions(out)
    if existing:
        before = read_metadata(out)
        same = before.get("foveate.model_digest") == identity["foveate.model_digest"] if before else None
        if same is None:  # a file from before the metadata: the rows name their model
            same = all(r.get("model") == str(model) for r in existing)
        if not same:
            raise ValueError(
                f"--out {str(out)!r} holds predictions of another model ({before.get('foveate.model') or existing[0].get('model')!r}"
                f"{', checkpoint ' + before['foveate.model_digest'][:12] if before.get('foveate.model_digest') else ''}); "
                f"this run's model is {str(model)!r} (checkpoint {identity['foveate.model_digest'][:12]}): "
                "choose another --out, or --overwrite to replace the file"
            )
    done = {r["slide_id"] for r in existing if r.get("status") == "ok"}
    todo = [(sid, p) for sid, p in all_stores if sid not in done]
    kept = [r for r in existing if r.get("status") == "ok" or r["slide_id"] not in {s for s, _ in todo}]
    skipped = len(all_stores) - len(todo)
    stem = storage.basename(out).removesuffix(".parquet")
    heatmap_dir = storage.sibling(out, f"{stem}_heatmaps") if heatmaps else None
    ngff_dir = storage.sibling(out, f"{stem}_ngff") if heatmaps else None  # OME-Zarr overlays (napari)
    writer = PredictionWriter(out, kept, flush_every_s=flush_every_s, metadata=identity)
    log.info(
        "%d store(s) in %s: %d already scored in %s, %d to score", len(all_stores), stores, skipped, out, len(todo)
    )

    run_id = None
    device, ok, failed, retried = "cpu", 0, 0, 0
    client = None
    if experiment and todo:
        from pipeline.tracking import client_for, get_or_create_experiment, start_run

        client = client_for(uri)
        exp_id = get_or_create_experiment(client, experiment, uri)
        run_id = start_run(
            client,
            exp_id,
            run_name=f"score-{storage.basename(stores)}",
            tags={"foveate.stage": "score", "foveate.model": str(model)},
        )
        from mlflow.entities import Param

        params = {
            "model": str(model),
            "stores": storage.normalize(stores),
            "out": str(out),
            "workers": workers or "auto",
            "scorer_workers": scorer_workers or "auto",
            "batch_size": batch_size,
            "slides_total": len(all_stores),
            "slides_todo": len(todo),
        }
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    status = "FAILED"
    try:
        if todo:
            import ray

            started = init_ray(address, num_cpus=num_cpus)
            try:
                ckpt_ref = ray.put(ckpt)
                with Progress(len(todo), "slides scored", unit="slide") as progress:
                    device, ok, failed, retried = run_stages(
                        todo,
                        ckpt_ref,
                        model_name=str(model),
                        heatmap_dir=heatmap_dir,
                        writer=writer,
                        workers=workers,
                        scorer_workers=scorer_workers,
                        batch_size=batch_size,
                        max_in_flight=max_in_flight,
                        max_restarts=max_restarts,
                        max_task_retries=max_task_retries,
                        progress=progress,
                        scorer_cls=scorer_cls,
                        classifier_cls=classifier_cls,
                        strict_mpp=strict_mpp,
                        ngff_dir=ngff_dir,
                    )
            finally:
                writer.flush()
                if started:
                    ray.shutdown()
        else:
            log.info("nothing to score: every slide in %s already has a row in %s", stores, out)
            writer.flush(force=not storage.file_exists(out))
        status = "FINISHED"
    finally:
        seconds = time.perf_counter() - t0
        if client is not None and run_id is not None:
            from pipeline.tracking import log_metrics

            log_metrics(
                client,
                run_id,
                {
                    "slides_scored": ok,
                    "slides_failed": failed,
                    "slides_skipped": skipped,
                    "seconds": seconds,
                    "retried_calls": retried,
                    "slides_per_second": (ok + failed) / max(seconds, 1e-9),
                },
                step=0,
            )
            if not remote and out.exists():
                client.log_artifact(run_id, str(out), "predictions")
            client.set_terminated(run_id, status=status)
    import pandas as pd

    raw = storage.read_file(out)
    table = pd.read_parquet(io.BytesIO(raw)) if raw is not None else pd.DataFrame()
    return ScoreResult(
        out=out,
        heatmap_dir=heatmap_dir,
        total=len(all_stores),
        skipped=skipped,
        scored=ok,
        failed=failed,
        seconds=seconds,
        run_id=run_id,
        tracking_uri=uri if run_id else None,
        scorer_device=device,
        retried_calls=retried,
        table=table,
    )


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="MLflow model URI (runs:/<run_id>, runs:/<run_id>/model, models:/<name>/<version>) or a "
        "local checkpoint (.pt) / MLflow model directory (required)",
    )
    parser.add_argument("--stores", help="folder of <slide_id>.zarr stores (foveate ingest's STORE_DIR; required)")
    parser.add_argument(
        "--out",
        help="predictions file (.parquet; a local path or an object-storage URL such as s3://bucket/p.parquet); an "
        "existing one is resumed (required)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="CPU actors reading patches + features + aggregation (default: the cluster's CPUs not "
        "used by CPU scorers, at least 1)",
    )
    parser.add_argument(
        "--scorer-workers",
        type=int,
        default=None,
        help="scorer actors (default: one per GPU of the cluster, else 1 on CPU)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray address (default: RAY_ADDRESS / the job's cluster, else an in-process Ray)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="slides per actor call (default 4)")
    parser.add_argument("--max-in-flight", type=int, default=None, help="queued calls per actor (default 2)")
    parser.add_argument(
        "--no-heatmaps", dest="heatmaps", action="store_false", default=None, help="do not write heatmap PNGs"
    )
    parser.add_argument(
        "--experiment", default=None, help="MLflow experiment of the scoring run (default foveate-score)"
    )
    parser.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="replace an existing --out (default: resume it, if the same model wrote it)",
    )
    parser.add_argument(
        "--strict-mpp",
        action="store_true",
        default=None,
        help="give a store whose mpp differs from the model's training mpp by > 10%% an error row (default: warn)",
    )
    parser.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even when some slides have error rows (default: exit 1 when any slide failed)",
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///<out dir>/mlflow.db)",
    )
    add_config_arguments(parser, "batch_size=8")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_cli(ScoreConfig, args, _FLAGS)
    if args.no_mlflow:
        cfg = dataclasses.replace(cfg, experiment=None)
    res = score(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    print(res.summary())
    errors = res.table[res.table["status"] != "ok"] if len(res.table) else res.table
    if len(errors):
        print(
            f"{len(errors)} of {len(res.table)} slide(s) have error rows in {res.out} "
            f"(e.g. {errors.iloc[0]['slide_id']}: {str(errors.iloc[0]['error'])[:200]})"
            + ("" if args.allow_failures else "; exit 1 (--allow-failures: exit 0)")
        )
        return 0 if args.allow_failures else 1
    return 0
