"""The two stages of ``foveate score`` as Ray actor pools (:class:`pipeline.runtime.ActorPool`) over
:class:`workers.scoring.ScorerWorker` and :class:`workers.scoring.ClassifierWorker`: sizing, backpressure,
splitting a failed call into single slides."""

from __future__ import annotations

import logging
import math
from collections import deque
from pathlib import Path
from typing import Any

from pipeline.predictions import PredictionWriter
from pipeline.runtime import ActorPool, wait_done

__all__ = ["run_stages"]

log = logging.getLogger(__name__)


def _unreachable(err: BaseException) -> bool:
    """True for an actor error that says the actor's node was lost or the actor could not be reached."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    if isinstance(err, ActorUnavailableError):
        return True
    return isinstance(err, RayActorError) and (err.preempted or "node has died" in str(err).lower())


def run_stages(
    todo: list[tuple[str, str]],
    ckpt_ref: Any,
    *,
    model_name: str,
    heatmap_dir: Path | None,
    writer: PredictionWriter,
    workers: int | None,
    scorer_workers: int | None,
    batch_size: int,
    max_in_flight: int,
    max_restarts: int,
    max_task_retries: int,
    progress,
    scorer_cls: type | None = None,
    classifier_cls: type | None = None,
    strict_mpp: bool = False,
    ngff_dir: Path | None = None,
) -> tuple[str, int, int, int]:
    """Drive the two actor pools over ``todo``; returns (scorer device, ok rows, error rows, retried calls)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    from workers.scoring import ClassifierWorker, ScorerWorker, error_row

    scorer_cls = scorer_cls or ScorerWorker
    classifier_cls = classifier_cls or ClassifierWorker

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
        scorer_actor = ray.remote(num_gpus=min(1.0, gpus / n_scorers), num_cpus=0, **opts)(scorer_cls)
        device = "cuda"
    else:
        scorer_actor = ray.remote(num_cpus=cpus_each, **opts)(scorer_cls)
        device = "cpu"
    classifier_actor = ray.remote(num_cpus=cpus_each, **opts)(classifier_cls)
    scorers = ActorPool(
        lambda: scorer_actor.remote(ckpt_ref, device=device, threads=threads, strict_mpp=strict_mpp),
        n_scorers,
        depth=max_in_flight,
        max_task_retries=max_task_retries,
        max_replacements=3 * n_scorers,
        name="scorer",
    )
    classifiers = ActorPool(
        lambda: classifier_actor.remote(
            ckpt_ref,
            heatmap_dir=str(heatmap_dir) if heatmap_dir else None,
            model_name=model_name,
            threads=threads,
            ngff_dir=str(ngff_dir) if ngff_dir else None,
        ),
        workers,
        depth=max_in_flight,
        max_task_retries=max_task_retries,
        max_replacements=3 * workers,
        name="classifier",
    )
    scorers.start()
    classifiers.start()
    log.info(
        "scoring %d slide(s): %d scorer actor(s) on %s, %d classifier actor(s), batch %d",
        len(todo),
        n_scorers,
        device,
        workers,
        batch_size,
    )

    pending: deque[list[tuple[str, str]]] = deque(todo[i : i + batch_size] for i in range(0, len(todo), batch_size))
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
    redo: deque[list[dict[str, Any]]] = deque()  # classifier calls whose actor died, resubmitted as they were

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
        while pending or waiting or solo or redo or len(scorers) or len(classifiers):
            while waiting or solo or redo:  # classifiers first: drain before scoring more
                i = classifiers.free()
                if i is None:
                    break
                if redo:
                    items = redo.popleft()
                elif solo:
                    items = [solo.popleft()]
                else:
                    items = [waiting.popleft() for _ in range(min(batch_size, len(waiting)))]
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
                    if done.actor_died and done.retry and (done.superseded or _unreachable(done.error)):
                        # the actor's node was lost (or could not be reached), not the slides' fault: the same call
                        # again on the replacement actor (Ray's own task retries can run out before a lost node
                        # is noticed). So is a call of an actor the pool had already replaced (killed) after
                        # another of its calls failed: it died with its actor. An actor that dies by itself goes
                        # the usual way (split, then error rows).
                        log.warning(
                            "%s call on %d slide(s) lost with its actor (attempt %d); resubmitting",
                            stage,
                            len(done.task),
                            done.pool.attempts(done.task),
                        )
                        (pending if stage == "scorer" else redo).appendleft(done.task)
                        continue
                    on_failure(stage, done.task, done.error)
                    continue
                if stage == "scorer":
                    for item in done.value:
                        if item["status"] == "ok":
                            waiting.append(item)
                        else:
                            record(
                                error_row(
                                    item["slide_id"],
                                    item["store"],
                                    item["error"],
                                    model=model_name,
                                    seconds=item.get("seconds", 0.0),
                                )
                            )
                else:
                    for row in done.value:
                        record(row)
    finally:
        scorers.shutdown()
        classifiers.shutdown()
    return device, ok, failed, retried
