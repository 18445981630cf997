"""``schedule.select_draws``: several second-phase classifiers side by side, the one with the lowest validation
loss kept."""

from __future__ import annotations

import dataclasses
import io
from types import SimpleNamespace

import pytest
import torch
from flat_model_config import flat_config
from tiny_stores import rare_structures_store

from operators.errors import ConfigError
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers.early_stopping import EarlyStoppingConfig
from workers.trainer import CLASSIFIER, EpochResult, OptimConfig, ScheduleConfig, Trainer


def _config():
    return flat_config(
        patch_size=64,
        scorer_downsample=8.0,
        k=3,
        selector="perturbed",
        num_samples=8,
        scorer=ScorerConfig(channels=8, pool="mean"),
        features=ResNetConfig(widths=(8,), blocks=(1,), feature_dim=8),
        color_jitter=0.0,
    )


@pytest.fixture
def records(tmp_path):
    rare_structures_store(tmp_path / "s.zarr")
    store = str(tmp_path / "s.zarr")
    return [SimpleNamespace(store=store, target=0), SimpleNamespace(store=store, target=1)]


def _classifier(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v.detach().clone()
        for name in CLASSIFIER
        if getattr(model, name) is not None
        for k, v in getattr(model, name).state_dict().items()
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def test_select_draws_is_checked():
    for bad in (0, -1, 1.5, True, "two"):
        with pytest.raises(ConfigError, match="select_draws"):
            ScheduleConfig(select_until=0.5, select_restart=True, select_draws=bad)
        with pytest.raises(ConfigError, match="select_draws_epochs"):
            ScheduleConfig(select_until=0.5, select_restart=True, select_draws=2, select_draws_epochs=bad)
    with pytest.raises(ConfigError, match="select_draws.*without schedule.select_restart"):
        ScheduleConfig(select_until=0.5, select_draws=2)
    assert ScheduleConfig().select_draws == 1


@pytest.mark.parametrize("clip", ["global", "per_module"])
def test_each_draw_trains_as_a_run_restarted_under_its_seed(records, clip):
    """Draw i of ``select_draws`` N (restart seed S) steps as a one-draw run with ``select_restart_seed`` S + i:
    the same weights and moving average after the second phase's steps; the run's own classifier is draw 0."""
    optim = OptimConfig(epochs=2, accumulate=1, lr=0.05, warmup=0, weight_decay=0.1, ema_epochs=1, clip=clip)

    def trainer(seed: int, draws: int) -> Trainer:
        sched = ScheduleConfig(select_until=0.5, select_restart=True, select_restart_seed=seed, select_draws=draws)
        return Trainer(_config(), optim, sched, slides_per_epoch=2, seed=3)

    many = trainer(5, 3)
    ones = [trainer(5, 1), trainer(6, 1), trainer(7, 1)]
    for i in range(4):  # steps 2 and 3 are the second phase
        for tr in (many, *ones):
            tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    assert len(many.draws) == 2 and [d.seed for d in many.draws] == [6, 7]
    _assert_same(_classifier(many.model), _classifier(ones[0].model))
    _assert_same(_classifier(many.ema_model), _classifier(ones[0].ema_model))
    for d, one in zip(many.draws, ones[1:]):
        _assert_same(_classifier(d.model), _classifier(one.model), atol=1e-6)
        _assert_same(_classifier(d.ema), _classifier(one.ema_model), atol=1e-6)
        assert d.model.scorer is many.model.scorer  # one frozen scorer
    # the draws differ from one another (each its own initialisation)
    a, b = _classifier(many.model), _classifier(many.draws[0].model)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_the_draw_with_the_lowest_validation_loss_is_kept(records):
    """At the epoch of the choice the draw with the lowest validation loss so far becomes the run's classifier
    (weights, moving average, optimizer state); ``select_draw`` names it and the epoch's ``val_*`` are its own.
    Later epochs train it alone; early stopping never stops before the choice."""
    optim = OptimConfig(epochs=3, accumulate=1, lr=0.05, warmup=0, ema_epochs=1)
    sched = ScheduleConfig(
        select_until=1 / 3, select_restart=True, select_restart_seed=11, select_draws=3, select_draws_epochs=1
    )
    tr = Trainer(_config(), optim, sched, slides_per_epoch=2, early_stopping=EarlyStoppingConfig(patience=1))
    assert tr._draws_end == 2 and tr.stopper.min_epochs >= 2
    tr.run_epoch(records, records)  # the first phase
    seen = {}
    screen = tr._screen_draws

    def spoil(metrics, val_records):
        # draw 0's loss (the run's own, already measured) and draw 1's classifier made bad: draw 2 must win
        metrics["val_loss"] = 50.0
        with torch.no_grad():
            for p in tr.draws[0].ema.aggregator.parameters():
                p.mul_(1000.0)
        seen["draws"] = list(tr.draws)
        seen["kept"] = _classifier(tr.draws[1].ema), _classifier(tr.draws[1].model)
        seen["adam"] = {
            n: tr.draws[1].optimizer.state[p]["exp_avg"].clone()
            for n, p in tr.draws[1].model.named_parameters()
            if p in tr.draws[1].optimizer.state
        }
        screen(metrics, val_records)

    tr._screen_draws = spoil
    metrics = tr.run_epoch(records, records)
    assert metrics["select_draw"] == 2 and tr.draws == []
    assert metrics["draw1_val_loss"] > metrics["draw2_val_loss"]
    assert metrics["val_loss"] == metrics["draw2_val_loss"]
    _assert_same(_classifier(tr.ema_model), seen["kept"][0])
    _assert_same(_classifier(tr.model), seen["kept"][1])
    mine = dict(tr.model.named_parameters())
    assert seen["adam"] and all(torch.equal(tr.optimizer.state[mine[n]]["exp_avg"], v) for n, v in seen["adam"].items())
    assert tr.stopper.best_epoch == 2  # the kept draw's epoch, the first candidate of its own rule
    # the third epoch trains the kept classifier alone
    calls = []
    forward = tr._forward
    tr._forward = lambda *a, **kw: calls.append(kw.get("model")) or forward(*a, **kw)
    tr.run_epoch(records, records)
    assert len(calls) == 2 + 2  # two training slides, two validation slides: one model
    assert tr.finished


def test_draws_resume_from_a_checkpoint_before_the_choice(records):
    """A state saved between the switch and the choice holds every draw; a trainer loaded from it steps as the
    original goes on."""
    optim = OptimConfig(epochs=4, accumulate=1, lr=0.05, warmup=0, ema_epochs=1)
    sched = ScheduleConfig(select_until=0.5, select_restart=True, select_draws=2, select_draws_epochs=2)
    tr = Trainer(_config(), optim, sched, slides_per_epoch=2)
    for i in range(5):  # steps 4.. are the second phase
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    buf = io.BytesIO()
    torch.save(tr.state_dict(), buf)  # as a checkpoint is (a state dict shares the optimizers' live tensors)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert len(state["draws"]) == 1
    again = Trainer(_config(), optim, sched, slides_per_epoch=2)
    again.load_state_dict(state)
    assert [d.seed for d in again.draws] == [d.seed for d in tr.draws]
    for t in (tr, again):
        t.step(records[1:2], EpochResult(started=0.0))
    for d, e in zip(tr.draws, again.draws):
        _assert_same(_classifier(d.model), _classifier(e.model))
        _assert_same(_classifier(d.ema), _classifier(e.ema))
    _assert_same(_classifier(tr.model), _classifier(again.model))


def test_draws_drop_the_mean_skip_too(records):
    base = _config()
    mil = dataclasses.replace(base.aggregator.attention_mil, mean_skip=True)
    cfg = dataclasses.replace(
        base, aggregator=dataclasses.replace(base.aggregator, kind="attention_mil", attention_mil=mil)
    )
    sched = ScheduleConfig(select_until=0.5, select_restart=True, select_drop_skip=True, select_draws=2)
    tr = Trainer(cfg, OptimConfig(epochs=2, accumulate=1, lr=0.05, ema_epochs=1), sched, slides_per_epoch=2)
    for i in range(4):
        tr.step(records[i % 2 : i % 2 + 1], EpochResult(started=0.0))
    d = tr.draws[0]
    for model in (d.model, d.ema):
        assert all(torch.equal(p, torch.zeros_like(p)) for p in model.aggregator.skip.parameters())
    assert not any(p.requires_grad for p in d.model.aggregator.skip.parameters())
