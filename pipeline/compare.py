"""``foveate compare --experiment NAME``: a table of an MLflow experiment's training runs.

One row per run: operator (the selector), K, aggregator, accuracy, AUC, train time, patches per second and
peak memory, read from what ``foveate train`` logs (params: the flattened resolved config, ``model.selection.selector``,
``model.selection.k``, ``model.aggregator.kind``; metrics: ``val_accuracy``, ``val_auc``, ``train_seconds``,
``epoch_patches_per_second``, ``peak_memory_mb``; latest value of each). Runs from other tools (e.g. the
benchmarks) may log ``operator``/``k``/``aggregator`` params and ``accuracy``/``auc``/... metrics instead;
those are read as fallbacks. Batch-scoring runs (tag ``foveate.stage=score``) are left out.

Nested runs (a ``foveate tune`` search and its trials: tag ``mlflow.parentRunId``) are grouped: each child run
follows its parent, best first, named ``└ <run>`` in the printed table, with ``parent_run_id`` in the CSV; a
child whose parent is not in the table stays where its accuracy puts it.

The table is printed, written as CSV, and accuracy is plotted against train time (PNG). Works against any
tracking URI MLflow supports (sqlite file, ``http://`` server).
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMNS",
    "CHILD_MARK",
    "CompareResult",
    "runs_table",
    "format_table",
    "plot_accuracy_vs_time",
    "compare",
    "Promotion",
    "promote",
    "add_arguments",
    "run",
]

log = logging.getLogger(__name__)

# column -> (source, candidate names in order of preference)
_PARAMS: dict[str, tuple[str, ...]] = {
    "operator": ("model.selection.selector", "model.selector", "operator", "selector", "model.operator"),
    "k": ("model.selection.k", "model.k", "k", "K"),
    "aggregator": ("model.aggregator.kind", "model.aggregator", "aggregator"),
}
_METRICS: dict[str, tuple[str, ...]] = {
    "accuracy": ("val_accuracy", "test_accuracy", "accuracy", "epoch_train_accuracy"),
    "auc": ("val_auc", "test_auc", "auc", "epoch_train_auc"),
    "train_seconds": ("train_seconds", "train_time_s", "train_time"),
    "patches_per_second": ("epoch_patches_per_second", "patches_per_second"),
    "peak_memory_mb": ("epoch_peak_memory_mb", "peak_memory_mb", "peak_memory"),
}
COLUMNS = (
    "run_id",
    "run_name",
    "status",
    "operator",
    "k",
    "aggregator",
    "accuracy",
    "auc",
    "train_seconds",
    "patches_per_second",
    "peak_memory_mb",
    "accuracy_metric",
    "start_time",
    "parent_run_id",
)
CHILD_MARK = "└ "  # before a child run's name in the printed table


@dataclass
class CompareResult:
    """What :func:`compare` returns."""

    table: Any  # pandas.DataFrame with COLUMNS
    csv_path: Path | None
    png_path: Path | None
    experiment_id: str
    tracking_uri: str


def _first(mapping: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, str | None]:
    for name in names:
        if name in mapping and mapping[name] is not None:
            return mapping[name], name
    return None, None


def _as_int(text: Any) -> int | None:
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return None


def _experiment(experiment: str, tracking_uri: str | None):
    """``(MlflowClient, Experiment, tracking URI)``; ValueError naming the experiments there if it is missing."""
    import mlflow

    if not isinstance(experiment, str) or not experiment:
        raise ValueError(f"experiment must be a non-empty experiment name, got {experiment!r}")
    from pipeline.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"experiment {experiment!r} not found at {uri}; experiments there: {names}")
    return client, exp, uri


def runs_table(experiment: str, *, tracking_uri: str | None = None, include_score_runs: bool = False):
    """The experiment's runs as a DataFrame (columns :data:`COLUMNS`), best accuracy first.

    Args:
        experiment: MLflow experiment name.
        tracking_uri: default ``$MLFLOW_TRACKING_URI``.
        include_score_runs: keep batch-scoring runs (tag ``foveate.stage=score``).

    Returns:
        ``(table, experiment_id, tracking_uri)``.

    Raises:
        ValueError: the experiment does not exist.
    """
    import pandas as pd

    client, exp, uri = _experiment(experiment, tracking_uri)
    rows = []
    page_token = None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=page_token)
        for r in page:
            tags = r.data.tags
            if not include_score_runs and tags.get("foveate.stage") == "score":
                continue
            params, metrics = r.data.params, r.data.metrics
            row: dict[str, Any] = {
                "run_id": r.info.run_id,
                "run_name": r.info.run_name or tags.get("mlflow.runName", ""),
                "status": r.info.status,
                "start_time": pd.Timestamp(r.info.start_time, unit="ms", tz="UTC") if r.info.start_time else pd.NaT,
                "parent_run_id": tags.get("mlflow.parentRunId"),
            }
            for col, names in _PARAMS.items():
                row[col] = _first(params, names)[0]
            row["k"] = _as_int(row["k"])
            for col, names in _METRICS.items():
                value, name = _first(metrics, names)
                row[col] = float(value) if value is not None else math.nan
                if col == "accuracy":
                    row["accuracy_metric"] = name
            if math.isnan(row["train_seconds"]) and r.info.end_time and r.info.start_time:
                row["train_seconds"] = (r.info.end_time - r.info.start_time) / 1000.0  # wall time of the run
            rows.append(row)
        page_token = page.token
        if not page_token:
            break
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(table):
        table["k"] = table["k"].astype("Int64")
        table = table.sort_values(
            ["accuracy", "train_seconds"], ascending=[False, True], na_position="last", kind="mergesort"
        ).reset_index(drop=True)
        table = _group_children(table)
    return table, exp.experiment_id, uri


def _group_children(table):
    """Each child run moved right after its parent (children keep their best-first order); nested searches
    nest. A child whose parent is not in the table stays in place."""
    ids = set(table["run_id"])
    children: dict[str, list[int]] = {}
    top: list[int] = []
    for i, (parent, run_id) in enumerate(zip(table["parent_run_id"], table["run_id"])):
        if isinstance(parent, str) and parent in ids and parent != run_id:
            children.setdefault(parent, []).append(i)
        else:
            top.append(i)
    order: list[int] = []
    seen: set[int] = set()

    def visit(i: int) -> None:
        if i in seen:  # a parent loop (hand-edited tags): each run once
            return
        seen.add(i)
        order.append(i)
        for j in children.get(table["run_id"].iat[i], ()):
            visit(j)

    for i in top:
        visit(i)
    order += [i for i in range(len(table)) if i not in seen]
    return table.iloc[order].reset_index(drop=True)


def format_table(table) -> str:
    """The table as fixed-width text (what ``foveate compare`` prints)."""
    if len(table) == 0:
        return "(no runs)"
    table = table.copy()
    ids = set(table["run_id"])
    depth = {}
    for run_id, parent in zip(table["run_id"], table["parent_run_id"]):  # parents come before their children
        depth[run_id] = depth.get(parent, -1) + 1 if isinstance(parent, str) and parent in ids else 0
    table["run_name"] = [
        "  " * (depth[r] - 1) + CHILD_MARK + str(n) if depth[r] else n
        for r, n in zip(table["run_id"], table["run_name"])
    ]
    shown = table[
        [
            "run_name",
            "status",
            "operator",
            "k",
            "aggregator",
            "accuracy",
            "auc",
            "train_seconds",
            "patches_per_second",
            "peak_memory_mb",
        ]
    ].copy()
    shown.columns = [
        "run",
        "status",
        "operator",
        "K",
        "aggregator",
        "accuracy",
        "AUC",
        "train s",
        "patches/s",
        "peak MB",
    ]
    width = max(len(str(n)) for n in shown["run"])
    return shown.to_string(
        index=False,
        na_rep="-",
        float_format=lambda v: f"{v:.4g}",
        formatters={"run": lambda v: f"{v:<{width}}"},  # left-aligned, so a child's mark lines up under its parent
        justify="left",
    )


def plot_accuracy_vs_time(table, path: str | Path, *, title: str = "") -> Path:
    """Scatter of accuracy against train time, one labelled point per run (runs missing either are skipped)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = table.dropna(subset=["accuracy", "train_seconds"]) if len(table) else table
    for _, row in ok.iterrows():
        k = row["k"]
        label = f"{row['operator'] or '?'} K={'?' if pd.isna(k) else int(k)} {row['aggregator'] or '?'}"
        ax.scatter(row["train_seconds"], row["accuracy"], s=36)
        ax.annotate(
            label, (row["train_seconds"], row["accuracy"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    ax.set_xlabel("train time (s)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "accuracy vs train time", fontsize=9)
    if len(ok) == 0:
        ax.text(0.5, 0.5, "no runs with accuracy and train time", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "experiment"


def compare(
    experiment: str,
    *,
    out_dir: str | Path | None = ".",
    tracking_uri: str | None = None,
    include_score_runs: bool = False,
) -> CompareResult:
    """Build the table, write ``<out_dir>/compare_<experiment>.csv`` and ``..._accuracy_vs_time.png``.

    Args:
        experiment: MLflow experiment name.
        out_dir: where to write the CSV and PNG (None: write nothing).
        tracking_uri: default ``$MLFLOW_TRACKING_URI``.
        include_score_runs: keep batch-scoring runs.
    """
    table, exp_id, uri = runs_table(experiment, tracking_uri=tracking_uri, include_score_runs=include_score_runs)
    csv_path = png_path = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"compare_{_safe_name(experiment)}"
        csv_path = out / f"{stem}.csv"
        tmp = csv_path.with_name(csv_path.name + ".tmp")
        table.to_csv(tmp, index=False)
        tmp.replace(csv_path)
        png_path = plot_accuracy_vs_time(
            table, out / f"{stem}_accuracy_vs_time.png", title=f"experiment {experiment}: accuracy vs train time"
        )
    return CompareResult(table, csv_path, png_path, exp_id, uri)


@dataclass(frozen=True)
class Promotion:
    """What :func:`promote` did: ``alias`` now points at ``name`` version ``version`` (from run ``run_id``,
    whose ``metric`` was ``value``)."""

    name: str
    version: str
    alias: str
    run_id: str
    metric: str
    value: float


def promote(
    experiment: str, alias: str, by: str, *, tracking_uri: str | None = None, minimize: bool = False
) -> list[Promotion]:
    """Point registry alias ``alias`` at the model version logged by the experiment's best finished training
    run by metric ``by`` (largest; smallest with ``minimize``), for every registered model that run has a
    version of (``tracking.registered_model`` when training). Each promoted version is tagged
    ``foveate.promoted_by = "<metric>=<value> in <experiment>"``.

    Raises:
        ValueError: bad alias/metric, no finished run with the metric, or the best run has no registered
            model version.
    """
    if not isinstance(alias, str) or not alias.strip() or alias.strip().lower() == "latest" or "/" in alias:
        raise ValueError(f"--promote takes an alias name (letters, digits, - or _; not 'latest'), got {alias!r}")
    if not isinstance(by, str) or not by:
        raise ValueError(f"--by takes a metric name (e.g. val_auc, val_accuracy), got {by!r}")
    client, exp, _ = _experiment(experiment, tracking_uri)
    runs = [
        r
        for r in client.search_runs(
            [exp.experiment_id], filter_string="attributes.status = 'FINISHED'", max_results=5000
        )
        if r.data.tags.get("foveate.stage") != "score" and by in r.data.metrics
    ]
    if not runs:
        raise ValueError(f"no finished training run in experiment {experiment!r} has a metric {by!r}")
    best = (min if minimize else max)(runs, key=lambda r: r.data.metrics[by])
    value = float(best.data.metrics[by])
    versions = client.search_model_versions(f"run_id = '{best.info.run_id}'")
    if not versions:
        raise ValueError(
            f"the best run {best.info.run_id} ({by} = {value:g}) has no registered model version; train with "
            f"--set tracking.registered_model=NAME (or register its model: mlflow.register_model)"
        )
    done = []
    for v in versions:
        client.set_registered_model_alias(v.name, alias, v.version)
        client.set_model_version_tag(v.name, v.version, "foveate.promoted_by", f"{by}={value:g} in {experiment}")
        done.append(Promotion(v.name, str(v.version), alias, best.info.run_id, by, value))
        log.info("models:/%s@%s -> version %s (run %s, %s = %g)", v.name, alias, v.version, best.info.run_id, by, value)
    return done


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--experiment", required=True, help="MLflow experiment name (e.g. the train config's tracking.experiment)"
    )
    parser.add_argument("--out", default=".", help="directory for compare_<experiment>.csv and the PNG (default .)")
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI; sqlite:///... or http://host:port)",
    )
    parser.add_argument("--include-score-runs", action="store_true", help="also list batch-scoring runs")
    parser.add_argument(
        "--promote",
        metavar="ALIAS",
        default=None,
        help="point this registry alias (e.g. champion) at the model version of the best run by --by",
    )
    parser.add_argument("--by", metavar="METRIC", default="val_auc", help="metric for --promote (default val_auc)")
    parser.add_argument("--minimize", action="store_true", help="with --promote: the smallest --by is best")


def run(args: argparse.Namespace) -> int:
    res = compare(
        args.experiment, out_dir=args.out, tracking_uri=args.tracking_uri, include_score_runs=args.include_score_runs
    )
    print(f"experiment {args.experiment!r} (id {res.experiment_id}) at {res.tracking_uri}: {len(res.table)} run(s)")
    print(format_table(res.table))
    print(f"table: {res.csv_path}")
    print(f"plot:  {res.png_path}")
    if args.promote:
        for p in promote(
            args.experiment, args.promote, args.by, tracking_uri=args.tracking_uri, minimize=args.minimize
        ):
            print(f"models:/{p.name}@{p.alias} -> version {p.version} (run {p.run_id}, {p.metric} = {p.value:g})")
    return 0
