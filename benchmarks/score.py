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

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # local_services: the moto S3 server of the tests


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
    args = p.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
