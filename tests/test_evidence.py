"""Evidence distillation (operators.evidence) and stratified exploration (workers.patches): float64 references,
finite-difference gradients, and the behaviour the training relies on."""

from __future__ import annotations

import math

import pytest
import torch
from flat_model_config import flat_config, flat_replace
from tiny_stores import rare_structures_image, rare_structures_store

from operators.errors import ConfigError
from operators.evidence import evidence_rank_loss, instance_confidence, instance_loss, neutral_loss
from operators.model import FoveateModel
from operators.model_config import ModelConfig
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers.slide_forward import forward_slide
from workers.strata import cell_strata, draw_cells

torch.set_num_threads(1)


def _rank_loss_reference(s, e, t):
    num = den = 0.0
    for i in range(len(s)):
        for j in range(len(s)):
            w = max(e[i] - e[j], 0.0)
            num += w * math.log1p(math.exp(-(s[i] - s[j]) / t))
            den += w
    return num / den


def test_rank_loss_matches_a_loop_reference_and_finite_differences():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(7, generator=g, dtype=torch.float64, requires_grad=True)
    e = torch.rand(7, generator=g, dtype=torch.float64)
    loss = evidence_rank_loss(s, e, temperature=0.3)
    assert float(loss.detach()) == pytest.approx(_rank_loss_reference(s.tolist(), e.tolist(), 0.3), rel=1e-12)
    assert torch.autograd.gradcheck(lambda x: evidence_rank_loss(x, e, temperature=0.3), (s,), eps=1e-6, atol=1e-8)
    # the targets are constants: no gradient reaches them
    e2 = e.clone().requires_grad_(True)
    evidence_rank_loss(s, e2, temperature=0.3).backward()
    assert e2.grad is None


def test_rank_loss_pushes_high_evidence_cells_up_and_is_zero_without_evidence_spread():
    s = torch.tensor([0.2, 0.8, 0.5], dtype=torch.float64, requires_grad=True)
    e = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    evidence_rank_loss(s, e, temperature=0.1).backward()
    assert s.grad[0] < 0 < s.grad[1]  # gradient descent raises cell 0, lowers cell 1
    assert s.grad[2] > 0
    flat = evidence_rank_loss(s.detach().requires_grad_(True), torch.full((3,), 0.4, dtype=torch.float64))
    assert float(flat.detach()) == 0.0
    # correctly ordered with a wide margin: ~0
    good = evidence_rank_loss(
        torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64), temperature=0.05
    )
    assert float(good) < 1e-8


def test_instance_confidence_and_loss_reference():
    logits = torch.tensor([[0.0, 0.0], [10.0, -10.0], [1.0, 2.0]], dtype=torch.float64)
    conf = instance_confidence(logits)
    p = torch.softmax(logits, 1)
    ref = 1 + (p * p.log()).sum(1) / math.log(2)
    assert torch.allclose(conf, ref, atol=1e-12)
    assert float(conf[0]) == pytest.approx(0.0, abs=1e-12) and float(conf[1]) > 0.999
    assert float(instance_loss(logits, 1)) == pytest.approx(
        float(-torch.log_softmax(logits, 1)[:, 1].mean()), rel=1e-12
    )
    with pytest.raises(ValueError, match="class index"):
        instance_loss(logits, 2)
    with pytest.raises(ValueError, match=r"\[M, C\]"):
        instance_confidence(torch.zeros(3))
    with pytest.raises(ValueError, match="temperature"):
        evidence_rank_loss(torch.zeros(2), torch.zeros(2), temperature=0)
    with pytest.raises(ValueError, match="shape"):
        evidence_rank_loss(torch.zeros(2), torch.zeros(3))


def test_config_validates_evidence_fields():
    with pytest.raises(ConfigError, match="instance_weight"):
        flat_config(rank_weight=0.1)
    with pytest.raises(ConfigError, match="explore_cells"):
        flat_config(explore_cells=-1)
    with pytest.raises(ValueError, match="rank_temperature"):  # ConfigError is a ValueError
        flat_config(instance_weight=1.0, rank_temperature=0.0)
    assert FoveateModel(flat_config()).instance_head is None  # off by default: same parameters as before
    assert FoveateModel(flat_config(instance_weight=1.0)).instance_head is not None


