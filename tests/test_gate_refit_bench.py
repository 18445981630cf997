"""benchmarks/gate_refit.py: the refit is the trainer's fit (same slides in store order, same seeding), its bags are
the gate's own, and no bag holds more objects than the candidates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from benchmark_modules import load_benchmark


def test_refit_is_the_trainers_fit_and_scores_the_held_out_bags(tmp_path):
    from test_gate import _gated_config
    from tiny_stores import rare_structures_views

    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    load_benchmark("robustness")
    gr = load_benchmark("gate_refit")
    recs = rare_structures_views(tmp_path)
    train, test = recs[:4], recs[4:]
    tr = Trainer(_gated_config(), OptimConfig(epochs=2), ScheduleConfig(select_until=0.5), slides_per_epoch=4, seed=3)
    tr._train_records = train[::-1]  # an epoch's order: the fit does not depend on it
    tr._fit_gate()
    model = tr.model.eval()
    # a box on the held-out slide's first candidate: the candidates hold it, a bag holds it when it keeps that one
    table0 = gr.candidate_table(model, SimpleNamespace(train=[], test=test))
    xy = table0["xy"][0]
    boxes = {r.store: [] for r in recs}
    boxes[test[0].store] = [{"x": int(xy[0, 0]) + 1, "y": int(xy[0, 1]) + 1, "width": 2, "height": 2, "kind": "b"}]
    split = SimpleNamespace(train=train, test=test, class_names=["a", "b"], boxes=boxes)
    table = gr.candidate_table(model, split)
    assert table["split"] == ["train"] * 4 + ["test"] and len(table["features"][0]) == len(table["scores"][0])
    k = model.gate.centroids.shape[0]
    gate, _ = gr.fit_gate(table, k, 3)
    for name in ("mean", "std", "centroids"):
        torch.testing.assert_close(getattr(gate, name).float(), getattr(model.gate, name), rtol=1e-5, atol=1e-6)
    assert torch.equal(gate.informative, model.gate.informative)
    row = gr.refit_rows(table, split, k, 3)
    # the trainer's fit: the same informative clusters, the same held-out bag
    keep = model.gate.keep(table["features"][4].float()).numpy()
    assert row["informative_clusters"] == int(model.gate.informative.sum())
    assert row["size"] == float(keep.sum())
    cand = gr.candidates_row(table, split)
    assert cand["object_recall"] == 1.0 and row["object_recall"] == float(keep[0])
    assert row["object_recall"] <= cand["object_recall"]
    assert row["vote_hit_rate"] == row["hit_rate"]  # one fit: every kept cell has one vote
    # a union of fits (its first fit is the trainer's) keeps at least what the trainer's gate keeps; fit_on fits on
    # each training slide's first candidates only
    union = gr.refit_rows(table, split, k, 3, fits=3)
    assert union["size"] >= row["size"]
    # every fit agreeing keeps no more than the union, and no more than the first fit (the trainer's) alone
    every = gr.refit_rows(table, split, k, 3, fits=3, agree=1.0)
    assert every["size"] <= min(union["size"], row["size"])
    _, fit2 = gr.fit_gate(table, k, 3, fits=2, fit_on=2)
    assert fit2["assignment"].numel() == 2 * len(train) and fit2["kept"].shape == (2 * len(train),)
    # boxes that name no class (the checker family): no decidable column, not a NaN
    plain = SimpleNamespace(**{**vars(split), "boxes": {r.store: [] for r in recs}})
    assert "decidable" not in gr.candidates_row(table, plain) and "decidable" not in gr.refit_rows(table, plain, k, 3)
    with pytest.raises(SystemExit):
        gr.main(["--stores", str(tmp_path), "--checkpoint", "x.pt", "--clusters", "1"])
    with pytest.raises(SystemExit):
        gr.main(["--stores", str(tmp_path), "--checkpoint", "x.pt", "--agree", "1.5"])
