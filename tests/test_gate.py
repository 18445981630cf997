"""The cluster gate (operators/gate.py, model.experimental.gate_candidates): the two-means cut against brute
force in float64, k-means on separated clusters, the fit's informative clusters, the gated bag in forward_slide,
the trainer fitting it when the selection is fixed (and the moving average getting the same gate), a checkpoint
round trip, and the scoring stages (scorer and classifier workers) giving the same bag and probabilities."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_two_phase import _config, _store

from operators.gate import CellGate, fit_cluster_gate, spherical_kmeans, two_means_upper
from operators.model import FoveateModel
from workers.early_stopping import EarlyStoppingConfig
from workers.slide_forward import forward_slide, gate_candidates
from workers.trainer import OptimConfig, ScheduleConfig, Trainer


def _brute_upper(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Every cut between distinct sorted values, the between-group variance computed directly."""
    best, mask = -1.0, torch.ones_like(v, dtype=torch.bool)
    for cut in sorted(set(v.tolist()))[1:]:
        hi = v >= cut
        lo = ~hi
        wl, wh = float(w[lo].sum()), float(w[hi].sum())
        if wl == 0 or wh == 0:
            continue
        ml, mh = float((v[lo] * w[lo]).sum()) / wl, float((v[hi] * w[hi]).sum()) / wh
        b = wl * wh * (mh - ml) ** 2
        if b > best:
            best, mask = b, hi
    return mask


def test_two_means_upper_matches_brute_force_in_float64():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 5, 9, 16):
        for _ in range(20):
            v = torch.rand(n, generator=g, dtype=torch.float64).round(decimals=2)  # ties included
            w = torch.randint(1, 50, (n,), generator=g).double()
            assert torch.equal(two_means_upper(v, w), _brute_upper(v, w)), (v, w)
    # two obvious groups; the weights move nothing here
    v = torch.tensor([0.86, 0.85, 0.93, 0.87, 0.92, 0.91], dtype=torch.float64)
    assert two_means_upper(v).tolist() == [False, False, True, False, True, True]
    assert two_means_upper(torch.tensor([0.5])).tolist() == [True]
    assert two_means_upper(torch.tensor([0.5, 0.5, 0.5])).all()
    with pytest.raises(ValueError, match="weights"):
        two_means_upper(v, -torch.ones(6))
    with pytest.raises(ValueError, match="values"):
        two_means_upper(torch.zeros(2, 2))


