"""`foveate demo` (the README's main command) end to end on embedded defaults, at a tiny size: its output on the
terminal (foveate's lines and the summary, none of Ray's or MLflow's internals) and what it writes."""

import json
import re

import pandas as pd
import pytest

from pipeline.cli import main
from pipeline.demo import demo

TINY = ["model.selection.num_samples=8", "model.selection.k=2"]

# what Ray and MLflow print on their own: C++ log lines (Ray's "[date time,ms E pid tid] file.cc:N:" and glog's
# "E1126 16:15:45.167 ..."), Ray Train's controller warnings, worker output forwarded to the driver
# ("(TrainController pid=1)", "(raylet)"), Ray's auth notice, MLflow's store set-up and download bars
RAY_OR_MLFLOW = re.compile(
    r"core_worker\.cc|\.cc:\d+|Failed to query Ray Train Controller|\(raylet\)|\((\w+ )?pid=\d+\)"
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\]|^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+"
    r"|Token authentication|INFO mlflow|Creating initial MLflow|Downloading artifacts",
    re.M,
)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_demo_end_to_end_tiny(tmp_path, capfd):
    wd = tmp_path / "demo"
    argv = ["demo", "--workdir", str(wd), "--count", "6", "--size", "2048", "--epochs", "1", "--workers", "2"]
    assert main([*argv, *(a for kv in TINY for a in ("--set", kv))]) == 0
    out, err = capfd.readouterr()
    # the terminal: the summary and foveate's own lines; Ray's and MLflow's messages went to the log file
    assert "foveate demo finished" in out and "validation      val_accuracy=" in out, out
    assert f"Ray/MLflow internals: {wd / 'foveate.log'}" in err
    assert "slides ingested: 6/6" in err and "slides scored: 6/6" in err and "train: " in err
    noise = [m.group(0) for m in RAY_OR_MLFLOW.finditer(out + err)]
    assert not noise, (noise, err[-4000:])
    log_text = (wd / "foveate.log").read_text()
    assert "Ray workers' logs:" in log_text and "Started a local Ray instance" in log_text

    preds_path = next(wd.glob("predictions-*.parquet"))
    run_id = re.search(r"run ([0-9a-f]{32})", out).group(1)
    preds = pd.read_parquet(preds_path)
    manifest = pd.read_parquet(wd / "stores" / "manifest.parquet")
    # synth's statement travelled with the stores (ingest carried it), and the demo trained with it
    assert json.loads((wd / "stores" / "archive.json").read_text())["label_symmetry"] == "dihedral"
    assert "states label_symmetry" not in err
    # every synthetic slide was ingested, and scored exactly once with the model trained in this run
    assert (manifest["status"] == "ok").sum() == 6
    assert sorted(preds["slide_id"]) == sorted(manifest["slide_id"])
    assert (preds["status"] == "ok").all()
    assert run_id[:8] in preds_path.name
    assert set(preds["prediction"].astype(str)) <= {"0", "1"}
    # the comparison table has this run
    table = pd.read_csv(next((wd / "compare").glob("*.csv")))
    assert len(table) == 1
    # a second demo run in the same folder reuses slides and stores, trains a new model and scores afresh
    s2 = demo(wd, count=6, size="2048", epochs=1, workers=2, overrides=TINY)
    assert s2["run_id"] != run_id and s2["slides_scored"] == 6
    # other demo slides (another seed) in the same folder: a clear error, nothing reused silently
    with pytest.raises(ValueError, match="another --workdir"):
        demo(wd, count=6, size="2048", epochs=1, workers=2, seed=1)
