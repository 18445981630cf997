"""benchmarks/pretrain_probe.py: the slide-vote arithmetic and its arguments (the probe itself runs as a benchmark)."""

from __future__ import annotations

import pytest
import torch
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("pretrain_probe")


def test_slide_vote_is_the_strict_mode_of_the_predicted_kinds(probe):
    true = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 0, 1, 1, 1, 1, 0])
    # slide 1 (3:2 of kind 0): one majority glyph misread -> 2:3, wrong; slide 2 (3 of kind 2 + 0 + 1): minority
    # misreads spread over two kinds -> 3:1:1, right; slide 3 (3:1 of kind 1): 2:2 tie -> wrong
    pred = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 1, 0, 1, 1, 0, 0])
    assert probe.majority_vote_accuracy(pred, true, [5, 5, 4]) == pytest.approx(1 / 3)
    assert probe.majority_vote_accuracy(true, true, [5, 5, 4]) == 1.0


def test_object_crops_rejects_an_unknown_place(probe, tmp_path):
    with pytest.raises(ValueError, match=r"at must be one of \('centred', 'cell', 'recentred'\), got 'corner'"):
        probe.object_crops(tmp_path, None, "corner")


def test_placement_is_the_offset_to_the_read_centre_and_whether_the_object_fits(probe):
    objs = [{"x": 10, "y": 20, "width": 20, "height": 10}, {"x": 0, "y": 0, "width": 40, "height": 40}]
    got = probe.placement(
        [[4, 9], [0, 0]], 32, objs
    )  # read centres (20, 25) and (16, 16); object centres (20, 25), (20, 20)
    assert got.tolist() == [[0.0, 1.0], [4.0, 0.0]]  # the first fits, the 40-px object cannot
