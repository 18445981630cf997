"""``foveate ingest INPUT... --out STORE_DIR``: slide archives -> OME-Zarr stores, on Ray.

A pool of tiler actors (:class:`workers.tiler.Tiler` under ``ray.remote``) does all the work; this
module only schedules it. Each slide goes through ``plan`` (open the slide, create or reopen its store)
-> its regions, stage by stage -> ``finalize`` (tissue mask, metadata, completion marker). Tasks of all
slides share one queue, so slides of an archive and regions of one large slide both spread over all
actors; an actor prefers regions of the slide it already has open. Each actor has at most
``2`` tasks queued, so memory stays bounded (a region is one ``2048 x 2048`` block by default).

A worker that dies (killed, OOM) is replaced and its task retried (``max_task_retries``); a region whose
workers die more often than that fails its slide once the other regions of its stage are written (kept for the
resume); a task that raises fails its slide only. Completed stores are skipped unless ``--overwrite``; interrupted ones resume
at region granularity.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from operators.errors import ConfigError
from pipeline import __version__
from pipeline.archive_info import carry_archive_info
from pipeline.config import add_config_arguments, config_from_cli
from pipeline.ingest_inputs import discover_inputs
from pipeline.ingest_manifest import merge_manifest
from pipeline.progress import Progress
from pipeline.runtime import ActorPool, init_ray, wait_done
from workers import storage
from workers.ingest_source import SlideFile
from workers.tiler import CODECS, IngestOptions, Tiler

__all__ = ["add_arguments", "run", "ingest", "IngestConfig", "IngestResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestConfig:
    """Everything ``foveate ingest`` needs (``--config`` YAML / ``--set`` keys; the flags map onto them).

    Attributes:
        inputs: slide files, directories (searched recursively) or CSV manifests with a ``path`` column.
        out: folder or object-storage URL (``s3://bucket/prefix``) for ``<slide_id>.zarr`` stores and the manifest.
        workers: tiler actors (None: the CPUs of the Ray cluster).
        address: Ray cluster to join (None: in-process Ray, see ``pipeline.runtime.init_ray``).
        overwrite: redo slides whose store is already complete.
        max_task_retries: how often a task whose actor died is retried on a fresh actor.
        options: how stores are written (:class:`workers.tiler.IngestOptions`).
    """

    inputs: tuple[str, ...] = ()
    out: str = ""
    workers: int | None = None
    address: str | None = None
    overwrite: bool = False
    max_task_retries: int = 2
    options: IngestOptions = field(default_factory=IngestOptions)

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("inputs: name at least one slide file, directory or CSV manifest")
        if not self.out:
            raise ConfigError("out: the store folder is required (--out)")
        if self.workers is not None and (isinstance(self.workers, bool) or self.workers < 1):
            raise ConfigError(f"workers: got {self.workers!r}, must be a positive integer")
        if self.max_task_retries < 0:
            raise ConfigError(f"max_task_retries: got {self.max_task_retries!r}, must be >= 0")


# CLI flag (argparse attribute) -> config key; flags not given leave the config's value
_FLAGS = {
    "inputs": "inputs",
    "out": "out",
    "workers": "workers",
    "address": "address",
    "overwrite": "overwrite",
    "options.tile_size": "tile_size",
    "options.codec": "codec",
    "options.jpeg_quality": "jpeg_quality",
    "options.zstd_level": "zstd_level",
    "options.threads": "threads",
    "options.mpp": "mpp",
    "options.min_size": "min_size",
    "options.region_tiles": "region_tiles",
    "options.passthrough": "passthrough",
    "options.direct": "direct",
    "options.shard": "shard",
}


def add_arguments(p) -> None:
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        default=None,
        help="slide files, directories (searched recursively) or CSV manifests with a 'path' column",
    )
    p.add_argument(
        "--out",
        metavar="STORE_DIR",
        help="folder or object-storage URL (s3://bucket/prefix; credentials from the environment) for "
        "<slide_id>.zarr stores and the manifest (required)",
    )
    p.add_argument("--workers", type=int, default=None, help="tiler actors (default: CPUs of the Ray cluster)")
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto' or host:port); default: start an in-process local Ray",
    )
    p.add_argument("--tile-size", type=int, help="chunk / tile side in pixels (default 256)")
    p.add_argument(
        "--codec",
        choices=CODECS,
        help="auto (default): copy the source's JPEG tiles byte for byte where they align with --tile-size (level 0 "
        "exactly as OpenSlide decodes it), else zstd; zstd: decode and store losslessly; jpeg: one RGB JPEG per "
        "chunk, copying aligned source JPEG tiles as-is",
    )
    p.add_argument("--jpeg-quality", type=int, help="quality of JPEGs foveate encodes (default 90)")
    p.add_argument(
        "--zstd-level",
        type=int,
        help="zstd level (default 1); negative levels (-1 ... -131072) are faster, with larger stores",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="threads per tiler actor for JPEG decoding, zstd and reductions (default 1; each actor "
        "still reserves one Ray CPU, so use >1 only when workers < CPUs)",
    )
    p.add_argument(
        "--mpp",
        type=float,
        default=None,
        help="resample level 0 to this many microns per pixel (slides without mpp metadata then fail)",
    )
    p.add_argument(
        "--min-size", type=int, help="stop the pyramid at a level whose longer side is <= this (default 1024)"
    )
    p.add_argument("--region-tiles", type=int, help="regions are blocks of N x N chunks (power of two, default 8)")
    p.add_argument(
        "--no-passthrough",
        dest="passthrough",
        action="store_false",
        default=None,
        help="with --codec auto: always decode and store with zstd; with --codec jpeg: always decode and re-encode",
    )
    p.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        default=None,
        help="always read through OpenSlide read_region",
    )
    p.add_argument(
        "--no-shard",
        dest="shard",
        action="store_false",
        default=None,
        help="one object per chunk instead of one zarr shard per ingest region and level (the default)",
    )
    p.add_argument("--overwrite", action="store_true", default=None, help="redo slides whose store is already complete")
    p.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even when some slides failed (default: exit 1 when any slide failed)",
    )
    add_config_arguments(p, "options.codec=jpeg")


def run(args) -> int:
    if not args.inputs:
        args.inputs = None  # nargs="*" gives [] when none are given: leave the config's inputs
    cfg = config_from_cli(IngestConfig, args, _FLAGS)
    res = ingest(
        cfg.inputs,
        cfg.out,
        options=cfg.options,
        workers=cfg.workers,
        address=cfg.address,
        overwrite=cfg.overwrite,
        max_task_retries=cfg.max_task_retries,
    )
    print(res.summary())
    if res.failed and not getattr(args, "allow_failures", False):
        print(f"{len(res.failed)} slide(s) failed; exit 1 (--allow-failures: exit 0)")
        return 1
    return 0


@dataclass
class IngestResult:
    rows: list[dict[str, Any]]
    seconds: float
    manifest_path: str
    pixels: int = 0  # level-0 pixels of the slides completed in this run
    cpu_seconds: float = 0.0  # CPU time the tiler actors spent in region and finalize tasks (not plan)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "failed"]

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.rows)

    def summary(self) -> str:
        lines = [
            f"ingest: {self.count('ok')} ok, {self.count('skipped')} skipped, {self.count('failed')} failed "
            f"of {len(self.rows)} in {self.seconds:.1f}s; manifest {self.manifest_path}"
        ]
        lines += [f"  FAILED {r['slide_id']}: {r['error']}" for r in self.failed]
        return "\n".join(lines)


@dataclass
class _Task:
    slide: str  # slide_id
    kind: str  # plan | region | finalize
    payload: Any = None


@dataclass
class _SlideState:
    inp: SlideFile
    t0: float = field(default_factory=time.perf_counter)
    store_path: str | None = None
    stages: list[list[Any]] = field(default_factory=list)
    stage: int = 0
    outstanding: int = 0
    regions: int = 0
    resumed: int = 0
    mpp_missing: bool = False
    done: bool = False
    error: str | None = None  # a region whose worker kept dying: the stage's other regions finish, then it fails


def _one_line(exc: BaseException) -> str:
    """The root cause of a (Ray-wrapped) exception as one line."""
    import ray

    cause = exc
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    msg = " ".join(str(cause).split())
    if isinstance(cause, ray.exceptions.RayTaskError):
        msg = msg.split(" ray::")[0]
    name = type(cause).__name__
    if name.startswith("RayTaskError(") and name.endswith(")"):
        name = name[len("RayTaskError(") : -1]
    return msg if name == "SlideOpenError" else f"{name}: {msg}"


def _actors(workers: int | None) -> int:
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(1, min(workers or cpus, cpus))


def _out_dir(out: str | Path) -> str:
    """``--out`` as a writable local folder (created) or an object-storage URL whose bucket exists (normalised),
    or a ValueError saying why not."""
    text = str(out)
    if storage.is_url(text):
        return _out_url(text)
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {text!r} is a file; give a folder for the stores (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {text!r}: cannot create the folder ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {text!r} is not writable by this user")
    return storage.normalize(path)


def _out_url(text: str) -> str:
    """Checks of an object-storage ``--out``: its filesystem package is installed and its bucket (the first
    part of the path) can be listed with the environment's credentials."""
    url = storage.normalize(text)
    try:
        fs, path = storage.filesystem(url)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"--out {text!r}: cannot open its filesystem ({exc})") from exc
    from workers.bucket_check import check_bucket

    # one listing of the bucket: refused credentials, a dead endpoint and a missing bucket each get their own line
    check_bucket(url, what=f"--out {text!r}")
    return url


