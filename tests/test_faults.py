"""Faults a careful (or adversarial) user meets: wrong config values, outputs that cannot be written, resuming a
predictions file with another model, exit codes that must tell the truth. Each case failed silently (or late,
after Ray and MLflow had started) before it was fixed; numbers refer to the cases of the reliability issue.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_score import CLASSES, _model_config
from test_score import data as data  # the module fixture: 4 good stores, 3 broken ones, a tiny model

from pipeline.config import ConfigError, load_config
from pipeline.train import TrainConfig

# ----------------------------------------------------------------------------------- 6: config values


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.weight_decay=-5", "optim.weight_decay"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.grad_clip=-1", "optim.grad_clip"),
        ("schedule.sigma_start=inf", "schedule.sigma_start"),
        ("tracking.run_name=../../../escape", "tracking.run_name"),
        ("tracking.run_name=a/b", "tracking.run_name"),
        ("tracking.run_name=..", "tracking.run_name"),
        ("tracking.registered_model=", "tracking.registered_model"),
    ],
)
def test_bad_config_values_fail_at_load_time(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(TrainConfig, None, ["data.stores=/x", override])


def test_k_above_the_grid_fails_before_ray_or_mlflow(tmp_path, data):
    """model.k larger than a slide's patch grid: a ConfigError naming the slide, before any MLflow run or Ray."""
    import mlflow
    import ray

    from pipeline.train import train

    labels = tmp_path / "labels.csv"
    pd.DataFrame({"slide_id": ["s0", "s1", "s2", "s3"], "label": ["a", "b", "a", "b"]}).to_csv(labels, index=False)
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"data.stores={data['stores']}",
            f"data.labels={labels}",
            "model.geometry.patch_size=32",
            "model.geometry.stride=32",
            "model.selection.k=500",
            f"workdir={tmp_path / 'work'}",
            "tracking.experiment=k-too-big",
        ],
    )
    was_running = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"model.selection.k: got 500,.* slide s\d \(400 x 300 px .* has 130"):
        train(cfg)
    assert ray.is_initialized() == was_running
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_experiment_by_name("k-too-big") is None
    assert not (tmp_path / "work" / "train").exists()


def test_run_folder_of_an_experiment_with_a_slash_stays_in_the_workdir(tmp_path):
    from pipeline.train import _run_dir

    cfg = load_config(TrainConfig, None, ["data.stores=/x", f"workdir={tmp_path}", "tracking.experiment=../../a/b"])
    run_dir = _run_dir(cfg, resume=False)
    run_dir = Path(run_dir)  # (a local workdir: a path; an object-storage workdir gives a URL)
    assert run_dir.parent == (tmp_path / "train").resolve() and run_dir.name.startswith("_.._a_b-")


# ----------------------------------------------------------------------------------- 6: ingest --out


def test_ingest_out_that_cannot_hold_stores(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.ingest import ingest

    slides = tmp_path / "slides"
    slides.mkdir()
    (tmp_path / "afile").write_text("x")
    # a URL is object storage (never a local folder named after it); one whose scheme has no filesystem fails
    with pytest.raises(ValueError, match="'nosuchfs://bucket/stores': cannot open its filesystem"):
        ingest([slides], "nosuchfs://bucket/stores")
    assert not Path("nosuchfs:").exists()
    with pytest.raises(ValueError, match="is a file"):
        ingest([slides], tmp_path / "afile")
    # an empty input folder: a clear error, exit code 2, no manifest claimed
    assert main(["ingest", str(slides), "--out", str(tmp_path / "stores")]) == 2
    assert not (tmp_path / "stores" / "manifest.csv").exists()
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="not writable|cannot create"):
            ingest([slides], ro / "stores")


# ----------------------------------------------------------------------------------- 3, 4: score


def _other_model(root: Path) -> Path:
    from operators.checkpoint import save_checkpoint
    from operators.model import FoveateModel

    torch.manual_seed(123)
    return save_checkpoint(root / "other.pt", FoveateModel(_model_config()).eval(), _model_config(), CLASSES)


