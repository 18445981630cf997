"""foveate ingest on real Ray: the CLI, bad inputs, the manifest, re-runs, and resume after a killed actor."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main as cli_main
from pipeline.ingest_inputs import discover_inputs
from pipeline.ingest_manifest import read_manifest
from workers.store import SlideStore, is_complete
from workers.tiler import PROGRESS_DIR, IngestOptions, Tiler


@pytest.fixture(scope="module")
def synth_svs(tmp_path_factory):
    from pipeline.synthetic import write_synthetic_slide

    p = tmp_path_factory.mktemp("synth") / "big.svs"
    write_synthetic_slide(p, width=2048, height=2048, label=1, seed=5, fmt="svs", tile_size=256)
    return p


@pytest.mark.slow
@pytest.mark.e2e
def test_cli_bad_inputs_fail_their_own_rows_and_the_rest_complete(ray_own, tmp_path, openslide_fixtures, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "zero.svs").write_bytes(b"")
    (bad / "truncated.svs").write_bytes((openslide_fixtures / "small.svs").read_bytes()[:1000])
    (bad / "notes.tiff").write_text("not an image\n")
    import tifffile

    tifffile.imwrite(
        bad / "nompp.tiff", np.full((300, 400, 3), 180, np.uint8), tile=(64, 64), photometric="rgb", metadata=None
    )
    csv = tmp_path / "slides.csv"
    csv.write_text(
        "path,label\n"
        f"{openslide_fixtures / 'boxes.tiff'},1\n"
        f"{openslide_fixtures / 'small.svs'},0\n"
        f"{openslide_fixtures / 'boxes_0.dcm'},1\n"
        f"{openslide_fixtures / 'unopenable.tiff'},0\n"
        f"{openslide_fixtures / 'unreadable.svs'},1\n"
        f"{tmp_path / 'missing.svs'},0\n"
    )
    out = tmp_path / "stores"
    rc = cli_main(
        ["ingest", str(csv), str(bad), "--out", str(out), "--workers", "2", "--tile-size", "64", "--min-size", "64"]
    )
    assert rc == 1
    printed = capsys.readouterr().out
    assert "4 ok, 0 skipped, 6 failed" in printed
    m = read_manifest(out).set_index("source")
    assert len(m) == 10
    fx = str(openslide_fixtures)
    nompp = str(bad / "nompp.tiff")
    assert set(m.loc[m.status == "ok"].index) == {f"{fx}/boxes.tiff", f"{fx}/small.svs", fx, nompp}
    assert bool(m.loc[nompp, "mpp_missing"]) and m.loc[nompp, "mpp"] != m.loc[nompp, "mpp"]  # flagged, NaN
    assert not bool(m.loc[f"{fx}/small.svs", "mpp_missing"])
    reasons = {Path(s).name: e for s, e in m.loc[m.status == "failed", "error"].items()}
    assert reasons["zero.svs"].startswith("empty file (0 bytes)")
    assert "not a slide OpenSlide can open" in reasons["truncated.svs"]
    assert "not a slide OpenSlide can open" in reasons["notes.tiff"]
    assert "Unsupported TIFF compression" in reasons["unopenable.tiff"]
    assert "cannot read pixels" in reasons["unreadable.svs"] and "Bogus marker" in reasons["unreadable.svs"]
    assert reasons["missing.svs"].startswith("no such file")
    assert all("\n" not in e for e in reasons.values())
    assert m.loc[f"{fx}/boxes.tiff", "label"] == "1" and m.loc[fx, "label"] == "1"  # carried through
    assert m.loc[f"{fx}/boxes.tiff", "width"] == 300 and m.loc[f"{fx}/boxes.tiff", "height"] == 250
    assert m.loc[f"{fx}/small.svs", "mpp"] == pytest.approx(0.499)
    assert (out / "manifest.csv").is_file()
    # no directory that looks like a complete store for a failed slide; each ok store is complete
    for sid, status in zip(m.slide_id, m.status):
        d = out / f"{sid}.zarr"
        assert is_complete(d) == (status == "ok")
        if status == "failed":
            assert not d.exists()
    # a re-run skips complete stores and keeps earlier rows (merge)
    rc = cli_main(
        ["ingest", f"{fx}/boxes.tiff", "--out", str(out), "--workers", "1", "--tile-size", "64", "--min-size", "64"]
    )
    assert rc == 0
    m2 = read_manifest(out).set_index("source")
    assert len(m2) == 10 and m2.loc[f"{fx}/boxes.tiff", "status"] == "skipped"
    assert m2.loc[f"{fx}/boxes.tiff", "width"] == 300
    assert m2.loc[f"{fx}/small.svs", "status"] == "ok"
    # --allow-failures: the same failures, exit 0
    capsys.readouterr()
    rc = cli_main(
        ["ingest", str(bad), "--out", str(out), "--workers", "1", "--tile-size", "64", "--min-size", "64"]
        + ["--allow-failures"]
    )
    assert rc == 0 and "3 failed" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_actor_mid_slide_then_rerun_resumes_with_identical_arrays(ray_own, tmp_path, synth_svs):
    from pipeline.ingest import ingest

    opts = IngestOptions(
        tile_size=256, min_size=256, region_tiles=2, codec="zstd"
    )  # the decoding path: regions write levels 0-1
    out = tmp_path / "stores"

    # run 1: every actor that writes stage-0 region 6 dies (os._exit) after writing part of it; the task is
    # retried once on a fresh actor, dies again, and the slide fails with its store kept for resuming
    class KilledMidRegion(Tiler):  # defined here: Ray ships it to the actors by value
        def _level_written(self, region, level, pending):
            if region.stage == 0 and region.index == 6:
                for f in pending:
                    f.result()
                os._exit(1)

    res = ingest(
        [synth_svs], out, options=opts, workers=2, max_task_retries=1, progress=False, tiler_cls=KilledMidRegion
    )
    (row,) = res.rows
    assert row["status"] == "failed" and "worker died 2 times" in row["error"]
    (inp,) = discover_inputs([synth_svs])
    store = out / f"{inp.slide_id}.zarr"
    assert store.is_dir() and not is_complete(store)
    done = {p.stem for p in (store / PROGRESS_DIR).glob("*.done")}
    assert "s0_r6" not in done and len(done) >= 10  # the other regions were written
    # region 6 (blocks of 512 px, 4 per row: x 1024-1535, y 512-1023) was partly written before the kill: its
    # level-0 shard (one 512-px shard per region and level) exists, its level-1 shard not yet
    assert (store / "0" / "c" / "0" / "1" / "2").is_file() and not (store / "1" / "c" / "0" / "1" / "2").exists()
    # run 2 resumes at region granularity
    res2 = ingest([synth_svs], out, options=opts, workers=2, progress=False)
    (row2,) = res2.rows
    assert row2["status"] == "ok" and row2["regions_resumed"] == len(done)
    assert is_complete(store) and not (store / PROGRESS_DIR).exists()
    # identical to an uninterrupted run
    ref = Tiler(tmp_path / "ref", opts)
    ref.ingest_slide(inp)
    a, b = SlideStore(store), SlideStore(ref.store_path(inp.slide_id))
    assert a.level_count == b.level_count == 4
    for lvl in range(a.level_count):
        np.testing.assert_array_equal(a.read_level(lvl), b.read_level(lvl))
    # --overwrite redoes it
    res3 = ingest([synth_svs], out, options=opts, workers=1, overwrite=True, progress=False)
    assert res3.rows[0]["status"] == "ok" and res3.rows[0]["regions_resumed"] == 0
    shutil.rmtree(tmp_path / "ref")
