"""Benchmark: how reliably do the selection models learn where to look? Seeds x selector configs x tasks.

For every task the data is made once (``foveate synth`` -> ``foveate ingest``, cached under
``WORKDIR/data/<task>-<count>x<size>/`` and reused when complete; ``--synth-jobs N`` writes N slides at once),
then for every config in ``configs/``
(default: every training config there except ``demo`` and ``runtime_env``) and every training seed one
``foveate train`` runs in a subprocess (:func:`run_training`; swap it for an in-process trainer later). The
"validation" split of ``foveate train`` (stratified, ``data.val_fraction``, ``data.seed``) is the held-out
test set, never used for model selection: the model after the last epoch is evaluated with hard top-k. With
``--in-process --val-fraction F`` a share F of the training slides is a validation split of its own and the config's
early stopping (``early_stopping``, as ``foveate train`` runs it) picks the epoch on it; the best epoch's model is
then tested on the held-out slides (``stop_reason``, ``stopped_epoch``, ``best_epoch`` in the row).

Per run: test accuracy and AUC (from the run's MLflow metrics ``val_accuracy`` / ``val_auc``), train seconds
(``train_seconds``: the training loop, without Ray/MLflow start-up), and the *hit rate*: the fraction of the
trained model's hard top-k test patches (re-run here from the run's checkpoint) that overlap a ground-truth
informative object of the synthetic slide's sidecar (checker: the candidate structures; objects: the
informative objects, not the distractors), next to the *chance* hit rate of uniformly random tissue cells;
the same for the distractors (objects task: does the scorer look at ink at all?).
Also the fraction of informative objects that at least one chosen patch touches (``recall``). With
``--in-process`` the same hard top-k on the first ``--trace-slides`` (20) held-out slides after every epoch goes
into the run's log line (``trace_hit_rate``, ``trace_object_recall``, ``trace_eval_accuracy``,
``trace_all_objects``, ``trace_decidable``; ``trace_train_bag_*`` the same of one training-mode draw): where the
scorer looks as training goes, and (shape family) whether the bag holds enough glyphs for its label to be read.

Per task x config the table shows: success rate (test accuracy >= 0.95), median and worst accuracy, median
AUC, median hit rate (and chance), median object recall, median distractor hit rate (and chance), median
train seconds.

``--oracle``: a learnability check. The same feature network + aggregator (from the first config) is trained
on the patches a perfect scorer would choose (the grid cells with the largest overlap with each informative
object, then the rest of the K slots filled with random tissue cells) and evaluated the same way; it shows
whether the task is learnable once the scorer looks at the right place.

Tasks (``--tasks``): ``checker`` (the 80-slide task of ``benchmarks/accuracy.py``: 80 slides of 2048-3072 px),
``objects-binary`` and ``objects-4class`` (``foveate synth --task objects``, 128 slides of 4096 px by default:
38–40 of them held out; on 64 a held-out set of 19–20 slides put one slide at 0.05 of accuracy;
``--count`` / ``--size`` change every task's size), and quick variants ``checker-quick`` (32 x 2048),
``objects-binary-quick`` and ``objects-4class-quick`` (32 x 4096); ``shapes-binary`` (384 x 3072: 268 train / 116
held out; with 90 training slides of 4096 px, as until 2026-11-26, even the classifier on the true glyphs stayed
near chance) and ``shapes-8class`` (384 x 3072 as well: 272 / 112) (``foveate synth --task shapes``:
the label is the majority glyph, 3 of 5, drawn with a bold pen among fine ink strokes of the same colour; data
folders ``…-v2``: the first version, every stroke of one width, is not made any more) and their ``-quick``
variants (32 x 4096).

Usage:
  python benchmarks/robustness.py --tasks objects-binary-quick --configs perturbed_mean --seeds 0,1,2 --epochs 10
  python benchmarks/robustness.py --tasks objects-binary,objects-4class --configs perturbed_mean,attention_sampling \\
      --seeds 0,1,2 --oracle --json benchmarks/results/robustness_objects.json
  # two processes on two cores, then one table:
  python benchmarks/robustness.py --in-process --seeds 0,2,4,6,8 --json a.json & \
  python benchmarks/robustness.py --in-process --seeds 1,3,5,7,9 --json b.json; wait
  python benchmarks/robustness.py --merge a.json b.json --json all.json
  # a two-phase run that keeps its state at the switch, then its second phase replayed under other options:
  python benchmarks/robustness.py --in-process --val-fraction 0.2 --configs perturbed_gate --seeds 0 --save-state-at 20
  python benchmarks/robustness.py --in-process --val-fraction 0.2 --configs perturbed_gate --seeds 0 \
      --resume-state WORKDIR/train/RUN/state-e20.pt --set optim.ema_epochs=0
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import fcntl
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np

PY = sys.executable
SUCCESS = 0.95
NOT_CONFIGS = ("demo", "runtime_env")


@dataclass(frozen=True)
class Task:
    name: str
    family: str  # "checker" | "objects" | "shapes"
    classes: int
    count: int
    size: str
    codec: str  # foveate ingest --codec
    version: str = ""  # the family's drawing version where it changed (a new data folder; old data stays apart)

    @property
    def key(self) -> str:
        v = f"-{self.version}" if self.version else ""
        return f"{self.name.removesuffix('-quick')}-{self.count}x{self.size.replace(':', '-')}{v}"


TASKS = {
    "checker": Task("checker", "checker", 2, 80, "2048:3072", "zstd"),
    "objects-binary": Task("objects-binary", "objects", 2, 128, "4096", "jpeg"),
    "objects-4class": Task("objects-4class", "objects", 4, 128, "4096", "jpeg"),
    "checker-quick": Task("checker-quick", "checker", 2, 32, "2048", "zstd"),
    "objects-binary-quick": Task("objects-binary-quick", "objects", 2, 32, "4096", "jpeg"),
    "objects-4class-quick": Task("objects-4class-quick", "objects", 4, 32, "4096", "jpeg"),
    "shapes-binary": Task("shapes-binary", "shapes", 2, 384, "3072", "jpeg", "v2"),
    "shapes-8class": Task("shapes-8class", "shapes", 8, 384, "3072", "jpeg", "v2"),
    "shapes-binary-quick": Task("shapes-binary-quick", "shapes", 2, 32, "4096", "jpeg", "v2"),
    "shapes-8class-quick": Task("shapes-8class-quick", "shapes", 8, 32, "4096", "jpeg", "v2"),
}


def resolve_tasks(names: str, count: int | None = None, size: str | None = None) -> list[Task]:
    """``--tasks`` (comma-separated names of :data:`TASKS`) with ``--count`` / ``--size`` applied; a task keeps its
    drawing version, so its data folder stays the version's."""
    tasks = []
    for name in [t.strip() for t in names.split(",") if t.strip()]:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose from {list(TASKS)}")
        task = TASKS[name]
        if count or size:
            task = replace(task, count=count or task.count, size=size or task.size)
        tasks.append(task)
    return tasks