def test_strata_isolate_rare_cells_and_stratified_exploration_reads_them_more_often():
    img = torch.from_numpy(rare_structures_image()).permute(2, 0, 1).float().div(255)
    lowres = torch.nn.functional.interpolate(img[None], size=(64, 64), mode="area")[0]  # 1/8, grid 8x8 of 64 px
    strata = cell_strata(lowres, (8, 8), 4)
    dark = [1 * 8 + 1, 5 * 8 + 6]  # cells holding the structures
    assert strata.shape == (64,) and len({int(strata[c]) for c in dark}) == 1
    assert int((strata == strata[dark[0]]).sum()) <= 4  # a small stratum of its own
    scores = torch.zeros(64, dtype=torch.float64)
    scores[:8] = float("-inf")  # a non-candidate row is never drawn
    g = torch.Generator().manual_seed(0)
    hit_strat = hit_unif = 0
    for _ in range(200):
        a = draw_cells(scores, 4, g, strata)
        b = draw_cells(scores, 4, g, None)
        assert len(set(a.tolist())) == 4 and len(set(b.tolist())) == 4
        assert all(c >= 8 for c in a.tolist() + b.tolist())
        hit_strat += sum(c in dark[1:] for c in a.tolist())
        hit_unif += sum(c in dark[1:] for c in b.tolist())
    assert hit_strat > 3 * hit_unif
    assert draw_cells(scores, 100, g, strata).numel() == 56  # all candidates when fewer


def _image_store(tmp_path):
    """:func:`tiny_stores.rare_structures_image` as a real Zarr store (128 px tiles)."""
    return rare_structures_store(tmp_path / "s.zarr")


def _small_config(**extra) -> ModelConfig:
    """A small model on :func:`_image`'s 8 x 8 grid of 64 px cells."""
    return flat_config(
        patch_size=64,
        scorer_downsample=8.0,
        k=4,
        num_samples=16,
        scorer=ScorerConfig(channels=8, pool="mean"),
        features=ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=16),
        **extra,
    )


def _evidence_config(**extra) -> ModelConfig:
    """:func:`_small_config` with the evidence losses on."""
    return _small_config(instance_weight=1.0, rank_weight=0.5, **extra)


def test_forward_slide_adds_evidence_losses_only_in_training_with_a_target(tmp_path):
    store = _image_store(tmp_path)
    cfg = _evidence_config(explore_cells=3, explore_strata=4)
    torch.manual_seed(0)
    model = FoveateModel(cfg)
    g = torch.Generator().manual_seed(0)
    out = forward_slide(model, store, training=True, sigma=0.1, generator=g, target=1)
    assert set(out.aux_losses) == {"instance", "rank"} and out.info["explore_cells"] == 3
    sum(out.aux_losses.values()).backward()
    assert model.instance_head.weight.grad.abs().sum() > 0
    assert sum(float(p.grad.abs().sum()) for p in model.scorer.parameters() if p.grad is not None) > 0
    assert forward_slide(model, store, training=True, sigma=0.1, generator=g).aux_losses == {}
    with torch.no_grad():
        assert forward_slide(model, store, training=False, target=1).aux_losses == {}


def test_rare_cells_are_the_smallest_strata_and_the_rare_bag_trains_the_classifier(tmp_path):
    from workers.strata import rare_cells

    img = torch.from_numpy(rare_structures_image()).permute(2, 0, 1).float().div(255)
    lowres = torch.nn.functional.interpolate(img[None], size=(64, 64), mode="area")[0]
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[1:7, 1:7] = True  # the border cells (half slide background) are not tissue: never a rare cell
    inner = set(torch.nonzero(mask.flatten()).flatten().tolist())
    dark = {1 * 8 + 1, 5 * 8 + 6}
    cells = rare_cells(lowres, mask, 2, 4)
    assert set(cells.tolist()) == dark  # the two structures form the smallest stratum
    assert torch.equal(rare_cells(lowres, mask, 2, 4), cells)  # deterministic, label-free
    more = rare_cells(lowres, mask, 10, 4)
    assert len(set(more.tolist())) == 10 and dark <= set(more.tolist()) <= inner
    assert rare_cells(lowres, mask, 100, 4).numel() == 36 and rare_cells(lowres, mask, 0, 4).numel() == 0
    with pytest.raises(ConfigError, match="rare_cells"):
        flat_config(rare_cells=4)  # needs the evidence losses
    with pytest.raises(ConfigError, match="rare_weight"):
        flat_config(instance_weight=1.0, rare_cells=4, rare_weight=float("nan"))

    store = _image_store(tmp_path)
    cfg = _evidence_config(rare_cells=2, rare_strata=4)
    torch.manual_seed(0)
    model = FoveateModel(cfg)
    g = torch.Generator().manual_seed(0)
    out = forward_slide(model, store, training=True, sigma=0.1, generator=g, target=1)
    assert set(out.aux_losses) == {"instance", "rank", "rare"}
    assert out.info["cells_read"] >= 2
    # the rare bag's loss is the aggregator's cross-entropy on the two rare cells, with the slide label
    from workers.patches import prepare_slide

    si = prepare_slide(store, cfg)
    rare = rare_cells(si.lowres_u8, si.cell_mask, 2, 4)
    with torch.no_grad():
        feats = model.embed(si.reader.read(rare).float().div(255))
        ref = torch.nn.functional.cross_entropy(
            model.aggregate(feats[None], si.grid.cell_centres(rare)[None].float()), torch.tensor([1])
        )
    assert float(out.aux_losses["rare"].detach()) == pytest.approx(float(ref), rel=1e-5)
    out.aux_losses["rare"].backward()
    assert sum(float(p.grad.abs().sum()) for p in model.aggregator.parameters() if p.grad is not None) > 0
    with torch.no_grad():
        assert "rare" not in forward_slide(model, store, training=False, target=1).aux_losses


