"""schedule.select_until: two-phase training. After the switch the scorer gets no updates, training selects the
inference's hard top-k and reads nothing but the bag (no exploration, rare-bag or neutral cells, no evidence
losses); before it, training is unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flat_model_config import flat_config
from tiny_stores import rare_structures_store

from operators.errors import ConfigError
from operators.model import FoveateModel
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers.early_stopping import EarlyStoppingConfig
from workers.slide_forward import forward_slide
from workers.trainer import EpochResult, OptimConfig, ScheduleConfig, Trainer, earliest_stop_epoch


def _store(tmp_path) -> str:
    rare_structures_store(tmp_path / "s.zarr")
    return str(tmp_path / "s.zarr")


def _config(selector: str = "perturbed", discovery: bool = True):
    """Every discovery term on: exploration, instance + rank losses, a rare bag and neutral cells (``discovery``
    False: all off)."""
    on = dict(
        instance_weight=1.0,
        rank_weight=0.5,
        explore_cells=3,
        explore_strata=4,
        rare_cells=2,
        rare_strata=4,
        neutral_cells=2,
    )
    off = dict(instance_weight=0.0, rank_weight=0.0, explore_cells=0, rare_cells=0, neutral_cells=0)
    return flat_config(
        patch_size=64,
        scorer_downsample=8.0,
        k=3,
        num_samples=8,
        selector=selector,
        scorer=ScorerConfig(channels=8, pool="mean"),
        features=ResNetConfig(widths=(8,), blocks=(1,), feature_dim=8),
        color_jitter=0.0,
        **(on if discovery else off),
    )


def test_select_until_is_checked_and_splits_the_steps():
    for bad in (0, 0.0, 1.5, -0.1, True, "half", float("nan")):
        with pytest.raises(ConfigError, match="select_until"):
            ScheduleConfig(select_until=bad)
    with pytest.raises(ConfigError, match="select_bag.*'draw' or 'topk'"):
        ScheduleConfig(select_until=0.5, select_bag="hard")
    s = ScheduleConfig(select_until=0.5)
    assert [s.selection_fixed(i, 8) for i in range(8)] == [False] * 4 + [True] * 4
    assert [ScheduleConfig(select_until=0.3).selection_fixed(i, 10) for i in range(10)] == [False] * 3 + [True] * 7
    assert not any(ScheduleConfig().selection_fixed(i, 8) for i in range(8))
    es = EarlyStoppingConfig(patience=2, min_epochs=0)
    assert earliest_stop_epoch(es, 20, ScheduleConfig()) == 0
    assert earliest_stop_epoch(es, 20, ScheduleConfig(select_until=0.5)) == 11  # one epoch of the second phase
    assert earliest_stop_epoch(es, 20, ScheduleConfig(select_until=1.0)) == 20  # capped at the epochs


@pytest.mark.parametrize("bag", ["draw", "topk"])
@pytest.mark.parametrize("selector", ["perturbed", "attention", "sinkhorn"])
def test_fixed_selection_reads_the_bag_and_nothing_else(tmp_path, selector, bag):
    store = _store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_config(selector)).train()
    g = torch.Generator().manual_seed(0)
    soft = forward_slide(model, store, training=True, sigma=0.1, generator=g, target=1)
    assert {"instance", "rank", "rare"} <= set(soft.aux_losses) and "neutral" in soft.aux_losses
    assert soft.info["cells_read"] > 3
    state = g.get_state()
    out = forward_slide(model, store, training=True, sigma=0.1, generator=g, target=1, fixed_selection=bag)
    with torch.no_grad():
        if bag == "topk":  # the inference's cells
            ref = forward_slide(model, store, training=False)
        else:  # the selector's training draw, from the same noise, without the discovery reads
            plain = FoveateModel(_config(selector, discovery=False)).train()
            plain.load_state_dict(model.state_dict(), strict=False)
            ref = forward_slide(plain, store, training=True, sigma=0.1, generator=g.set_state(state), target=1)
    assert out.aux_losses == {} and "explore_cells" not in out.info
    assert torch.equal(out.cell_indices, ref.cell_indices)
    assert out.info["cells_read"] == ref.info["cells_read"] and not out.scores.requires_grad
    assert bag == "draw" or out.info["cells_read"] == 3
    torch.testing.assert_close(out.logits.detach(), ref.logits, rtol=0, atol=1e-6)
    torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([1])).backward()
    assert all(p.grad is None for p in model.scorer.parameters())
    assert sum(float(p.grad.abs().sum()) for p in model.features.parameters() if p.grad is not None) > 0
    with pytest.raises(ValueError, match="fixed_selection"):
        forward_slide(model, store, training=True, target=1, fixed_selection=True)


@pytest.mark.parametrize("ema", [0, 1])
def test_trainer_freezes_the_scorer_in_the_second_phase(tmp_path, ema):
    store = _store(tmp_path)
    cfg = _config()
    tr = Trainer(
        cfg,
        OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=ema),
        ScheduleConfig(sigma_start=0.1, sigma_end=0.1, select_until=0.5),
        slides_per_epoch=2,
    )
    assert tr.total_steps == 4
    seen = []
    forward = tr._forward

    def spy(*args, **kw):
        seen.append(kw["fixed_selection"])
        return forward(*args, **kw)

    tr._forward = spy
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]

    def snap(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    scorer0, feats0 = snap(tr.model.scorer), snap(tr.model.features)
    for i in range(2):  # the first phase: the scorer learns
        tr.step(records[i : i + 1], EpochResult(started=0.0))
    scorer1 = snap(tr.model.scorer)
    assert any(not torch.equal(scorer0[k], scorer1[k]) for k in scorer0)
    feats1 = snap(tr.model.features)
    assert any(not torch.equal(feats0[k], feats1[k]) for k in feats0)
    parts = []
    for i in range(2):  # the second phase: scorer frozen (weight decay and Adam momentum included)
        metrics = tr.step(records[i : i + 1], EpochResult(started=0.0))
        parts.append({k for k in metrics if k.startswith("loss_")})
    assert seen == [None, None, "topk", "topk"]
    scorer2 = snap(tr.model.scorer)
    if ema:  # the frozen scorer is the moving average's at the switch (the evaluated one), and stays
        ema_scorer = snap(tr.ema_model.scorer)
        assert all(torch.equal(ema_scorer[k], scorer2[k]) for k in scorer2)
        assert any(not torch.equal(scorer1[k], scorer2[k]) for k in scorer1)
        tr.step(records[:1], EpochResult(started=0.0))  # (a step past the end of the schedule: still frozen)
        assert all(torch.equal(scorer2[k], v) for k, v in snap(tr.model.scorer).items())
    else:
        assert all(torch.equal(scorer1[k], scorer2[k]) for k in scorer1)
    assert any(not torch.equal(feats1[k], v) for k, v in snap(tr.model.features).items())
    # the bag CE alone: no evidence, rare-bag or neutral terms after the switch
    assert parts == [{"loss_ce"}, {"loss_ce"}]


def test_second_phase_weight_decay_from_the_switch_and_through_a_resume(tmp_path):
    for bad in (-0.1, float("nan"), True, "big"):
        with pytest.raises(ConfigError, match="select_weight_decay"):
            ScheduleConfig(select_until=0.5, select_weight_decay=bad)
    with pytest.raises(ConfigError, match="select_weight_decay.*without schedule.select_until"):
        ScheduleConfig(select_weight_decay=0.05)
    store = _store(tmp_path)
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]

    def trainer():
        return Trainer(
            _config(discovery=False),
            OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=1e-4),
            ScheduleConfig(select_until=0.5, select_restart=True, select_weight_decay=0.05),
            slides_per_epoch=2,
        )

    tr = trainer()
    decays = []
    for i in range(4):
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
        decays.append({g["weight_decay"] for g in tr.optimizer.param_groups})
    assert decays == [{1e-4}, {1e-4}, {0.05}, {0.05}]  # steps 2 and 3 are the second phase
    # a resume in the second phase (the trainer's own state dict): the optimizer state carries the second phase's
    # decay, and the resumed trainer's next step, which enters the second phase again, keeps it
    again = trainer()
    again.load_state_dict(tr.state_dict())
    assert {g["weight_decay"] for g in again.optimizer.param_groups} == {0.05}
    again.step(records[:1], EpochResult(started=0.0))
    assert {g["weight_decay"] for g in again.optimizer.param_groups} == {0.05}


def test_second_phase_drops_the_mean_skip_and_keeps_it_dropped_through_a_resume(tmp_path):
    import dataclasses

    with pytest.raises(ConfigError, match="select_drop_skip.*without schedule.select_restart"):
        ScheduleConfig(select_until=0.5, select_drop_skip=True)
    with pytest.raises(ConfigError, match="select_drop_skip"):
        ScheduleConfig(select_until=0.5, select_restart=True, select_drop_skip=1)
    base = _config(discovery=False)
    mil = dataclasses.replace(base.aggregator.attention_mil, mean_skip=True)
    cfg = dataclasses.replace(
        base, aggregator=dataclasses.replace(base.aggregator, kind="attention_mil", attention_mil=mil)
    )
    sched = ScheduleConfig(select_until=0.5, select_restart=True, select_drop_skip=True)
    optim = OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1)
    no_skip = dataclasses.replace(
        cfg,
        aggregator=dataclasses.replace(
            cfg.aggregator, attention_mil=dataclasses.replace(cfg.aggregator.attention_mil, mean_skip=False)
        ),
    )
    for bad in (base, no_skip):  # the mean aggregator has no skip; nor has attention-MIL without mean_skip
        with pytest.raises(ValueError, match="select_drop_skip.*mean_skip"):
            Trainer(bad, optim, sched, slides_per_epoch=2)
    store = _store(tmp_path)
    records = [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]
    tr = Trainer(cfg, optim, sched, slides_per_epoch=2)
    skip = tr.model.aggregator.skip
    for i in range(2):  # the first phase: the skip trains
        tr.step(records[i : i + 1], EpochResult(started=0.0))
    assert any(bool(p.abs().sum() > 0) for p in skip.parameters())
    attention0 = {k: v.clone() for k, v in tr.model.aggregator.V.state_dict().items()}
    for i in range(2):  # the second phase: the skip zero and frozen (weight decay and momentum included)
        tr.step(records[i : i + 1], EpochResult(started=0.0))
        for model in (tr.model, tr.ema_model):
            assert all(torch.equal(p, torch.zeros_like(p)) for p in model.aggregator.skip.parameters())
        assert not any(p.requires_grad for p in skip.parameters())
    assert any(not torch.equal(attention0[k], v) for k, v in tr.model.aggregator.V.state_dict().items())
    # the classifier is the attention path alone: the same logits as the aggregator without its skip
    feats = torch.randn(1, 3, tr.model.feature_dim)
    agg = tr.model.aggregator.eval()
    with torch.no_grad():
        want = agg(feats)
        agg.skip = None
        got = agg(feats)
        agg.skip = skip
    torch.testing.assert_close(got, want)
    # a resume after the switch: the loaded zeros are frozen again on the next step
    again = Trainer(cfg, optim, sched, slides_per_epoch=2)
    again.load_state_dict(tr.state_dict())
    again.step(records[:1], EpochResult(started=0.0))
    assert not any(p.requires_grad for p in again.model.aggregator.skip.parameters())
    assert all(torch.equal(p, torch.zeros_like(p)) for p in again.model.aggregator.skip.parameters())


def test_the_restarted_classifier_is_drawn_from_its_own_seed(tmp_path):
    """``select_restart_seed`` S: at the restart the feature network and aggregator are those of a model built
    under seed S; None: under the run's own ``seed * 7919 + 1``. Bad values are errors."""
    from operators.model import FoveateModel

    for bad in (-1, 1.5, True, "one"):
        with pytest.raises(ConfigError, match="select_restart_seed"):
            ScheduleConfig(select_until=0.5, select_restart=True, select_restart_seed=bad)
    with pytest.raises(ConfigError, match="select_restart_seed.*without schedule.select_restart"):
        ScheduleConfig(select_until=0.5, select_restart_seed=3)
    cfg = _config(discovery=False)
    for restart_seed, drawn in ((5, 5), (None, 2 * 7919 + 1)):
        tr = Trainer(
            cfg,
            OptimConfig(epochs=2, accumulate=1),
            ScheduleConfig(select_until=0.5, select_restart=True, select_restart_seed=restart_seed),
            slides_per_epoch=2,
            seed=2,
        )
        tr._restart_classifier()
        torch.manual_seed(drawn)
        ref = FoveateModel(cfg)
        for name in ("features", "aggregator"):
            mine, want = getattr(tr.model, name).state_dict(), getattr(ref, name).state_dict()
            assert all(torch.equal(mine[k], want[k]) for k in want), (restart_seed, name)
