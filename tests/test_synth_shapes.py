"""The ``shapes`` synthetic task family (``foveate synth --task shapes``): balanced labels, 3 glyphs of the slide's
class and 2 of others, the boxes (inside the slide, 24..64 px, apart, matching the ink), one ink for glyphs and
distractors, per-instance distortion, determinism, argument validation and OpenSlide on the written files."""

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
from pipeline.synthetic.shapes import (
    BOX_SIDE,
    DISTRACTOR_STROKE_WIDTH,
    GLYPH_STROKE_WIDTH,
    INK,
    MAJORITY_COUNT,
    SHAPE_CLASSES,
    SHAPE_COUNT,
    SHAPES_MAX_CLASSES,
    _distort,
    _glyph_strokes,
    _polyline_distance,
    check_shape_classes,
    make_shapes_layout,
    render_shapes_region,
    shape_class_names,
)
from pipeline.synthetic.tasks import TASKS, check_task
from pipeline.synthetic.tiff import sidecar_path, write_synthetic_slide

W, H, SEED = 2400, 2000, 5


@pytest.fixture(scope="module")
def slides(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("shapes")
    return {
        (fmt, label): write_synthetic_slide(
            d / f"s{label}.{fmt}", width=W, height=H, label=label, seed=SEED, fmt=fmt, task="shapes", classes=10
        )
        for fmt, label in (("svs", 0), ("tiff", 7))
    }


def _rect(b: dict) -> tuple[int, int, int, int]:
    return b["x"], b["y"], b["x"] + b["width"], b["y"] + b["height"]


def _apart(a: dict, b: dict, gap: int = 0) -> bool:
    ax0, ay0, ax1, ay1 = _rect(a)
    bx0, by0, bx1, by1 = _rect(b)
    return ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0


def test_registered():
    assert "shapes" in TASKS and check_task("shapes", 10) == ("shapes", 10)
    assert len(SHAPE_CLASSES) == len(set(SHAPE_CLASSES)) == SHAPES_MAX_CLASSES == 10
    assert shape_class_names(3) == ("ring", "triangle", "square")


def test_sidecar_schema(slides):
    for (_, label), info in slides.items():
        side = json.loads(sidecar_path(info["path"]).read_text())
        assert side["task"] == "shapes" and side["classes"] == 10 and side["label_index"] == label
        assert side["label"] == SHAPE_CLASSES[label] == side["class_names"][label]
        assert side["majority_count"] == MAJORITY_COUNT == 3 and SHAPE_COUNT == 5
        s = side["structures"]
        assert len(s) == 5 and all(b["informative"] and b["kind"] == b["class"] in SHAPE_CLASSES for b in s)
        assert sum(b["majority"] for b in s) == 3 and all(b["majority"] == (b["class_index"] == label) for b in s)
        assert side["class_counts"][SHAPE_CLASSES[label]] == 3 and sum(side["class_counts"].values()) == 5
        assert all({"x", "y", "width", "height", "shape", "stroke_width"} <= set(b) for b in side["distractors"])
        # 30..80 strokes per megapixel of tissue (the tissue is 75..95 % of the slide)
        assert 0.75 * 30 * W * H / 1e6 <= len(side["distractors"]) <= 0.95 * 80 * W * H / 1e6
    # the layout does not depend on the label: the glyphs' places and every distractor are the same
    a, b = (json.loads(sidecar_path(i["path"]).read_text()) for i in slides.values())
    assert a["distractors"] == b["distractors"]
    centres = [np.array([[g["cx"], g["cy"]] for g in side["structures"]]) for side in (a, b)]
    np.testing.assert_allclose(centres[0], centres[1], atol=1e-6)
    assert [g["majority"] for g in a["structures"]] == [g["majority"] for g in b["structures"]]


@pytest.mark.parametrize("classes", [2, 4, 10])
def test_three_of_the_class_two_of_others(classes):
    for seed in range(4):
        label = (seed * 3) % classes
        lay = make_shapes_layout(W, H, label, seed, classes)
        counts = np.bincount(lay.glyph_classes, minlength=classes)
        assert len(lay.glyph_classes) == 5 and counts[label] == 3 and counts.sum() == 5, (seed, counts)
        assert set(lay.glyph_classes.tolist()) <= set(range(classes))
        side = lay.sidecar_info()
        assert side["label"] == SHAPE_CLASSES[label] and len(side["class_names"]) == classes


@pytest.mark.parametrize("size", [(2000, 2000), (W, H), (4096, 3000)])
def test_boxes_inside_sized_apart_and_on_ink(size):
    w, h = size
    lay = make_shapes_layout(w, h, 1, 3, 4)
    glyphs, distractors = lay.structure_boxes(), lay.distractor_boxes()
    for b in glyphs + distractors:
        x0, y0, x1, y1 = _rect(b)
        assert 0 <= x0 and 0 <= y0 and x1 <= w and y1 <= h, b
        assert BOX_SIDE[0] <= b["width"] <= BOX_SIDE[1] and BOX_SIDE[0] <= b["height"] <= BOX_SIDE[1], b
        lo, hi = GLYPH_STROKE_WIDTH if b in glyphs else DISTRACTOR_STROKE_WIDTH
        assert lo <= b["stroke_width"] <= hi, b
        assert _tissue_field(lay.base, np.array([b["cx"]]), np.array([b["cy"]]))[0] > 0  # on tissue
    for i, a in enumerate(glyphs):
        assert all(_apart(a, b, 48) for b in glyphs[i + 1 :])
    boxes = glyphs + distractors  # a distractor keeps 6 px from every other box, glyph or distractor
    assert all(_apart(a, b, 6) for i, a in enumerate(boxes) for b in boxes[max(i + 1, len(glyphs)) :])
    if (w, h) == (W, H):  # the rendered ink lies inside the boxes and every box holds ink
        full = render_shapes_region(lay, 0, 0, w, h).astype(np.int16)
        diff = np.abs(full - render_region(lay.base, 0, 0, w, h).astype(np.int16)).sum(-1)
        inside = np.zeros((h, w), bool)
        for b in glyphs + distractors:
            x0, y0, x1, y1 = _rect(b)
            inside[y0:y1, x0:x1] = True
            assert (diff[y0:y1, x0:x1] > 150).mean() > 0.03, b
            # the box is tight: ink within 2 px of each of its four sides
            ink = diff[y0:y1, x0:x1] > 60
            assert ink[:2].any() and ink[-2:].any() and ink[:, :2].any() and ink[:, -2:].any(), b
        assert not diff[~inside].any()


def test_one_ink_for_glyphs_and_distractors(slides):
    info = slides[("tiff", 7)]
    lay = make_shapes_layout(W, H, 7, SEED, 10)
    full = render_shapes_region(lay, 0, 0, W, H).astype(np.float64)
    osl = openslide.OpenSlide(info["path"])
    got = np.asarray(osl.read_region((0, 0), 0, (W, H)).convert("RGB")).astype(np.float64)

    def ink(im: np.ndarray, boxes: list[dict]) -> tuple[np.ndarray, float]:
        px, widths = [], []
        for b in boxes:
            x0, y0, x1, y1 = _rect(b)
            sub = im[y0:y1, x0:x1].reshape(-1, 3)
            px.append(sub[sub.sum(1) < 260])  # stroke cores (nuclei and tissue are lighter)
            widths.append(b["stroke_width"])
        return np.median(np.concatenate(px), 0), float(np.mean(widths))

    (g, gw), (d, dw) = ink(full, lay.structure_boxes()), ink(full, lay.distractor_boxes())
    assert np.abs(g - INK).max() <= 3 and np.abs(d - INK).max() <= 3 and np.abs(g - d).max() <= 2
    assert 5.0 <= gw <= 8.0 and 1.5 <= dw <= 3.0  # a bold pen for the glyphs, a fine one for the distractors
    (g, _), (d, _) = ink(got, lay.structure_boxes()), ink(got, lay.distractor_boxes())  # through JPEG
    assert np.abs(g - d).max() <= 16  # JPEG's 2x2 chroma subsampling blurs a 1.5..3 px stroke's colour


def _mask(polys: list[np.ndarray], hw: float, side: int = 72) -> np.ndarray:
    """Coverage of a drawing centred in a ``side`` px square."""
    px = np.arange(side, dtype=np.float64)[None, :] + 0.5 - side / 2
    py = np.arange(side, dtype=np.float64)[:, None] + 0.5 - side / 2
    d = np.min([_polyline_distance(px, py, p, 1e9) for p in polys], axis=0)
    return np.clip(hw - d + 0.5, 0.0, 1.0)


def _normalised(m: np.ndarray, n: int = 16) -> np.ndarray:
    """The mask's ink bounding box resampled to ``n x n`` (a simple scale-free shape descriptor)."""
    ys, xs = np.nonzero(m > 0.5)
    sub = m[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    yi = np.linspace(0, sub.shape[0] - 1, n).round().astype(int)
    xi = np.linspace(0, sub.shape[1] - 1, n).round().astype(int)
    return sub[np.ix_(yi, xi)].ravel()


def test_instances_differ_but_classes_separate():
    rng = np.random.default_rng(0)
    n_inst = 8
    feats, masks = [], []
    for name in SHAPE_CLASSES:
        row_f, row_m = [], []
        for _ in range(n_inst):
            rot = float(rng.uniform(-math.radians(25), math.radians(25)))
            m = _mask(_distort(_glyph_strokes(name), rng, rot, 56.0, 1.5), 1.5)
            row_m.append(m > 0.5)
            row_f.append(_normalised(m))
        feats.append(row_f)
        masks.append(row_m)
    feats = np.array(feats)  # (classes, instances, 256)
    # two instances of one class are never the same drawing (elastic, affine, size): no exact template
    for row in masks:
        for i in range(n_inst):
            for j in range(i + 1, n_inst):
                iou = (row[i] & row[j]).sum() / (row[i] | row[j]).sum()
                assert iou < 0.9
    # ... while a nearest-centroid on the normalised masks (leave one out) tells the classes apart on average
    correct = 0
    for c in range(len(SHAPE_CLASSES)):
        for i in range(n_inst):
            cents = []
            for k in range(len(SHAPE_CLASSES)):
                rows = [feats[k, j] for j in range(n_inst) if not (k == c and j == i)]
                cents.append(np.mean(rows, 0))
            correct += int(np.argmin([np.abs(feats[c, i] - m).sum() for m in cents]) == c)
    assert correct / (len(SHAPE_CLASSES) * n_inst) > 0.5  # chance: 0.1


def test_deterministic_and_tiling_independent(tmp_path, slides):
    info = slides[("svs", 0)]
    again = write_synthetic_slide(
        tmp_path / Path(info["path"]).name, width=W, height=H, label=0, seed=SEED, fmt="svs", task="shapes", classes=10
    )
    assert Path(again["path"]).read_bytes() == Path(info["path"]).read_bytes()
    a, b = (
        {k: v for k, v in json.loads(sidecar_path(i["path"]).read_text()).items() if k != "path"} for i in (again, info)
    )
    assert a == b
    other = write_synthetic_slide(
        tmp_path / "other.svs", width=W, height=H, label=0, seed=SEED + 1, fmt="svs", task="shapes", classes=10
    )
    assert Path(other["path"]).read_bytes() != Path(info["path"]).read_bytes()
    assert other["structures"] != info["structures"]
    lay = make_shapes_layout(W, H, 4, SEED, 10)
    big = render_shapes_region(lay, 256, 256, 1024, 768)
    for x, y, w, h in ((256, 256, 300, 200), (556, 256, 724, 200), (256, 456, 1024, 568), (1000, 700, 77, 91)):
        np.testing.assert_array_equal(
            render_shapes_region(lay, x, y, w, h), big[y - 256 : y - 256 + h, x - 256 : x - 256 + w]
        )


@pytest.mark.parametrize("fmt,vendor", [("svs", "aperio"), ("tiff", "generic-tiff")])
def test_openslide_reads_the_glyphs(slides, fmt, vendor):
    info = next(v for (f, _), v in slides.items() if f == fmt)
    s = openslide.OpenSlide(info["path"])
    assert s.properties["openslide.vendor"] == vendor and s.dimensions == (W, H)
    assert not [k for k in s.properties if "label" in k.lower()]
    lay = make_shapes_layout(W, H, info["label_index"], SEED, 10)
    for b in info["structures"]:
        x0, y0 = b["x"] - 4, b["y"] - 4
        got = np.asarray(s.read_region((x0, y0), 0, (b["width"] + 8, b["height"] + 8)).convert("RGB")).astype(np.int16)
        want = render_shapes_region(lay, x0, y0, b["width"] + 8, b["height"] + 8).astype(np.int16)
        assert np.abs(got - want).mean() < 6, b  # JPEG noise only


@pytest.mark.slow
def test_archive_balanced_and_cli(tmp_path, capsys):
    df = synth_archive(tmp_path / "a", count=7, size=2000, fmt="tiff", seed=2, task="shapes", classes=3)
    assert sorted(df["label"].value_counts().tolist()) == [2, 2, 3] and set(df["label"]) == set(SHAPE_CLASSES[:3])
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "a" / "labels.csv"), df)
    for p, label in zip(df["path"], df["label"]):
        assert json.loads(sidecar_path(p).read_text())["label"] == label
    out = tmp_path / "cli"
    argv = ["synth", str(out), "--task", "shapes", "--classes", "8", "--count", "8", "--size", "2000"]
    assert cli_main(argv + ["--format", "mixed", "--seed", "1"]) == 0
    table = pd.read_csv(out / "labels.csv")
    assert sorted(table["label"]) == sorted(SHAPE_CLASSES[:8])
    assert [Path(p).suffix for p in table["path"]] == [".svs", ".tiff"] * 4
    for p in table["path"]:
        assert openslide.OpenSlide(p).dimensions == (2000, 2000)
    assert "wrote 8 slides" in capsys.readouterr().out