def test_per_module_clipping_keeps_the_classifier_update_when_the_scorer_gradient_is_huge():
    from types import SimpleNamespace

    from workers.trainer import EpochResult, OptimConfig, ScheduleConfig, Trainer

    with pytest.raises(ValueError, match="optim.clip"):
        OptimConfig(clip="layerwise")
    cfg = flat_config(
        patch_size=64,
        scorer_downsample=8.0,
        k=2,
        scorer=ScorerConfig(channels=8, pool="mean"),
        features=ResNetConfig(widths=(8,), blocks=(1,), feature_dim=8),
    )
    grads = {}
    for mode in ("global", "per_module"):
        tr = Trainer(cfg, OptimConfig(grad_clip=1.0, clip=mode, lr=0.1), ScheduleConfig(), slides_per_epoch=1)
        # a fixed loss: the aggregator's gradient of norm ~1, the scorer's 1000x larger
        agg = [p for p in tr.model.aggregator.parameters()]
        sc = [p for p in tr.model.scorer.parameters()]

        def fake_forward(
            store, *, training, sigma, target=None, rarity=0.0, rare=1.0, fixed_selection=None, agg=agg, sc=sc
        ):
            loss = sum(p.sum() for p in agg) / math.sqrt(sum(p.numel() for p in agg))
            loss = loss + 1000.0 * sum(p.sum() for p in sc) / math.sqrt(sum(p.numel() for p in sc))
            return SimpleNamespace(
                logits=torch.zeros(1, 2) + 0 * loss, aux_losses={"x": loss}, info={}, coords_l0=torch.zeros(2, 2)
            )

        tr._forward = fake_forward
        tr._store = lambda path: None
        before = [p.detach().clone() for p in agg]
        tr.step([SimpleNamespace(store="s", target=0)], EpochResult(started=0.0))
        # the step clips in place and leaves the gradients it applied (zero_grad runs at the next step's start)
        grads[mode] = float(torch.stack([p.grad.norm() for p in agg]).norm())
        assert any(not torch.equal(a, b) for a, b in zip(before, agg))
    assert grads["global"] < 2e-3  # one norm over everything: the classifier's share is scaled by ~1/1000
    assert grads["per_module"] == pytest.approx(1.0, rel=1e-4)  # its own norm, untouched by the scorer's