def _blobs(centres: torch.Tensor, per: int, spread: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = centres.repeat_interleave(per, 0) + spread * torch.randn(len(centres) * per, centres.shape[1], generator=g)
    return x, torch.arange(len(centres)).repeat_interleave(per)


def test_spherical_kmeans_recovers_separated_directions():
    centres = torch.eye(4, 6, dtype=torch.float64) * 5
    x, label = _blobs(centres, 30, 0.3)
    x = torch.nn.functional.normalize(x, dim=1)
    cen, assign = spherical_kmeans(x, 4, torch.Generator().manual_seed(1))
    assert cen.shape == (4, 6) and torch.allclose(cen.norm(dim=1), torch.ones(4, dtype=torch.float64))
    # the partition is the blobs' (up to the clusters' order)
    pairs = set(zip(label.tolist(), assign.tolist()))
    assert len(pairs) == 4 and len({a for _, a in pairs}) == 4
    again = spherical_kmeans(x, 4, torch.Generator().manual_seed(1))
    assert torch.equal(again[1], assign)
    assert spherical_kmeans(x[:3], 8)[0].shape[0] == 3  # k cut to M
    with pytest.raises(ValueError, match="k must"):
        spherical_kmeans(x, 0)


def test_spherical_kmeans_restarts_keep_the_best_of_the_same_seedings():
    # many overlapping blobs and k below their number: single seedings end in different partitions; the restarts
    # return the one of highest objective among exactly the runs single calls make from the same generator stream
    centres = torch.randn(12, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = torch.nn.functional.normalize(_blobs(centres, 15, 0.6)[0], dim=1)

    def objective(cen, assign):
        return float((x * cen[assign]).sum())

    g = torch.Generator().manual_seed(4)
    singles = [objective(*spherical_kmeans(x, 5, g)) for _ in range(6)]
    assert len({round(v, 9) for v in singles}) > 1  # the seedings disagree: the choice matters
    best = spherical_kmeans(x, 5, torch.Generator().manual_seed(4), restarts=6)
    assert objective(*best) == pytest.approx(max(singles), abs=1e-12)
    with pytest.raises(ValueError, match="restarts must"):
        spherical_kmeans(x, 5, restarts=0)


def test_fit_marks_the_clusters_the_scorer_ranks_high_on_average():
    # six appearance blobs; the scorer's score per cell is noisy (blobs overlap cell by cell) but two blobs are
    # ranked high on average: those two are the informative clusters
    centres = torch.eye(6, 8, dtype=torch.float64) * 4 + 1.0
    x, label = _blobs(centres, 40, 0.2)
    g = torch.Generator().manual_seed(3)
    high = (label == 1) | (label == 4)
    scores = torch.where(high, 0.93, 0.86).double() + 0.04 * torch.randn(len(label), generator=g, dtype=torch.float64)
    assert float(((scores[high][:, None] > scores[~high][None]).double()).mean()) < 0.95  # cell by cell: noisy
    fit = fit_cluster_gate(x, scores, 6, torch.Generator().manual_seed(0))
    kept = fit["informative"][fit["assignment"]]
    assert torch.equal(kept, high)
    with pytest.raises(ValueError, match="scores"):
        fit_cluster_gate(x, scores[:-1], 6)

    gate = CellGate(None, 8, 6)
    assert gate.keep(x.float()[:5]).all()  # unfitted: every candidate
    gate.fit(x, scores, torch.Generator().manual_seed(0))
    assert gate.is_fitted and torch.equal(gate.keep(x.float()), high)
    lows = x.float()[~high][:3]
    assert gate.keep(lows).tolist() == [True, False, False]  # none informative: the best-scored (first) one
    small = CellGate(None, 8, 16)  # more clusters than candidates: spare centroids never nearest
    small.fit(x[:10], scores[:10])
    assert int(small.assign(x.float()[:10]).max()) < 10


def test_the_margin_keeps_candidates_near_an_informative_centroid():
    # two centroids by hand: cluster 0 informative (direction e0), cluster 1 not (e1); a candidate between them,
    # a little nearer e1, is kept with a margin larger than its similarity gap and dropped without one
    gate = CellGate(None, 2, 2)
    gate.centroids.copy_(torch.eye(2))
    gate.informative.copy_(torch.tensor([True, False]))
    gate.fitted.fill_(True)
    angles = torch.tensor([0.05, 0.7, 0.9, 1.5])  # radians from e0 (pi/4 is the boundary)
    feats = torch.stack([angles.cos(), angles.sin()], 1)  # mean 0 / std 1: features are the directions
    gap = (angles.sin() - angles.cos()).clamp_min(0)  # similarity to e1 minus that to e0 where e1 is nearest
    assert gate.keep(feats).tolist() == [True, True, False, False]
    for margin in (0.1, 0.5, 1.0):
        wide = CellGate(None, 2, 2, margin=margin)
        wide.load_state_dict(gate.state_dict())
        assert torch.equal(wide.keep(feats), gap <= margin)
    with pytest.raises(ValueError, match="margin"):
        CellGate(None, 2, 2, margin=-0.1)


def test_a_union_of_fits_keeps_what_any_fit_keeps():
    # overlapping blobs, k below their number: fits of different seedings keep different candidates; the F-fit
    # gate's fit f is the one-fit gate fitted with the f-th stretch of the same generator stream, and it keeps a
    # candidate when any of those keeps it
    centres = torch.randn(12, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x, label = _blobs(centres, 15, 0.6)
    g = torch.Generator().manual_seed(11)
    scores = (label % 3 == 0).double() * 0.1 + 0.05 * torch.randn(len(label), generator=g, dtype=torch.float64)
    union = CellGate(None, 5, 6, fits=4)
    fit = union.fit(x, scores, torch.Generator().manual_seed(0))
    stream, singles = torch.Generator().manual_seed(0), []
    for f in range(4):
        one = CellGate(None, 5, 6)
        one.fit(x, scores, stream)
        torch.testing.assert_close(union.centroids[6 * f : 6 * f + 6], one.centroids, rtol=0, atol=0)
        assert torch.equal(union.informative[6 * f : 6 * f + 6], one.informative)
        singles.append(one.keep(x.float()))
    any_fit = torch.stack(singles).any(0)
    assert len({int(k.sum()) for k in singles}) > 1  # the fits disagree: the union is more than one of them
    assert torch.equal(union.keep(x.float()), any_fit) and torch.equal(fit["kept"], any_fit)
    assert int(any_fit.sum()) > max(int(k.sum()) for k in singles)
    assert union.assign(x.float()).shape == (len(x), 4) and one.assign(x.float()).shape == (len(x),)
    # the first fit is the fit of a one-fit gate: the same seed gives it the same state (and shapes)
    first = CellGate(None, 5, 6)
    first.fit(x, scores, torch.Generator().manual_seed(0))
    assert first.centroids.shape == (6, 5) and union.centroids.shape == (24, 5)
    torch.testing.assert_close(union.centroids[:6], first.centroids, rtol=0, atol=0)
    # a margin widens every fit's choice
    wide = CellGate(None, 5, 6, margin=0.3, fits=4)
    wide.load_state_dict(union.state_dict())
    kept_wide = wide.keep(x.float())
    assert bool((kept_wide >= any_fit).all()) and int(kept_wide.sum()) > int(any_fit.sum())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="fits must"):
            CellGate(None, 5, 6, fits=bad)


def test_agree_keeps_what_enough_fits_keep():
    # the same fits as the union's test: with agree a, a candidate is kept when at least max(1, ceil(a * F)) of
    # the one-fit gates keep it; a = 0 is the union, a = 1 the intersection (each checked against the single fits)
    centres = torch.randn(12, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x, label = _blobs(centres, 15, 0.6)
    g = torch.Generator().manual_seed(11)
    scores = (label % 3 == 0).double() * 0.1 + 0.05 * torch.randn(len(label), generator=g, dtype=torch.float64)
    stream, singles = torch.Generator().manual_seed(0), []
    for _ in range(4):
        one = CellGate(None, 5, 6)
        one.fit(x, scores, stream)
        singles.append(one.keep(x.float()))
    count = torch.stack(singles).long().sum(0)
    kept_by = {}
    for agree, votes in ((0.0, 1), (0.25, 1), (0.5, 2), (0.6, 3), (1.0, 4)):
        gate = CellGate(None, 5, 6, fits=4, agree=agree)
        fit = gate.fit(x, scores, torch.Generator().manual_seed(0))
        assert gate.min_votes == votes
        assert torch.equal(gate.vote_counts(x.float()), count)
        want = count >= votes
        assert torch.equal(gate.keep(x.float()), want) and torch.equal(fit["kept"], want)
        kept_by[agree] = int(want.sum())
    assert kept_by[0.0] > kept_by[0.5] > kept_by[1.0] > 0  # the rule matters on these fits
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="agree"):
            CellGate(None, 5, 6, fits=4, agree=bad)


def _gated_config(candidates: int = 6, clusters: int = 3, **experimental):
    cfg = _config()
    return dataclasses.replace(
        cfg,
        experimental=dataclasses.replace(
            cfg.experimental, gate_candidates=candidates, gate_clusters=clusters, **experimental
        ),
    )


def test_gated_forward_reads_the_candidates_once_and_classifies_the_kept_ones(tmp_path):
    store = _store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_gated_config()).eval()
    assert model.gate is not None and model.gate.encoder is not None
    assert not any(p.requires_grad for p in model.gate.parameters())
    with torch.no_grad():
        before = forward_slide(model, store, training=False)
    assert before.cell_indices.numel() == 3  # unfitted: the plain top-k
    from workers.patches import prepare_slide

    slide = prepare_slide(store, model.cfg)
    with torch.no_grad():
        scores = model.score(slide.lowres_u8[None], slide.cell_mask[None], slide.geometry)
        cells, values = gate_candidates(model, scores, tuple(slide.cell_mask.shape))
        assert cells.numel() == 6 and torch.all(values[:-1] >= values[1:])
        pix = slide.reader.read(cells).float() / 255
        feats = model.gate_encode(pix)
    model.gate.fit(feats.double(), values, torch.Generator().manual_seed(0))
    keep = model.gate.keep(feats)
    with torch.no_grad():
        out = forward_slide(model, store, training=False)
        ref_cells = cells[keep].sort().values
        ref = model.aggregate(
            model.embed(slide.reader.read(ref_cells).float() / 255)[None],
            slide.grid.cell_centres(ref_cells)[None],
            None,
        )
    assert torch.equal(out.cell_indices, ref_cells)
    assert out.info["cells_read"] == 6 and out.info["gate_kept"] == ref_cells.numel()
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-6)
    # training: the gate applies in the second phase only (fixed selection); the first phase is unchanged
    model.train()
    g = torch.Generator().manual_seed(0)
    fixed = forward_slide(model, store, training=True, generator=g, target=1, fixed_selection="topk")
    assert torch.equal(fixed.cell_indices, ref_cells) and fixed.aux_losses == {}
    free = forward_slide(model, store, training=True, sigma=0.1, generator=g, target=1)
    assert "gate_kept" not in free.info and free.cell_indices.numel() == 3