def test_classes_refused(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"classes must be an int in \[2, 10\] for task 'shapes' \(at most 10"):
        check_shape_classes(11)
    for bad in (1, 11, True, 2.0):
        with pytest.raises(ValueError, match="task 'shapes'"):
            check_task("shapes", bad)
    with pytest.raises(ValueError, match=r"at most 10"):
        write_synthetic_slide(tmp_path / "x.tiff", width=2000, height=2000, label=0, seed=0, task="shapes", classes=11)
    with pytest.raises(ValueError, match=r"label must be in \[0, 2\], got 3"):
        make_shapes_layout(2000, 2000, 3, 0, 3)
    out = str(tmp_path / "x")
    assert cli_main(["synth", out, "--task", "shapes", "--classes", "11", "--size", "2000"]) == 2
    assert cli_main(["synth", out, "--task", "shapes", "--positive-fraction", "0.3", "--size", "2000"]) == 2
    assert "classes must be an int in [2, 10] for task 'shapes' (at most 10: the glyph classes ring," in caplog.text
    assert "--positive-fraction applies to --task checker only (the shapes task" in caplog.text
    assert not list(tmp_path.iterdir())


def test_glyphs_are_where_to_look_at_low_resolution():
    """At the scorer's 1/16 a glyph (bold pen) is a darker smudge than any but the rarest distractor (fine pen):
    where to look shows at low resolution, what the glyph is does not (its box is 2..4 px there)."""
    w = 2048
    for seed in range(2):
        lay = make_shapes_layout(w, w, 1, seed, 8)
        dark = 255.0 - render_shapes_region(lay, 0, 0, w, w).astype(np.float64).mean(-1)
        low = dark.reshape(w // 16, 16, w // 16, 16).mean((1, 3))

        def peaks(boxes: list[dict], low: np.ndarray = low) -> np.ndarray:
            out = []
            for b in boxes:
                x0, y0, x1, y1 = _rect(b)
                out.append(low[y0 // 16 : y1 // 16 + 1, x0 // 16 : x1 // 16 + 1].max())
            return np.array(out)

        glyph, distractor = peaks(lay.structure_boxes()), peaks(lay.distractor_boxes())
        assert len(distractor) > 50
        assert np.median(glyph) > np.percentile(distractor, 99) + 10, (np.median(glyph), np.percentile(distractor, 99))
        assert (distractor > np.median(glyph)).mean() < 0.01