def test_label_evidence_ranks_read_cells_by_the_classifiers_probability_of_the_slide_label():
    """evidence="label": the rank targets are softmax(aggregator(cell as a bag of one))[label], which for the mean
    aggregator is the linear head on that cell's features; the bag's attention (heatmaps) is left alone."""
    with pytest.raises(ConfigError, match="evidence"):
        flat_config(instance_weight=1.0, rank_weight=0.1, evidence="labels")
    torch.manual_seed(0)
    for aggregator in ("mean", "attention_mil"):
        cfg = _evidence_config(aggregator=aggregator, evidence="label")
        model = FoveateModel(cfg).double()
        feats = torch.randn(6, cfg.features.feature_dim, dtype=torch.float64)
        pos = torch.rand(6, 2, dtype=torch.float64)
        scores = torch.rand(6, dtype=torch.float64, requires_grad=True)
        if aggregator == "attention_mil":
            model.aggregate(feats[None, :3], pos[None, :3])
            bag_att = model.aggregator.last_attention.clone()
        losses, info = model.evidence_losses(feats, scores, 1, pos)
        if aggregator == "attention_mil":
            assert torch.equal(model.aggregator.last_attention, bag_att)
        with torch.no_grad():
            single = torch.stack([model.aggregate(feats[i : i + 1][None], pos[i : i + 1][None])[0] for i in range(6)])
        ev = torch.softmax(single, 1)[:, 1]
        if aggregator == "mean":  # a bag of one through the mean aggregator is the head on that cell
            assert torch.allclose(single, model.aggregator.head(feats), atol=1e-12)
        ref = evidence_rank_loss(scores, ev, temperature=cfg.evidence.rank_temperature)
        assert float(losses["rank"]) == pytest.approx(cfg.evidence.rank_weight * float(ref), rel=1e-12)
        assert info["label_evidence"] == pytest.approx(float(ev.mean()), rel=1e-12)
        # the other label reverses the targets: cells ranked by p(label 0) = 1 - p(label 1)
        losses0, _ = model.evidence_losses(feats, scores, 0, pos)
        ref0 = evidence_rank_loss(scores, 1 - ev, temperature=cfg.evidence.rank_temperature)
        assert float(losses0["rank"]) == pytest.approx(cfg.evidence.rank_weight * float(ref0), rel=1e-12)
        losses["rank"].backward()
        assert scores.grad.abs().sum() > 0


def test_evidence_gamma_makes_the_label_target_concave():
    """evidence_gamma < 1: the rank targets are p(label) ** gamma (a concave target: a cell type whose p(label)
    is high on some slides and low on the others ranks below one with the same mean everywhere)."""
    for bad in (0.0, -0.5, 1.5, float("nan"), "0.5"):
        with pytest.raises(ConfigError, match="evidence_gamma"):
            flat_config(instance_weight=1.0, rank_weight=0.1, evidence="label", evidence_gamma=bad)
    torch.manual_seed(0)
    cfg = _evidence_config(evidence="label", evidence_gamma=0.5)
    model = FoveateModel(cfg).double()
    feats = torch.randn(6, cfg.features.feature_dim, dtype=torch.float64)
    scores = torch.rand(6, dtype=torch.float64, requires_grad=True)
    losses, info = model.evidence_losses(feats, scores, 1)
    with torch.no_grad():
        ev = torch.softmax(model.aggregator.head(feats), 1)[:, 1] ** 0.5
    ref = evidence_rank_loss(scores, ev, temperature=cfg.evidence.rank_temperature)
    assert float(losses["rank"]) == pytest.approx(cfg.evidence.rank_weight * float(ref), rel=1e-12)
    assert info["label_evidence"] == pytest.approx(float(ev.mean()), rel=1e-12)


def test_selection_grad_scales_the_selection_gradient_to_the_scorer_and_not_the_values():
    with pytest.raises(ConfigError, match="scorer_grad"):
        flat_config(selection_grad=1.5)
    scores = torch.rand(2, 30, dtype=torch.float64)
    scores[0, :3] = float("-inf")
    grads, outs = {}, {}
    for w in (1.0, 0.25, 0.0):
        model = FoveateModel(flat_config(k=4, num_samples=32, selection_grad=w)).double()
        s = scores.clone().requires_grad_(True)
        sel = model.select(s, training=True, sigma=0.1, generator=torch.Generator().manual_seed(3))
        loss = (sel.weights * torch.arange(sel.weights.numel(), dtype=torch.float64).view_as(sel.weights)).sum()
        outs[w] = sel.weights.detach()
        loss.backward() if loss.requires_grad else None
        grads[w] = s.grad if s.grad is not None else torch.zeros_like(s)
    assert torch.equal(outs[1.0], outs[0.25]) and torch.equal(outs[1.0], outs[0.0])  # values unchanged
    assert grads[1.0].abs().sum() > 0 and torch.isfinite(grads[1.0]).all()
    assert torch.allclose(grads[0.25], 0.25 * grads[1.0], atol=1e-12)
    assert grads[0.0].abs().sum() == 0