def test_vote_weights_weigh_each_kept_cell_by_its_fits_in_forward_and_scoring(tmp_path):
    # gate_weights: votes — the bag's cells weighted by how many of the F fits keep them (over the kept cells'
    # total), the same in a gated forward and in the scoring stages; equal weights are the plain mean
    from operators.checkpoint import save_checkpoint
    from workers.patches import prepare_slide
    from workers.scoring import ClassifierWorker, ScorerWorker

    store = _store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_gated_config(6, 3, gate_fits=4, gate_weights="votes")).eval()
    slide = prepare_slide(store, model.cfg)
    with torch.no_grad():
        scores = model.score(slide.lowres_u8[None], slide.cell_mask[None], slide.geometry)
        cells, values = gate_candidates(model, scores, tuple(slide.cell_mask.shape))
        feats = model.gate_encode(slide.reader.read(cells).float() / 255)
    model.gate.fit(feats.double(), values, torch.Generator().manual_seed(1))
    # fit 0 keeps every cluster, the other fits only the cluster of the best candidate: unequal votes
    nearest = model.gate.assign(feats)  # [M, F]
    info = torch.zeros(4, 3, dtype=torch.bool)
    info[0] = True
    info[torch.arange(1, 4), nearest[0, 1:]] = True
    model.gate.informative.copy_(info.flatten())
    keep, votes = model.gate.keep(feats), model.gate.vote_counts(feats)
    ref_cells, order = cells[keep].sort()
    w = votes[keep][order].double().clamp_min(1)
    w = (w / w.sum()).float()
    with torch.no_grad():
        out = forward_slide(model, store, training=False)
        emb = model.embed(slide.reader.read(ref_cells).float() / 255)
        pos = slide.grid.cell_centres(ref_cells)[None]
        ref = model.aggregate(emb[None], pos, w[None])
        plain = model.aggregate(emb[None], pos, None)
    assert torch.equal(out.cell_indices, ref_cells)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    assert len(set(w.tolist())) > 1  # unequal votes on this slide: not the plain mean
    assert not torch.allclose(out.logits, plain, atol=1e-6)
    path = save_checkpoint(tmp_path / "votes.pt", model, model.cfg, ["a", "b"])
    sw, cw = ScorerWorker(str(path), device="cpu"), ClassifierWorker(str(path))
    row = cw.classify_batch(sw.score_batch([("s", store)]))[0]
    assert row["status"] == "ok", row
    probs = torch.softmax(out.logits.reshape(-1), 0).numpy()
    np.testing.assert_allclose([row["probabilities"][c] for c in ("a", "b")], probs, rtol=1e-5, atol=1e-6)
    from operators.errors import ConfigError
    from operators.model_config import ExperimentalConfig

    with pytest.raises(ConfigError, match="gate_weights: votes needs"):
        ExperimentalConfig(gate_candidates=16, gate_weights="votes")
    with pytest.raises(ConfigError, match="gate_weights"):
        ExperimentalConfig(gate_candidates=16, gate_fits=4, gate_weights="score")


