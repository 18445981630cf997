"""``foveate score``: batch-score an archive of slide stores with a trained model, on Ray.

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
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.runtime import ActorPool, init_ray, wait_done
from pipeline.tracking import resolve_tracking_uri

__all__ = ["ScoreResult", "list_stores", "read_predictions", "PredictionWriter", "score", "add_arguments", "run",
           "CRASH_ENV"]

log = logging.getLogger(__name__)

# test hook: "scorer:<slide_id>:<marker path>" and/or "classifier:<slide_id>:<marker path>" (";"-separated) make
# that stage's actor kill its own process once when it reaches that slide (see workers.scoring)
CRASH_ENV = "FOVEATE_TEST_CRASH_ONCE"


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
        lines = [f"{self.total} slide(s): {self.scored} scored, {self.failed} failed, {self.skipped} already done "
                 f"({self.seconds:.1f} s, scorer on {self.scorer_device})",
                 f"predictions: {self.out}"]
        if self.heatmap_dir is not None:
            lines.append(f"heatmaps:    {self.heatmap_dir}")
        if self.run_id:
            lines.append(f"MLflow run:  {self.run_id} at {self.tracking_uri}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- inputs/outputs
def list_stores(stores_dir: str | Path) -> list[tuple[str, str]]:
    """``[(slide_id, store path)]`` of every ``*.zarr`` directory in ``stores_dir``, sorted by slide id
    (complete or not: an incomplete store gets an error row)."""
    root = Path(stores_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--stores: no such directory {str(root)!r}")
    out = [(p.name[: -len(".zarr")], str(p.resolve())) for p in root.iterdir() if p.is_dir() and p.name.endswith(".zarr")]
    return sorted(out)


def _schema(prob_columns: list[str]):
    import pyarrow as pa

    patch = pa.struct([("x", pa.int64()), ("y", pa.int64()), ("w", pa.int64()), ("h", pa.int64()),
                       ("score", pa.float64())])
    fields = [("slide_id", pa.string()), ("status", pa.string()), ("error", pa.string()),
              ("prediction", pa.string()), ("probability", pa.float64()),
              ("probabilities", pa.map_(pa.string(), pa.float64())), ("patches", pa.list_(patch)),
              ("heatmap", pa.string()), ("seconds", pa.float64()), ("store", pa.string()), ("model", pa.string()),
              ("scored_at", pa.string())]
    fields += [(c, pa.float64()) for c in prob_columns]
    return pa.schema(fields)


def _prob_column(name: str) -> str:
    return f"prob_{name}"


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an existing predictions file (``[]`` if there is none)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        return []
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"--out {str(path)!r} exists but is not a readable predictions file ({exc}); move it away "
                         f"or choose another --out") from exc
    if "slide_id" not in table.column_names or "status" not in table.column_names:
        raise ValueError(f"--out {str(path)!r} is not a foveate predictions file (no slide_id/status columns)")
    rows = table.to_pylist()
    for r in rows:  # map columns come back as lists of (key, value) pairs
        if isinstance(r.get("probabilities"), list):
            r["probabilities"] = dict(r["probabilities"])
    return rows


class PredictionWriter:
    """Holds the rows (one per slide id) and rewrites the Parquet file atomically.

    Args:
        path: the output file.
        rows: rows to start from (e.g. those of an earlier run that are kept).
        flush_every_s: :meth:`add` rewrites the file when at least this long has passed since the last write.
    """

    def __init__(self, path: str | Path, rows: list[dict[str, Any]] = (), *, flush_every_s: float = 2.0):
        self.path = Path(path)
        self.rows: dict[str, dict[str, Any]] = {}
        for r in rows:
            self.rows[r["slide_id"]] = r
        self.flush_every_s = float(flush_every_s)
        self._last = 0.0
        self._dirty = False
        self.writes = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["slide_id"]] = row
        self._dirty = True
        if time.monotonic() - self._last >= self.flush_every_s:
            self.flush()

    def table(self):
        """The rows as a pyarrow Table (sorted by slide id)."""
        import pyarrow as pa

        rows = [self.rows[k] for k in sorted(self.rows)]
        prob_cols = sorted({_prob_column(n) for r in rows for n in (r.get("probabilities") or {})})
        out = []
        for r in rows:
            d = {k: r.get(k) for k in ("slide_id", "status", "error", "prediction", "probability", "heatmap",
                                        "seconds", "store", "model", "scored_at")}
            probs = r.get("probabilities") or {}
            d["probabilities"] = list(probs.items())
            d["patches"] = list(r.get("patches") or [])
            for c in prob_cols:
                d[c] = None
            for name, v in probs.items():
                d[_prob_column(name)] = float(v)
            out.append(d)
        return pa.Table.from_pylist(out, schema=_schema(prob_cols))

    def flush(self, force: bool = False) -> None:
        """Rewrite the file (temp file, fsync, rename) if anything changed (or ``force``)."""
        import pyarrow.parquet as pq

        if not (self._dirty or force):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        pq.write_table(self.table(), tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._last = time.monotonic()
        self._dirty = False
        self.writes += 1


# ---------------------------------------------------------------------------------------------- Ray glue
def _crash_hook(stage: str) -> tuple[str, str] | None:
    """The test hook for ``stage`` from ``$FOVEATE_TEST_CRASH_ONCE`` (``;``-separated specs)."""
    text = os.environ.get(CRASH_ENV, "")
    for spec in filter(None, text.split(";")):
        parts = spec.split(":", 2)
        if len(parts) != 3 or parts[0] not in ("scorer", "classifier"):
            raise ValueError(f"{CRASH_ENV} must be 'scorer|classifier:<slide_id>:<marker path>[;...]', got {text!r}")
        if parts[0] == stage:
            return parts[1], parts[2]
    return None


def _run_pipeline(todo: list[tuple[str, str]], ckpt_ref: Any, *, model_name: str, heatmap_dir: Path | None,
                  writer: PredictionWriter, workers: int | None, scorer_workers: int | None, batch_size: int,
                  max_in_flight: int, max_restarts: int, max_task_retries: int, progress) -> tuple[str, int, int, int]:
    """Drive the two actor pools over ``todo``; returns (scorer device, ok rows, error rows, retried calls)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    from workers.scoring import ClassifierWorker, ScorerWorker, error_row

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    n_scorers = scorer_workers or max(1, gpus)
    total_cpus = float(resources.get("CPU", 1))
    if workers is None:  # the CPUs the scorers leave, at least one, at most one per slide batch
        workers = max(1, min(int(total_cpus) - (0 if gpus else n_scorers), math.ceil(len(todo) / batch_size)))
    cpu_actors = workers + (0 if gpus else n_scorers)
    cpus_each = min(1.0, total_cpus / max(cpu_actors, 1))  # never ask for more CPUs than the cluster has
    threads = max(1, int(cpus_each))
    opts = {"max_restarts": max_restarts, "max_task_retries": max_task_retries}
    if gpus:
        scorer_cls = ray.remote(num_gpus=min(1.0, gpus / n_scorers), num_cpus=0, **opts)(ScorerWorker)
        device = "cuda"
    else:
        scorer_cls = ray.remote(num_cpus=cpus_each, **opts)(ScorerWorker)
        device = "cpu"
    classifier_cls = ray.remote(num_cpus=cpus_each, **opts)(ClassifierWorker)
    scorers = ActorPool(lambda: scorer_cls.remote(ckpt_ref, device=device, threads=threads,
                                                  crash_once=_crash_hook("scorer")),
                        n_scorers, depth=max_in_flight, max_replacements=3 * n_scorers, name="scorer")
    classifiers = ActorPool(lambda: classifier_cls.remote(ckpt_ref, heatmap_dir=str(heatmap_dir) if heatmap_dir else None,
                                                          model_name=model_name, threads=threads,
                                                          crash_once=_crash_hook("classifier")),
                            workers, depth=max_in_flight, max_replacements=3 * workers, name="classifier")
    scorers.start()
    classifiers.start()
    log.info("scoring %d slide(s): %d scorer actor(s) on %s, %d classifier actor(s), batch %d", len(todo), n_scorers,
             device, workers, batch_size)

    pending: deque[list[tuple[str, str]]] = deque(todo[i:i + batch_size] for i in range(0, len(todo), batch_size))
    waiting: deque[dict[str, Any]] = deque()  # scored slides waiting for a classifier
    backlog_limit = max(2 * batch_size * workers * max_in_flight, batch_size)
    ok = failed = retried = 0

    def record(row: dict[str, Any]) -> None:
        nonlocal ok, failed
        writer.add(row)
        if row["status"] == "ok":
            ok += 1
        else:
            failed += 1
        progress.update(1)

    solo: deque[dict[str, Any]] = deque()  # classifier items re-run one by one after a failed call

    def on_failure(stage: str, work: list, exc: BaseException) -> None:
        nonlocal retried
        retried += 1
        log.warning("%s call on %d slide(s) failed after Ray's retries: %s", stage, len(work), exc)
        if len(work) > 1:  # split, so only the slide that fails gets an error row
            for w in reversed(work):
                if stage == "scorer":
                    pending.appendleft([w])
                else:
                    solo.appendleft(w)
            return
        sid, store = (work[0][0], work[0][1]) if stage == "scorer" else (work[0]["slide_id"], work[0]["store"])
        record(error_row(sid, store, f"{stage} worker failed: {type(exc).__name__}: {exc}"[:2000], model=model_name))

    try:
        while pending or waiting or solo or len(scorers) or len(classifiers):
            while waiting or solo:  # classifiers first: drain before scoring more
                i = classifiers.free()
                if i is None:
                    break
                items = [solo.popleft()] if solo else [waiting.popleft() for _ in range(min(batch_size, len(waiting)))]
                classifiers.submit(i, "classify_batch", items, task=items)
            queued = len(waiting) + len(solo) + sum(len(w) for w in scorers.in_flight())
            while pending and queued < backlog_limit:  # backpressure: bounded backlog ahead of the classifiers
                i = scorers.free()
                if i is None:
                    break
                batch = pending.popleft()
                scorers.submit(i, "score_batch", batch, task=batch)
                queued += len(batch)
            for done in wait_done(scorers, classifiers, timeout=30.0):
                stage = "scorer" if done.pool is scorers else "classifier"
                if done.error is not None:
                    if not isinstance(done.error, (RayError, GetTimeoutError)):
                        raise done.error
                    on_failure(stage, done.task, done.error)
                    continue
                if stage == "scorer":
                    for item in done.value:
                        if item["status"] == "ok":
                            waiting.append(item)
                        else:
                            record(error_row(item["slide_id"], item["store"], item["error"], model=model_name,
                                             seconds=item.get("seconds", 0.0)))
                else:
                    for row in done.value:
                        record(row)
    finally:
        scorers.shutdown()
        classifiers.shutdown()
    return device, ok, failed, retried