def ingest(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    options: IngestOptions | None = None,
    workers: int | None = None,
    address: str | None = None,
    overwrite: bool = False,
    max_task_retries: int = 2,
    progress: bool | None = None,
    tiler_cls: type[Tiler] = Tiler,
) -> IngestResult:
    """Ingest slides into ``out``; see the module doc and ``foveate ingest --help``.

    Args:
        inputs: files, directories, CSV manifests.
        out: store folder (created) or object-storage URL (``s3://bucket/prefix``, :mod:`workers.storage`).
        options: :class:`workers.tiler.IngestOptions`.
        workers: number of tiler actors (default: the cluster's CPUs).
        address: Ray address to join; ``None`` starts a local Ray (or uses the one already initialised).
        overwrite: redo complete stores.
        max_task_retries: how often a task whose worker died is retried on a fresh actor.
        tiler_cls: the actor class (fault-injection tests pass a :class:`workers.tiler.Tiler` subclass).
        progress: show progress bars (default: when stderr is a terminal).

    Returns:
        :class:`IngestResult` (rows as written to the manifest).
    """

    options = options or IngestOptions()
    IngestConfig(
        tuple(str(i) for i in inputs),
        str(out),
        workers=workers,
        address=address,
        overwrite=overwrite,
        max_task_retries=max_task_retries,
        options=options,
    )  # validates
    t_start = time.perf_counter()
    out = _out_dir(out)
    from pipeline.locks import output_lock

    with output_lock(out, "foveate ingest"):  # one writer per store folder (and its manifest)
        return _ingest_locked(
            inputs, out, t_start, options, workers, address, overwrite, max_task_retries, progress, tiler_cls
        )


