"""Bounded under load: ``foveate view`` and the served model with many requests at once (127.0.0.1 only).

(a) The viewer. One ``--size`` x ``--size`` store (crc32c in every chunk, as ``foveate ingest`` writes them) and
``foveate view --max-concurrent C`` in its own process. For each N of ``--clients``, N client threads (one
keep-alive connection each) request for ``--seconds`` s: a random 2048² level-0 patch (PNG) with probability
``--patch-share``, else a random 256-px JPEG tile of a random level. A client that gets 503 goes on at once (it
does not honour Retry-After: the worst case). Per phase: requests, 200s, 503s, other errors, p50/p95 of the 200s
per kind, and the viewer's peak RSS (sampled every 20 ms). One more phase with the largest N and the cap raised
to N shows what the cap bounds.

(b) The served model. A model of ``configs/demo.yaml``'s architecture (untrained; scoring cost does not depend on
the weights) logged to a local sqlite MLflow, served by ``mlflow models serve --env-manager local -w 1`` (its
scoring server's default 60 s request timeout), ``--model-stores`` distinct 2048² stores (the demo's slide
size). One client sends requests of 1, 10 and 100 stores (``--batches``; cycling through the stores) and one of
``FOVEATE_SERVE_MAX_STORES`` + 1 stores, which must be a 4xx at once. Per size: status, seconds per request, stores/s.

Prints tables and writes JSON (no absolute paths). Bounded: every phase has a deadline; the default run takes
about 4–5 minutes on two cores.

    python benchmarks/load.py --json benchmarks/results/load.json
    python benchmarks/load.py --clients 1,4 --seconds 5 --batches 1,10 --skip-model   # a quick look
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np

PATCH = 2048
TILE = 256


# ------------------------------------------------------------------ helpers


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (MB); 0 when gone."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return total / 1024


class _PeakRss:
    """Samples :func:`_rss_mb` of a process tree every ``every`` s in a thread."""

    def __init__(self, pid: int, every: float = 0.02):
        self.pid, self.every, self.peak = pid, every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb(self.pid))
            self._stop.wait(self.every)

    def __enter__(self) -> _PeakRss:
        self.peak = _rss_mb(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


# ------------------------------------------------------------------ (a) the viewer


def _write_viewer_store(path: Path, size: int) -> float:
    from tiles import _band

    from workers.store import write_store_from_array

    t0 = time.perf_counter()
    write_store_from_array(path, _band(0, size, size), tile_size=TILE, min_size=1024, source="<benchmarks/load.py>")
    return time.perf_counter() - t0


def _start_viewer(stores: Path, cap: int) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "pipeline", "view", str(stores), "--port", "0", "--max-concurrent", str(cap)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"http://([\d.]+):(\d+)/", line)
    if not m:
        _stop(proc)
        raise SystemExit(f"foveate view printed no address: {line!r}")
    return proc, m.group(1), int(m.group(2))


def _viewer_phase(
    host: str, port: int, pid: int, sid: str, levels: list[tuple[int, int]], clients: int, seconds: float, share: float
) -> dict:
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    lat: dict[str, list[float]] = {"tile": [], "patch": []}
    counts = {"requests": 0, "ok": 0, "busy_503": 0, "other_errors": 0}
    busy_ms: list[float] = []
    w0, h0 = levels[0]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection(host, port, timeout=60)
        while time.monotonic() < deadline:
            if rng.random() < share:
                kind = "patch"
                x, y = rng.randrange(0, w0 - PATCH + 1), rng.randrange(0, h0 - PATCH + 1)
                url = f"/patch/{sid}?x={x}&y={y}&w={PATCH}&h={PATCH}"
            else:
                kind = "tile"
                lv = rng.randrange(len(levels))
                w, h = levels[lv]
                url = f"/tiles/{sid}/{lv}/{rng.randrange(-(-w // TILE))}/{rng.randrange(-(-h // TILE))}.jpg"
            t = time.perf_counter()
            try:
                conn.request("GET", url)
                r = conn.getresponse()
                body = r.read()
                status = r.status
            except (OSError, http.client.HTTPException):
                status, body = None, b""
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=60)
            ms = (time.perf_counter() - t) * 1000
            with lock:
                counts["requests"] += 1
                if status == 200 and body:
                    counts["ok"] += 1
                    lat[kind].append(ms)
                elif status == 503:
                    counts["busy_503"] += 1
                    busy_ms.append(ms)
                else:
                    counts["other_errors"] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    with _PeakRss(pid) as rss:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 120)
    wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        **counts,
        "requests_per_s": round(counts["requests"] / wall, 2),
        "tile": {"n": len(lat["tile"]), "p50_ms": _pct(lat["tile"], 50), "p95_ms": _pct(lat["tile"], 95)},
        "patch": {"n": len(lat["patch"]), "p50_ms": _pct(lat["patch"], 50), "p95_ms": _pct(lat["patch"], 95)},
        "busy_503_p50_ms": _pct(busy_ms, 50),
        "peak_rss_mb": round(rss.peak, 1),
    }


def bench_viewer(args: argparse.Namespace, work: Path) -> dict:
    from workers.store import SlideStore

    stores = work / "view"
    store = stores / f"load-{args.size}.zarr"
    shutil.rmtree(stores, ignore_errors=True)
    stores.mkdir(parents=True)
    print(f"(a) writing a {args.size}² store ...", flush=True)
    write_s = _write_viewer_store(store, args.size)
    levels = [tuple(map(int, d)) for d in SlideStore(store).level_dimensions]
    sid = store.name.removesuffix(".zarr")
    plan = [(n, args.max_concurrent) for n in args.clients]
    if max(args.clients) > args.max_concurrent:
        plan.append((max(args.clients), max(args.clients)))  # the cap raised to N: what the cap bounds
    phases = []
    for cap in dict.fromkeys(c for _, c in plan):
        proc, host, port = _start_viewer(stores, cap)
        try:
            idle = _rss_mb(proc.pid)
            for n, c in plan:
                if c != cap:
                    continue
                print(f"    {n} client(s), --max-concurrent {cap}, {args.seconds:g} s ...", flush=True)
                ph = _viewer_phase(host, port, proc.pid, sid, levels, n, args.seconds, args.patch_share)
                phases.append({"max_concurrent": cap, "idle_rss_mb": round(idle, 1), **ph})
        finally:
            _stop(proc)
    return {
        "store": {"size": args.size, "levels": len(levels), "written_s": round(write_s, 1)},
        "seconds_per_phase": args.seconds,
        "patch_side": PATCH,
        "patch_share": args.patch_share,
        "phases": phases,
    }


# ------------------------------------------------------------------ (b) the served model


def _post(url: str, records: list[dict], timeout: float) -> tuple[int | None, bytes]:
    req = urllib.request.Request(
        url, json.dumps({"dataframe_records": records}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return None, str(e).encode()


def _reason(body: bytes, root: Path) -> str:
    """The server's message without the echoed request (MLflow prefixes the data it failed on)."""
    text = body.decode(errors="replace")
    try:
        text = str(json.loads(text).get("message", text))
    except ValueError:
        pass
    i = text.find("this request names")
    return " ".join((text[i:] if i >= 0 else text[-300:]).replace(str(root), "<work>").split())[:300]