# ---------------------------------------------------------------------------------------------- the job
def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def score(model: str, stores: str | Path, out: str | Path, *, workers: int | None = None,
          scorer_workers: int | None = None,
          address: str | None = None, batch_size: int = 4, max_in_flight: int = 2, heatmaps: bool = True,
          experiment: str | None = "foveate-score", tracking_uri: str | None = None, max_restarts: int = 3,
          max_task_retries: int = 3, flush_every_s: float = 2.0, num_cpus: int | None = None) -> ScoreResult:
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
        heatmaps: write ``<out stem>_heatmaps/<slide_id>.png``.
        experiment: MLflow experiment of the scoring run (None: no MLflow run).
        tracking_uri: MLflow tracking URI (default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<out dir>/mlflow.db``).
        max_restarts, max_task_retries: Ray fault tolerance of the actors.
        flush_every_s: minimum seconds between rewrites of ``out`` while running.
        num_cpus: CPUs of an in-process Ray (default: all).
    """
    from pipeline.progress import Progress

    if not isinstance(model, (str, Path)) or not str(model):
        raise ValueError(f"--model must be an MLflow model URI or a checkpoint path, got {model!r}")
    if workers is not None:
        _check_int("--workers", workers, 1)
    if scorer_workers is not None:
        _check_int("--scorer-workers", scorer_workers, 1)
    _check_int("--batch-size", batch_size, 1)
    _check_int("--max-in-flight", max_in_flight, 1)
    _check_int("max_restarts", max_restarts, 0)
    _check_int("max_task_retries", max_task_retries, 0)
    out = Path(out).expanduser().resolve()
    if out.suffix != ".parquet":
        raise ValueError(f"--out must be a .parquet file, got {str(out)!r}")
    t0 = time.perf_counter()
    all_stores = list_stores(stores)
    if not all_stores:
        raise ValueError(f"--stores {str(stores)!r} has no <slide_id>.zarr stores")
    existing = read_predictions(out)
    done = {r["slide_id"] for r in existing if r.get("status") == "ok"}
    todo = [(sid, p) for sid, p in all_stores if sid not in done]
    kept = [r for r in existing if r.get("status") == "ok" or r["slide_id"] not in {s for s, _ in todo}]
    skipped = len(all_stores) - len(todo)
    heatmap_dir = out.with_name(f"{out.stem}_heatmaps") if heatmaps else None
    writer = PredictionWriter(out, kept, flush_every_s=flush_every_s)
    log.info("%d store(s) in %s: %d already scored in %s, %d to score", len(all_stores), stores, skipped, out,
             len(todo))

    uri = resolve_tracking_uri(tracking_uri, default_dir=out.parent)
    run_id = None
    device, ok, failed, retried = "cpu", 0, 0, 0
    client = None
    if experiment and todo:
        from pipeline.tracking import client_for, get_or_create_experiment

        client = client_for(uri)
        exp_id = get_or_create_experiment(client, experiment, uri)
        run_id = client.create_run(exp_id, run_name=f"score-{Path(stores).name}",
                                   tags={"foveate.stage": "score", "foveate.model": str(model)}).info.run_id
        from mlflow.entities import Param

        params = {"model": str(model), "stores": str(Path(stores).resolve()), "out": str(out),
                  "workers": workers or "auto",
                  "scorer_workers": scorer_workers or "auto", "batch_size": batch_size, "slides_total": len(all_stores),
                  "slides_todo": len(todo)}
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    status = "FAILED"
    try:
        if todo:
            from pipeline.model_io import checkpoint_dict, load_model

            net, cfg, class_names = load_model(str(model), tracking_uri=uri)
            ckpt = checkpoint_dict(net, cfg, class_names)
            del net
            import ray

            started = init_ray(address, num_cpus=num_cpus)
            try:
                ckpt_ref = ray.put(ckpt)
                with Progress(len(todo), "slides scored", unit="slide") as progress:
                    device, ok, failed, retried = _run_pipeline(
                        todo, ckpt_ref, model_name=str(model), heatmap_dir=heatmap_dir, writer=writer, workers=workers,
                        scorer_workers=scorer_workers, batch_size=batch_size, max_in_flight=max_in_flight,
                        max_restarts=max_restarts, max_task_retries=max_task_retries, progress=progress)
            finally:
                writer.flush()
                if started:
                    ray.shutdown()
        else:
            log.info("nothing to score: every slide in %s already has a row in %s", stores, out)
            writer.flush(force=not out.exists())
        status = "FINISHED"
    finally:
        seconds = time.perf_counter() - t0
        if client is not None and run_id is not None:
            from pipeline.tracking import log_metrics

            log_metrics(client, run_id, {"slides_scored": ok, "slides_failed": failed, "slides_skipped": skipped,
                                         "seconds": seconds, "retried_calls": retried,
                                         "slides_per_second": (ok + failed) / max(seconds, 1e-9)}, step=0)
            if out.exists():
                client.log_artifact(run_id, str(out), "predictions")
            client.set_terminated(run_id, status=status)
    import pandas as pd

    table = pd.read_parquet(out) if out.exists() else pd.DataFrame()
    return ScoreResult(out=out, heatmap_dir=heatmap_dir, total=len(all_stores), skipped=skipped, scored=ok,
                       failed=failed, seconds=seconds, run_id=run_id, tracking_uri=uri if run_id else None,
                       scorer_device=device, retried_calls=retried, table=table)


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="MLflow model URI (runs:/<run_id>, runs:/<run_id>/model, models:/<name>/<version>) or a "
                             "local checkpoint (.pt) / MLflow model directory")
    parser.add_argument("--stores", required=True, help="folder of <slide_id>.zarr stores (foveate ingest's STORE_DIR)")
    parser.add_argument("--out", required=True, help="predictions file (.parquet); an existing one is resumed")
    parser.add_argument("--workers", type=int, default=None,
                        help="CPU actors reading patches + features + aggregation (default: the cluster's CPUs not "
                             "used by CPU scorers, at least 1)")
    parser.add_argument("--scorer-workers", type=int, default=None,
                        help="scorer actors (default: one per GPU of the cluster, else 1 on CPU)")
    parser.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS / the job's cluster, else "
                                                        "an in-process Ray)")
    parser.add_argument("--batch-size", type=int, default=4, help="slides per actor call (default 4)")
    parser.add_argument("--max-in-flight", type=int, default=2, help="queued calls per actor (default 2)")
    parser.add_argument("--no-heatmaps", action="store_true", help="do not write heatmap PNGs")
    parser.add_argument("--experiment", default="foveate-score", help="MLflow experiment of the scoring run")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///<out dir>/mlflow.db)")


def run(args: argparse.Namespace) -> int:
    res = score(args.model, args.stores, args.out, workers=args.workers, scorer_workers=args.scorer_workers,
                address=args.address, batch_size=args.batch_size, max_in_flight=args.max_in_flight,
                heatmaps=not args.no_heatmaps, experiment=None if args.no_mlflow else args.experiment,
                tracking_uri=args.tracking_uri)
    print(res.summary())
    return 0
