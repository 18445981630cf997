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
    from workers.slide_forward import gate_candidates, read_gate_candidates, score_slide
    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    rb = load_benchmark("robustness")
    gr = load_benchmark("gate_refit")
    gb = load_benchmark("gate_bags")
    recs = rare_structures_views(tmp_path)
    train, test = recs[:4], recs[4:]
    tr = Trainer(_gated_config(), OptimConfig(epochs=2), ScheduleConfig(select_until=0.5), slides_per_epoch=4, seed=3)
    tr._train_records = train
    tr._fit_gate()
    model = tr.model.eval()
    split0 = SimpleNamespace(train=train, test=test, class_names=["a", "b"], boxes={r.store: [] for r in recs})
    table = gr.candidate_table(model, split0, 6, pixels=True)
    assert table["split"] == ["train"] * 4 + ["test"]
    # the bag's pixels are the slide reader's pixels of its candidates, the features the gate encoder's of them
    slide = prepare_slide(test[0].store, model.cfg)
    cells, _ = gate_candidates(model, score_slide(model, slide), tuple(slide.cell_mask.shape), 6)
    assert torch.equal(table["pixels"][4], slide.reader.read(cells)) and table["pixels"][4].dtype == torch.uint8
    assert torch.equal(table["positions"][4], slide.grid.cell_centres(cells))
    with torch.no_grad():
        feats = model.gate_encode(read_gate_candidates(model, slide, score_slide(model, slide), 6)[2])
    torch.testing.assert_close(table["features"][4], feats.double())
    k = model.gate.centroids.shape[0]
    kw = {"fit_on": 6, "clusters": k, "seeding": 3, "fits": 1, "keep_from": 6}
    keep = gb.rule_keep("gate", table, split0, **kw)
    for feat, kept in zip(table["features"], keep):  # the trainer's gate, refitted from the same slides and seeding
        assert np.array_equal(kept, np.flatnonzero(model.gate.keep(feat.float()).numpy()))
    assert all(np.array_equal(t, np.arange(2)) for t in gb.rule_keep("top2", table, split0, **kw))
    # a box on the held-out slide's second candidate only: +pure keeps that one; a slide with no box its first
    xy = table["xy"][4]
    box = {"x": int(xy[1, 0]) + 1, "y": int(xy[1, 1]) + 1, "width": 2, "height": 2, "kind": "b"}
    on = rb.overlaps(xy, table["patch"][4], [box])[:, 0]
    split = SimpleNamespace(**{**vars(split0), "boxes": {**split0.boxes, test[0].store: [box]}})
    pure = gb.rule_keep("top6+pure", table, split, **kw)
    assert np.array_equal(pure[4], np.flatnonzero(on)) and 1 in pure[4]
    assert all(np.array_equal(p, [0]) for p in pure[:4])
    with pytest.raises(ValueError, match="unknown bag rule"):
        gb.rule_keep("best", table, split, **kw)
    with pytest.raises(ValueError, match=r"X\+pure"):
        gb.rule_keep("gate+clean", table, split, **kw)
    items = [(x[:2], pos[:2], y) for x, pos, y in zip(table["pixels"], table["positions"], table["target"])]
    row = gb.train_rule("perturbed_mean", [], split, 0, 1, items[:4], items[4:])
    assert 0.0 <= row["test_accuracy"] <= 1.0 and 0.0 <= row["train_accuracy"] <= 1.0
    curve = gb.train_rule(
        "perturbed_mean", [], split, 0, 2, items[:3], items[4:], as_trainer=True, curve=True, val_items=items[3:4]
    )
    assert [p[0] for p in curve["test_curve"]] == [1, 2] and [p[0] for p in curve["val_curve"]] == [1, 2]
    assert curve["val_accuracy"] in (0.0, 1.0) and curve["val_loss"] > 0
    # the loop's split: its training slides and its validation slides part the split's training slides
    named = [SimpleNamespace(**vars(r), slide_id=f"s{i}") for i, r in enumerate(train)]
    cut, val = gb.loop_split(rb.Split(["a", "b"], named, test), 0.25, "perturbed_mean", [])
    assert cut.test == test and len(val) >= 1 and len(cut.train) >= 1
    assert sorted(r.store for r in [*cut.train, *val]) == sorted(r.store for r in train)
    assert not {r.store for r in cut.train} & {r.store for r in val}


def test_fit_bags_as_the_trainer_averages_and_the_oracle_does_not():
    """``as_trainer`` with ``optim.ema_epochs``: the model returned (and passed to ``after_epoch``) is the moving
    average, not the trained model; without it, the trained model itself, bit-identical to ``as_trainer`` with no
    average and one global clip."""
    import dataclasses

    from operators.checkpoint import build_model, with_num_classes
    from pipeline.config import load_config
    from pipeline.train import TrainConfig

    rb = load_benchmark("robustness")
    cfg = load_config(TrainConfig, rb.config_path("perturbed_mean"), [])
    g = torch.Generator().manual_seed(0)
    bags = [
        (torch.randint(0, 256, (3, 3, 32, 32), generator=g, dtype=torch.uint8), torch.rand(3, 2, generator=g), i % 2)
        for i in range(8)
    ]

    def run(optim, as_trainer):
        torch.manual_seed(0)
        model, _ = build_model(with_num_classes(cfg.model, 2))
        seen = []
        out = rb.fit_bags(
            model,
            optim,
            lambda _e: bags,
            2,
            np.random.default_rng(0),
            as_trainer=as_trainer,
            after_epoch=lambda e, m: seen.append((e, m)),
        )
        return model, out, seen

    assert cfg.optim.ema_epochs > 0
    model, out, seen = run(cfg.optim, True)
    assert out is not model and [e for e, _ in seen] == [0, 1] and all(m is out for _, m in seen)
    w_live = dict(model.named_parameters())
    assert any(not torch.equal(p, w_live[n]) for n, p in out.named_parameters())
    plain = dataclasses.replace(cfg.optim, clip="global", ema_epochs=0.0)
    m1, o1, _ = run(cfg.optim, False)
    m2, o2, _ = run(plain, True)
    assert o1 is m1 and o2 is m2
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
