"""Benchmark: time and peak memory of forward+backward of the selection operators, against the paper baseline.

Usage::

    python benchmarks/operators.py [--quick] [--device cpu|cuda] [--batch 1] [--k 64] [--num-samples 500]
        [--sizes 2000,20000,200000,1000000] [--threads 2] [--json benchmarks/results/operators_cpu.json]

Every case runs in a fresh subprocess (``--worker``), so one case's allocations cannot hide another's.
Method:

* time: wall clock of the forward and of the backward (``out.backward(G)`` with a random upstream gradient
  created beforehand), median over the timed repeats, after a warm-up run at a small size (N/8, at most
  1024) and one untimed cold run at full size (cases slower than 3 s: the cold run is the timed one).
  CUDA: with ``torch.cuda.synchronize()``.
* peak memory, CPU: after the timing, one more forward+backward; its peak resident set size minus the
  resident size just before (Linux ``/proc/self/status`` ``VmHWM`` after resetting it with
  ``/proc/self/clear_refs`` = 5, and ``VmRSS``). Before it, glibc is switched to a fixed 128 KiB mmap
  threshold and its heap trimmed (``mallopt``/``malloc_trim`` via ctypes), so freed blocks go back to the OS
  and RSS follows live memory. tracemalloc does not see torch's allocations. The inputs (scores, upstream
  gradient) are allocated before and not counted; the output, the saved tensors and all temporaries are.
  CUDA: ``torch.cuda.max_memory_allocated`` minus the allocated bytes before.

Operators: ``perturbed_topk`` (ours, full VJP, no one-hot), ``perturbed_baseline`` (written from the appendix
of Cordonnier et al. 2021: dense ``[B, n, k, N]`` one-hot, diagonal ``einsum`` backward), ``lapsum_topk``,
``sinkhorn_topk``, ``attention_sample`` (without replacement; skipped if not implemented) and ``hard_topk``
(forward only). The baseline is skipped where its estimated peak (3x its one-hot tensor) would exceed
``--baseline-max-gb``.
The paper's traffic-sign case (B=32, N=2028, k=10, n=500) is always run for ours and the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAPSUM_CPP_MS = {"forward": 114.0, "backward": 10.0}  # gmum/LapSum C++/OpenMP, 1 row, N=1e6, k=64 (issue 3)


# ----------------------------------------------------------------------------------------------- baseline
def _baseline_function():
    import torch

    class PaperPerturbedTopK(torch.autograd.Function):
        """Cordonnier et al. 2021, appendix: dense one-hot forward, diagonal einsum backward (biased)."""

        @staticmethod
        def forward(ctx, x, k, num_samples, sigma):
            b, d = x.shape
            noise = torch.normal(mean=0.0, std=1.0, size=(b, num_samples, d), dtype=x.dtype, device=x.device)
            perturbed_x = x[:, None, :] + noise * sigma
            indices = torch.topk(perturbed_x, k=k, dim=-1, sorted=False).indices
            indices = torch.sort(indices, dim=-1).values
            perturbed_output = torch.nn.functional.one_hot(indices, num_classes=d).to(x.dtype)
            indicators = perturbed_output.mean(dim=1)
            ctx.k, ctx.num_samples, ctx.sigma = k, num_samples, sigma
            ctx.save_for_backward(perturbed_output, noise)
            return indicators

        @staticmethod
        def backward(ctx, grad_output):
            perturbed_output, noise = ctx.saved_tensors
            expected_gradient = torch.einsum("bnkd,bnd->bkd", perturbed_output, noise) / ctx.num_samples / ctx.sigma
            grad_input = torch.einsum("bkd,bkd->bd", grad_output, expected_gradient)
            return grad_input, None, None, None

    return PaperPerturbedTopK


# ----------------------------------------------------------------------------------------------- worker
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_return_to_os() -> None:
    """glibc: fixed 128 KiB mmap threshold (every large block goes back to the OS on free) and trim the heap,
    so that RSS follows live memory and a later peak is not hidden by memory freed earlier."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3
    if libc.mallopt(m_mmap_threshold, 128 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    libc.malloc_trim(0)


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    op, b, n, k = spec["op"], spec["batch"], spec["n"], spec["k"]
    gen = torch.Generator(device=dev).manual_seed(0)
    import operators as ops

    def make(b, n, k):
        """(forward closure, upstream gradient or None, scores) for one problem size."""
        scores = torch.randn(b, n, generator=gen, device=dev).requires_grad_(op != "hard_topk")
        if op == "perturbed_topk":

            def fwd():
                return ops.perturbed_topk(
                    scores, k, num_samples=spec["num_samples"], sigma=spec["sigma"], generator=gen
                )

            grad_shape = (b, k, n)
        elif op == "perturbed_baseline":
            fn = _baseline_function()

            def fwd():
                return fn.apply(scores, k, spec["num_samples"], spec["sigma"])

            grad_shape = (b, k, n)
        elif op == "lapsum_topk":

            def fwd():
                return ops.lapsum_topk(scores, k, alpha=spec["alpha"])

            grad_shape = (b, n)
        elif op == "sinkhorn_topk":

            def fwd():
                return ops.sinkhorn_topk(scores, k, epsilon=spec["epsilon"], max_iter=200)

            grad_shape = (b, n)
        elif op == "attention_sample":
            attn = torch.softmax(scores.detach(), dim=1).requires_grad_(True)
            feats = torch.randn(b, k, generator=gen, device=dev)

            def fwd():
                _, w = ops.attention_sample(attn, k, replace=False, generator=gen)
                return (w * feats).sum(1)

            grad_shape = (b,)
        elif op == "hard_topk":

            def fwd():
                return ops.hard_topk(scores, k)

            grad_shape = None
        else:
            raise ValueError(op)
        grad = torch.randn(grad_shape, generator=gen, device=dev) if grad_shape else None
        return fwd, grad, scores

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run_once(fwd, grad, scores):
        sync()
        t0 = time.perf_counter()
        out = fwd()
        sync()
        t1 = time.perf_counter()
        if grad is not None:
            out.backward(grad)
            sync()
        t2 = time.perf_counter()
        del out
        scores.grad = None
        return t1 - t0, t2 - t1

    try:
        # warm-up on a small problem (lazy initialisation of kernels and thread pools is not the operator's)
        nw = max(16, min(n // 8, 1024))
        run_once(*make(min(b, 2), nw, min(k, nw - 1)))
        case = make(b, n, k)
        # time, with the allocator's default behaviour: first (cold) run, then timed repeats
        first = run_once(*case)
        times = []
        if sum(first) > 3.0:  # slow case: the cold run is the timed one
            times.append(first)
        else:
            spent = sum(first)
            for _ in range(spec["repeats"]):
                times.append(run_once(*case))
                spent += sum(times[-1])
                if spent > spec["time_budget_s"]:
                    break
        # peak memory of one more run
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            _malloc_return_to_os()
            base = _rss_kib("VmRSS")
            if not _reset_peak():
                raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs)")
        run_once(*case)
        if cuda:
            peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            peak_mb = (_rss_kib("VmHWM") - base) / 1024
    except NotImplementedError as e:
        return {"status": "not implemented", "error": str(e)}
    fw = statistics.median(t[0] for t in times)
    bw = statistics.median(t[1] for t in times)
    return {
        "status": "ok",
        "forward_ms": fw * 1e3,
        "backward_ms": bw * 1e3,
        "total_ms": (fw + bw) * 1e3,
        "peak_mb": peak_mb,
        "timed_repeats": len(times),
    }


# ----------------------------------------------------------------------------------------------- driver
def run_case(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {**spec, "status": f"timeout after {timeout:.0f} s"}
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return {**spec, "status": f"failed (rc {p.returncode}): {tail[0][:200]}"}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return {**spec, **res}


def _fmt(x, nd=1):
    return "—" if x is None else f"{x:,.{nd}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| op | B | N | k | n | forward ms | backward ms | total ms | peak MB | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        n_s = r["num_samples"] if r["op"].startswith("perturbed") else ""
        lines.append(
            f"| {r['op']} | {r['batch']} | {r['n']:,} | {r['k']} | {n_s} | {_fmt(r.get('forward_ms')) if ok else ''} | "
            f"{_fmt(r.get('backward_ms')) if ok else ''} | {_fmt(r.get('total_ms')) if ok else ''} | "
            f"{_fmt(r.get('peak_mb')) if ok else ''} | {'' if ok else r.get('status', '')} |"
        )
    return "\n".join(lines)


def goals(rows: list[dict], lapsum_factor: float = 1.5) -> list[dict]:
    def find(op, **kw):
        for r in rows:
            if r["op"] == op and r.get("status") == "ok" and all(r[a] == v for a, v in kw.items()):
                return r
        return None

    out = []
    ours = find("perturbed_topk", tag="paper")
    base = find("perturbed_baseline", tag="paper")
    if ours and base:
        mem_ratio = base["peak_mb"] / max(ours["peak_mb"], 1e-9)
        time_ratio = base["total_ms"] / ours["total_ms"]
        out.append(
            {
                "goal": "paper case B=32 N=2028 k=10 n=500: peak memory >= 10x less than baseline",
                "value": f"{mem_ratio:.1f}x ({base['peak_mb']:.0f} MB vs {ours['peak_mb']:.0f} MB)",
                "met": mem_ratio >= 10,
            }
        )
        out.append(
            {
                "goal": "paper case: time >= 3x less than baseline",
                "value": f"{time_ratio:.1f}x ({base['total_ms']:.0f} ms vs {ours['total_ms']:.0f} ms)",
                "met": time_ratio >= 3,
            }
        )
    pt = find("perturbed_topk", n=1_000_000, batch=1)
    if pt:
        out.append(
            {
                "goal": f"perturbed_topk N=1e6 k={pt['k']} n={pt['num_samples']} B=1 peak < 4 GB",
                "value": f"{pt['peak_mb']:.0f} MB",
                "met": pt["peak_mb"] < 4096,
            }
        )
    ls = find("lapsum_topk", n=1_000_000, batch=1)
    if ls:
        f_lim, b_lim = lapsum_factor * LAPSUM_CPP_MS["forward"], lapsum_factor * LAPSUM_CPP_MS["backward"]
        out.append(
            {
                "goal": f"lapsum_topk N=1e6 k={ls['k']} 1 row: forward <= {f_lim:.0f} ms, backward <= {b_lim:.0f} ms",
                "value": f"{ls['forward_ms']:.1f} ms / {ls['backward_ms']:.1f} ms",
                "met": ls["forward_ms"] <= f_lim and ls["backward_ms"] <= b_lim,
            }
        )
    sk = find("sinkhorn_topk", n=1_000_000)
    if sk:
        per_row = sk["total_ms"] / sk["batch"]
        out.append(
            {"goal": "sinkhorn_topk N=1e6 < 1 s per row (fwd+bwd)", "value": f"{per_row:.0f} ms", "met": per_row < 1000}
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="small sizes (2e3, 2e4), n=100, fewer repeats")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=500)
    p.add_argument("--sigma", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.1, help="LapSum scale")
    p.add_argument("--epsilon", type=float, default=0.01, help="Sinkhorn regularisation")
    p.add_argument("--sizes", default="2000,20000,200000,1000000")
    p.add_argument(
        "--ops", default="perturbed_topk,perturbed_baseline,lapsum_topk,sinkhorn_topk,attention_sample,hard_topk"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable numbers on a shared machine)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--baseline-max-gb",
        type=float,
        default=8.0,
        help="skip the baseline where its estimated peak (3x its one-hot tensor) exceeds this",
    )
    p.add_argument("--no-paper-case", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="per case, seconds")
    p.add_argument("--json", default=None, help="default benchmarks/results/operators_<device>[_quick].json")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available", file=sys.stderr)
            return 2
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    num_samples, repeats = args.num_samples, args.repeats
    if args.quick:
        sizes, num_samples, repeats = [s for s in sizes if s <= 20000] or [2000], 100, 2
    common = {
        "device": args.device,
        "threads": args.threads,
        "sigma": args.sigma,
        "alpha": args.alpha,
        "epsilon": args.epsilon,
        "repeats": repeats,
        "time_budget_s": 20.0,
    }
    specs = []
    if not args.no_paper_case:
        for op in ("perturbed_topk", "perturbed_baseline"):
            specs.append({**common, "op": op, "batch": 32, "n": 2028, "k": 10, "num_samples": 500, "tag": "paper"})
    for n in sizes:
        for op in args.ops.split(","):
            spec = {
                **common,
                "op": op,
                "batch": args.batch,
                "n": n,
                "k": min(args.k, n - 1),
                "num_samples": num_samples,
                "tag": "sweep",
            }
            if op == "perturbed_baseline":
                gb = 3 * args.batch * num_samples * spec["k"] * n * 4 / 2**30  # measured peak ~2.9x the one-hot
                if gb > args.baseline_max_gb:
                    specs.append({**spec, "status": f"skipped: est. peak {gb:.0f} GB > --baseline-max-gb"})
                    continue
            specs.append(spec)
    rows = []
    for spec in specs:
        if "status" in spec:
            rows.append(spec)
        else:
            r = run_case(spec, args.timeout)
            rows.append(r)
        r = rows[-1]
        print(
            f"  {r['op']:20s} B={r['batch']:<3d} N={r['n']:<8,d} k={r['k']:<3d}: "
            + (
                f"fwd {r['forward_ms']:.1f} ms, bwd {r['backward_ms']:.1f} ms, peak {r['peak_mb']:.0f} MB"
                if r.get("status") == "ok"
                else r.get("status", "?")
            ),
            flush=True,
        )
    g = goals(rows)
    import torch

    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "device": args.device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "memory_method": "CPU: VmHWM-VmRSS in a fresh subprocess per case; CUDA: max_memory_allocated delta",
    }
    print()
    print(table(rows))
    print()
    for x in g:
        print(f"- {'MET' if x['met'] else 'NOT MET'}: {x['goal']}: {x['value']}")
    out = Path(
        args.json or ROOT / "benchmarks" / "results" / f"operators_{args.device}{'_quick' if args.quick else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "goals": g}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
