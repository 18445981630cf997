"""Ingest and score throughput on two Ray nodes vs one, on one machine (``tests/test_cluster.py``'s ``ray_nodes``:
a head of 2 CPUs, optionally a second node of 2 CPUs, token auth, stores on a moto S3 server), both as
``ray job submit`` jobs with the commands' defaults (ingest: one tiler per cluster CPU; score: the classifier
actors the CPUs allow) and an untrained model of ``configs/demo.yaml`` (weights do not change the work).

    python benchmarks/multinode.py --count 12 --size 2000 --json benchmarks/results/multinode.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=12, help="slides (default 12)")
    p.add_argument("--size", type=int, default=2000, help="slide side in pixels (default 2000)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    import test_cluster as mn
    import torch
    import yaml
    from local_services import moto_s3

    from operators.checkpoint import save_checkpoint
    from operators.model import FoveateModel
    from operators.model_config import ModelConfig
    from pipeline.config import from_dict

    rows = []
    with tempfile.TemporaryDirectory(prefix="fov-mn-bench-") as tmp, moto_s3(mn.BUCKET) as (client, aws):
        work = Path(tmp)
        synth = work / "synth"
        subprocess.run(
            [sys.executable, "-m", "pipeline", "-q", "synth", str(synth), "--count", str(args.count)]
            + ["--size", str(args.size), "--seed", "0"],
            check=True,
            cwd=REPO,
        )
        lines = ["path,label"]
        for line in (synth / "labels.csv").read_text().splitlines()[1:]:
            path, label = line.rsplit(",", 1)
            client.put_object(Bucket=mn.BUCKET, Key=f"slides/{Path(path).name}", Body=Path(path).read_bytes())
            lines.append(f"{Path(path).name},{label}")
        client.put_object(Bucket=mn.BUCKET, Key="slides/labels.csv", Body=("\n".join(lines) + "\n").encode())
        cfg = from_dict(
            ModelConfig, dict(yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["model"], num_classes=2)
        )
        torch.manual_seed(0)
        model = save_checkpoint(work / "model.pt", FoveateModel(cfg).eval(), cfg, ["0", "1"])
        root = f"s3://{mn.BUCKET}"
        for nodes in (1, 2):
            run = work / f"run{nodes}"
            run.mkdir()
            with mn.ray_nodes(run, aws, second_node=nodes == 2) as c:
                t0 = time.monotonic()
                out = c.submit(
                    [
                        "python",
                        "-m",
                        "pipeline",
                        "ingest",
                        f"{root}/slides/labels.csv",
                        "--out",
                        f"{root}/stores{nodes}",
                    ]
                    + ["--address", "auto"],
                    900,
                    f"ingest, {nodes} node(s)",
                )
                ingest_job = time.monotonic() - t0
                ingest_s = float(re.search(r"ingest: \d+ ok.* in ([\d.]+)s", out).group(1))
                t0 = time.monotonic()
                out = c.submit(
                    ["python", "-m", "pipeline", "score", "--model", str(model), "--stores", f"{root}/stores{nodes}"]
                    + ["--out", f"{root}/preds{nodes}.parquet"],
                    900,
                    f"score, {nodes} node(s)",
                )
                score_job = time.monotonic() - t0
                score_s = float(re.search(r"scored, .*\(([\d.]+) s,", out).group(1))
            rows.append(
                {
                    "nodes": nodes,
                    "cpus": 2 * nodes,
                    "slides": args.count,
                    "ingest_seconds": ingest_s,
                    "ingest_slides_per_s": args.count / ingest_s,
                    "ingest_job_seconds": ingest_job,
                    "score_seconds": score_s,
                    "score_slides_per_s": args.count / score_s,
                    "score_job_seconds": score_job,
                }
            )
            print(rows[-1], flush=True)
    one, two = rows
    print("| nodes (CPUs) | ingest slides/s | ingest job s | score slides/s | score job s |")
    for r in rows:
        print(
            f"| {r['nodes']} ({r['cpus']}) | {r['ingest_slides_per_s']:.3f} | {r['ingest_job_seconds']:.1f} "
            f"| {r['score_slides_per_s']:.3f} | {r['score_job_seconds']:.1f} |"
        )
    print(
        f"two nodes / one node: ingest {two['ingest_slides_per_s'] / one['ingest_slides_per_s']:.2f}, "
        f"score {two['score_slides_per_s'] / one['score_slides_per_s']:.2f}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
