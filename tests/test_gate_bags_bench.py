"""benchmarks/gate_bags.py: its gate is the trainer's (same slides, same seeding: the same kept cells), its bags are
the candidates' own pixels, ``+pure`` drops exactly the patches off the boxes, and a training row comes back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from benchmark_modules import load_benchmark


def test_bags_are_the_trainers_gate_and_pure_drops_the_filler(tmp_path):
    from test_gate import _gated_config
    from tiny_stores import rare_structures_views

    from workers.patches import prepare_slide
    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    rb = load_benchmark("robustness")
    gb = load_benchmark("gate_bags")
    recs = rare_structures_views(tmp_path)
    train, test = recs[:4], recs[4:]
    tr = Trainer(_gated_config(), OptimConfig(epochs=2), ScheduleConfig(select_until=0.5), slides_per_epoch=4, seed=3)
    tr._train_records = train
    tr._fit_gate()
    model = tr.model.eval()
    split0 = SimpleNamespace(train=train, test=test, class_names=["a", "b"], boxes={r.store: [] for r in recs})
    bags = gb.candidate_bags(model, split0, 6)
    assert [b["split"] for b in bags] == ["train"] * 4 + ["test"]
    # the bag's pixels are the slide reader's pixels of its candidates
    b = bags[4]
    slide = prepare_slide(test[0].store, model.cfg)
    assert torch.equal(b["pixels"], slide.reader.read(b["cells"]))
    assert b["pixels"].dtype == torch.uint8 and b["positions"].shape == (len(b["cells"]), 2)
    k = model.gate.centroids.shape[0]
    keep = gb.rule_keep("gate", bags, split0, fit_on=6, clusters=k, seeding=3, fits=1, keep_from=6)
    for bag, kept in zip(bags, keep):  # the trainer's gate, refitted from the same slides and seeding
        want = np.flatnonzero(model.gate.keep(bag["features"].float()).numpy())
        assert np.array_equal(kept, want)
    top = gb.rule_keep("top2", bags, split0, fit_on=6, clusters=k, seeding=3, fits=1, keep_from=6)
    assert all(np.array_equal(t, np.arange(2)) for t in top)
    # a box on the held-out slide's second candidate only: +pure keeps that one; a slide with no box its first
    xy = b["xy"]
    box = {"x": int(xy[1, 0]) + 1, "y": int(xy[1, 1]) + 1, "width": 2, "height": 2, "kind": "b"}
    on = rb.overlaps(xy, b["patch"], [box])[:, 0]
    split = SimpleNamespace(**{**vars(split0), "boxes": {**split0.boxes, test[0].store: [box]}})
    pure = gb.rule_keep("top6+pure", bags, split, fit_on=6, clusters=k, seeding=3, fits=1, keep_from=6)
    assert np.array_equal(pure[4], np.flatnonzero(on)) and 1 in pure[4]
    assert all(np.array_equal(p, [0]) for p in pure[:4])
    with pytest.raises(ValueError, match="unknown bag rule"):
        gb.rule_keep("best", bags, split, fit_on=6, clusters=k, seeding=3, fits=1, keep_from=6)
    with pytest.raises(ValueError, match=r"X\+pure"):
        gb.rule_keep("gate+clean", bags, split, fit_on=6, clusters=k, seeding=3, fits=1, keep_from=6)
    items = [(bb["pixels"][:2], bb["positions"][:2], bb["target"]) for bb in bags]
    row = gb.train_rule("perturbed_mean", [], split, 0, 1, items[:4], items[4:])
    assert 0.0 <= row["test_accuracy"] <= 1.0 and 0.0 <= row["train_accuracy"] <= 1.0
