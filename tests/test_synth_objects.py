"""The ``objects`` synthetic task family (``foveate synth --task objects``): determinism, label = the majority
kind, the label invisible at 1/4 scale and below, the coverage bounds, sidecar boxes vs rendered pixels and
argument validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import openslide
import pandas as pd
import pytest

from pipeline.cli import main as cli_main
from pipeline.synthetic.archive import synth_archive
from pipeline.synthetic.checker import _tissue_field, render_region
from pipeline.synthetic.objects import OBJECT_KINDS, make_objects_layout, object_class_names, render_objects_region
from pipeline.synthetic.tasks import check_task
from pipeline.synthetic.tiff import sidecar_path, write_synthetic_slide

S, SEED = 2400, 11  # three pyramid levels (1, 1/2, 1/4); a multiple of 16


def _box(a: np.ndarray, f: int) -> np.ndarray:
    h, w, c = a.shape
    return a.astype(np.float64).reshape(h // f, f, w // f, f, c).mean(axis=(1, 3))


def _read(slide: openslide.OpenSlide, level: int) -> np.ndarray:
    return np.asarray(slide.read_region((0, 0), level, slide.level_dimensions[level]).convert("RGB")).astype(np.int16)


@pytest.fixture(scope="module")
def slides(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("objects")
    return {
        label: write_synthetic_slide(
            d / f"o{label}.tiff", width=S, height=S, label=label, seed=SEED, fmt="tiff", task="objects", classes=4
        )
        for label in range(4)
    }


def test_sidecar_lists_objects_and_distractors(slides):
    for label, info in slides.items():
        side = json.loads(sidecar_path(info["path"]).read_text())
        assert side["task"] == "objects" and side["classes"] == 4 and side["label_index"] == label
        assert side["label"] == OBJECT_KINDS[label] == side["class_names"][label]
        assert 3 <= len(side["structures"]) <= 6 and 20 <= len(side["distractors"]) <= 60
        assert {d["shape"] for d in side["distractors"]} == {"ring", "stroke"}
        assert all(o["informative"] and 40 <= o["width"] <= 54 for o in side["structures"])
    # the layout does not depend on the label
    boxes = [[(o["x"], o["y"], o["width"]) for o in s["structures"]] for s in slides.values()]
    dboxes = [[(o["x"], o["y"], o["kind"]) for o in s["distractors"]] for s in slides.values()]
    assert all(b == boxes[0] for b in boxes) and all(b == dboxes[0] for b in dboxes)


@pytest.mark.parametrize(
    "classes", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)]
)
def test_label_is_the_majority_kind_with_one_minority_object(classes):
    for seed in range(12):
        for label in range(classes):
            lay = make_objects_layout(4096, 4096, label, seed, classes)
            kinds = lay.objects[:, 3].astype(int).tolist()
            n = len(kinds)
            assert 3 <= n <= 6
            counts = np.bincount(kinds, minlength=classes)
            assert counts[label] == n - 1, (seed, label, kinds)  # the majority (n - 1 of n >= 3) decides
            assert (counts > 0).sum() == 2  # exactly one minority object, of another kind
            assert set(kinds) <= set(range(classes))
            side = lay.sidecar_info()
            assert side["label"] == OBJECT_KINDS[label] and side["kind_counts"][OBJECT_KINDS[label]] == counts[label]


def test_coverage_bounds():
    """Tissue covers most of the slide; the informative objects < 0.1 % of the tissue (4096 px and larger)."""
    for side in (4096, 8192, 12288):
        for seed in range(6):
            lay = make_objects_layout(side, side, 0, seed, 4)
            step = side / 256
            g = (np.arange(256) + 0.5) * step
            xs, ys = np.meshgrid(g, g)
            tissue = float((_tissue_field(lay.base, xs.ravel(), ys.ravel()) > 0).mean()) * side * side
            assert tissue > 0.75 * side * side, (side, seed, tissue / side**2)
            obj = float(np.sum(math.pi * lay.objects[:, 2] ** 2))
            assert obj / tissue < 1e-3, (side, seed, obj / tissue)
            # every object and distractor lies inside the tissue
            f = _tissue_field(lay.base, lay.objects[:, 0], lay.objects[:, 1])
            assert (f > lay.objects[:, 2]).all()
            assert 20 <= len(lay.rings) + len(lay.strokes) <= 60


def test_deterministic(tmp_path, slides):
    info = slides[1]
    again = write_synthetic_slide(
        tmp_path / Path(info["path"]).name, width=S, height=S, label=1, seed=SEED, fmt="tiff", task="objects", classes=4
    )
    assert Path(again["path"]).read_bytes() == Path(info["path"]).read_bytes()
    assert again["structures"] == info["structures"] and again["distractors"] == info["distractors"]
    other = make_objects_layout(S, S, 1, SEED + 1, 4)
    assert other.structure_boxes() != make_objects_layout(S, S, 1, SEED, 4).structure_boxes()
    # tiling-independent rendering
    lay = make_objects_layout(S, S, 2, SEED, 4)
    big = render_objects_region(lay, 0, 0, 1024, 1024)
    for x, y, w, h in ((0, 0, 300, 200), (300, 0, 724, 200), (0, 200, 1024, 824)):
        np.testing.assert_array_equal(render_objects_region(lay, x, y, w, h), big[y : y + h, x : x + w])


@pytest.mark.slow
def test_label_invisible_at_quarter_scale_visible_at_full_resolution(slides):
    lays = [make_objects_layout(S, S, label, SEED, 4) for label in range(4)]
    intent = [render_objects_region(lay, 0, 0, S, S) for lay in lays]
    for f in (4, 8, 16):  # the generator's intent: aligned 4x4 box means identical up to uint8 rounding
        ref = _box(intent[0], f)
        for im in intent[1:]:
            assert np.abs(_box(im, f) - ref).max() <= 0.5
    # through OpenSlide (JPEG): the 1/4 level (level 2) differs only by JPEG noise ...
    osl = [openslide.OpenSlide(slides[label]["path"]) for label in range(4)]
    assert osl[0].level_downsamples[2] == pytest.approx(4.0)
    low = [_read(s, 2) for s in osl]
    for im in low[1:]:
        assert np.abs(im - low[0]).mean() < 0.5 and np.abs(im - low[0]).max() <= 12
    # ... while at full resolution the objects' textures are plainly different kinds
    side = json.loads(sidecar_path(slides[0]["path"]).read_text())
    for o in side["structures"]:
        r = int(o["radius"] * 0.6)
        cx, cy = int(o["cx"]), int(o["cy"])
        crops = [
            np.asarray(s.read_region((cx - r, cy - r), 0, (2 * r, 2 * r)).convert("L")).astype(np.float64) for s in osl
        ]
        for c in crops:
            assert c.std() > 15  # textured
        kinds = [json.loads(sidecar_path(slides[lb]["path"]).read_text())["structures"] for lb in range(4)]
        ks = [next(k for k in kk if k["x"] == o["x"] and k["y"] == o["y"])["kind"] for kk in kinds]
        for a in range(4):
            for b in range(a + 1, 4):
                if ks[a] != ks[b]:
                    assert np.abs(crops[a] - crops[b]).mean() > 20


def test_boxes_match_rendered_pixels(slides):
    info = slides[3]
    lay = make_objects_layout(S, S, 3, SEED, 4)
    full = render_objects_region(lay, 0, 0, S, S).astype(np.int16)
    base = render_region(lay.base, 0, 0, S, S).astype(np.int16)
    diff = np.abs(full - base).sum(-1)
    covered = np.zeros((S, S), bool)
    osl = openslide.OpenSlide(info["path"])
    for b in info["structures"] + info["distractors"]:
        x0, y0 = max(b["x"], 0), max(b["y"], 0)
        x1, y1 = min(b["x"] + b["width"], S), min(b["y"] + b["height"], S)
        covered[max(y0 - 3, 0) : y1 + 3, max(x0 - 3, 0) : x1 + 3] = True
        assert (diff[y0:y1, x0:x1] > 60).mean() > (0.5 if b in info["structures"] else 0.03), b
        # the written file shows the object too (ink is much darker than tissue)
        region = np.asarray(osl.read_region((x0, y0), 0, (x1 - x0, y1 - y0)).convert("RGB")).astype(np.int16)
        assert (np.abs(region - base[y0:y1, x0:x1]).sum(-1) > 60).mean() > 0.03, b
    # nothing is drawn outside the listed boxes
    assert not diff[~covered].any()
    # informative disks: the box's pixels are ink (dark) at the centre
    for o in info["structures"]:
        assert full[int(o["cy"]), int(o["cx"])].mean() < 190 < base[int(o["cy"]), int(o["cx"])].mean() + 60


@pytest.mark.slow
def test_archive_and_cli(tmp_path, capsys):
    df = synth_archive(tmp_path / "a", count=5, size=2048, fmt="tiff", seed=2, task="objects", classes=2)
    assert sorted(df["label"]) == ["horizontal", "horizontal", "horizontal", "vertical", "vertical"]
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "a" / "labels.csv"), df)
    for p, label in zip(df["path"], df["label"]):
        assert json.loads(sidecar_path(p).read_text())["label"] == label
    out = tmp_path / "cli"
    assert (
        cli_main(
            [
                "synth",
                str(out),
                "--task",
                "objects",
                "--classes",
                "4",
                "--count",
                "4",
                "--size",
                "2048",
                "--format",
                "tiff",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    assert sorted(pd.read_csv(out / "labels.csv")["label"]) == sorted(object_class_names(4))
    assert "wrote 4 slides" in capsys.readouterr().out


def test_cli_validation(tmp_path, capsys, caplog):
    out = str(tmp_path / "x")
    assert cli_main(["synth", out, "--task", "objects", "--classes", "7", "--size", "2048"]) == 2
    assert cli_main(["synth", out, "--task", "objects", "--classes", "1", "--size", "2048"]) == 2
    assert cli_main(["synth", out, "--classes", "4", "--size", "2048"]) == 2  # checker is binary
    assert cli_main(["synth", out, "--task", "objects", "--positive-fraction", "0.3", "--size", "2048"]) == 2
    err = caplog.text
    assert "classes must be an int in [2, 5] for task 'objects'" in err
    assert "classes must be 2 for task 'checker'" in err and "positive-fraction applies to --task checker" in err
    with pytest.raises(SystemExit) as e:
        cli_main(["synth", out, "--task", "stripes"])
    assert e.value.code == 2
    assert "invalid choice: 'stripes' (choose from 'checker', 'objects', 'shapes')" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"task": "dots"}, r"task must be one of \('checker', 'objects', 'shapes'\), got 'dots'"),
        ({"task": "objects", "classes": 6}, r"classes must be an int in \[2, 5\] for task 'objects'"),
        ({"task": "checker", "classes": 4}, r"classes must be 2 for task 'checker'"),
        ({"task": "objects", "classes": 4, "label": 4}, r"label must be in \[0, 3\], got 4"),
    ],
)
def test_bad_args(tmp_path, kwargs, match):
    args = dict(width=2048, height=2048, label=0, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        write_synthetic_slide(tmp_path / "x.tiff", **args)
    with pytest.raises(ValueError, match=r"task must be one of"):
        synth_archive(tmp_path / "arch", count=1, size=2048, task="nope")
    assert not list(tmp_path.iterdir())
    assert check_task("objects", 5) == ("objects", 5)