def test_trainer_fits_the_gate_at_the_switch_and_it_survives_a_checkpoint(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(ValueError, match="needs schedule.select_until"):
        Trainer(_gated_config(), OptimConfig(epochs=1), ScheduleConfig(), slides_per_epoch=1)
    tr = Trainer(
        _gated_config(),
        OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1),
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5),
        slides_per_epoch=2,
    )
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr.train_epoch(records)
    assert not tr.model.gate.is_fitted  # the first phase
    enc_at_switch = {k: v.clone() for k, v in tr.model.features.state_dict().items()}
    tr.train_epoch(records)
    gate, ema_gate = tr.model.gate, tr.ema_model.gate
    assert gate.is_fitted and ema_gate.is_fitted
    for k, v in gate.state_dict().items():
        assert torch.equal(v, ema_gate.state_dict()[k]), k
    for k, v in gate.encoder.state_dict().items():  # the frozen copy is the encoder as it was at the switch
        assert torch.equal(v, enc_at_switch[k]), k
    assert any(not torch.equal(v, enc_at_switch[k]) for k, v in tr.model.features.state_dict().items())
    model = tr.eval_model.eval()
    with torch.no_grad():
        out = forward_slide(model, store, training=False)
    assert "gate_kept" in out.info
    # a checkpoint's state dict gives the same gated predictions in a fresh model
    fresh = FoveateModel(model.cfg).eval()
    fresh.load_state_dict(model.state_dict())

    def fresh_plain():
        return FoveateModel(model.cfg).eval()  # the same config, its gate never fitted

    with torch.no_grad():
        again = forward_slide(fresh, store, training=False)
    assert torch.equal(again.cell_indices, out.cell_indices)
    torch.testing.assert_close(again.logits, out.logits, rtol=0, atol=0)

    # the scoring stages (foveate score, the served model) give the same bag and probabilities
    from operators.checkpoint import save_checkpoint
    from workers.scoring import ClassifierWorker, ScorerWorker

    path = save_checkpoint(tmp_path / "gated.pt", model, model.cfg, ["a", "b"])
    sw, cw = ScorerWorker(str(path), device="cpu"), ClassifierWorker(str(path))
    items = sw.score_batch([("s", store)])
    assert items[0]["gated"] and len(items[0]["cells"]) == out.info["gate_candidates"]
    row = cw.classify_batch(items)[0]
    assert row["status"] == "ok", row
    xy = out.coords_l0.numpy()
    np.testing.assert_array_equal([[p["x"], p["y"]] for p in row["patches"]], xy)
    probs = torch.softmax(out.logits.reshape(-1), 0).numpy()
    np.testing.assert_allclose([row["probabilities"][c] for c in ("a", "b")], probs, rtol=1e-5, atol=1e-6)
    # bags of different sizes in one batch: each slide classified on its own
    other = {**items[0], "slide_id": "t", "cells": items[0]["cells"][:1]}
    rows = cw.classify_batch([items[0], other])
    assert [len(r["patches"]) for r in rows] == [len(xy), 1]
    np.testing.assert_allclose([rows[0]["probabilities"][c] for c in ("a", "b")], probs, rtol=1e-5, atol=1e-6)
    plain = ClassifierWorker(save_checkpoint(tmp_path / "plain.pt", fresh_plain(), model.cfg, ["a", "b"]))
    assert "no fitted gate" in plain.classify_batch(items)[0]["error"]