@pytest.mark.slow
@pytest.mark.e2e
def test_score_exit_code_and_resume_identity(data, ray_local, tmp_path, capsys):
    """4 good + 3 broken stores: exit 1 (0 with --allow-failures); resuming the file with another model is
    refused, --overwrite replaces it, the same model resumes."""
    from pipeline.cli import main
    from pipeline.predictions import read_metadata
    from pipeline.score import score

    out = tmp_path / "p.parquet"
    args = ["score", "--model", str(data["ckpt"]), "--stores", str(data["stores"]), "--out", str(out)]
    args += ["--no-mlflow", "--no-heatmaps", "--workers", "1"]
    assert main(args) == 1
    assert "3 of 7 slide(s) have error rows" in capsys.readouterr().out
    meta = read_metadata(out)
    assert meta["foveate.model"] == str(data["ckpt"]) and len(meta["foveate.model_digest"]) == 64
    assert main([*args, "--allow-failures"]) == 0  # resumed (same model): only the 3 broken ones again
    other = _other_model(tmp_path)
    with pytest.raises(ValueError, match="holds predictions of another model .* --overwrite"):
        score(str(other), data["stores"], out, workers=1, experiment=None, heatmaps=False)
    res = score(str(other), data["stores"], out, workers=1, experiment=None, heatmaps=False, overwrite=True)
    assert res.skipped == 0 and res.scored == 4
    assert read_metadata(out)["foveate.model"] == str(other)
    assert set(res.table["model"]) == {str(other)}
    # the same weights under another path are the same model (the digest, not the path, decides)
    copy = tmp_path / "copy.pt"
    copy.write_bytes(Path(other).read_bytes())
    res = score(str(copy), data["stores"], out, workers=1, experiment=None, heatmaps=False)
    assert res.skipped == 4


# ----------------------------------------------------------------------------------- 2: CSV manifests


def _csv(path: Path, rows: list[dict]) -> Path:
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_csv_manifest_faults(tmp_path):
    from pipeline.ingest_inputs import discover_inputs

    s = tmp_path / "s"
    s.mkdir()
    (s / "x.svs").write_bytes(b"not a slide")
    (s / "y.svs").write_bytes(b"not a slide either")
    # reserved column names are refused, naming them
    bad = _csv(tmp_path / "reserved.csv", [{"path": "s/x.svs", "slide_id": "A", "label": "a"}])
    with pytest.raises(ValueError, match=r"\['slide_id'\] are written by foveate ingest itself"):
        discover_inputs([bad])
    # a blank path fails its own row instead of walking the CSV's folder
    blank = _csv(tmp_path / "blank.csv", [{"path": "s/x.svs", "label": "a"}, {"path": "", "label": "b"}])
    found = discover_inputs([blank])
    assert len(found) == 2 and found[0].source.endswith("x.svs")
    assert "blank path in blank.csv line 3" in found[1].path and found[1].carried == {"label": "b"}
    # one slide written two ways is one slide with one id
    two_ways = _csv(
        tmp_path / "twoways.csv", [{"path": "s/x.svs", "label": "a"}, {"path": "./s/../s/x.svs", "label": "a"}]
    )
    assert len(discover_inputs([two_ways])) == 1
    assert (
        discover_inputs([s / "x.svs"])[0].slide_id
        == discover_inputs([tmp_path / "s" / ".." / "s" / "x.svs"])[0].slide_id
    )
    # ... also through a symlink
    (tmp_path / "link.svs").symlink_to(s / "x.svs")
    assert discover_inputs([tmp_path / "link.svs"])[0].slide_id == discover_inputs([s / "x.svs"])[0].slide_id
    # the same slide with two labels: refused, naming both
    conflict = _csv(tmp_path / "conflict.csv", [{"path": "s/x.svs", "label": "a"}, {"path": "./s/x.svs", "label": "b"}])
    with pytest.raises(ValueError, match=r"twice with different values of \['label'\]: \['a'\] and \['b'\]"):
        discover_inputs([conflict])