def _ingest_locked(
    inputs, out: str, t_start: float, options, workers, address, overwrite, max_task_retries, progress, tiler_cls
) -> IngestResult:
    import ray

    slides = discover_inputs(inputs)
    if not slides:
        raise ValueError(f"no slides found in {list(map(str, inputs))}: nothing to ingest, no manifest written")
    carry_archive_info(inputs, out)  # the archive's statement (archive.json) travels with its stores
    log.info("ingest: %d slide(s) from %d input(s) -> %s", len(slides), len(inputs), out)
    rows: dict[str, dict[str, Any]] = {}
    states: dict[str, _SlideState] = {}
    queue: deque[_Task] = deque()
    for inp in slides:
        spath = storage.join(out, f"{inp.slide_id}.zarr")
        if not overwrite and _complete(spath):
            rows[inp.slide_id] = _skipped_row(inp, spath)
            continue
        states[inp.slide_id] = _SlideState(inp)
        queue.append(_Task(inp.slide_id, "plan", inp))
    pixels, cpu = 0, 0.0
    try:
        if states:
            started = init_ray(
                address,
                num_cpus=workers or os.cpu_count() or 1,
                object_store_memory=128 * 1024**2,
                env_vars={"OMP_NUM_THREADS": "1"},
            )
            n_actors = _actors(workers)
            try:
                pixels, cpu = _schedule(
                    states, queue, rows, out, options, n_actors, overwrite, max_task_retries, progress, tiler_cls
                )
            finally:
                if started:
                    ray.shutdown()
    finally:  # even when interrupted: the rows of the slides that finished are not lost
        ordered = [rows[s.slide_id] for s in slides if s.slide_id in rows]
        for r in ordered:
            r.setdefault("error", None)
            r.pop("cpu_seconds", None)
        merge_manifest(out, ordered)
    return IngestResult(ordered, time.perf_counter() - t_start, storage.join(out, "manifest.parquet"), pixels, cpu)


