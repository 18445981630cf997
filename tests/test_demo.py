"""`foveate demo` (the README's main command) end to end on embedded defaults, at a tiny size."""

import pandas as pd
import pytest

from pipeline.demo import demo


@pytest.mark.slow
@pytest.mark.ray
def test_demo_end_to_end_tiny(tmp_path):
    s = demo(
        tmp_path / "demo", count=6, size="2048", epochs=1, workers=2, overrides=["model.num_samples=8", "model.k=2"]
    )
    preds = pd.read_parquet(s["predictions"])
    manifest = pd.read_parquet(tmp_path / "demo" / "stores" / "manifest.parquet")
    # every synthetic slide was ingested, and scored exactly once with the model trained in this run
    assert (manifest["status"] == "ok").sum() == 6
    assert sorted(preds["slide_id"]) == sorted(manifest["slide_id"])
    assert (preds["status"] == "ok").all()
    assert s["run_id"][:8] in s["predictions"]
    assert set(preds["prediction"].astype(str)) <= {"0", "1"}
    # the comparison table has this run
    table = pd.read_csv(next((tmp_path / "demo" / "compare").glob("*.csv")))
    assert len(table) == 1
    # a second demo run in the same folder reuses slides and stores, trains a new model and scores afresh
    s2 = demo(
        tmp_path / "demo", count=6, size="2048", epochs=1, workers=2, overrides=["model.num_samples=8", "model.k=2"]
    )
    assert s2["run_id"] != s["run_id"] and s2["slides_scored"] == 6
    # other demo slides (another seed) in the same folder: a clear error, nothing reused silently
    with pytest.raises(ValueError, match="another --workdir"):
        demo(tmp_path / "demo", count=6, size="2048", epochs=1, workers=2, seed=1)