@pytest.mark.slow
@pytest.mark.e2e
def test_blank_csv_row_fails_its_own_row_in_ingest(tmp_path, ray_local, openslide_fixtures):
    """End to end: a CSV with one real slide and a blank path: the slide is ingested, the blank row fails with
    a reason naming the CSV line, nothing else is ingested."""
    from pipeline.ingest import ingest

    src = next(p for p in sorted(openslide_fixtures.rglob("*.tiff")) if p.stat().st_size < 5_000_000)
    (tmp_path / "other.svs").write_bytes(b"must not be ingested")  # in the CSV's folder
    manifest = _csv(tmp_path / "m.csv", [{"path": str(src), "label": "a"}, {"path": " ", "label": "b"}])
    res = ingest([manifest], tmp_path / "stores", workers=1)
    by_label = {r["label"]: r for r in res.rows}
    assert set(by_label) == {"a", "b"}
    assert by_label["b"]["status"] == "failed" and "blank path in m.csv line 3" in by_label["b"]["error"]


# ----------------------------------------------------------------------------------- 3: damaged stores


def test_missing_chunks_and_corrupt_metadata_are_never_read_as_white(tmp_path, capsys):
    """Delete a store's level-0 chunk files / corrupt its zarr.json: opening it fails naming the store,
    foveate verify reports it (exit 1), the scoring workers give an error row, training refuses before Ray."""
    import shutil

    from test_score import _slide

    from operators.checkpoint import checkpoint_dict
    from pipeline.cli import main
    from pipeline.train import _check_grids
    from workers.scoring import ScorerWorker
    from workers.store import SlideStore, verify_store, write_store_from_array

    stores = tmp_path / "stores"
    for i in range(3):
        write_store_from_array(stores / f"s{i}.zarr", _slide(i), tile_size=64, min_size=64)
    assert all(verify_store(p) == [] for p in stores.iterdir())
    assert main(["verify", str(stores)]) == 0
    # s1: level-0 chunks gone; s2: a level-0 chunk added that the marker does not list; s0 stays whole
    shutil.rmtree(stores / "s1.zarr" / "0" / "c")
    chunk = next(p for p in (stores / "s2.zarr" / "0").rglob("*") if p.is_file() and p.name != "zarr.json")
    shutil.copy(chunk, chunk.with_name("99"))
    capsys.readouterr()
    assert main(["verify", str(stores)]) == 1
    out = capsys.readouterr().out
    assert "s0: ok" in out and "s1: damaged — level 0: 0 chunk object(s) in the store" in out
    assert "s2: damaged — level 0:" in out and "3 store(s)" in out
    with pytest.raises(ValueError, match=r"s1.zarr is damaged: level 0: 0 chunk object\(s\) in the store"):
        SlideStore(stores / "s1.zarr")
    torch.manual_seed(0)
    from operators.model import FoveateModel

    ckpt = checkpoint_dict(FoveateModel(_model_config()).eval(), _model_config(), CLASSES)
    item = ScorerWorker(ckpt, device="cpu").score_one("s1", str(stores / "s1.zarr"))
    assert item["status"] == "error" and "damaged" in item["error"]

    class Rec:
        slide_id, store = "s1", str(stores / "s1.zarr")

    with pytest.raises(ValueError, match="slide s1: cannot open its store .* damaged"):
        _check_grids(_model_config(), [Rec()])
    # a corrupt zarr.json names the store
    (stores / "s0.zarr" / "zarr.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"s0.zarr is damaged: unreadable metadata"):
        SlideStore(stores / "s0.zarr")


# ----------------------------------------------------------------------------------- 1: one writer per output


def test_a_second_writer_is_refused_and_a_dead_holder_releases(tmp_path, caplog):
    import signal
    import subprocess
    import sys
    import time

    from pipeline.cli import main
    from pipeline.locks import OutputLocked, lock_path, output_lock

    out = tmp_path / "stores"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); from pipeline.locks import output_lock\n"
            "with output_lock(sys.argv[2], 'foveate ingest'):\n    print('locked', flush=True); time.sleep(600)",
            str(Path(__file__).resolve().parents[1]),
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputLocked, match=rf"another foveate ingest \(pid {holder.pid}, host .*\) is writing"):
            with output_lock(out, "foveate ingest"):
                pass
        # through the CLI: exit 2 with the message, before any slide is looked at or Ray starts
        slides = tmp_path / "slides"
        slides.mkdir()
        caplog.clear()
        assert main(["ingest", str(slides), "--out", str(out)]) == 2
        assert f"another foveate ingest (pid {holder.pid}" in caplog.text
        # the same for a predictions file
        pred = tmp_path / "p.parquet"
        with output_lock(pred, "foveate score"):
            with pytest.raises(OutputLocked, match="another foveate score"):
                with output_lock(pred, "foveate score"):
                    pass
        assert lock_path(pred).name == ".p.parquet.lock"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 released it: the next writer takes it at once
    t = time.monotonic()
    with output_lock(out, "foveate ingest"):
        pass
    assert time.monotonic() - t < 1


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_two_real_ingests_with_overwrite_into_one_out(tmp_path):
    """Case 1 as the user met it: two `foveate ingest --overwrite` processes started together on one --out. One
    takes the lock and completes; the other exits 2 naming the holder, having written nothing; every store that
    carries the completion marker verifies, and the manifest has each slide exactly once."""
    import subprocess
    import sys

    from pipeline.synthetic import synth_archive

    slides, out = tmp_path / "slides", tmp_path / "stores"
    synth_archive(slides, count=3, size=2000, seed=0)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "pipeline", "ingest", str(slides / "labels.csv"), "--out", str(out), "--overwrite"]
    cmd += ["--workers", "1"]
    repo = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs.append(subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], [(r[0], r[2][-2000:]) for r in results]
    (winner,) = [p for p, r in zip(procs, results) if r[0] == 0]
    (loser,) = [r for r in results if r[0] == 2]
    assert f"another foveate ingest (pid {winner.pid}" in loser[2], loser[2][-2000:]
    verify = subprocess.run(
        [sys.executable, "-m", "pipeline", "verify", str(out)], cwd=repo, env=env, capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    man = pd.read_parquet(out / "manifest.parquet")
    assert len(man) == 3 and man["slide_id"].is_unique and set(man["status"]) == {"ok"}, man
    assert len(list(out.glob("*.zarr"))) == 3


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_no_ray_process_outlives_a_killed_command(tmp_path):
    """Case 5: `kill -9` of a command that started an in-process Ray; within 15 s none of the Ray processes it
    started is left (without the watcher of pipeline/reaper.py, Ray 2.60's dashboard and runtime-env agents
    keep running)."""
    import signal
    import subprocess
    import sys
    import time

    from pipeline.reaper import alive, ray_descendants

    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); import ray; from pipeline.runtime import init_ray\n"
            "init_ray(num_cpus=1); ray.get(ray.remote(lambda: 1).remote()); print('up', flush=True)\n"
            "time.sleep(600)",
            repo,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
    )
    try:
        assert child.stdout.readline().strip() == "up"
        started = ray_descendants(child.pid)
        names = sorted(Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in started)
        assert any("DashboardAgent" in n for n in names) and any("gcs_server" in n for n in names), names
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 15
    while any(alive(p, t) for p, t in started.items()) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p, t in started.items() if alive(p, t)]
    assert not left, f"still running 15 s after kill -9: {left}"