def config_path(config: str) -> Path:
    """A config name of ``configs/`` (``perturbed_mean``) or a YAML path (``.../best.yaml``) -> its file."""
    return Path(config) if str(config).endswith((".yaml", ".yml")) else ROOT / "configs" / f"{config}.yaml"


def available_configs() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if p.stem not in NOT_CONFIGS)


# ---------------------------------------------------------------------------------------------- data
def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {rc}; see {log}")


def prepare_data(task: Task, workdir: Path, seed: int = 0, synth_jobs: int = 1) -> Path:
    """synth + ingest once; returns the stores folder. A completed dataset has a ``READY`` marker.

    ``synth_jobs``: ``foveate synth --jobs`` (slides written at once; the bytes do not depend on it).
    """
    d = workdir / "data" / task.key
    stores = d / "stores"
    if (d / "READY").is_file():
        return stores
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second benchmark on the same data waits here, then finds it READY
        if (d / "READY").is_file():
            return stores
        return _prepare_locked(task, d, seed, synth_jobs)


def _prepare_locked(task: Task, d: Path, seed: int, synth_jobs: int) -> Path:
    """:func:`prepare_data`'s synth and ingest, under its lock."""
    slides, stores = d / "slides", d / "stores"
    log = d / "prepare.log"
    t0 = time.perf_counter()
    if not (slides / "labels.csv").is_file():
        cmd = [
            PY,
            "-m",
            "pipeline",
            "synth",
            str(slides),
            "--count",
            str(task.count),
            "--size",
            task.size,
            "--format",
            "tiff",
            "--seed",
            str(seed),
            "--jobs",
            str(synth_jobs),
        ]
        if task.family in ("objects", "shapes"):
            cmd += ["--task", task.family, "--classes", str(task.classes)]
        _run(cmd, log)
    t1 = time.perf_counter()
    _run(
        [
            PY,
            "-m",
            "pipeline",
            "ingest",
            str(slides / "labels.csv"),
            "--out",
            str(stores),
            "--workers",
            "2",
            "--codec",
            task.codec,
        ],
        log,
    )
    t2 = time.perf_counter()
    (d / "READY").write_text(
        json.dumps({"task": task.__dict__, "synth_seconds": t1 - t0, "ingest_seconds": t2 - t1}) + "\n"
    )
    print(f"[data] {task.key}: synth {t1 - t0:.0f}s, ingest {t2 - t1:.0f}s", flush=True)
    return stores