def test_the_gate_keeps_from_more_candidates_than_it_is_fitted_on(tmp_path):
    # gate_candidates 4, gate_keep_from 6: the trainer's fit sees 4 candidates per slide, a gated forward (and the
    # scorer stage) reads and chooses from 6
    store = _store(tmp_path)
    tr = Trainer(
        _gated_config(4, 2, gate_keep_from=6, gate_fits=3),
        OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0),
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5),
        slides_per_epoch=2,
    )
    assert tr.model.gate.fits == 3 and tr.model.gate.centroids.shape[0] == 6
    fitted_on = []
    real_fit = tr.model.gate.fit

    def recording_fit(features, scores, generator=None, ranks=None):
        fitted_on.append(features.shape[0])
        return real_fit(features, scores, generator, ranks)

    tr.model.gate.fit = recording_fit
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr.train_epoch(records)
    tr.train_epoch(records)
    assert fitted_on == [8]  # 4 candidates of each of the 2 training slides
    model = tr.model.eval()
    with torch.no_grad():
        out = forward_slide(model, store, training=False)
    assert out.info["cells_read"] == 6 and out.info["gate_candidates"] == 6
    from workers.patches import prepare_slide

    slide = prepare_slide(store, model.cfg)
    cells6, _ = gate_candidates(model, out.scores[None], tuple(slide.cell_mask.shape))
    cells4, _ = gate_candidates(model, out.scores[None], tuple(slide.cell_mask.shape), 4)
    assert torch.equal(cells6[:4], cells4)  # the same ranking, read further down
    assert set(out.cell_indices.tolist()) <= set(cells6.tolist())


def test_gate_fits_and_keep_from_are_checked():
    from operators.errors import ConfigError
    from operators.model_config import ExperimentalConfig

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="gate_fits"):
            ExperimentalConfig(gate_candidates=16, gate_fits=bad)
    with pytest.raises(ConfigError, match="gate_keep_from must be 0 .* at least gate_candidates=16, got 8"):
        ExperimentalConfig(gate_candidates=16, gate_keep_from=8)
    with pytest.raises(ConfigError, match="gate_keep_from"):
        ExperimentalConfig(gate_candidates=16, gate_keep_from=-1)
    with pytest.raises(ConfigError, match="the cluster gate is off"):
        ExperimentalConfig(gate_fits=8)
    with pytest.raises(ConfigError, match="the cluster gate is off"):
        ExperimentalConfig(gate_agree=0.5)
    for bad in (-0.5, 1.01, True):
        with pytest.raises(ConfigError, match="gate_agree"):
            ExperimentalConfig(gate_candidates=16, gate_fits=8, gate_agree=bad)
    assert ExperimentalConfig(gate_candidates=16, gate_fits=8, gate_agree=0.5).gate_agree == 0.5
    assert ExperimentalConfig(gate_candidates=16, gate_keep_from=0).gate_keep_from == 0
    assert ExperimentalConfig(gate_candidates=16, gate_keep_from=24, gate_fits=8).gate_fits == 8


@pytest.mark.parametrize(("candidates", "clusters"), list(itertools.product((-1, 1.5, True), (16,))) + [(8, 1)])
def test_gate_settings_are_checked(candidates, clusters):
    from operators.errors import ConfigError
    from operators.model_config import ExperimentalConfig

    with pytest.raises(ConfigError, match="gate_"):
        ExperimentalConfig(gate_candidates=candidates, gate_clusters=clusters)
    with pytest.raises(ConfigError, match="gate_margin"):
        ExperimentalConfig(gate_margin=-0.5)


def test_select_restart_starts_the_classifier_and_the_learning_rate_again(tmp_path):
    from operators.errors import ConfigError
    from workers.trainer import EpochResult, lr_factor

    with pytest.raises(ConfigError, match="select_restart"):
        ScheduleConfig(select_restart=True)
    with pytest.raises(ConfigError, match="select_restart"):
        ScheduleConfig(select_until=0.5, select_restart="yes")
    store = _store(tmp_path)
    optim = OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=1, weight_decay=0.1, ema_epochs=1)
    tr = Trainer(
        _gated_config(),
        optim,
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5, select_restart=True),
        slides_per_epoch=2,
        seed=3,
        early_stopping=EarlyStoppingConfig(patience=2),
    )
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    calls = []
    restart = tr._restart_classifier
    # a first-phase best epoch and its kept weights: after the restart neither is a candidate for export
    tr.stopper.update(1, 0.5)
    tr.stopper.update(2, 0.7)
    tr.best_state = {k: v.clone() for k, v in tr.eval_model.state_dict().items()}

    def spy():
        calls.append(tr.global_step)
        before = {k: v.clone() for k, v in tr.model.scorer.state_dict().items()}
        restart()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3 * 7919 + 1)
            fresh = FoveateModel(tr.model.cfg)
        for name in ("features", "feature_norm", "aggregator"):
            mine, ref = getattr(tr.model, name), getattr(fresh, name)
            if mine is None:
                continue
            for k, v in ref.state_dict().items():
                assert torch.equal(mine.state_dict()[k], v), (name, k)
            assert all(p not in tr.optimizer.state for p in mine.parameters())
        for k, v in tr.model.state_dict().items():  # the moving average starts from the weights as they are
            assert torch.equal(tr.ema_model.state_dict()[k], v), k
        for k, v in tr.model.scorer.state_dict().items():  # the fixed scorer stays
            assert torch.equal(before[k], v), k
        assert tr.model.gate.is_fitted  # fitted before the restart, on the encoder as it was
        assert tr.best_state is None  # early stopping starts over with the new classifier
        assert (tr.stopper.best, tr.stopper.best_epoch, tr.stopper.bad_epochs) == (None, 0, 0)
        assert not tr.stopper.update(3, 0.9) and tr.stopper.best_epoch == 3  # any value is the new best

    tr._restart_classifier = spy
    tr._train_records = records  # what train_epoch hands on (the gate is fitted on them)
    lrs = []
    for i in range(4):
        lrs.append(tr.optimizer.param_groups[0]["lr"])
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    assert calls == [2]
    # warm-up and cosine over steps 0-3, or again over 2-3 from the switch
    assert lrs == pytest.approx(
        [0.05 * lr_factor(s, 4, 1, optim.min_lr_ratio) for s in (0, 1)]
        + [0.05 * lr_factor(s, 2, 1, optim.min_lr_ratio) for s in (0, 1)]
    )


