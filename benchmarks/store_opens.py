"""Store opens per slide in batch scoring: how often the two scoring stages open, verify and list each store.

Writes ``--slides`` synthetic slides (SVS, ``--size`` px square), ingests each with a tiler (the shipped
defaults: zstd, 256-px chunks, sharded) into a local folder and into a bucket of a local S3 server (moto on
127.0.0.1, as ``tests/test_s3.py`` starts it), then runs the scorer and the classifier stage
(``workers.scoring.ScorerWorker.score_batch`` then ``ClassifierWorker.classify_batch``, in one process, a tiny
untrained model: the stores' traffic does not depend on the weights) over them and counts, per slide and stage:

- full opens: ``SlideStore(path)`` (existence, completion marker, metadata, verification);
- verifications: ``workers.store.verify_store`` calls (each lists every image level once);
- store listings: ``list`` / ``list_prefix`` / ``list_dir`` calls of zarr's store API (``LocalStore``,
  ``FsspecStore``) and the folder walks of ``workers.storage.list_keys`` on a ``LocalStore``;
- metadata requests: ``exists`` calls and reads of ``zarr.json`` / the completion marker through the store API;
- S3 requests (object storage only): every S3 API call botocore makes (``aiobotocore``'s ``_make_api_call``),
  by operation (``ListObjectsV2``, ``GetObject``, ``HeadObject``, ...).

With ``--baseline REV`` the same measurement also runs on the code of git revision ``REV`` (its ``workers``,
``operators`` and ``pipeline`` extracted with ``git archive``) on the same stores: the "before" rows; the
"after" rows measure ``--revision REV`` the same way, or the working tree. Each measurement runs in a fresh child
process with only that code importable (the editable install's finder removed). Seconds are wall time of the two
stages in that process (a moto server answers S3 on the same machine), the counts do not depend on load.

    # 4 slides of 2048 x 2048, the code before and after the commit that made scoring open each store once
    python benchmarks/store_opens.py --baseline 'HEAD^{/one open per slide}~1' --revision 'HEAD^{/one open per slide}'
    python benchmarks/store_opens.py --slides 8 --json out.json  # the working tree only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
BUCKET = "store-opens"

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ child: one measurement
def _measure(code: Path, stores: list[tuple[str, str]]) -> dict:
    """Run both scoring stages over ``stores`` with the code in ``code``; the counts per stage."""
    sys.path.insert(0, str(code))
    # only ``code``: not the editable install's finder, which resolves modules missing there from the checkout
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    logging.disable(logging.WARNING)
    import torch
    import zarr.storage

    import workers.store as ws
    from operators.errors import ConfigError
    from operators.model import FoveateModel
    from pipeline.config import from_dict
    from workers.scoring import ClassifierWorker, ScorerWorker

    if (code / "operators" / "checkpoint.py").is_file():
        from operators.checkpoint import checkpoint_dict
    else:  # code from before checkpoints had their own module
        from pipeline.model_io import checkpoint_dict

    if (code / "operators" / "model_config.py").is_file():
        from operators.model_config import ModelConfig
    else:  # code from before the model config had its own module
        from operators.model import ModelConfig

    assert Path(ws.__file__).resolve().is_relative_to(code.resolve()), (ws.__file__, code)
    torch.set_num_threads(1)
    counts: dict[str, Counter] = {}

    def count(what: str, key: str = "") -> None:
        counts.setdefault(what, Counter())[key] += 1

    real_init = ws.SlideStore.__init__

    def init(self, *args, **kwargs):
        count("full_opens")
        return real_init(self, *args, **kwargs)

    ws.SlideStore.__init__ = init
    real_verify = ws.verify_store

    def verify(*args, **kwargs):
        count("verifications")
        return real_verify(*args, **kwargs)

    ws.verify_store = verify
    import workers.storage as wst

    real_walk = getattr(wst, "_walk_keys", None)  # list_keys walks a LocalStore's folder itself (newer code)

    def walk(*args, **kwargs):
        count("store_listings")
        return real_walk(*args, **kwargs)

    if real_walk is not None:
        wst._walk_keys = walk
    for cls in (zarr.storage.LocalStore, zarr.storage.FsspecStore):
        for name in ("list", "list_prefix", "list_dir"):
            real = getattr(cls, name)

            def listing(self, *args, _real=real):
                count("store_listings")
                return _real(self, *args)

            setattr(cls, name, listing)
        real_get, real_exists = cls.get, cls.exists

        async def get(self, key, *args, _real=real_get, **kwargs):
            if key.endswith(("zarr.json", ws.COMPLETE_MARKER)):
                count("metadata_requests")
            return await _real(self, key, *args, **kwargs)

        async def exists(self, key, _real=real_exists):
            count("metadata_requests")
            return await _real(self, key)

        cls.get, cls.exists = get, exists
    with contextlib.suppress(ImportError):
        from aiobotocore.client import AioBaseClient

        real_call = AioBaseClient._make_api_call

        async def api_call(self, operation_name, api_params):
            count("s3_requests", operation_name)
            return await real_call(self, operation_name, api_params)

        AioBaseClient._make_api_call = api_call

    nets = {"num_classes": 2, "scorer": {"channels": 8}, "features": {"widths": [8, 16], "blocks": [1, 1]}}
    try:  # the model config in sections
        geometry = {"geometry": {"patch_size": 64, "scorer_downsample": 8.0}, "selection": {"k": 8}}
        cfg = from_dict(ModelConfig, {**nets, **geometry, "aggregator": {"kind": "mean"}})
    except ConfigError:  # code from before the sections: flat keys
        cfg = from_dict(ModelConfig, {**nets, "patch_size": 64, "scorer_downsample": 8.0, "k": 8, "aggregator": "mean"})
    torch.manual_seed(0)
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, ["a", "b"])
    scorer, classifier = ScorerWorker(ckpt, device="cpu"), ClassifierWorker(ckpt)
    stages = {}
    for stage in ("scorer", "classifier"):
        counts.clear()
        t0 = time.perf_counter()
        if stage == "scorer":
            items = scorer.score_batch(stores)
            status = [i["status"] for i in items]
        else:
            rows = classifier.classify_batch(items)
            status = [r["status"] for r in rows]
        seconds = time.perf_counter() - t0
        if status != ["ok"] * len(stores):
            raise RuntimeError(f"{stage}: {status}")
        stages[stage] = {k: dict(v) if k == "s3_requests" else v[""] for k, v in counts.items()}
        stages[stage]["seconds"] = seconds
    return stages


# ------------------------------------------------------------------------------------------ parent
def _per_slide(stages: dict, n: int) -> dict:
    """Totals of both stages and per stage, divided by the slide count."""
    out: dict = {}
    for what in ("full_opens", "verifications", "store_listings", "metadata_requests", "seconds"):
        per = {s: stages[s].get(what, 0) / n for s in ("scorer", "classifier")}
        out[what] = {**per, "total": sum(per.values())}
    s3 = Counter()
    for s in ("scorer", "classifier"):
        s3.update(stages[s].get("s3_requests", {}))
    if s3:
        out["s3_requests"] = {
            "by_operation": {k: v / n for k, v in sorted(s3.items())},
            "list_objects": s3.get("ListObjectsV2", 0) / n,
            "total": sum(s3.values()) / n,
            "scorer": sum(stages["scorer"].get("s3_requests", {}).values()) / n,
            "classifier": sum(stages["classifier"].get("s3_requests", {}).values()) / n,
        }
    return out


def _run_child(code: Path, stores: list[tuple[str, str]], env: dict[str, str]) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(code),
                "--child-out",
                f.name,
                "--child-stores",
                json.dumps(stores),
            ],
            check=True,
            env={**os.environ, **env, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"},
            cwd=tempfile.gettempdir(),  # no checkout on sys.path but the one given
        )
        return json.loads(Path(f.name).read_text())


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def _extract(rev: str, dest: Path) -> Path:
    """``workers``, ``operators`` and ``pipeline`` of git revision ``rev`` in ``dest`` (replaced)."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", rev, "workers", "operators", "pipeline"], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slides", type=int, default=4, help="slides (default 4)")
    p.add_argument("--size", type=int, default=2048, help="slide side in pixels (default 2048)")
    p.add_argument("--baseline", default=None, help="git revision to measure as 'before' (default: none)")
    p.add_argument("--revision", default=None, help="git revision to measure as 'after' (default: the working tree)")
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "store_opens.json"), help="JSON output")
    p.add_argument("--work-dir", default=None, help="slides and local stores (default: a temporary folder)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-stores", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        stages = _measure(Path(args.child), [tuple(s) for s in json.loads(args.child_stores)])
        Path(args.child_out).write_text(json.dumps(stages))
        return 0
    if args.slides < 1 or args.size < 2000:
        p.error(f"--slides must be >= 1 and --size >= 2000 (synthetic slides), got {args.slides}, {args.size}")

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))  # local_services: the moto S3 server of the tests
    from local_services import moto_s3

    from pipeline.ingest_inputs import discover_inputs
    from pipeline.synthetic import write_synthetic_slide
    from workers.tiler import IngestOptions, Tiler

    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        codes = {}
        for label, rev in (("before", args.baseline), ("after", args.revision)):
            if rev:
                _git("rev-parse", "--verify", f"{rev}^{{commit}}")  # a revision git knows, or stop here
                codes[label] = (rev, _extract(rev, work / f"code-{label}"))
        codes.setdefault("after", ("working tree", REPO))
        slides = work / "slides"
        slides.mkdir(parents=True, exist_ok=True)
        for i in range(args.slides):
            path = slides / f"slide{i}.svs"
            if not path.is_file():
                write_synthetic_slide(path, width=args.size, height=args.size, label=i % 2, seed=i, fmt="svs")
        inputs = discover_inputs([slides / f"slide{i}.svs" for i in range(args.slides)])  # not others of a --work-dir
        opts = IngestOptions(tile_size=256, min_size=256)
        _, env = stack.enter_context(moto_s3(BUCKET))
        os.environ.update(env)  # the tiler writing to the bucket, and the children (they inherit it)
        where = {"local": str(work / "stores"), "s3": f"s3://{BUCKET}/stores"}
        stores: dict[str, list[tuple[str, str]]] = {}
        for name, root in where.items():
            tiler = Tiler(root, opts)
            stores[name] = []
            for inp in inputs:
                tiler.ingest_slide(inp, overwrite=True)
                stores[name].append((inp.slide_id, tiler.store_path(inp.slide_id)))
        from workers.store import SlideStore

        levels = SlideStore(stores["local"][0][1]).level_count
        rows = []
        for label, (rev, code) in codes.items():
            for name in where:
                stages = _run_child(code, stores[name], env)
                rows.append({"code": label, "revision": rev, "storage": name, **_per_slide(stages, args.slides)})

    head = "| code | storage | full opens | verifications | store listings | metadata requests | S3 ListObjectsV2 | S3 requests | s / slide |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        s3 = r.get("s3_requests")
        lines.append(
            f"| {r['code']} | {r['storage']} | {r['full_opens']['total']:g} | "
            f"{r['verifications']['total']:g} | {r['store_listings']['total']:g} | "
            f"{r['metadata_requests']['total']:g} | {s3['list_objects'] if s3 else '-'} | "
            f"{s3['total'] if s3 else '-'} | {r['seconds']['total']:.3f} |"
        )
    print(f"per slide ({args.slides} slides of {args.size}^2 px, {levels} levels; scorer + classifier):")
    print("\n".join(lines))
    print("code: " + "; ".join(f"{label} = {rev}" for label, (rev, _) in codes.items()))
    out = {
        "benchmark": "store_opens",
        "command": "python benchmarks/store_opens.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "slides": args.slides,
        "size": args.size,
        "levels": levels,
        "ingest": {"tile_size": opts.tile_size, "min_size": opts.min_size, "shard": opts.shard, "codec": opts.codec},
        "rows": rows,
        "table": lines,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