# ---------------------------------------------------------------------------------------------- one training
def run_training(
    config: str, stores: Path, seed: int, overrides: list[str], workdir: Path, run_name: str, log: Path
) -> dict[str, Any]:
    """Train one model with ``foveate train`` in a subprocess. Returns ``{"metrics", "checkpoint", "run_dir",
    "run_id", "wall_seconds"}``. The only place that knows how a training is launched."""
    run_dir = workdir / "train" / run_name
    if run_dir.exists():  # a crashed earlier attempt: start over
        shutil.rmtree(run_dir)
    cmd = [
        PY,
        "-m",
        "pipeline",
        "train",
        "--config",
        str(config_path(config)),
        "--set",
        f"data.stores={stores}",
        "--set",
        "data.labels=manifest",
        "--set",
        f"seed={seed}",
        "--set",
        f"tracking.run_name={run_name}",
        "--set",
        "tracking.experiment=foveate-robustness",
        "--set",
        "threads=1",
        "--set",
        "tracking.artifact_slides=0",
        *[a for o in overrides for a in ("--set", o)],
        "--workdir",
        str(workdir),
    ]
    t0 = time.perf_counter()
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{workdir / 'mlflow.db'}")
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"training {run_name} exited with {rc}; see {log}")
    state = json.loads((run_dir / "train_state.json").read_text())
    from mlflow.tracking import MlflowClient

    metrics = dict(MlflowClient(state["tracking_uri"]).get_run(state["run_id"]).data.metrics)
    ckpts = sorted(run_dir.rglob("model.pt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        raise RuntimeError(f"no checkpoint under {run_dir}")
    return {
        "metrics": metrics,
        "checkpoint": str(ckpts[-1]),
        "run_dir": str(run_dir),
        "run_id": state["run_id"],
        "wall_seconds": wall,
    }


def run_training_in_process(
    config: str,
    stores: Path,
    seed: int,
    overrides: list[str],
    workdir: Path,
    run_name: str,
    log: Path,
    trace=None,
    val_fraction: float = 0.0,
    device: str = "cpu",
    save_state_at: int | None = None,
    resume_state: Path | None = None,
) -> dict[str, Any]:
    """Train one model in this process with ``workers.trainer.Trainer`` (the numerics of ``foveate train`` on one
    worker, without Ray Train start-up, MLflow and model logging). Same return value as :func:`run_training`.
    ``trace(model) -> dict``: called on the evaluated model after every epoch, its values added to the epoch's
    log line (``--trace-slides``: the hit rate on held-out slides as training goes). ``val_fraction`` > 0: that
    share of the training slides (stratified, seeded by ``data.seed + 1``) is a validation split of its own, and
    the config's early stopping runs on it (the best epoch's model is the one saved) — the held-out test slides
    stay out of every choice; 0: validation on the held-out split, to the cap (early stopping must then be off).
    ``device``: where the model trains. ``save_state_at`` E: after epoch E the trainer's whole state
    (:meth:`Trainer.state_dict`) is saved as ``RUN_DIR/state-eE.pt`` and the evaluated model as
    ``RUN_DIR/model-eE.pt``, and training goes on; ``resume_state``: training continues from such a state (its
    epoch, optimizer, generators), under this call's config: options of the optimizer and the schedule may differ
    from the saved run's (e.g. a second phase replayed from the switch), the model's structure may not; a replay
    without the moving average (``optim.ema_epochs=0``) of a run with it takes the average's scorer, the one the
    saved run freezes at the switch of ``schedule.select_until`` (so resume at the switch)."""
    import dataclasses

    import torch

    from operators.checkpoint import checkpoint_dict
    from pipeline.config import load_config
    from pipeline.data import build_slide_table, shard, split_train_val
    from pipeline.train import TrainConfig
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(
        TrainConfig,
        config_path(config),
        [f"data.stores={stores}", "data.labels=manifest", f"seed={seed}", *overrides],
    )
    table = build_slide_table(cfg.data)
    train, val = split_train_val(table.records, cfg.data.val_fraction, cfg.data.seed)
    if val_fraction > 0:  # a validation split of the training slides: the held-out ones stay for the test
        train, val = split_train_val(train, val_fraction, cfg.data.seed + 1)
    elif cfg.early_stopping.patience > 0:
        raise ValueError("early stopping on the held-out split: set early_stopping.patience=0 or a val_fraction")
    model_cfg = dataclasses.replace(cfg.model, num_classes=table.num_classes)
    t0 = time.perf_counter()
    trainer = Trainer(
        model_cfg,
        cfg.optim,
        cfg.schedule,
        slides_per_epoch=len(train),
        seed=cfg.seed,
        early_stopping=cfg.early_stopping if val_fraction > 0 else None,
        features_init=_uri_init(model_cfg),
        gate_encoder_init=_gate_init(cfg, model_cfg, train, workdir),
        device=device,
    )
    if resume_state is not None:
        state = torch.load(resume_state, map_location="cpu", weights_only=False)
        trainer.load_state_dict(state)
        if trainer.ema_model is None and "ema" in state:  # the saved run would freeze its average's scorer
            prefix = "scorer."
            trainer.model.scorer.load_state_dict(
                {k[len(prefix) :]: v for k, v in state["ema"].items() if k.startswith(prefix)}
            )
    run_dir = workdir / "train" / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    with open(log, "w") as fh:
        while not trainer.finished:
            metrics = trainer.run_epoch(shard(train, 0, 1, epoch=trainer.epoch, seed=cfg.data.seed), val)
            line = dict(metrics)
            if trace is not None:
                line.update({f"trace_{k}": v for k, v in trace(trainer.eval_model).items()})
            fh.write(json.dumps(line) + "\n")
            fh.flush()
            if save_state_at is not None and trainer.epoch == save_state_at:
                torch.save(trainer.state_dict(), run_dir / f"state-e{save_state_at}.pt")
                torch.save(
                    checkpoint_dict(trainer.eval_model, model_cfg, list(table.class_names)),
                    run_dir / f"model-e{save_state_at}.pt",
                )
    ckpt = run_dir / "model.pt"
    torch.save(checkpoint_dict(trainer.eval_model, model_cfg, list(table.class_names)), ckpt)
    return {
        "metrics": metrics,
        "checkpoint": str(ckpt),
        "run_dir": str(run_dir),
        "run_id": "",
        "wall_seconds": time.perf_counter() - t0,
        "stop_reason": trainer.stop_reason,
        "validation_slides": len(val),
    }


def _uri_init(model_cfg) -> dict | None:
    """The encoder state dict of a ``model.features.init`` that is an MLflow URI (resolved as ``foveate train``'s
    driver does); None for a local file (the model loads it when built) or no init."""
    from operators.model_config import is_init_uri

    if not is_init_uri(model_cfg.features.init):
        return None
    from pipeline.encoder_init import resolve_init

    return resolve_init(model_cfg.features)


def _gate_init(cfg, model_cfg, train: list, workdir: Path) -> dict | None:
    """The cluster gate's encoder state dict when the driver would resolve it (as ``foveate train`` does): an
    MLflow URI through MLflow; ``pretrain``: :class:`workers.pretrain.Pretrainer` in this process on the training
    slides with ``cfg.pretrain``, cached under ``WORKDIR/gate_encoders`` by config and split (the seeds of a task
    share one). None otherwise (a local file loads when the model is built)."""
    import dataclasses
    import hashlib

    import torch

    from operators.model_config import GATE_ENCODER_PRETRAIN, is_init_uri
    from pipeline.config import to_dict
    from pipeline.data import shard

    gate = model_cfg.experimental.gate_encoder
    if is_init_uri(gate):
        from pipeline.encoder_init import resolve_init

        return resolve_init(dataclasses.replace(model_cfg.features, init=gate, freeze=True))
    if gate != GATE_ENCODER_PRETRAIN:
        return None
    from workers.pretrain import Pretrainer

    key = json.dumps(
        [
            to_dict(cfg.pretrain),
            to_dict(model_cfg.features),
            to_dict(model_cfg.geometry),
            sorted(r.store for r in train),
        ],
        sort_keys=True,
        default=str,
    )
    path = workdir / "gate_encoders" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        print(f"[gate_encoder] pretrained encoder {path.name} (cached)", flush=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    pc = cfg.pretrain
    pre = Pretrainer(model_cfg, pc, slides_per_epoch=len(train))
    t0 = time.perf_counter()
    while pre.epoch < pc.epochs:
        m = pre.run_epoch(shard(train, 0, 1, epoch=pre.epoch, seed=pc.seed))
        print(f"[gate_encoder] pretrain epoch {pre.epoch}/{pc.epochs}: loss {m['epoch_loss']:.4f}", flush=True)
    print(f"[gate_encoder] pretrained in {time.perf_counter() - t0:.0f}s -> {path.name}", flush=True)
    state = pre.encoder_state()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return state


# ---------------------------------------------------------------------------------------------- ground truth
@dataclass
class Split:
    class_names: list[str]
    train: list
    test: list
    boxes: dict[str, list[dict]] = field(default_factory=dict)  # store -> informative boxes (level 0)
    distractors: dict[str, list[dict]] = field(default_factory=dict)  # store -> distractor boxes (objects task)


def checkpoint_result(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The head of the JSON the checkpoint re-test scripts (``gate_refit.py``, ``feature_stats.py``) write: the
    command as run, the date, the machine, and an empty ``checkpoints`` list they fill."""
    import torch

    return {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}".strip(),
        "checkpoints": [],
    }


def load_split(config: str, stores: Path, overrides: list[str]) -> Split:
    """The train/test split ``foveate train`` makes for this config, plus each slide's informative boxes."""
    import pandas as pd

    from pipeline.config import load_config
    from pipeline.data import build_slide_table, split_train_val
    from pipeline.synthetic.tiff import sidecar_path
    from pipeline.train import TrainConfig

    cfg = load_config(TrainConfig, config_path(config), [f"data.stores={stores}", "data.labels=manifest", *overrides])
    table = build_slide_table(cfg.data)
    train, test = split_train_val(table.records, cfg.data.val_fraction, cfg.data.seed)
    man = (
        pd.read_parquet(stores / "manifest.parquet")
        if (stores / "manifest.parquet").is_file()
        else pd.read_csv(stores / "manifest.csv")
    )
    src = {Path(s).resolve().name: r for s, r in zip(man["store"], man["source"])} if "store" in man.columns else {}
    boxes, distractors = {}, {}
    for rec in train + test:
        source = src.get(Path(rec.store).resolve().name)
        if source is None:  # manifest without a store column: match on the slide id
            source = man.loc[man["slide_id"] == rec.slide_id, "source"].iloc[0]
        side = json.loads(sidecar_path(source).read_text())
        boxes[rec.store] = side["structures"]
        distractors[rec.store] = side.get("distractors", [])
    return Split(list(table.class_names), train, test, boxes, distractors)


def _cell_boxes(grid, cells) -> np.ndarray:
    xy = grid.cell_xy_l0(cells).numpy().reshape(-1, 2)
    return xy


def overlaps(xy: np.ndarray, patch: int, boxes: list[dict]) -> np.ndarray:
    """``[P, B]`` bool: chosen patch ``p`` (level-0 top-left ``xy``, side ``patch``) overlaps box ``b``."""
    if not boxes:
        return np.zeros((len(xy), 0), bool)
    b = np.array([[o["x"], o["y"], o["x"] + o["width"], o["y"] + o["height"]] for o in boxes], np.float64)
    x, y = xy[:, 0:1].astype(np.float64), xy[:, 1:2].astype(np.float64)
    return (x < b[None, :, 2]) & (b[None, :, 0] < x + patch) & (y < b[None, :, 3]) & (b[None, :, 1] < y + patch)


def overlap_areas(xy: np.ndarray, patch: int, boxes: list[dict]) -> np.ndarray:
    """``[P, B]`` int64: level-0 pixel area of box ``b`` inside patch ``p`` (top-left ``xy``, side ``patch``)."""
    if not boxes:
        return np.zeros((len(xy), 0), np.int64)
    b = np.array([[o["x"], o["y"], o["x"] + o["width"], o["y"] + o["height"]] for o in boxes], np.int64)
    x, y = np.asarray(xy, np.int64)[:, 0:1], np.asarray(xy, np.int64)[:, 1:2]
    w = np.clip(np.minimum(x + patch, b[None, :, 2]) - np.maximum(x, b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(y + patch, b[None, :, 3]) - np.maximum(y, b[None, :, 1]), 0, None)
    return w * h


def hits_of(xy: np.ndarray, patch: int, boxes: list[dict]) -> tuple[np.ndarray, int]:
    """Per chosen patch (level-0 top-left ``xy``, side ``patch``): does it overlap an informative box; and how
    many distinct boxes are touched."""
    ov = overlaps(xy, patch, boxes)
    return ov.any(1), int(ov.any(0).sum())


def chance_hit_rate(split: Split, model_cfg, which: str = "boxes") -> float:
    """Mean over test slides of the fraction of tissue cells that overlap an informative object (``which=
    "distractors"``: a distractor)."""
    import torch

    from workers.patches import prepare_slide

    rates = []
    for rec in split.test:
        si = prepare_slide(rec.store, model_cfg)
        cells = torch.nonzero(si.cell_mask.flatten()).flatten()
        if len(cells) == 0:
            continue
        h, _ = hits_of(_cell_boxes(si.grid, cells), si.grid.patch_size, getattr(split, which)[rec.store])
        rates.append(h.mean())
    return float(np.mean(rates)) if rates else float("nan")


def evaluate_checkpoint(checkpoint: str, split: Split) -> dict[str, float]:
    """Hard top-k on the test slides from a trained checkpoint: accuracy, hit rate, object recall."""
    from operators.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint)
    return evaluate_model(model, split)


def bag_row(
    xy: np.ndarray, patch: int, boxes: list[dict], label: str, distractors: list[dict] | None = None
) -> dict[str, float]:
    """What one bag holds: ``hit_rate`` (share of its patches on an object), ``object_recall``, ``all_objects``,
    with ``distractors`` also ``distractor_hit_rate``, and where the boxes name their class (``class`` or ``kind``)
    ``decidable``: the strict majority class of the objects the bag touches is ``label`` (what a perfect reader of
    the bag could get right). ``xy``: the patches' level-0 top-left corners ``[K, 2]``, side ``patch``."""
    ov = overlaps(xy, patch, boxes)
    touched = ov.any(0)  # [B]
    row = {
        "hit_rate": float(ov.any(1).mean()),
        "object_recall": int(touched.sum()) / max(len(boxes), 1),
        "all_objects": float(touched.all()),
    }
    if distractors is not None:
        row["distractor_hit_rate"] = float(hits_of(xy, patch, distractors)[0].mean())
    if boxes and all(("class" in b or "kind" in b) for b in boxes):
        # by class name: a sidecar's class_index is the synth's order, a split's targets index the sorted names
        seen = Counter(b.get("class", b.get("kind")) for b, t in zip(boxes, touched) if t)
        row["decidable"] = float(seen[label] > max((n for c, n in seen.items() if c != label), default=0))
    return row


def evaluate_model(model, split: Split, limit: int | None = None, training_bags: bool = False) -> dict[str, float]:
    """Hard top-k of ``model`` on the first ``limit`` (default all) test slides: accuracy, AUC, hit rate, object
    recall, distractor hit rate, the share of slides whose K cells touch every object (``all_objects``) and, where
    the objects carry a class (the shape family's glyphs), the share whose touched objects' strict majority class is
    the slide's label (``decidable``: what a perfect classifier of the bag could get right; the model is left in
    eval mode). ``training_bags``: also the hit rate, recall, ``all_objects`` and ``decidable`` of the bag training
    draws (the config's selection in training mode at ``model.selection.sigma``, one draw per slide, fixed seed),
    prefixed ``train_bag_``. A model with a fitted cluster gate also gets the same of the gate's candidates (the
    scorer's top ``model.experimental.gate_keep_from`` local maxima, what the gate chooses from), prefixed
    ``candidates_``: a glyph the candidates miss, no gate can keep."""
    import torch

    from pipeline.train import classification_metrics
    from workers.patches import prepare_slide, slide_geometry
    from workers.slide_forward import forward_slide, gate_candidates
    from workers.store import SlideStore

    cfg = model.cfg
    model.eval()
    probs, ys = [], []
    stats: dict[str, list] = {}
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)

    def bag_stats(prefix: str, xy: np.ndarray, patch: int, rec) -> None:
        distractors = split.distractors[rec.store] if prefix == "" else None
        row = bag_row(xy, patch, split.boxes[rec.store], split.class_names[int(rec.target)], distractors)
        for k, v in row.items():
            stats.setdefault(prefix + k, []).append(float(v))

    with torch.no_grad():
        for rec in split.test[:limit]:
            store = SlideStore(rec.store)
            out = forward_slide(model, store, training=False, sigma=0.0)
            patch = slide_geometry(store, cfg).patch_size  # level-0 pixels of this slide (also for µm settings)
            probs.append(torch.softmax(out.logits.reshape(1, -1).float(), -1)[0].numpy())
            ys.append(rec.target)
            bag_stats("", out.coords_l0.numpy().reshape(-1, 2), patch, rec)
            if "gate_candidates" in out.info:  # a fitted gate chose this bag: what it chose from
                si = prepare_slide(store, cfg)
                cand, _ = gate_candidates(model, out.scores[None], tuple(si.cell_mask.shape))
                bag_stats("candidates_", si.grid.cell_xy_l0(cand).numpy().reshape(-1, 2), patch, rec)
            if training_bags:
                out_t = forward_slide(model, store, training=True, generator=gen)
                bag_stats("train_bag_", out_t.coords_l0.numpy().reshape(-1, 2), patch, rec)
    m = classification_metrics(ys, np.array(probs))
    return {"eval_accuracy": m["accuracy"], "eval_auc": m["auc"], **{k: float(np.mean(v)) for k, v in stats.items()}}


# ---------------------------------------------------------------------------------------------- oracle
ORACLE_BAGS = ("distinct", "overlap")


def oracle_cells(si, boxes: list[dict], k: int, rng: np.random.Generator, bag: str = "overlap") -> np.ndarray:
    """K cells a perfect scorer would pick: per object its best-overlapping cell; then further cells by overlap:
    with ``bag="overlap"`` (default) any cell that overlaps an object; with ``"distinct"`` each only where it
    covers at least half a cell of object area that the cells already chosen do not (an object larger than a cell
    gets the cells that cover the rest of it, a small one is not read twice); then random tissue cells. On the
    shape family a second, partial view of a glyph can flip the bag's glyph count, yet the classifier learns the
    glyphs faster from the overlap bag (benchmarks/RESULTS.md), so it stays the oracle."""
    if bag not in ORACLE_BAGS:
        raise ValueError(f"bag must be one of {ORACLE_BAGS}, got {bag!r}")
    import torch

    g = si.grid
    n = g.num_cells
    xy = _cell_boxes(g, torch.arange(n)).astype(np.int64)
    p = g.patch_size
    best: list[int] = []
    extra: list[tuple[float, int, int]] = []  # (overlap area, cell, object index)
    areas = overlap_areas(xy, p, boxes)  # [N, B]
    for j in range(len(boxes)):
        area = areas[:, j]
        order = np.argsort(-area, kind="stable")
        order = order[area[order] > 0]
        if len(order):
            best.append(int(order[0]))
            extra += [(float(area[c]), int(c), j) for c in order[1:]]
    chosen = list(dict.fromkeys(best))[:k]
    # what of each object the chosen cells cover, on the object's own pixel raster
    covered = [np.zeros((max(int(o["height"]), 1), max(int(o["width"]), 1)), bool) for o in boxes]

    def cover(c: int, j: int, apply: bool) -> int:
        o = boxes[j]
        x0, y0 = int(xy[c, 0]) - int(o["x"]), int(xy[c, 1]) - int(o["y"])
        sub = covered[j][max(y0, 0) : max(y0 + p, 0), max(x0, 0) : max(x0 + p, 0)]
        new = int(sub.size - sub.sum())
        if apply:
            sub[...] = True
        return new

    for c in chosen:
        for j in range(len(boxes)):
            cover(c, j, True)
    for _, c, j in sorted(extra, key=lambda t: (-t[0], t[1])):
        if len(chosen) >= k:
            break
        if c not in chosen and (bag == "overlap" or cover(c, j, False) >= p * p / 2):
            chosen.append(c)
            for jj in range(len(boxes)):
                cover(c, jj, True)
    tissue = np.flatnonzero(si.cell_mask.flatten().numpy())
    pool = np.setdiff1d(tissue if len(tissue) else np.arange(n), chosen)
    fill = rng.choice(pool, size=min(k - len(chosen), len(pool)), replace=False) if len(chosen) < k else []
    cells = np.array(chosen + [int(c) for c in fill], np.int64)
    return cells[rng.permutation(len(cells))]


def run_oracle(
    config: str, split: Split, seed: int, epochs: int, overrides: list[str], bag: str = "overlap"
) -> dict[str, float]:
    """Train the config's feature network + aggregator on oracle patches (:func:`oracle_cells` with ``bag``); test
    accuracy on oracle patches."""
    import torch

    from operators.checkpoint import build_model, with_num_classes
    from pipeline.config import load_config
    from pipeline.train import TrainConfig, classification_metrics
    from workers.patches import prepare_slide

    cfg = load_config(TrainConfig, config_path(config), overrides)
    mcfg = with_num_classes(cfg.model, len(split.class_names))
    torch.manual_seed(seed)
    model, mcfg = build_model(mcfg)
    state = _uri_init(mcfg)
    if state is not None:  # build_model loads a local init file itself, an MLflow URI only through the trainer
        model.features.load_state_dict(state)
    rng = np.random.default_rng(seed)

    def item(rec):
        si = prepare_slide(rec.store, mcfg)
        cells = torch.from_numpy(oracle_cells(si, split.boxes[rec.store], mcfg.selection.k, rng, bag))
        return si.reader.read(cells), si.grid.cell_centres(cells), rec.target

    t0 = time.perf_counter()
    train_items = [item(r) for r in split.train]
    test_items = [item(r) for r in split.test]
    fit_bags(model, cfg.optim, lambda _epoch: train_items, epochs, rng)
    running = {}
    if getattr(model, "feature_norm", None) is not None:  # the running statistics too, for the record
        running = classification_metrics(*predict_bags(model, test_items), prefix="test_running_")
    refresh_bag_statistics(model, train_items)  # as the trainer ends: the training bags' feature statistics
    seconds = time.perf_counter() - t0
    ys, probs = predict_bags(model, test_items)
    m = classification_metrics(ys, probs)
    train_m = classification_metrics(*predict_bags(model, train_items))  # does the classifier fit its own bags?
    return {
        "test_accuracy": m["accuracy"],
        "test_auc": m["auc"],
        "train_accuracy": train_m["accuracy"],
        "oracle_bag": bag,
        "train_seconds": seconds,
        **running,
    }


def fit_bags(
    model,
    optim,
    epoch_bags,
    epochs: int,
    rng: np.random.Generator,
    on_epoch=None,
    *,
    as_trainer: bool = False,
    after_epoch=None,
):
    """Train ``model.classify`` (features + aggregator) on fixed bags of patches with the slide label, the patches
    augmented as ``foveate train`` does (``model.augment``: colour jitter, symmetry): AdamW, the
    trainer's warm-up + cosine schedule (``optim``: ``foveate train``'s ``OptimConfig``), ``optim.accumulate``
    bags per step in a random order per epoch, gradient clipping. Returns the model to evaluate: ``model``, or
    with ``as_trainer`` and ``optim.ema_epochs`` its moving average.

    Args:
        epoch_bags: ``epoch -> [(patches uint8 [K, 3, p, p], positions [K, 2], target), ...]``, called at the start
            of every epoch (the same number of bags each time; the schedule is laid out from the first epoch's).
        on_epoch: called as ``on_epoch(epoch, mean training loss)`` after every epoch.
        as_trainer: clip and average as :class:`workers.trainer.Trainer` does (``optim.clip`` ``per_module``: each
            child module's gradient clipped on its own; ``optim.ema_epochs``: a moving average of the weights,
            :func:`workers.trainer.ema_update`); False (the oracle's): one global clip, no average.
        after_epoch: called as ``after_epoch(epoch, model to evaluate)`` after every epoch.
    """
    import copy

    import torch

    from pipeline.train import lr_factor
    from workers.slide_forward import augment_patches
    from workers.trainer import clip_gradients, clip_groups, ema_update

    params = [q for q in model.parameters() if q.requires_grad]
    groups = clip_groups(model) if as_trainer and optim.clip == "per_module" else None
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))  # the training's patch augmentation
    opt = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    acc = optim.accumulate
    sched = None
    ema, decay, step = None, 0.0, 0
    for epoch in range(epochs):
        bags = epoch_bags(epoch)
        if sched is None:
            per_epoch = math.ceil(len(bags) / acc)
            total = epochs * per_epoch
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: lr_factor(s, total, optim.warmup, optim.min_lr_ratio)
            )
            if as_trainer and optim.ema_epochs > 0:
                ema = copy.deepcopy(model).eval().requires_grad_(False)
                decay = 1.0 - 1.0 / max(optim.ema_epochs * per_epoch, 1.0)
        model.train()
        order = rng.permutation(len(bags))
        losses = []
        for s in range(0, len(order), acc):
            opt.zero_grad(set_to_none=True)
            batch = order[s : s + acc]
            for i in batch:
                x, pos, y = bags[i]
                patches = augment_patches(x[None].float().div(255.0), model.cfg.augment, gen)
                logits = model.classify(patches, pos[None])
                loss = torch.nn.functional.cross_entropy(logits.reshape(1, -1), torch.tensor([y]))
                (loss / len(batch)).backward()
                losses.append(float(loss.detach()))
            clip_gradients(params, groups, optim.grad_clip if optim.grad_clip > 0 else 1e9)
            opt.step()
            sched.step()
            if ema is not None:
                ema_update(ema, model, step, decay)
            step += 1
        if on_epoch is not None:
            on_epoch(epoch, float(np.mean(losses)))
        if after_epoch is not None:
            after_epoch(epoch, model if ema is None else ema)
    return model if ema is None else ema