def _complete(spath: str) -> bool:
    """A store to skip: it has its completion marker and its chunks match the marker's inventory (a damaged
    store is ingested again)."""
    from workers.store import is_complete, verify_store

    if not is_complete(spath):
        return False
    problems = verify_store(spath)
    if problems:
        log.warning("%s carries its completion marker but is damaged (%s): ingesting it again", spath, problems[0])
    return not problems


def _base_row(inp: SlideFile) -> dict[str, Any]:
    return {"slide_id": inp.slide_id, "source": inp.source, **inp.carried}


def _skipped_row(inp: SlideFile, spath: str) -> dict[str, Any]:
    from workers.store import SlideStore

    row = {**_base_row(inp), "status": "skipped", "error": None, "store": str(spath), "seconds": 0.0}
    try:
        s = SlideStore(spath)
        m = s.meta
        row.update(
            width=m.level0_size[0],
            height=m.level0_size[1],
            mpp=m.mpp[0] if m.mpp else None,
            mpp_missing=m.mpp is None,
            tissue_fraction=m.tissue_fraction,
            vendor=m.vendor,
            codec=m.codec,
            levels=len(m.downsamples),
        )
    except Exception as exc:
        log.warning("%s: complete store but unreadable metadata: %s", spath, exc)
    return row