def test_rarity_prior_marks_the_smallest_strata_and_decays_on_schedule():
    from workers.strata import cell_rarity, cell_strata
    from workers.trainer import ScheduleConfig, linear_decay

    img = torch.from_numpy(rare_structures_image()).permute(2, 0, 1).float().div(255)
    lowres = torch.nn.functional.interpolate(img[None], size=(64, 64), mode="area")[0]
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[1:7, 1:7] = True
    r = cell_rarity(lowres, mask, 4)
    st = cell_strata(lowres, (8, 8), 4)
    m = mask.flatten()
    sizes = torch.bincount(st[m], minlength=int(st.max()) + 1).double()
    ref = -torch.log(sizes[st].clamp_min(1) / m.sum())
    ref = torch.where(m, ref, torch.zeros_like(ref))
    assert torch.allclose(r.double(), ref / ref.max(), atol=1e-6)
    dark = [1 * 8 + 1, 5 * 8 + 6]
    assert r[dark].tolist() == [1.0, 1.0] and float(r[~m].abs().max()) == 0.0
    assert float(r[m].min()) < 0.2  # the common background stratum is far below the rare structures

    assert linear_decay(0, 100, 0.8, 0.5) == pytest.approx(0.8)
    assert linear_decay(25, 100, 0.8, 0.5) == pytest.approx(0.4)
    assert linear_decay(50, 100, 0.8, 0.5) == 0.0 and linear_decay(90, 100, 0.8, 0.5) == 0.0
    assert linear_decay(0, 100, 0.0, 0.5) == 0.0
    # schedule.rarity_end: the share the decay ends at and keeps
    assert linear_decay(25, 100, 0.8, 0.5, 0.2) == pytest.approx(0.5)
    assert linear_decay(50, 100, 0.8, 0.5, 0.2) == pytest.approx(0.2) == linear_decay(99, 100, 0.8, 0.5, 0.2)
    with pytest.raises(ConfigError, match="rarity_start"):
        ScheduleConfig(rarity_start=1.5)
    with pytest.raises(ConfigError, match=r"schedule.rarity_end: got 0.9, must be at most rarity_start \(0.8\)"):
        ScheduleConfig(rarity_start=0.8, rarity_end=0.9)

    # the prior enters the rank targets as (1 - w) * evidence + w * prior
    torch.manual_seed(0)
    model = FoveateModel(_evidence_config(evidence="label")).double()
    feats = torch.randn(5, 16, dtype=torch.float64)
    scores = torch.rand(5, dtype=torch.float64)
    prior = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        ev = torch.softmax(model.aggregate(feats[:, None], torch.zeros(5, 1, 2, dtype=torch.float64)), 1)[:, 1]
    got, _ = model.evidence_losses(feats, scores, 1, prior=prior, prior_weight=0.3)
    want = evidence_rank_loss(scores, 0.7 * ev + 0.3 * prior, temperature=0.1) * 0.5
    assert float(got["rank"]) == pytest.approx(float(want), rel=1e-12)
    with pytest.raises(ValueError, match="prior"):
        model.evidence_losses(feats, scores, 1, prior=prior[:3], prior_weight=0.3)


def test_color_jitter_patches_is_a_per_patch_per_channel_affine_map_clamped_to_unit_range():
    from workers.slide_forward import color_jitter_patches

    x = torch.rand(5, 3, 8, 8, dtype=torch.float64) * 0.6 + 0.2
    assert color_jitter_patches(x, 0.0) is x
    y = color_jitter_patches(x.clone(), 0.2, torch.Generator().manual_seed(1))
    assert torch.equal(y, color_jitter_patches(x.clone(), 0.2, torch.Generator().manual_seed(1)))  # reproducible
    assert not torch.equal(y, x) and float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    for i in range(5):
        for c in range(3):  # one gain and one offset per patch and channel: y = a x + b exactly
            a = (y[i, c, 0, 1] - y[i, c, 0, 0]) / (x[i, c, 0, 1] - x[i, c, 0, 0])
            b = y[i, c, 0, 0] - a * x[i, c, 0, 0]
            assert torch.allclose(y[i, c], a * x[i, c] + b, atol=1e-12)
            assert 0.8 - 1e-12 <= float(a) <= 1.2 + 1e-12 and abs(float(b)) <= 0.1 + 1e-12
    with pytest.raises(ConfigError, match="color_jitter"):
        flat_config(color_jitter=-0.1)


