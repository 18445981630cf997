"""benchmarks/tune.py's own parts: the search sees the training slides only; a search's row adds up its trials."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tune as bench


def test_training_labels_hold_the_training_slides_only(tmp_path):
    split = SimpleNamespace(
        class_names=["neg", "pos"],
        train=[SimpleNamespace(slide_id="a", target=0), SimpleNamespace(slide_id="b", target=1)],
        test=[SimpleNamespace(slide_id="held", target=1)],
    )
    path = bench.training_labels(split, tmp_path / "x" / "train.csv")
    assert path.read_text().splitlines() == ["slide_id,label", "a,neg", "b,pos"]


def test_search_row_counts_epochs_states_and_cpu_hours():
    rows = [
        SimpleNamespace(number=1, values={"optim.lr": 0.01}, state="completed", epochs=4, metric=0.9),
        SimpleNamespace(number=2, values={"optim.lr": 0.1}, state="early-stopped", epochs=1, metric=0.5),
        SimpleNamespace(number=3, values={"optim.lr": 0.2}, state="early-stopped", epochs=2, metric=0.6),
    ]
    result = SimpleNamespace(rows=rows, best=rows[0], best_config="best.yaml")
    row = bench.search_row(result, wall=1800.0, cpus_held=2.0)
    assert row["trial_epochs"] == 7 and row["states"] == {"completed": 1, "early-stopped": 2}
    assert row["cpu_hours_held"] == 1.0 and row["best"] == {"values": {"optim.lr": 0.01}, "metric": 0.9}
    assert [t["number"] for t in row["trials"]] == [1, 2, 3]
    assert bench.median([0.5, None, 0.7, 0.9]) == 0.7 and bench.median([None]) is None