def refresh_bag_statistics(model, bags) -> int:
    """Set the feature standardisation of ``model`` (``model.features.standardise``; none: nothing) to the exact
    statistics of the features of ``bags`` in eval mode, as ``foveate train`` ends (``Trainer.refresh_feature_stats``).
    Returns the rows counted."""
    from operators.resnet import feature_moments, set_exact_statistics

    if getattr(model, "feature_norm", None) is None:
        return 0
    with feature_moments(model.feature_norm) as moments:
        predict_bags(model, bags)
    return set_exact_statistics(model.feature_norm, moments)


def predict_bags(model, bags) -> tuple[list[int], np.ndarray]:
    """``(targets, class probabilities [n, C])`` of ``model.classify`` on bags (eval mode, no gradients)."""
    import torch

    model.eval()
    probs, ys = [], []
    with torch.no_grad():
        for x, pos, y in bags:
            logits = model.classify(x[None].float().div(255.0), pos[None]).reshape(1, -1)
            probs.append(torch.softmax(logits, -1)[0].numpy())
            ys.append(y)
    return ys, np.array(probs)


# ---------------------------------------------------------------------------------------------- table
def summarise(rows: list[dict]) -> list[dict]:
    out = []
    keys = list(dict.fromkeys((r["task"], r["config"]) for r in rows))
    for task, config in keys:
        rs = [r for r in rows if r["task"] == task and r["config"] == config and "error" not in r]
        errs = [r for r in rows if r["task"] == task and r["config"] == config and "error" in r]
        accs = [r["test_accuracy"] for r in rs]

        def med(k):
            v = [r[k] for r in rs if r.get(k) is not None and not (isinstance(r[k], float) and math.isnan(r[k]))]
            return float(np.median(v)) if v else float("nan")

        out.append(
            {
                "task": task,
                "config": config,
                "runs": len(rs),
                "failed_runs": len(errs),
                "successes": int(sum(a >= SUCCESS for a in accs)),
                "success_rate": float(np.mean([a >= SUCCESS for a in accs])) if accs else float("nan"),
                "median_accuracy": med("test_accuracy"),
                "worst_accuracy": float(min(accs)) if accs else float("nan"),
                "median_auc": med("test_auc"),
                "median_hit_rate": med("hit_rate"),
                "chance_hit_rate": med("chance_hit_rate"),
                "median_object_recall": med("object_recall"),
                "median_distractor_hit_rate": med("distractor_hit_rate"),
                "chance_distractor_hit_rate": med("chance_distractor_hit_rate"),
                "median_train_seconds": med("train_seconds"),
                "accuracies": accs,
            }
        )
    return out