@pytest.mark.parametrize("symmetry, allowed", [("dihedral", range(8)), ("flips", (0, 2, 5, 7)), ("rot180", (0, 2))])
def test_symmetry_patches_turns_each_patch_by_a_drawn_symmetry_of_the_square(symmetry, allowed):
    from operators.model_config import AugmentConfig
    from workers.slide_forward import augment_patches, symmetry_patches

    x = torch.rand(2, 200, 3, 6, 6, dtype=torch.float64)
    y = symmetry_patches(x, symmetry, torch.Generator().manual_seed(3))
    assert y.shape == x.shape and torch.equal(y, symmetry_patches(x, symmetry, torch.Generator().manual_seed(3)))
    seen = set()
    for i in range(2):
        for j in range(200):
            p = x[i, j]
            syms = [torch.rot90(q, r, dims=(-2, -1)) for q in (p, p.transpose(-1, -2)) for r in range(4)]
            hits = [s for s, q in enumerate(syms) if torch.equal(y[i, j], q)]
            assert hits, (i, j)  # a symmetry of its own patch, never another patch's pixels
            seen.add(hits[0])
            if symmetry == "flips":  # the axes kept: the patch as it is, mirrored left-right, up-down, or both
                assert any(torch.equal(y[i, j], p.flip(d)) for d in ((), (-1,), (-2,), (-2, -1))), (i, j)
    assert seen == set(allowed)  # every allowed symmetry is drawn, no other
    with pytest.raises(ValueError, match="square"):
        symmetry_patches(torch.rand(2, 3, 4, 5), symmetry)
    with pytest.raises(ValueError, match="rot180"):
        symmetry_patches(x, "rot90")
    off = AugmentConfig(color_jitter=0.0, symmetry="none")
    assert augment_patches(x, off) is x  # nothing drawn, nothing changed
    on = AugmentConfig(color_jitter=0.0, symmetry=symmetry)
    assert torch.equal(augment_patches(x, on, torch.Generator().manual_seed(3)), y)
    with pytest.raises(ValueError, match="symmetry"):
        AugmentConfig(symmetry="flip")


def test_trainer_passes_the_scheduled_rarity_share_and_forward_slide_mixes_it_in(tmp_path):
    from types import SimpleNamespace

    from workers.trainer import EpochResult, OptimConfig, ScheduleConfig, Trainer, linear_decay

    cfg = _evidence_config(evidence="label")
    tr = Trainer(
        cfg,
        OptimConfig(epochs=4, accumulate=1),
        ScheduleConfig(rarity_start=0.6, rarity_until=0.5, rare_until=0.25),
        slides_per_epoch=2,
    )
    seen, seen_rare = [], []

    def fake_forward(store, *, training, sigma, target=None, rarity=0.0, rare=1.0, fixed_selection=None):
        seen.append(rarity)
        seen_rare.append(rare)
        w = next(tr.model.aggregator.parameters())
        return SimpleNamespace(
            logits=torch.zeros(1, 2) + 0 * w.sum(), aux_losses={}, info={}, coords_l0=torch.zeros(2, 2)
        )

    tr._forward, tr._store = fake_forward, (lambda path: None)
    for _ in range(tr.total_steps):
        tr.step([SimpleNamespace(store="s", target=0)], EpochResult(started=0.0))
    assert seen == pytest.approx([linear_decay(i, 8, 0.6, 0.5) for i in range(8)])
    assert seen[0] == pytest.approx(0.6) and seen[4:] == [0.0] * 4
    assert seen_rare == pytest.approx([1.0, 0.5, 0, 0, 0, 0, 0, 0])  # the rare bag's weight, to 0 at 1/4
    with pytest.raises(ConfigError, match="rare_until"):
        ScheduleConfig(rare_until=0.0)

    # forward_slide: the same step with and without the prior differs only in the rank targets
    store = _image_store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_evidence_config(evidence="label", explore_cells=4, explore_strata=4))
    outs = {}
    for r in (0.0, 1.0):
        outs[r] = forward_slide(
            model, store, training=True, sigma=0.1, generator=torch.Generator().manual_seed(0), target=1, rarity=r
        )
    assert torch.equal(outs[0.0].logits, outs[1.0].logits)
    assert float(outs[0.0].aux_losses["instance"]) == float(outs[1.0].aux_losses["instance"])
    assert float(outs[0.0].aux_losses["rank"]) != float(outs[1.0].aux_losses["rank"])


def test_rare_scale_weights_the_rare_bag_and_zero_skips_it(tmp_path):
    store = _image_store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_evidence_config(rare_cells=2, rare_strata=4))
    outs = {
        r: forward_slide(
            model, store, training=True, sigma=0.1, generator=torch.Generator().manual_seed(0), target=1, rare_scale=r
        )
        for r in (1.0, 0.5, 0.0)
    }
    assert float(outs[0.5].aux_losses["rare"]) == pytest.approx(0.5 * float(outs[1.0].aux_losses["rare"]), rel=1e-6)
    assert "rare" not in outs[0.0].aux_losses
    assert outs[0.0].info["cells_read"] == outs[1.0].info["cells_read"] - 2  # not read at all