# ----------------------------------------------------------------------------------- 4: resolution identity


def test_model_records_its_mpp_and_scoring_checks_it(tmp_path, caplog):
    """A model trained at 0.5 µm/px scoring a 0.25 µm/px store: a warning naming both; with strict_mpp an
    error item. Within 10 % nothing happens."""
    import dataclasses

    from test_score import _slide

    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.scoring import ScorerWorker
    from workers.store import write_store_from_array

    with pytest.raises(ConfigError, match="model.mpp"):
        dataclasses.replace(_model_config(), mpp=-1.0)
    cfg = dataclasses.replace(_model_config(), mpp=0.5)
    torch.manual_seed(0)
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, CLASSES)
    near = write_store_from_array(tmp_path / "near.zarr", _slide(0), mpp=(0.52, 0.52), tile_size=64, min_size=64)
    far = write_store_from_array(tmp_path / "far.zarr", _slide(1), mpp=(0.25, 0.25), tile_size=64, min_size=64)
    caplog.clear()
    lenient = ScorerWorker(ckpt, device="cpu")
    assert lenient.score_one("near", str(near.path))["status"] == "ok" and "mpp" not in caplog.text
    assert lenient.score_one("far", str(far.path))["status"] == "ok"
    assert "far: store mpp 0.25 differs from the model's training mpp 0.5" in caplog.text
    strict = ScorerWorker(ckpt, device="cpu", strict_mpp=True)
    item = strict.score_one("far", str(far.path))
    assert item["status"] == "error" and "re-ingest at --mpp 0.5" in item["error"]
    assert strict.score_one("near", str(near.path))["status"] == "ok"


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_sigterm_ends_the_mlflow_run_as_failed(data, tmp_path):
    """`kill` (SIGTERM) of a scoring command mid-run: the command ends through its finally blocks, so its MLflow
    run is FAILED rather than RUNNING forever, and the exit code is not 0."""
    import signal
    import subprocess
    import sys
    import time

    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "score", "--model", str(data["ckpt"]), "--stores", str(data["stores"])]
        + ["--out", str(tmp_path / "p.parquet"), "--experiment", "sigterm", "--no-heatmaps", "--workers", "1"],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = mlflow.MlflowClient(uri)
    deadline = time.monotonic() + 120
    run = None
    while run is None and time.monotonic() < deadline and proc.poll() is None:
        exp = client.get_experiment_by_name("sigterm") if (tmp_path / "mlflow.db").exists() else None
        runs = client.search_runs([exp.experiment_id]) if exp else []
        run = runs[0] if runs and runs[0].info.status == "RUNNING" else None
        time.sleep(0.2)
    assert run is not None, "the scoring run never started"
    # signal once the actors are up (the log line after ray.init): a SIGTERM that lands inside ray.init meets Ray's
    # own handler, whose sys.exit(15) is lost when it fires in an at-fork callback (CPython prints "Exception
    # ignored in _releaseLock" and the command scores on; seen once in CI) — a window this test cannot control
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "pipeline.score_stages: scoring" in line:
            break
    assert proc.poll() is None, "the scoring command ended before it could be signalled:\n" + "".join(seen)[-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    # 130: our handler (KeyboardInterrupt, pipeline.interrupt); 15: Ray's driver handler (sys.exit(15)) if the
    # signal lands inside ray.init before we re-install ours (kept accepted, though the wait above avoids it); -2: CPython ends a process by SIGINT (the shell
    # shows 130, as for Ctrl-C) when the KeyboardInterrupt passed through code run by exec(<string>) (dataclass,
    # namedtuple and SQLAlchemy set-up during an import), even though our handler caught it: the finally blocks
    # still ran, which the FAILED status below checks
    assert proc.returncode in (130, 15, -signal.SIGINT), err[-2000:]
    assert client.get_run(run.info.run_id).info.status == "FAILED"


class _Foreign:  # a class that weights_only=True refuses to unpickle
    pass


def test_a_pickled_pt_file_is_refused_without_advice_to_unpickle(tmp_path):
    import pickle
    from collections import OrderedDict

    from operators.checkpoint import load_checkpoint

    bad = tmp_path / "foreign.pt"
    torch.save({"model": _Foreign(), "d": OrderedDict()}, bad)
    with pytest.raises(ValueError, match="is not a foveate model checkpoint") as info:
        load_checkpoint(bad)
    assert "weights_only=False" not in str(info.value) and "never unpickles" in str(info.value)
    (tmp_path / "junk.pt").write_bytes(pickle.dumps([1, 2]) + b"junk")
    with pytest.raises(ValueError, match="is not a foveate model checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
