"""Batch-scoring throughput: ``foveate score`` over an archive of synthetic stores.

Writes ``--count`` synthetic slides (``foveate synth``, SVS), ingests them (``foveate ingest``, zstd), builds an
untrained model from a train config's ``model`` section (weights do not change the work: hard top-k reads K
patches per slide whatever the scores are), and scores the archive with ``pipeline.score.score`` for each
``--batch-sizes`` value on an in-process Ray started once (start-up not counted; actor start-up is, it is part
of every run). Reports slides/s and the per-slide compute time of the two stages (the ``seconds`` column of the
output, summed over both stages), and writes JSON.

    python benchmarks/score.py                          # 16 slides of 4096 x 4096, batch sizes 1 and 4
    python benchmarks/score.py --count 64 --size 8192 --batch-sizes 1,4,8 --json out.json
    python benchmarks/score.py --s3 --batch-sizes 4   # also from/to a local S3 server (moto), alternating

``--s3`` starts a moto S3 server on 127.0.0.1, uploads the stores to a bucket and, for each batch size, scores
the local stores into a local file and the bucket's stores into an ``s3://`` predictions file, one after the
other (rows ``where: local`` / ``s3``).

``--in-process`` runs the two stages as the plain classes the actors wrap, in this process with no Ray (what a lent
GPU machine without Ray can run): the stores are made from arrays (``benchmarks/array_stores.py``: tiled checker
slides, no OpenSlide), one :class:`~workers.scoring.ScorerWorker` on ``--device`` takes batches of ``--batch``
slides (their low-res views read by ``--prefetch`` threads while it scores), ``--classifiers`` threads each run a
:class:`~workers.scoring.ClassifierWorker` on ``--classifier-device`` (its patch reads in ``--prefetch`` threads)
on what the scorer hands on. Per ``--precision`` value: slides/s over ``--passes`` passes after one warm-up pass,
the GPU's utilisation (NVML, sampled every 0.1 s) and the seconds per slide of each part (low-res read, scorer,
patch read, feature network + aggregator, output); with more than one precision, how the first one's chosen cells
and predictions compare with each other's on the same slides (``--model`` names a trained checkpoint for that).

    python benchmarks/score.py --in-process --device cuda --count 64 --size 32768 --precision fp32,bf16 \
        --model model.pt --json score_cuda.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # local_services: the moto S3 server of the tests
sys.path.insert(0, str(REPO / "benchmarks"))  # array_stores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=16, help="slides (default 16)")
    p.add_argument("--size", type=int, default=4096, help="slide side in pixels (default 4096)")
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="train config for the model section")
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated --batch-size values (default 1,4)")
    p.add_argument("--workers", type=int, default=None, help="classifier actors (default: auto)")
    p.add_argument("--work-dir", default=str(REPO / "benchmarks" / "_work" / "score"), help="cache of slides/stores")
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "score_cpu.json"), help="JSON output")
    p.add_argument("--s3", action="store_true", help="also score from / to a local S3 server (moto)")
    g = p.add_argument_group("--in-process (no Ray)")
    g.add_argument("--in-process", action="store_true", help="the stage classes in this process, stores from arrays")
    g.add_argument("--device", default="cpu", help="the scorer's device (default cpu)")
    g.add_argument("--classifier-device", default=None, help="the classifiers' device (default: --device)")
    g.add_argument("--precision", default="fp32", help="comma-separated precisions to run (fp32, bf16)")
    g.add_argument("--batch", type=int, default=16, help="slides per scorer / classifier call (default 16)")
    g.add_argument("--prefetch", type=int, default=8, help="reader threads per stage object (default 8)")
    g.add_argument("--classifiers", type=int, default=2, help="classifier threads (default 2)")
    g.add_argument("--passes", type=int, default=2, help="timed passes over the archive after a warm-up (default 2)")
    g.add_argument("--model", default=None, help="a checkpoint to score with (default: an untrained model)")
    g.add_argument("--jobs", type=int, default=1, help="processes writing the array stores (default 1)")
    args = p.parse_args(argv)
    if args.in_process:
        return in_process(args)

    import ray
    import torch
    import yaml

    from operators.checkpoint import save_checkpoint
    from operators.model import FoveateModel
    from operators.model_config import ModelConfig
    from pipeline.config import from_dict
    from pipeline.score import score

    work = Path(args.work_dir)
    slides, stores = work / f"synth_{args.size}_{args.count}", work / f"stores_{args.size}_{args.count}"
    py = sys.executable
    if not (slides / "labels.csv").is_file():
        subprocess.run(
            [
                py,
                "-m",
                "pipeline",
                "-q",
                "synth",
                str(slides),
                "--count",
                str(args.count),
                "--size",
                str(args.size),
                "--seed",
                "0",
            ],
            check=True,
            cwd=REPO,
        )
    if not (stores / "manifest.parquet").is_file():
        subprocess.run(
            [py, "-m", "pipeline", "-q", "ingest", str(slides / "labels.csv"), "--out", str(stores)],
            check=True,
            cwd=REPO,
        )
    model_section = yaml.safe_load(Path(args.config).read_text())["model"]
    cfg = from_dict(ModelConfig, dict(model_section, num_classes=2))
    torch.manual_seed(0)
    ckpt = save_checkpoint(work / "model.pt", FoveateModel(cfg).eval(), cfg, ["0", "1"])

    places = [("local", str(stores), lambda bs: work / f"pred_bs{bs}.parquet")]
    services = contextlib.ExitStack()  # the local S3 server, when asked for
    if args.s3:  # before ray.init: the workers inherit the endpoint and credentials
        import s3fs
        from local_services import moto_s3

        _, aws = services.enter_context(moto_s3("bench"))
        os.environ.update(aws)
        s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"]).put(str(stores), "bench/stores", recursive=True)
        places.append(("s3", "s3://bench/stores", lambda bs: f"s3://bench/pred_bs{bs}.parquet"))
    ray.init(include_dashboard=False, log_to_driver=False)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    rows = []
    try:
        for bs, (where, src, out_of) in [(int(b), p) for b in args.batch_sizes.split(",") for p in places]:
            out = out_of(bs)
            if isinstance(out, Path):
                if out.exists():
                    out.unlink()
                shutil.rmtree(work / f"pred_bs{bs}_heatmaps", ignore_errors=True)
                shutil.rmtree(work / f"pred_bs{bs}_ngff", ignore_errors=True)
            t0 = time.perf_counter()
            res = score(str(ckpt), src, out, workers=args.workers, batch_size=bs, experiment=None, overwrite=True)
            wall = time.perf_counter() - t0
            ok = res.table[res.table["status"] == "ok"]
            rows.append(
                {
                    "where": where,
                    "batch_size": bs,
                    "slides": res.total,
                    "ok": int(len(ok)),
                    "wall_s": wall,
                    "slides_per_s": res.total / wall,
                    "compute_s_per_slide": float(ok["seconds"].mean()),
                    "k": cfg.k,
                    "patch_size": cfg.patch_size,
                    "scorer_device": res.scorer_device,
                }
            )
    finally:
        ray.shutdown()
        services.close()
    print(
        f"{args.count} slides of {args.size}x{args.size}, model from {Path(args.config).name} (K={cfg.k}, "
        f"patch {cfg.patch_size}), Ray with {cpus} CPUs"
    )
    print(f"{'where':>5} {'batch':>5} {'slides':>6} {'ok':>4} {'wall s':>8} {'slides/s':>9} {'compute s/slide':>16}")
    for r in rows:
        print(
            f"{r['where']:>5} {r['batch_size']:>5} {r['slides']:>6} {r['ok']:>4} {r['wall_s']:>8.1f} "
            f"{r['slides_per_s']:>9.3f} "
            f"{r['compute_s_per_slide']:>16.3f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": cpus,
                "count": args.count,
                "size": args.size,
                "config": str(args.config),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"JSON: {args.json}")
    return 0


def _gpu_sampler(device: str):
    """Start sampling the GPU's utilisation (NVML through ``torch.cuda.utilization``) every 0.1 s; returns
    ``stop() -> mean percent or None``."""
    import threading

    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return lambda: None
    try:
        torch.cuda.utilization()
    except Exception as exc:  # no NVML binding
        print(f"GPU utilisation not available: {exc}")
        return lambda: None
    samples: list[int] = []
    done = threading.Event()

    def run():
        while not done.wait(0.1):
            samples.append(int(torch.cuda.utilization()))

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def stop():
        done.set()
        t.join()
        return float(np.mean(samples)) if samples else None

    return stop


def _score_pass(scorer, classifiers, todo: list, batch: int) -> tuple[list[dict], dict[str, float], float]:
    """One pass: the scorer on batches in one thread, the classifiers on its output in theirs; returns the rows,
    seconds per part summed over slides, and the wall seconds."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=2 * len(classifiers))
    rows: list[dict] = []
    parts = {"lowres_read": 0.0, "scorer": 0.0, "patch_read": 0.0, "features": 0.0, "output": 0.0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce():
        try:
            for i in range(0, len(todo), batch):
                items = scorer.score_batch(todo[i : i + batch])
                with lock:
                    for it in items:
                        if it["status"] == "ok":
                            parts["lowres_read"] += it["timing"]["read"]
                            parts["scorer"] += it["timing"]["score"]
                q.put(items)
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)
        finally:
            for _ in classifiers:
                q.put(None)

    def consume(worker):
        try:
            while (items := q.get()) is not None:
                out = worker.classify_batch(items)
                with lock:
                    rows.extend(out)
                    parts["patch_read"] += worker.last_timing["read"]
                    parts["features"] += worker.last_timing["classify"]
                    parts["output"] += worker.last_timing["output"]
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=produce)] + [threading.Thread(target=consume, args=(w,)) for w in classifiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rows, parts, time.perf_counter() - t0


def in_process(args) -> int:
    """``--in-process``: see the module docstring."""
    import torch
    import yaml
    from array_stores import make_archive

    from operators.checkpoint import load_local, save_checkpoint
    from operators.model import FoveateModel
    from operators.model_config import ModelConfig
    from pipeline.config import from_dict
    from workers.scoring import ClassifierWorker, ScorerWorker

    work = Path(args.work_dir)
    if args.model:
        model, cfg, classes = load_local(args.model)
        ckpt = args.model
    else:
        model_section = yaml.safe_load(Path(args.config).read_text())["model"]
        cfg = from_dict(ModelConfig, dict(model_section, num_classes=2))
        torch.manual_seed(0)
        ckpt = str(save_checkpoint(work / "model.pt", FoveateModel(cfg).eval(), cfg, ["0", "1"]))
        classes = ["0", "1"]
    mpp = float(getattr(cfg, "mpp", None) or 0.5)  # the model's training mpp: no mismatch warning per slide
    tile = 4096 if args.size % 4096 == 0 else 2048  # tissue in pieces the tissue mask keeps (array_stores)
    stores = work / f"array_stores_{args.size}_{args.count}_t{tile}_mpp{mpp:g}"
    if not (stores / "labels.csv").is_file():
        t0 = time.perf_counter()
        make_archive(stores, args.count, args.size, tile=tile, jobs=args.jobs, mpp=mpp)
        print(f"{args.count} array stores of {args.size} px made in {time.perf_counter() - t0:.1f} s", flush=True)
    labels = dict(line.split(",") for line in (stores / "labels.csv").read_text().splitlines()[1:])
    todo = [(sid, str(stores / f"{sid}.zarr")) for sid in labels]
    cdev = args.classifier_device or args.device
    results, by_precision = [], {}
    for precision in args.precision.split(","):
        scorer = ScorerWorker(ckpt, device=args.device, precision=precision, prefetch=args.prefetch, batch=args.batch)
        classifiers = [
            ClassifierWorker(ckpt, device=cdev, precision=precision, prefetch=args.prefetch)
            for _ in range(args.classifiers)
        ]
        _score_pass(scorer, classifiers, todo, args.batch)  # warm-up: kernels, allocator, page cache
        walls, parts_sum, rows = [], None, []
        stop = _gpu_sampler(args.device)
        for _ in range(args.passes):
            rows, parts, wall = _score_pass(scorer, classifiers, todo, args.batch)
            walls.append(wall)
            parts_sum = parts if parts_sum is None else {k: parts_sum[k] + parts[k] for k in parts}
        util = stop()
        ok = [r for r in rows if r["status"] == "ok"]
        n = len(todo) * args.passes
        acc = float(np.mean([r["prediction"] == classes[int(labels[r["slide_id"]])] for r in ok])) if ok else None
        by_precision[precision] = {r["slide_id"]: r for r in ok}
        results.append(
            {
                "precision": precision,
                "device": args.device,
                "classifier_device": cdev,
                "slides": len(todo),
                "ok": len(ok),
                "passes": args.passes,
                "wall_s": walls,
                "slides_per_s": n / sum(walls),
                "gpu_util_mean_pct": util,
                "seconds_per_slide": {k: v / n for k, v in parts_sum.items()},
                "accuracy": acc,
            }
        )
        print(
            f"{precision}: {n / sum(walls):.1f} slides/s ({len(ok)}/{len(todo)} ok, passes {walls}), GPU util "
            f"{util if util is None else round(util, 1)} %, s/slide "
            + ", ".join(f"{k} {v / n:.4f}" for k, v in parts_sum.items()),
            flush=True,
        )
    names = list(by_precision)
    agreement = []
    for other in names[1:]:
        a, b = by_precision[names[0]], by_precision[other]
        common = sorted(set(a) & set(b))
        cells = [
            len({(p["x"], p["y"]) for p in a[s]["patches"]} & {(p["x"], p["y"]) for p in b[s]["patches"]})
            / max(len(a[s]["patches"]), 1)
            for s in common
        ]
        agreement.append(
            {
                "reference": names[0],
                "other": other,
                "slides": len(common),
                "same_prediction": float(np.mean([a[s]["prediction"] == b[s]["prediction"] for s in common])),
                "max_abs_prob_diff": float(
                    max(abs(a[s]["probabilities"][c] - b[s]["probabilities"][c]) for s in common for c in classes)
                ),
                "chosen_patches_shared": float(np.mean(cells)),
            }
        )
        print(f"{other} vs {names[0]}: {agreement[-1]}")
    out = {
        "machine": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "count": args.count,
        "size": args.size,
        "model": "trained checkpoint" if args.model else f"untrained, {Path(args.config).name}",
        "k": cfg.selection.k,
        "batch": args.batch,
        "prefetch": args.prefetch,
        "classifiers": args.classifiers,
        "rows": results,
        "agreement": agreement,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