def print_table(summary: list[dict], oracle: list[dict]) -> None:
    print()
    print(
        f"{'task':<22} {'config':<22} {'success':>8} {'med acc':>8} {'worst':>6} {'med AUC':>8} "
        f"{'hit':>6} {'chance':>7} {'recall':>7} {'d.hit':>6} {'d.chance':>8} {'train s':>8}  accuracies"
    )
    for s in summary:
        print(
            f"{s['task']:<22} {s['config']:<22} {s['successes']:>3}/{s['runs']:<4} {s['median_accuracy']:>8.3f} "
            f"{s['worst_accuracy']:>6.3f} {s['median_auc']:>8.3f} {s['median_hit_rate']:>6.3f} "
            f"{s['chance_hit_rate']:>7.3f} {s['median_object_recall']:>7.3f} {s['median_distractor_hit_rate']:>6.3f} "
            f"{s['chance_distractor_hit_rate']:>8.3f} {s['median_train_seconds']:>8.1f}  "
            + " ".join(f"{a:.2f}" for a in s["accuracies"])
            + (f"  ({s['failed_runs']} crashed)" if s["failed_runs"] else "")
        )
    for o in oracle:
        print(
            f"{o['task']:<22} {'oracle (' + o['config'] + ')':<22} acc {o['test_accuracy']:.3f} AUC {o['test_auc']:.3f} "
            f"seed {o['seed']} ({o['train_seconds']:.0f}s)"
        )