def test_gate_refits_fit_the_gate_again_during_the_second_phase(tmp_path):
    from operators.errors import ConfigError
    from workers.trainer import EpochResult

    for bad in (-1, 1.0, True):
        with pytest.raises(ConfigError, match="gate_refits"):
            ScheduleConfig(select_until=0.5, gate_refits=bad)
    assert ScheduleConfig(gate_refits=2).gate_refit_steps(100) == []  # one phase: no gate to refit
    assert ScheduleConfig(select_until=0.5, gate_refits=1).gate_refit_steps(100) == [75]
    assert ScheduleConfig(select_until=0.5, gate_refits=3).gate_refit_steps(100) == [62, 75, 88]
    assert ScheduleConfig(select_until=0.5, gate_refits=4).gate_refit_steps(4) == [3, 4]  # never at the switch
    store = _store(tmp_path)
    tr = Trainer(
        _gated_config(),
        OptimConfig(epochs=4, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1),
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5, gate_refits=1),
        slides_per_epoch=2,
    )
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr._train_records = records
    fits, encoders = [], []
    fit = tr._fit_gate

    def spy():
        fits.append(tr.global_step)
        fit()
        encoders.append({k: v.clone() for k, v in tr.model.gate.encoder.state_dict().items()})

    tr._fit_gate = spy
    for i in range(8):
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    assert fits == [4, 6]
    # each fit copies the encoder as it is then: the second differs from the first (the encoder trained between)
    assert any(not torch.equal(encoders[0][k], v) for k, v in encoders[1].items())
    for k, v in tr.model.gate.state_dict().items():
        assert torch.equal(tr.ema_model.gate.state_dict()[k], v), k


def test_gate_encoder_file_is_the_gates_own_and_is_never_refreshed(tmp_path):
    from operators.checkpoint import load_checkpoint, save_checkpoint
    from operators.errors import ConfigError
    from operators.resnet import ResNet

    store = _store(tmp_path)
    base = _gated_config()
    torch.manual_seed(7)
    pretrained = ResNet(base.features.resnet())  # what `foveate pretrain` writes: the encoder's state dict
    torch.save(pretrained.state_dict(), tmp_path / "encoder.pt")
    cfg = dataclasses.replace(
        base, experimental=dataclasses.replace(base.experimental, gate_encoder=str(tmp_path / "encoder.pt"))
    )
    tr = Trainer(
        cfg,
        OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1),
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5),
        slides_per_epoch=2,
    )
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr.train_epoch(records)
    tr.train_epoch(records)
    gate = tr.model.gate
    assert gate.is_fitted and gate.encoder is not tr.model.features
    for k, v in gate.encoder.state_dict().items():  # the file's weights, not the model's encoder at the switch
        assert torch.equal(v, pretrained.state_dict()[k]), k
    assert any(not torch.equal(v, pretrained.state_dict()[k]) for k, v in tr.model.features.state_dict().items())
    assert not any(p.requires_grad for p in gate.encoder.parameters())
    # a checkpoint loads without the file: the gate's encoder is in its state dict
    model = tr.eval_model.eval()
    path = save_checkpoint(tmp_path / "g.pt", model, model.cfg, ["a", "b"])
    (tmp_path / "encoder.pt").unlink()
    loaded, lcfg, _ = load_checkpoint(path)
    assert lcfg.experimental.gate_encoder is None
    with torch.no_grad():
        a, b = forward_slide(model, store, training=False), forward_slide(loaded.eval(), store, training=False)
    assert torch.equal(a.cell_indices, b.cell_indices)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    # a missing file, the gate off, a frozen encoder: each a clear error
    with pytest.raises(ValueError, match="existing state_dict file"):
        FoveateModel(cfg)
    with pytest.raises(ConfigError, match="gate is off"):
        dataclasses.replace(cfg, experimental=dataclasses.replace(cfg.experimental, gate_candidates=0))
    with pytest.raises(ConfigError, match="trained ResNet encoder"):
        dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, freeze=True))