def test_local_maxima_keeps_window_maxima_falls_back_when_too_few_and_passes_gradients():
    with pytest.raises(ConfigError, match="nms_radius"):
        flat_config(nms_radius=-1)
    model = FoveateModel(flat_config(k=2, nms_radius=1)).double()
    g = torch.tensor(
        [
            [0.1, 0.9, 0.8, 0.0, 0.2],
            [0.2, 0.3, 0.1, 0.0, 0.7],
            [float("-inf"), 0.0, 0.0, 0.1, 0.6],
            [0.5, 0.1, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    s = g.flatten()[None].clone().requires_grad_(True)
    out = model.local_maxima(s, (4, 5))
    # brute force: a finite cell is kept iff no cell of its 3x3 window scores higher
    want = torch.full_like(g, float("-inf"))
    for y in range(4):
        for x in range(5):
            win = g[max(y - 1, 0) : y + 2, max(x - 1, 0) : x + 2]
            if torch.isfinite(g[y, x]) and g[y, x] >= win.max():
                want[y, x] = g[y, x]
    assert torch.equal(out.detach().view(4, 5), want)
    assert int(torch.isfinite(out).sum()) == 3  # 0.9, 0.7 and 0.5
    out[torch.isfinite(out)].sum().backward()
    assert torch.equal(s.grad.view(4, 5) != 0, torch.isfinite(want))
    # fewer than k maxima: the row is left as it is
    few = FoveateModel(flat_config(k=4, nms_radius=1)).double()
    assert torch.equal(few.local_maxima(g.flatten()[None], (4, 5)), g.flatten()[None])
    assert FoveateModel(flat_config(k=2)).local_maxima(s, (4, 5)) is s  # off by default
    with pytest.raises(ValueError, match="grid"):
        model.local_maxima(s, (5, 5))


def test_local_maxima_first_ties_keep_one_cell_per_tied_window():
    with pytest.raises(ConfigError, match="nms_ties"):
        flat_config(nms_ties="last")
    # a 2x2 plateau of tied maxima (as an overlapping grid's max-pooled cells of one structure give) and a single
    # peak: "keep" keeps all five, "first" the plateau's first cell and the peak
    g = torch.full((5, 6), float("-inf"), dtype=torch.float64)
    g[0:4, 0:4] = 0.1
    g[1:3, 1:3] = 0.9
    g[4, 5] = 0.7
    keep = FoveateModel(flat_config(k=2, nms_radius=1)).double().local_maxima(g.flatten()[None], (5, 6))
    first = FoveateModel(flat_config(k=2, nms_radius=1, nms_ties="first")).double()
    out = first.local_maxima(g.flatten()[None], (5, 6)).view(5, 6)
    assert int(torch.isfinite(keep).sum()) == 5
    assert torch.isfinite(out).nonzero().tolist() == [[1, 1], [4, 5]]
    # random integer scores (many ties), radius 1 and 2: a local maximum is kept iff no local maximum of smaller
    # index lies in its window (brute force)
    gen = torch.Generator().manual_seed(3)
    for r in (1, 2):
        model = FoveateModel(flat_config(k=1, nms_radius=r, nms_ties="first")).double()
        for _ in range(5):
            h, w = 7, 9
            sc = torch.randint(0, 3, (h, w), generator=gen).double()
            sc[0, 0] = float("-inf")
            got = model.local_maxima(sc.flatten()[None], (h, w)).view(h, w)
            lm = torch.zeros(h, w, dtype=torch.bool)
            for y in range(h):
                for x in range(w):
                    win = sc[max(y - r, 0) : y + r + 1, max(x - r, 0) : x + r + 1]
                    lm[y, x] = bool(torch.isfinite(sc[y, x])) and bool(sc[y, x] >= win.max())
            want = torch.full_like(sc, float("-inf"))
            for y in range(h):
                for x in range(w):
                    earlier = [
                        lm[yy, xx]
                        for yy in range(max(y - r, 0), min(y + r + 1, h))
                        for xx in range(max(x - r, 0), min(x + r + 1, w))
                        if yy * w + xx < y * w + x
                    ]
                    if lm[y, x] and not any(earlier):
                        want[y, x] = sc[y, x]
            assert torch.equal(got, want)


def test_neutral_loss_is_the_kl_from_uniform_zero_on_constant_rows_with_exact_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ref = 0.0
    for row in x.detach().tolist():  # KL(u || p) = sum_c u_c log(u_c / p_c), u = 1/C
        z = [math.exp(v - max(row)) for v in row]
        p = [v / sum(z) for v in z]
        ref += sum((1 / 3) * math.log((1 / 3) / pc) for pc in p) / 5
    assert float(neutral_loss(x).detach()) == pytest.approx(ref, rel=1e-12)
    assert torch.autograd.gradcheck(neutral_loss, (x,), eps=1e-6, atol=1e-8)
    # the gradient of one row is (softmax(l) - 1/C) / M: it moves every class towards the same probability
    neutral_loss(x).backward()
    expected = (torch.softmax(x.detach(), 1) - 1 / 3) / 5
    assert torch.allclose(x.grad, expected, rtol=0, atol=1e-14)
    flat = torch.tensor([[2.0, 2.0], [-7.0, -7.0]], dtype=torch.float64)
    assert float(neutral_loss(flat)) == pytest.approx(0.0, abs=1e-15)
    assert float(neutral_loss(torch.tensor([[9.0, -9.0]]))) > 8.0  # a confident patch costs a lot
    for bad in (torch.zeros(3), torch.zeros(3, 1), torch.zeros(0, 2), [[0.0, 1.0]]):
        with pytest.raises(ValueError, match="logits"):
            neutral_loss(bad)


def test_neutral_cells_pull_random_cells_predictions_to_uniform_in_training_only(tmp_path):
    with pytest.raises(ConfigError, match="neutral_cells"):
        flat_config(neutral_cells=-1)
    with pytest.raises(ConfigError, match="neutral_weight"):
        flat_config(neutral_cells=2, neutral_weight=-1.0)
    store = _image_store(tmp_path)
    torch.manual_seed(0)
    # without the evidence losses too: the neutral term needs only the aggregator
    cfg = _small_config(neutral_cells=5, neutral_weight=2.0)
    model = FoveateModel(cfg)
    with torch.no_grad():  # a head far from uniform, so the loss is clearly positive
        model.aggregator.head[-1].bias.copy_(torch.tensor([3.0, -3.0]))
    out = forward_slide(model, store, training=True, sigma=0.1, generator=torch.Generator().manual_seed(0), target=1)
    assert set(out.aux_losses) == {"neutral"}
    torch.manual_seed(0)  # the same initial model without the neutral cells: the same selection
    base = forward_slide(
        FoveateModel(flat_replace(cfg, neutral_cells=0)),
        store,
        training=True,
        sigma=0.1,
        generator=torch.Generator().manual_seed(0),
        target=1,
    )
    assert out.info["cells_read"] == base.info["cells_read"] + 5
    model.eval()
    gen = torch.Generator().manual_seed(0)
    out = forward_slide(model, store, training=True, sigma=0.1, generator=gen, target=1)
    assert float(out.aux_losses["neutral"]) > 2.0 * 1.5  # 2 x KL(u || softmax([3, -3] + w.f)) ~ 2 x 2.3
    model.train()
    out.aux_losses["neutral"].backward()
    assert model.aggregator.head[-1].bias.grad[0] > 0 > model.aggregator.head[-1].bias.grad[1]  # towards equal
    assert sum(float(p.grad.abs().sum()) for p in model.features.parameters() if p.grad is not None) > 0
    with torch.no_grad():
        assert "neutral" not in forward_slide(model, store, training=False, target=1).aux_losses
        assert "neutral" not in forward_slide(model, store, training=True, sigma=0.1).aux_losses  # no target


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_local_maxima_first_ties_on_cuda_match_the_cpu():
    gen = torch.Generator().manual_seed(4)
    for r in (1, 2):
        model = FoveateModel(flat_config(k=1, nms_radius=r, nms_ties="first"))
        sc = torch.randint(0, 3, (3, 30 * 40), generator=gen).float()
        sc[:, :7] = float("-inf")
        cpu = model.local_maxima(sc, (30, 40))
        gpu = model.cuda().local_maxima(sc.cuda(), (30, 40))
        assert torch.equal(gpu.cpu(), cpu)
        assert int(torch.isfinite(cpu).sum()) < int(torch.isfinite(sc).sum())  # ties were thinned