def merge(paths: list[str], out_json: str | None) -> int:
    """Merge the rows of several output JSONs (runs of this script, e.g. one per process) into one table; a
    (task, config, seed) that occurs twice keeps the last file's row."""
    rows: dict[tuple, dict] = {}
    oracle: dict[tuple, dict] = {}
    parts = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        parts.append(
            {k: d.get(k) for k in ("command", "started_utc", "machine", "torch", "overrides", "total_seconds")}
        )
        for r in d.get("rows", []):
            rows[(r["task"], r["config"], r["seed"])] = r
        for r in d.get("oracle", []):
            oracle[(r["task"], r["config"], r["seed"])] = r
    merged = sorted(rows.values(), key=lambda r: (r["task"], r["config"], r["seed"]))
    summary = summarise(merged)
    print_table(summary, list(oracle.values()))
    if out_json:
        out = {
            "merged_from": parts,
            "success_threshold": SUCCESS,
            "summary": summary,
            "oracle": list(oracle.values()),
            "rows": merged,
        }
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(out, indent=2, default=float))
        print(f"wrote {out_json}")
    return 0


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--tasks",
        default="checker,objects-binary,objects-4class",
        help=f"comma-separated, from {list(TASKS)} (default checker,objects-binary,objects-4class)",
    )
    p.add_argument(
        "--configs", default=None, help=f"comma-separated config names (default: all, {available_configs()})"
    )
    p.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    p.add_argument("--epochs", type=int, default=None, help="optim.epochs (default: the config's)")
    p.add_argument("--count", type=int, default=None, help="slides per task (overrides every task's count)")
    p.add_argument("--size", default=None, help="slide size, as foveate synth --size (overrides every task's)")
    p.add_argument("--data-seed", type=int, default=0, help="foveate synth --seed (default 0)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="train-config override passed to every run (repeatable)",
    )
    p.add_argument("--workdir", default=str(ROOT / "benchmarks" / "_work" / "robustness"))
    p.add_argument("--jobs", type=int, default=1, help="trainings at once (default 1)")
    p.add_argument(
        "--synth-jobs", type=int, default=1, help="slides foveate synth writes at once when making data (default 1)"
    )
    p.add_argument(
        "--oracle", action="store_true", help="also train the first config's feature network on oracle patches"
    )
    p.add_argument(
        "--oracle-bag",
        choices=ORACLE_BAGS,
        default="overlap",
        help="the oracle's cells after each object's best one: 'overlap' (default) any cell that overlaps an object, "
        "by overlap; 'distinct' only cells that cover object area not covered yet (each small object read once), "
        "then tissue",
    )
    p.add_argument("--no-train", action="store_true", help="skip the selection-model runs (e.g. only --oracle)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="train with workers.trainer.Trainer in this process (same numerics as foveate train on one worker, "
        "no Ray/MLflow start-up per run; takes --jobs 1: one process per seed, joined with --merge)",
    )
    p.add_argument("--device", default="cpu", help="with --in-process: where the model trains (cpu, cuda)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="with --in-process: hold this share of the training slides out as a validation split and run the "
        "config's early stopping on it (the best epoch's model is tested on the held-out slides, which no choice "
        "sees); 0 (default): train to the cap, validating on the held-out slides",
    )
    p.add_argument(
        "--save-state-at",
        type=int,
        default=None,
        metavar="E",
        help="with --in-process: after epoch E save the trainer's state (RUN_DIR/state-eE.pt) and the evaluated "
        "model (RUN_DIR/model-eE.pt), then go on",
    )
    p.add_argument(
        "--resume-state",
        type=Path,
        default=None,
        metavar="STATE",
        help="with --in-process, one task, config and seed: continue from a --save-state-at state under this "
        "command's --set options (the optimizer's and the schedule's may differ; the model's structure may not)",
    )
    p.add_argument(
        "--trace-slides",
        type=int,
        default=20,
        help="with --in-process: after every epoch, hard top-k on the first N held-out slides, their hit rate, "
        "object recall and accuracy added to the run's log line as trace_* (0: off; default 20)",
    )
    p.add_argument("--json", default=None, help="output JSON (default WORKDIR/robustness.json)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the successful runs (and oracle rows) already in the output JSON and run only the "
        "missing or crashed (task, config, seed) combinations",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no training: merge the rows of these output JSONs (e.g. one per process) into one table and --json",
    )
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json)

    try:
        tasks = resolve_tasks(args.tasks, args.count, args.size)
    except ValueError as err:
        p.error(str(err))
    configs = [c.strip() for c in (args.configs or ",".join(available_configs())).split(",") if c.strip()]
    unknown = [c for c in configs if not (ROOT / "configs" / f"{c}.yaml").is_file()]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {available_configs()}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.in_process and args.jobs > 1:
        p.error(
            f"--in-process takes --jobs 1, got --jobs {args.jobs}: in-process runs are threads of this process and "
            "share torch's global RNG, so a run's initial weights would not be its seed's; start one process per "
            "seed (each with its own --json) and join them with --merge"
        )
    if not 0.0 <= args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.device != "cpu" and not args.in_process:
        p.error("--device needs --in-process (foveate train takes --set use_gpu=true)")
    if args.val_fraction > 0 and not args.in_process:
        p.error("--val-fraction needs --in-process")
    if (args.save_state_at is not None or args.resume_state is not None) and not args.in_process:
        p.error("--save-state-at and --resume-state need --in-process")
    if args.save_state_at is not None and args.save_state_at < 1:
        p.error(f"--save-state-at must be an epoch >= 1, got {args.save_state_at}")
    if args.resume_state is not None and not args.resume_state.is_file():
        p.error(f"--resume-state {args.resume_state} is not a file")
    # without --val-fraction the held-out split is the trainer's validation split: no early stopping on it (train
    # to the cap, test the last epoch); with it, the config's early stopping runs on the carved validation split
    overrides = (["early_stopping.patience=0"] if args.val_fraction == 0 else []) + [*args.overrides]
    overrides += [f"optim.epochs={args.epochs}"] if args.epochs else []
    workdir = Path(args.workdir).resolve()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    out_json = Path(args.json) if args.json else workdir / "robustness.json"

    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    rows: list[dict] = []
    oracle_rows: list[dict] = []
    if args.resume and out_json.is_file():
        old = json.loads(out_json.read_text())
        rows = [r for r in old.get("rows", []) if "error" not in r]
        oracle_rows = list(old.get("oracle", []))
        print(f"--resume: keeping {len(rows)} run(s) and {len(oracle_rows)} oracle row(s) from {out_json}", flush=True)
    done = {(r["task"], r["config"], r["seed"]) for r in rows}
    oracle_done = {(r["task"], r["config"], r["seed"]) for r in oracle_rows}
    data_info: dict[str, Any] = {}

    def write_json() -> None:
        out = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started_utc": started,
            "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.platform()}",
            "torch": torch.__version__,
            "tasks": [t.__dict__ for t in tasks],
            "configs": configs,
            "seeds": seeds,
            "overrides": overrides,
            "success_threshold": SUCCESS,
            "data": data_info,
            "summary": summarise(rows),
            "oracle": oracle_rows,
            "rows": rows,
            "total_seconds": time.perf_counter() - t_start,
        }
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(out, indent=2, default=float))

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for task in tasks:
        stores = prepare_data(task, workdir, args.data_seed, args.synth_jobs)
        data_info[task.name] = json.loads((stores.parent / "READY").read_text())
        # what the family's labels keep (foveate synth's archive.json), before the command's --set (which win)
        from pipeline.synthetic.tasks import task_label_symmetry

        label_symmetry = task_label_symmetry(task.family, task.classes)
        data_info[task.name]["label_symmetry"] = label_symmetry
        task_overrides = [f"data.label_symmetry={label_symmetry}", *overrides]
        split = load_split(configs[0], stores, task_overrides)
        from pipeline.config import load_config
        from pipeline.train import TrainConfig

        mcfg = load_config(TrainConfig, ROOT / "configs" / f"{configs[0]}.yaml", task_overrides).model
        chance = chance_hit_rate(split, mcfg)
        dchance = chance_hit_rate(split, mcfg, "distractors")
        data_info[task.name].update(
            {
                "classes": split.class_names,
                "train_slides": len(split.train),
                "test_slides": len(split.test),
                "chance_hit_rate": chance,
                "chance_distractor_hit_rate": dchance,
            }
        )
        print(
            f"[{task.name}] {len(split.train)} train / {len(split.test)} test slides, classes {split.class_names}, "
            f"chance hit rate {chance:.4f} (distractors {dchance:.4f})",
            flush=True,
        )
        if args.oracle:
            for seed in seeds:
                if (task.name, configs[0], seed) in oracle_done:
                    continue
                o = run_oracle(
                    configs[0],
                    split,
                    seed,
                    args.epochs
                    or load_config(TrainConfig, ROOT / "configs" / f"{configs[0]}.yaml", task_overrides).optim.epochs,
                    task_overrides,
                    args.oracle_bag,
                )
                oracle_rows.append({"task": task.name, "config": configs[0], "seed": seed, **o})
                print(
                    f"[{task.name}] oracle {configs[0]} seed {seed}: acc {o['test_accuracy']:.3f} "
                    f"AUC {o['test_auc']:.3f} train acc {o['train_accuracy']:.3f} ({o['train_seconds']:.0f}s)"
                    + (
                        f"; running statistics acc {o['test_running_accuracy']:.3f}"
                        if "test_running_accuracy" in o
                        else ""
                    ),
                    flush=True,
                )
                write_json()
        if args.no_train:
            continue
        jobs = [
            (c, s)
            for s in seeds
            for c in configs  # seed-major: a cut-short sweep still covers every config
            if (task.name, c, s) not in done
        ]

        def one(job):
            config, seed = job
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            # the pid: two benchmarks started in the same second (other --set overrides) get their own run folders
            name = f"{task.key}-{config}-s{seed}-{stamp}-{os.getpid()}"
            row: dict[str, Any] = {
                "task": task.name,
                "config": config,
                "seed": seed,
                "run_name": name,
                "chance_hit_rate": chance,
                "chance_distractor_hit_rate": dchance,
            }
            try:
                log = workdir / "logs" / f"{name}.log"
                if args.in_process:
                    trace = (
                        partial(evaluate_model, split=split, limit=args.trace_slides, training_bags=True)
                        if args.trace_slides
                        else None
                    )
                    res = run_training_in_process(
                        config,
                        stores,
                        seed,
                        task_overrides,
                        workdir,
                        name,
                        log,
                        trace,
                        val_fraction=args.val_fraction,
                        device=args.device,
                        save_state_at=args.save_state_at,
                        resume_state=args.resume_state,
                    )
                else:
                    res = run_training(config, stores, seed, task_overrides, workdir, name, log)
                m = res["metrics"]
                row.update(
                    {
                        "test_accuracy": m.get("val_accuracy"),
                        "test_auc": m.get("val_auc"),
                        "train_seconds": m.get("train_seconds"),
                        "train_accuracy": m.get("epoch_train_accuracy"),
                        "wall_seconds": res["wall_seconds"],
                        "run_id": res["run_id"],
                        "checkpoint": res["checkpoint"],
                    }
                )
                row.update(evaluate_checkpoint(res["checkpoint"], split))
                if args.val_fraction > 0:  # the last epoch's metrics are the carved validation split's
                    row.update(
                        {
                            "test_accuracy": row["eval_accuracy"],
                            "test_auc": row["eval_auc"],
                            "val_fraction": args.val_fraction,
                            "validation_slides": res["validation_slides"],
                            "val_accuracy": m.get("val_accuracy"),
                            "stop_reason": res["stop_reason"],
                            "stopped_epoch": m.get("stopped_epoch"),
                            "best_epoch": m.get("best_epoch"),
                        }
                    )
            except Exception as exc:  # keep going: one crashed run is a data point, not the end of the sweep
                row["error"] = f"{type(exc).__name__}: {exc}"
            return row

        with cf.ThreadPoolExecutor(max_workers=args.jobs) as ex:
            for row in ex.map(one, jobs):
                rows.append(row)
                if "error" in row:
                    print(f"[{task.name}] {row['config']} seed {row['seed']}: FAILED {row['error']}", flush=True)
                else:
                    print(
                        f"[{task.name}] {row['config']} seed {row['seed']}: test acc {row['test_accuracy']:.3f} "
                        f"(re-eval {row['eval_accuracy']:.3f}) AUC {row['test_auc']:.3f} train acc "
                        f"{row['train_accuracy']:.3f} hit {row['hit_rate']:.3f} (chance {chance:.3f}) recall "
                        f"{row['object_recall']:.2f} distractor hit {row['distractor_hit_rate']:.3f} "
                        f"(chance {dchance:.3f}) train {row['train_seconds']:.0f}s wall {row['wall_seconds']:.0f}s",
                        flush=True,
                    )
                write_json()
    write_json()
    print_table(summarise(rows), oracle_rows)
    print(f"total {time.perf_counter() - t_start:.0f}s; wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