def test_gate_encoder_from_an_mlflow_run_is_resolved_by_the_driver(tmp_path):
    import mlflow

    from operators.errors import ConfigError
    from operators.resnet import ResNet
    from pipeline.encoder_init import ENCODER_DIR, ENCODER_FILE
    from pipeline.train import TrainConfig, _encoder_inits

    base = _gated_config()
    torch.manual_seed(11)
    pretrained = ResNet(base.features.resnet())
    (tmp_path / ENCODER_DIR).mkdir()
    torch.save(pretrained.state_dict(), tmp_path / ENCODER_DIR / ENCODER_FILE)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("gate-encoder", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    client.log_artifact(run_id, str(tmp_path / ENCODER_DIR / ENCODER_FILE), ENCODER_DIR)
    client.set_terminated(run_id)

    def config(gate_encoder):
        ex = dataclasses.replace(base.experimental, gate_encoder=gate_encoder)
        return TrainConfig(model=dataclasses.replace(base, experimental=ex))

    inits = _encoder_inits(config(f"runs:/{run_id}"), uri)
    assert list(inits) == ["gate_encoder_init"]
    state = inits["gate_encoder_init"]
    assert all(torch.equal(state[k], v) for k, v in pretrained.state_dict().items())
    assert _encoder_inits(config(str(tmp_path / ENCODER_DIR / ENCODER_FILE)), uri) == {}  # a file: read by the model
    with pytest.raises(ConfigError, match=r"model.experimental.gate_encoder='runs:/missing'.*cannot find"):
        _encoder_inits(config("runs:/missing"), uri)

    cfg = config(f"runs:/{run_id}").model
    optim, schedule = OptimConfig(), ScheduleConfig(select_until=0.5)
    with pytest.raises(ValueError, match="gate_encoder=.* is an MLflow URI: the driver resolves it"):
        Trainer(cfg, optim, schedule, slides_per_epoch=1)
    tr = Trainer(cfg, optim, schedule, slides_per_epoch=1, gate_encoder_init=state)
    for k, v in tr.model.gate.encoder.state_dict().items():  # the run's weights, in the model and its average
        assert torch.equal(v, state[k]) and torch.equal(tr.eval_model.gate.encoder.state_dict()[k], v), k
    assert any(not torch.equal(v, state[k]) for k, v in tr.model.features.state_dict().items())
    with pytest.raises(ValueError, match="gate_encoder_init was given"):
        Trainer(base, optim, schedule, slides_per_epoch=1, gate_encoder_init=state)


def test_the_cut_counts_clusters_not_cells():
    # cluster mean scores and sizes as a pretrained gate encoder gave them on the shape family (one seed): four
    # glyph clusters (0.94-0.88), twelve of strokes (0.85-0.84), the strokes' clusters the larger. Weighted by size
    # the split leaves the fourth glyph cluster (246 cells) out; one point per cluster keeps it.
    ms = torch.tensor([0.9367, 0.9197, 0.8928, 0.8782] + [0.8495, 0.8472, 0.8472, 0.8470, 0.8461, 0.8431, 0.8428]
                      + [0.8426, 0.8415, 0.8407, 0.8397, 0.8378], dtype=torch.float64)  # fmt: skip
    size = torch.tensor([511, 444, 255, 246, 228, 82, 361, 252, 334, 190, 261, 225, 296, 150, 110, 343])
    assert int(two_means_upper(ms, size.double()).sum()) == 3
    assert two_means_upper(ms, torch.ones(16, dtype=torch.float64)).tolist() == [True] * 4 + [False] * 12
    # the fit does the same: features in 16 separated blobs of those sizes, each blob scored at its mean
    centres = torch.eye(16, 20, dtype=torch.float64) * 6 + 1.0
    g = torch.Generator().manual_seed(0)
    x = centres.repeat_interleave(size, 0) + 0.1 * torch.randn(int(size.sum()), 20, generator=g, dtype=torch.float64)
    label = torch.arange(16).repeat_interleave(size)
    scores = ms[label] + 0.01 * torch.randn(len(label), generator=g, dtype=torch.float64)
    fit = fit_cluster_gate(x, scores, 16, torch.Generator().manual_seed(1))  # a seeding that finds the 16 blobs
    assert len(set(zip(fit["assignment"].tolist(), label.tolist()))) == 16
    assert torch.equal(fit["informative"][fit["assignment"]], label < 4)


def test_the_rank_cut_keeps_the_clusters_ranked_first_in_their_slides():
    # four separated appearances: A best-scored and first in its slide; B scored nearly as high but ranked low (the
    # filler a long candidate list adds); C, D low-scored and low-ranked. The mean score puts B with A; the mean
    # within-slide rank puts A alone in the upper group.
    centres = torch.eye(4, 8, dtype=torch.float64)
    x, label = _blobs(centres, 30, 0.05)
    score = torch.tensor([0.90, 0.89, 0.10, 0.11], dtype=torch.float64)[label]
    rank = torch.tensor([0.0, 20.0, 19.0, 21.0], dtype=torch.float64)[label]
    by_score = fit_cluster_gate(x, score, 4, torch.Generator().manual_seed(0))
    by_rank = fit_cluster_gate(x, score, 4, torch.Generator().manual_seed(0), ranks=rank)
    kept_score = by_score["informative"][by_score["assignment"]]
    kept_rank = by_rank["informative"][by_rank["assignment"]]
    assert torch.equal(kept_score, label <= 1) and torch.equal(kept_rank, label == 0)
    with pytest.raises(ValueError, match="ranks must be"):
        fit_cluster_gate(x, score, 4, ranks=rank[:-1])


def test_the_trainer_hands_the_candidates_ranks_to_the_gate_with_the_rank_cut(tmp_path):
    store = _store(tmp_path)
    cfg = _gated_config()
    cfg = dataclasses.replace(cfg, experimental=dataclasses.replace(cfg.experimental, gate_cut="rank"))
    tr = Trainer(cfg, OptimConfig(epochs=2, accumulate=1), ScheduleConfig(select_until=0.5), slides_per_epoch=2)
    seen = {}
    fit = tr.model.gate.fit

    def spy(features, scores, generator=None, ranks=None):
        seen["ranks"] = ranks
        return fit(features, scores, generator, ranks=ranks)

    tr.model.gate.fit = spy
    tr._train_records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr._fit_gate()
    n = cfg.experimental.gate_candidates
    assert torch.equal(seen["ranks"], torch.arange(n, dtype=torch.float64).repeat(2))  # each slide's, best first
    with pytest.raises(Exception, match=r"gate_cut must be one of \['score', 'rank'\], got 'mean'"):
        dataclasses.replace(cfg.experimental, gate_cut="mean")


def test_the_gate_fit_depends_on_the_training_slides_not_their_order(tmp_path):
    """k-means++ seeds by row: the trainer fits on the slides in store order, so an epoch's shuffle (or another
    split of the slides over workers) gives the same gate."""
    from tiny_stores import rare_structures_image

    from workers.store import write_store_from_array

    img = rare_structures_image()
    stores = []
    for i, view in enumerate((img, img[::-1], img[:, ::-1], np.roll(img, 200, axis=1))):
        write_store_from_array(tmp_path / f"s{i}.zarr", np.ascontiguousarray(view), tile_size=128, min_size=64)
        stores.append(str(tmp_path / f"s{i}.zarr"))
    records = [SimpleNamespace(store=s, target=i % 2) for i, s in enumerate(stores)]
    states = []
    for order in (records, records[::-1], records[2:] + records[:2]):
        torch.manual_seed(0)
        tr = Trainer(_gated_config(), OptimConfig(epochs=2), ScheduleConfig(select_until=0.5), slides_per_epoch=4)
        tr._train_records = order
        tr._fit_gate()
        states.append(tr.model.gate.state_dict())
    assert bool(states[0]["informative"].any()) and not bool(states[0]["informative"].all())
    for other in states[1:]:
        for k, v in states[0].items():
            if k.startswith("encoder."):
                continue
            assert torch.equal(v, other[k]), k


def test_select_restart_features_from_the_gate_encoder(tmp_path):
    """``schedule.select_restart_features: gate_encoder``: at the switch the model's feature network becomes a
    trainable copy of the gate's pretrained encoder; the gate's own stays frozen and unchanged by training."""
    from operators.errors import ConfigError
    from operators.resnet import ResNet
    from workers.trainer import EpochResult

    with pytest.raises(ConfigError, match="select_restart_features"):
        ScheduleConfig(select_until=0.5, select_restart=True, select_restart_features="pretrain")
    with pytest.raises(ConfigError, match="select_restart_features"):
        ScheduleConfig(select_until=0.5, select_restart_features="gate_encoder")  # no restart
    schedule = ScheduleConfig(
        sigma_start=0.1, sigma_end=0.1, select_until=0.5, select_restart=True, select_restart_features="gate_encoder"
    )
    optim = OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1)
    with pytest.raises(ValueError, match="gate_encoder"):  # the gate's encoder is a copy of the model's: refused
        Trainer(_gated_config(), optim, schedule, slides_per_epoch=2)
    store = _store(tmp_path)
    base = _gated_config()
    torch.manual_seed(7)
    pretrained = ResNet(base.features.resnet()).state_dict()
    torch.save(pretrained, tmp_path / "encoder.pt")
    cfg = dataclasses.replace(
        base, experimental=dataclasses.replace(base.experimental, gate_encoder=str(tmp_path / "encoder.pt"))
    )
    tr = Trainer(cfg, optim, schedule, slides_per_epoch=2, seed=3)
    assert any(not torch.equal(v, pretrained[k]) for k, v in tr.model.features.state_dict().items())
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr._train_records = records
    seen = []
    restart = tr._restart_classifier

    def spy():
        restart()
        seen.append({k: v.clone() for k, v in tr.model.features.state_dict().items()})

    tr._restart_classifier = spy
    for i in range(4):
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    assert len(seen) == 1
    for k, v in seen[0].items():  # at the switch: the pretrained weights
        assert torch.equal(v, pretrained[k]), k
    assert tr.model.features is not tr.model.gate.encoder
    assert any(p.requires_grad for p in tr.model.features.parameters())
    assert any(not torch.equal(v, pretrained[k]) for k, v in tr.model.features.state_dict().items())  # fine-tuned
    for k, v in tr.model.gate.encoder.state_dict().items():  # the gate's stays
        assert torch.equal(v, pretrained[k]), k