def _schedule(
    states: dict[str, _SlideState],
    queue: deque,
    rows: dict,
    out: str,
    options: IngestOptions,
    n_actors: int,
    overwrite: bool,
    max_task_retries: int,
    progress: bool | None,
    tiler_cls: type[Tiler] = Tiler,
) -> tuple[int, float]:
    import ray

    actor_cls = ray.remote(num_cpus=1, max_restarts=0)(tiler_cls)
    pool = ActorPool(
        lambda: actor_cls.remote(out, options, version=__version__),
        n_actors,
        depth=2,
        max_task_retries=max_task_retries,
        name="tiler",
    ).start()
    pixels = 0
    cpu = 0.0
    # one bar: slides ingested, with the tiles written so far (of those planned) as its postfix
    slide_bar = Progress(len(states), "slides ingested", unit="slide", enable=progress)
    total_tiles = tiles_done = 0

    def pick(i: int) -> _Task | None:
        if not queue:
            return None
        last = pool.last_task[i]
        for j, t in enumerate(queue):  # prefer the slide this actor has open
            if last is not None and t.slide == last.slide and t.kind == "region":
                del queue[j]
                return t
            if j > 64:
                break
        return queue.popleft()

    def submit(i: int, t: _Task) -> None:
        st = states[t.slide]
        if t.kind == "plan":
            st.t0 = time.perf_counter()
            pool.submit(i, "plan", t.payload, overwrite=overwrite, task=t)
        elif t.kind == "region":
            pool.submit(i, "write_region", st.store_path, t.payload, task=t)
        else:
            pool.submit(i, "finalize", st.store_path, task=t)

    def fail(slide: str, error: str, *, remove_store: bool) -> None:
        st = states[slide]
        if st.done:
            return
        st.done = True
        rows[slide] = {
            **_base_row(st.inp),
            "status": "failed",
            "error": error,
            "seconds": time.perf_counter() - st.t0,
            "regions": st.regions,
            "regions_resumed": st.resumed,
            "store": None,
        }
        log.warning("slide %s failed: %s", slide, error)
        for t in [t for t in queue if t.slide == slide]:
            queue.remove(t)
        if remove_store and st.store_path:
            storage.remove_tree(st.store_path)
        slide_bar.update(1)

    def enqueue_stage(slide: str) -> None:
        st = states[slide]
        while st.stage < len(st.stages) and not st.stages[st.stage]:
            st.stage += 1
        if st.stage >= len(st.stages):
            queue.appendleft(_Task(slide, "finalize"))
            return
        regs = st.stages[st.stage]
        st.outstanding = len(regs)
        queue.extend(_Task(slide, "region", r) for r in regs)

    try:
        while queue or len(pool):
            for i in range(n_actors):
                while pool.has_room(i):
                    t = pick(i)
                    if t is None:
                        break
                    submit(i, t)
            if not len(pool):
                continue
            for done in wait_done(pool):
                t = done.task
                st = states[t.slide]
                if done.actor_died:  # tasks queued on the dead actor fail too; each is retried on its own
                    if st.done:
                        continue
                    if not done.retry:
                        error = (
                            f"worker died {pool.attempts(t)} times on {t.kind} {getattr(t.payload, 'key', '')}".rstrip()
                            + " (store kept; re-run to resume)"
                        )
                        if t.kind != "region":
                            fail(t.slide, error, remove_store=False)
                            continue
                        # give up on this region but let the stage's other regions finish, so that a re-run
                        # resumes from everything that could be written; the slide fails when the stage is over
                        st.error = st.error or error
                        st.outstanding -= 1
                        if st.outstanding == 0:
                            fail(t.slide, st.error, remove_store=False)
                    else:
                        queue.appendleft(t)
                    continue
                if done.error is not None:
                    if not isinstance(done.error, ray.exceptions.RayTaskError):
                        raise done.error
                    if not st.done:
                        from workers.ingest_source import SlideOpenError

                        bad_input = isinstance(getattr(done.error, "cause", None), SlideOpenError)
                        fail(t.slide, _one_line(done.error), remove_store=bad_input)
                    continue
                if st.done:
                    continue
                result = done.value
                if t.kind == "plan":
                    plan = result
                    st.store_path = plan.store_path
                    st.stages = plan.todo
                    st.regions = sum(len(s) for s in plan.stages)
                    st.resumed = plan.resumed_regions
                    st.mpp_missing = plan.info["mpp"] is None
                    if st.mpp_missing:
                        log.warning("slide %s has no mpp metadata (flagged in the manifest)", t.slide)
                    n_tiles = sum(_tiles(plan.tile, r) for s in plan.stages for r in s)
                    total_tiles += n_tiles
                    tiles_done += n_tiles - sum(_tiles(plan.tile, r) for s in plan.todo for r in s)
                    slide_bar.update(0, postfix=f"{tiles_done}/{total_tiles} tiles")
                    enqueue_stage(t.slide)
                elif t.kind == "region":
                    tiles_done += result["tiles"]
                    slide_bar.update(0, postfix=f"{tiles_done}/{total_tiles} tiles")
                    cpu += result.get("cpu_seconds", 0.0)
                    st.outstanding -= 1
                    if st.outstanding == 0 and st.error:
                        fail(t.slide, st.error, remove_store=False)
                    elif st.outstanding == 0:
                        st.stage += 1
                        enqueue_stage(t.slide)
                else:
                    st.done = True
                    log.info("%s: %s", t.slide, result.pop("layout", ""))
                    rows[t.slide] = {
                        **_base_row(st.inp),
                        "status": "ok",
                        "error": None,
                        "seconds": time.perf_counter() - st.t0,
                        "mpp_missing": st.mpp_missing,
                        "regions": st.regions,
                        "regions_resumed": st.resumed,
                        "store": st.store_path,
                        **result,
                    }
                    pixels += int(result["width"]) * int(result["height"])
                    cpu += result.get("cpu_seconds", 0.0)
                    slide_bar.update(1, postfix=f"{tiles_done}/{total_tiles} tiles")
    finally:
        pool.shutdown()
        slide_bar.close()
    return pixels, cpu


def _tiles(t: int, r) -> int:
    return -(-r.box.width // t) * -(-r.box.height // t)


if __name__ == "__main__":  # pragma: no cover
    from pipeline.cli import main

    sys.exit(main(["ingest", *sys.argv[1:]]))