def _log_model(root: Path, stores: Path) -> Path:
    import mlflow
    import pandas as pd
    import torch

    from operators.model import FoveateModel
    from pipeline.config import load_config
    from pipeline.mlflow_model import log_model
    from pipeline.tracking import get_or_create_experiment
    from pipeline.train_config import TrainConfig

    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml").model
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(get_or_create_experiment(client, "load-bench", uri)).info.run_id
    torch.manual_seed(0)
    model_uri = log_model(
        FoveateModel(cfg).eval(),
        cfg,
        ["benign", "tumour"],
        run_id=run_id,
        tracking_uri=uri,
        input_example=pd.DataFrame({"store": [str(next(iter(sorted(stores.iterdir()))))]}),
    )
    client.set_terminated(run_id)
    return Path(
        mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(root / "model"), tracking_uri=uri)
    )


def bench_model(args: argparse.Namespace, work: Path) -> dict:
    from tiles import _band

    from pipeline.serving import max_stores
    from workers.store import write_store_from_array

    root = work / "model"
    shutil.rmtree(root, ignore_errors=True)
    stores = root / "stores"
    print(f"(b) writing {args.model_stores} 2048² stores and logging the model ...", flush=True)
    paths = []
    for i in range(args.model_stores):
        img = _band(1000 * i, 2048, 2048, seed=i)
        img[:, : 512 + 64 * i] = 245  # background on the left, as on a slide
        write_store_from_array(stores / f"m{i:03d}.zarr", img, tile_size=TILE, min_size=256)
        paths.append(str(stores / f"m{i:03d}.zarr"))
    local = _log_model(root, stores)
    limit = max_stores()
    port = _free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    env = {
        **os.environ,
        "PATH": f"{mlflow_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "FOVEATE_SERVE_ROOTS": str(stores),
    }
    cmd = [str(mlflow_bin), "models", "serve", "-m", str(local), "-h", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(
        cmd + ["--env-manager", "local", "-w", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 180:
                raise SystemExit("mlflow models serve did not come up in 180 s")
            time.sleep(0.5)
        start_s = time.monotonic() - t0
        _post(f"{base}/invocations", [{"store": paths[0]}], 120)  # warm-up: first model call
        with _PeakRss(proc.pid) as rss:
            plan = [(n, args.repeat if n < 100 else args.repeat_large) for n in args.batches] + [(limit + 1, 1)]
            for n, repeat in plan:
                recs = [{"store": paths[i % len(paths)]} for i in range(n)]
                times, statuses, ok_rows, message = [], [], 0, None
                for _ in range(repeat):
                    print(f"    {n} store(s) ...", flush=True)
                    t = time.perf_counter()
                    status, body = _post(f"{base}/invocations", recs, args.request_timeout)
                    times.append(time.perf_counter() - t)
                    statuses.append(status)
                    if status == 200:
                        ok_rows += sum(r.get("status") == "ok" for r in json.loads(body)["predictions"])
                    elif message is None:
                        message = _reason(body, root)
                good = [s for s, st in zip(times, statuses) if st == 200]
                rows.append(
                    {
                        "stores": n,
                        "requests": repeat,
                        "statuses": statuses,
                        "seconds": [round(s, 2) for s in times],
                        "median_s": round(float(np.median(times)), 3),
                        "stores_per_s": round(n * len(good) / sum(good), 2) if good else None,
                        "ok_rows": ok_rows,
                        "message": message,
                    }
                )
        peak = rss.peak
    finally:
        _stop(proc)
    return {
        "model": "configs/demo.yaml architecture, untrained, 2 classes",
        "stores": {"distinct": len(paths), "size": 2048},
        "server": "mlflow models serve --env-manager local -w 1",
        "max_stores": limit,
        "server_start_s": round(start_s, 1),
        "peak_rss_mb": round(peak, 1),
        "requests": rows,
    }


# ------------------------------------------------------------------ main


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=_ints, default=[1, 4, 16], help="concurrent viewer clients per phase")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of each viewer phase")
    ap.add_argument("--max-concurrent", type=int, default=4, help="the viewer's cap (its default: 4)")
    ap.add_argument("--size", type=int, default=8192, help="side of the viewer's store (px)")
    ap.add_argument("--patch-share", type=float, default=0.2, help="share of 2048² patch requests")
    ap.add_argument("--batches", type=_ints, default=[1, 10, 100], help="stores per request to the served model")
    ap.add_argument("--repeat", type=int, default=3, help="requests of each size below 100 stores")
    ap.add_argument("--repeat-large", type=int, default=1, help="requests of 100 stores or more")
    ap.add_argument("--model-stores", type=int, default=10, help="distinct 2048² stores for the served model")
    ap.add_argument("--request-timeout", type=float, default=150.0, help="client timeout per model request (s)")
    ap.add_argument("--skip-viewer", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "_work" / "load"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    out: dict = {
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), Python {platform.python_version()}",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    try:
        if not args.skip_viewer:
            out["viewer"] = bench_viewer(args, work)
        if not args.skip_model:
            out["model"] = bench_model(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_average"] = {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)}
    out["total_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        out["command"] = out["command"].replace(str(REPO) + os.sep, "")
    if "viewer" in out:
        v = out["viewer"]
        print(f"\nfoveate view, {v['store']['size']}² store, {v['seconds_per_phase']:g} s per phase (ms; RSS in MB)")
        print(
            f"{'clients':>7} {'cap':>4} {'req':>6} {'ok':>6} {'503':>5} {'err':>4} {'tile p50':>9} {'tile p95':>9} "
            f"{'patch p50':>10} {'patch p95':>10} {'RSS idle':>9} {'RSS peak':>9}"
        )
        for p in v["phases"]:
            print(
                f"{p['clients']:>7} {p['max_concurrent']:>4} {p['requests']:>6} {p['ok']:>6} {p['busy_503']:>5} "
                f"{p['other_errors']:>4} {_ms(p['tile']['p50_ms']):>9} {_ms(p['tile']['p95_ms']):>9} "
                f"{_ms(p['patch']['p50_ms']):>10} {_ms(p['patch']['p95_ms']):>10} {p['idle_rss_mb']:>9.0f} "
                f"{p['peak_rss_mb']:>9.0f}"
            )
    if "model" in out:
        m = out["model"]
        print(f"\nserved model ({m['server']}, up in {m['server_start_s']} s, peak RSS {m['peak_rss_mb']:.0f} MB)")
        print(f"{'stores':>7} {'requests':>8} {'statuses':>16} {'median s':>9} {'stores/s':>9}")
        for r in m["requests"]:
            sps = "-" if r["stores_per_s"] is None else f"{r['stores_per_s']:.2f}"
            st = ",".join(str(s) for s in r["statuses"])
            print(f"{r['stores']:>7} {r['requests']:>8} {st:>16} {r['median_s']:>9.2f} {sps:>9}")
            if r["message"]:
                print(f"        {r['message'][:200]}")
    print(f"\ntotal {out['total_s']} s, load average {out['load_average']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
