"""Early stopping's rule (workers/early_stopping.py) and its config section, without Ray or a model.

The trainer's side (the best epoch's weights kept, restored and checkpointed) and a real ``foveate train`` that
stops, resumes and exports the best epoch: tests/test_train.py.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import ConfigError, load_config, to_dict
from pipeline.train_config import EarlyStoppingConfig, ScheduleConfig, TrainConfig
from workers.early_stopping import CHANCE_ALPHA, EarlyStopping, chance_p_value, stop_message
from workers.trainer import Trainer, earliest_stop_epoch


def _run(rule: EarlyStopping, values, start: int = 1) -> list[bool]:
    return [rule.update(epoch, v) for epoch, v in enumerate(values, start)]


def test_lower_is_better_for_the_loss_and_patience_counts_epochs_since_the_best():
    rule = EarlyStopping("val_loss", patience=3)
    assert rule.mode == "min"
    assert _run(rule, [1.0, 0.9, 0.95, 0.92, 0.91]) == [False] * 4 + [True]
    assert (rule.best, rule.best_epoch, rule.bad_epochs, rule.stopped_epoch) == (0.9, 2, 3, 5)
    assert rule.stopped
    # an improvement resets the count
    rule = EarlyStopping("val_loss", patience=2)
    assert _run(rule, [1.0, 1.1, 0.8, 0.9, 0.85]) == [False, False, False, False, True]
    assert rule.best_epoch == 3


def test_higher_is_better_for_auc_and_accuracy_and_min_delta_is_the_margin():
    for metric in ("val_auc", "val_accuracy"):
        assert EarlyStopping(metric).mode == "max"
    rule = EarlyStopping("val_auc", patience=3, min_delta=0.1)
    assert _run(rule, [0.5, 0.55, 0.58, 0.6]) == [False, False, False, True]  # 0.6 is not more than 0.5 + 0.1
    assert rule.best_epoch == 1 and rule.best == 0.5
    rule = EarlyStopping("val_auc", patience=3, min_delta=0.04)
    assert _run(rule, [0.5, 0.55, 0.58, 0.585, 0.6]) == [False] * 5
    assert rule.best_epoch == 5 and rule.bad_epochs == 0  # 0.58, 0.585 within 0.04 of 0.55; 0.6 beyond
    # a tie is no improvement: the first epoch to reach the best stays the best
    rule = EarlyStopping("val_accuracy", patience=2)
    assert _run(rule, [1.0, 1.0, 1.0]) == [False, False, True] and rule.best_epoch == 1


def test_min_epochs_holds_the_stop_back_and_the_message_counts_the_epochs():
    rule = EarlyStopping("val_loss", patience=1, min_epochs=4)
    assert _run(rule, [1, 2, 3, 4, 5]) == [False, False, False, True, True]
    assert rule.stopped_epoch == 5 and rule.bad_epochs == 4
    rule = EarlyStopping("val_loss", patience=1, min_epochs=4)
    _run(rule, [1, 2, 3, 4])
    assert rule.message() == (
        "early stop at epoch 4: val_loss has not improved by more than 0 for 3 epochs; best epoch 1: "
        "val_loss = 1, restored"
    )
    assert stop_message("val_auc", 0.01, 9, 4, 0.97) == (
        "early stop at epoch 9: val_auc has not improved by more than 0.01 for 5 epochs; best epoch 4: "
        "val_auc = 0.97, restored"
    )


def test_nan_is_never_an_improvement_and_without_a_best_it_never_stops():
    rule = EarlyStopping("val_auc", patience=1)
    assert _run(rule, [math.nan] * 5) == [False] * 5
    assert rule.best is None and rule.best_epoch == 0 and not rule.stopped
    assert _run(rule, [0.7, math.nan], start=6) == [False, True]
    assert rule.best_epoch == 6 and rule.stopped_epoch == 7


def test_state_round_trip_continues_the_count_exactly():
    values = [0.9, 0.8, 0.85, 0.7, 0.75, 0.72, 0.71, 0.74]
    whole = EarlyStopping("val_loss", patience=3, min_delta=0.01)
    expected = _run(whole, values)
    assert expected == [False] * 6 + [True, True]
    for cut in range(1, len(values)):
        first = EarlyStopping("val_loss", patience=3, min_delta=0.01)
        got = _run(first, values[:cut])
        state = first.state_dict()
        # plain values: a checkpoint loaded with weights_only=True reads them back
        assert all(isinstance(v, (str, int, float, type(None))) for v in state.values())
        again = EarlyStopping("val_loss", patience=3, min_delta=0.01)
        again.load_state_dict(state)
        got += _run(again, values[cut:], start=cut + 1)
        assert got == expected, cut
        assert again.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="val_auc"):
        EarlyStopping("val_auc").load_state_dict(whole.state_dict())


def test_state_survives_torch_save(tmp_path):
    rule = EarlyStopping("val_auc", patience=2)
    _run(rule, [0.6, 0.8, 0.7])
    torch.save({"early_stopping": rule.state_dict()}, tmp_path / "s.pt")
    again = EarlyStopping("val_auc", patience=2)
    again.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True)["early_stopping"])
    assert again.state_dict() == rule.state_dict()
    assert again.update(4, 0.79) is True and again.best_epoch == 2


def test_rule_arguments_are_checked():
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping("val_f1")
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("val_loss", patience=0)
    assert EarlyStopping("val_f1", mode="max").mode == "max"


def test_chance_p_value_is_the_exact_binomial_tail():
    # 9 or 10 of 10 right by a coin: (10 + 1) / 1024; 8 or more: 56 / 1024
    assert chance_p_value(9, 10, 0.5) == pytest.approx(11 / 1024, rel=1e-12)
    assert chance_p_value(8, 10, 0.5) == pytest.approx(56 / 1024, rel=1e-12)
    assert chance_p_value(4, 4, 0.5) == pytest.approx(1 / 16, rel=1e-12)  # a 4-slide split never passes 0.05
    # against the direct sum in float64 for an uneven prior
    n, q = 30, 0.6
    direct = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(24, n + 1))
    assert chance_p_value(24, n, q) == pytest.approx(direct, rel=1e-10)
    assert chance_p_value(0, 7, 0.5) == 1.0 and chance_p_value(0, 0, 0.5) == 1.0
    # a large split: 64 of 116 (0.552) is chance, 74 of 116 (0.638) is not
    assert chance_p_value(64, 116, 0.5) > CHANCE_ALPHA > chance_p_value(74, 116, 0.5)
    for bad in [(5, 4, 0.5), (-1, 4, 0.5), (2, 4, 1.5), (True, 4, 0.5)]:
        with pytest.raises(ValueError, match="must be"):
            chance_p_value(*bad)


def test_after_chance_counts_only_once_chance_is_beaten_and_restarts_with_the_classifier():
    losses = [0.70, 0.71, 0.72, 0.73, 0.74, 0.69, 0.60, 0.65, 0.66]
    beats = [False, False, False, False, False, False, True, True, True]
    plain = EarlyStopping("val_loss", patience=2)
    assert [plain.update(e, v, beats_chance=b) for e, (v, b) in enumerate(zip(losses, beats), 1)].index(True) == 2
    rule = EarlyStopping("val_loss", patience=2, after_chance=True)
    stops = [rule.update(e, v, beats_chance=b) for e, (v, b) in enumerate(zip(losses, beats), 1)]
    # epochs 2-5 do not improve on epoch 1 but chance is not yet beaten: no count; from epoch 7 it counts
    assert stops == [False] * 8 + [True]
    assert (rule.chance_epoch, rule.best_epoch, rule.stopped_epoch) == (7, 7, 9)
    # an epoch at chance is no candidate once chance is beaten, even with a lower loss (a chance-level 0.69 against
    # a learnt but less calibrated 0.75)
    early = EarlyStopping("val_loss", patience=2, after_chance=True)
    assert [
        early.update(e, v, beats_chance=b) for e, (v, b) in enumerate(zip([0.69, 0.75, 0.77, 0.78], [0, 1, 1, 1]), 1)
    ] == [False, False, False, True]
    assert (early.chance_epoch, early.best_epoch, early.best) == (2, 2, 0.75)
    never = EarlyStopping("val_loss", patience=1, after_chance=True)  # never past chance: the best is kept, no stop
    assert [never.update(e, v) for e, v in enumerate([0.7, 0.69, 0.72, 0.73], 1)] == [False] * 4
    assert (never.best_epoch, never.chance_epoch) == (2, 0)
    state = rule.state_dict()
    assert state["chance_epoch"] == 7
    again = EarlyStopping("val_loss", patience=2, after_chance=True)
    again.load_state_dict(state)
    assert again.chance_epoch == 7 and again.counting
    rule.restart()  # a new classifier: it has to beat chance again
    assert rule.chance_epoch == 0 and not rule.counting
    assert [rule.update(e, 0.8) for e in (10, 11, 12, 13)] == [False] * 4 and rule.bad_epochs == 0
    cfg = EarlyStoppingConfig(patience=3)
    assert EarlyStopping.from_config(cfg).after_chance is True
    assert EarlyStopping.from_config(dataclasses.replace(cfg, after_chance=False)).after_chance is False


def test_chance_must_be_beaten_on_epochs_in_a_row():
    """``chance_epochs``: every epoch tests the same validation split again, so one epoch past p < 0.05 (a lucky
    one) does not start the count; ``chance_epochs`` in a row do, the last of them the first candidate."""
    losses = [0.70, 0.68, 0.69, 0.70, 0.71, 0.72, 0.60, 0.55, 0.58, 0.59]
    beats = [False, True, False, False, False, False, True, True, True, True]
    one = EarlyStopping("val_loss", patience=3, after_chance=True)  # one epoch: the lucky epoch 2 starts the count
    assert [one.update(e, v, beats_chance=b) for e, (v, b) in enumerate(zip(losses, beats), 1)].index(True) == 4
    assert one.chance_epoch == 2  # stopped after epoch 5, before the model learnt (epochs 7-10)
    two = EarlyStopping("val_loss", patience=3, after_chance=True, chance_epochs=2)
    stops = [two.update(e, v, beats_chance=b) for e, (v, b) in enumerate(zip(losses, beats), 1)]
    assert not any(stops) and (two.chance_epoch, two.best_epoch, two.bad_epochs) == (8, 8, 2)
    state = two.state_dict()  # a streak under way survives a checkpoint
    three = EarlyStopping("val_loss", patience=3, after_chance=True, chance_epochs=3)
    three.update(1, 0.7, beats_chance=True)
    three.update(2, 0.6, beats_chance=True)
    mid = three.state_dict()
    resumed = EarlyStopping("val_loss", patience=3, after_chance=True, chance_epochs=3)
    resumed.load_state_dict(mid)
    resumed.update(3, 0.65, beats_chance=True)
    assert resumed.chance_epoch == 3 and state["chance_streak"] == 4
    resumed.restart()  # a new classifier starts its streak again
    assert resumed.chance_streak == 0 and resumed.chance_epoch == 0
    assert EarlyStopping.from_config(EarlyStoppingConfig()).chance_epochs == 2
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="early_stopping.chance_epochs"):
            EarlyStoppingConfig(chance_epochs=bad)
        with pytest.raises(ValueError, match="chance_epochs"):
            EarlyStopping("val_loss", chance_epochs=bad)


# ------------------------------------------------------------------------------------------ config
def test_config_section_defaults_and_errors():
    cfg = load_config(TrainConfig, None)
    assert cfg.early_stopping == EarlyStoppingConfig(
        metric="val_loss", patience=5, min_delta=0.0, min_epochs=0, after_chance=True, chance_epochs=2
    )
    assert to_dict(cfg)["early_stopping"] == {
        "metric": "val_loss",
        "patience": 5,
        "min_delta": 0.0,
        "min_epochs": 0,
        "after_chance": True,
        "chance_epochs": 2,
        "max_epochs": 0,
    }
    with pytest.raises(ConfigError, match="early_stopping.after_chance: got 'yes', must be true or false"):
        EarlyStoppingConfig(after_chance="yes")
    cfg = load_config(TrainConfig, None, ["early_stopping.metric=val_auc", "early_stopping.patience=0"])
    assert cfg.early_stopping.metric == "val_auc" and cfg.early_stopping.patience == 0
    with pytest.raises(ConfigError, match=r"early_stopping.metric.*'val_loss', 'val_auc', 'val_accuracy'"):
        load_config(TrainConfig, None, ["early_stopping.metric=val_f1"])
    with pytest.raises(ConfigError, match=r"must be one of \['val_loss', 'val_auc', 'val_accuracy'\]"):
        EarlyStoppingConfig(metric="auc")
    with pytest.raises(ConfigError, match="early_stopping.patience: got -1"):
        load_config(TrainConfig, None, ["early_stopping.patience=-1"])
    with pytest.raises(ConfigError, match="early_stopping.min_delta: got -0.1"):
        load_config(TrainConfig, None, ["early_stopping.min_delta=-0.1"])
    with pytest.raises(ConfigError, match="early_stopping.min_epochs"):
        EarlyStoppingConfig(min_epochs=-2)
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['early_stopping.mode'\]"):
        load_config(TrainConfig, None, ["early_stopping.mode=max"])


def test_config_show_prints_the_section(capsys):
    from pipeline.cli import main

    assert main(["config", "show", "--section", "early_stopping", "--set", "early_stopping.patience=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "early_stopping:"
    assert any(line.startswith("  metric: val_loss") and line.endswith("# default") for line in out)
    assert any(line.startswith("  patience: 3") and line.endswith("# --set") for line in out)


def test_no_stop_before_the_scheduled_exploration_ends():
    es = EarlyStoppingConfig()
    demo = ScheduleConfig(sigma_start=0.05, sigma_end=0.05, rarity_start=0.8, rare_until=0.5)
    assert earliest_stop_epoch(es, 30, demo) == 15  # the rarity prior is on until half-way
    assert earliest_stop_epoch(es, 20, ScheduleConfig(rarity_start=0.0, rare_until=0.7)) == 0  # no rare bag read
    model = SimpleNamespace(evidence=SimpleNamespace(rare_cells=32))  # a ModelConfig's part that counts
    assert earliest_stop_epoch(es, 20, ScheduleConfig(rarity_start=0.0, rare_until=0.7), model) == 14
    assert earliest_stop_epoch(es, 7, ScheduleConfig(rarity_start=0.5, rarity_until=0.5)) == 4  # 3.5 -> 4
    assert earliest_stop_epoch(EarlyStoppingConfig(min_epochs=25), 30, demo) == 25


# ------------------------------------------------------------------ past the cap while still learning


def _cap_trainer(overrides):
    cfg = load_config(
        TrainConfig, None, ["optim.epochs=4", "early_stopping.chance_epochs=1", "model.num_classes=2", *overrides]
    )
    assert earliest_stop_epoch(cfg.early_stopping, cfg.optim.epochs, cfg.schedule, cfg.model) <= 3
    return Trainer(cfg.model, cfg.optim, cfg.schedule, slides_per_epoch=4, early_stopping=cfg.early_stopping)


def _feed(trainer, values, p: float = 0.001) -> list[int]:
    """The trainer's end-of-epoch decision for each validation loss in turn (no training: the rule's input only);
    returns the epochs it went through."""
    seen = []
    for v in values:
        trainer.epoch += 1
        trainer._early_stopping({"val_loss": v, "val_chance_p": p})
        seen.append(trainer.epoch)
        if trainer.finished:
            break
    return seen


def test_max_epochs_trains_past_the_cap_only_while_the_curve_still_improves():
    improving = [1.0 - 0.05 * i for i in range(20)]
    # off (the default): the cap ends it, whatever the curve says
    tr = _cap_trainer(["early_stopping.patience=2"])
    assert tr.max_epochs == 4 and _feed(tr, improving) == [1, 2, 3, 4] and tr.stop_reason == "cap"
    # still improving at the cap: on, one epoch at a time, until patience stops it; the best epoch is kept
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=10"])
    assert _feed(tr, [1.0, 0.9, 0.8, 0.7, 0.6, 0.65, 0.66, 0.5]) == [1, 2, 3, 4, 5, 6, 7]
    assert tr.stop_reason == "patience" and tr.stopper.best_epoch == 5 and tr.finished
    # ... or until max_epochs
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=6"])
    assert _feed(tr, improving) == [1, 2, 3, 4, 5, 6] and tr.stop_reason == "max_epochs"
    assert tr.stopper.best_epoch == 6
    # at chance with a flat curve at the cap (stuck, or memorising): the cap ends it
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=10"])
    assert _feed(tr, [0.69, 0.68, 0.70, 0.71, 0.5], p=0.5) == [1, 2, 3, 4] and tr.stop_reason == "cap"
    # at chance but the curve still falls (a late starter about to leave chance): on, until it is flat for patience
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=10"])
    assert _feed(tr, [0.69, 0.68, 0.67, 0.66, 0.65, 0.655, 0.66, 0.1], p=0.5) == [1, 2, 3, 4, 5, 6, 7]
    assert tr.stop_reason == "patience" and tr.stopper.best_epoch == 5
    # ... and once it beats chance past the cap, the rule's own count takes over
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=20"])
    ps = [0.5] * 5 + [0.001] * 10
    seen = []
    for v, p in zip([0.69, 0.68, 0.67, 0.66, 0.65, 0.60, 0.62, 0.55, 0.56, 0.57, 0.4], ps):
        seen += _feed(tr, [v], p=p)
        if tr.finished:
            break
    assert seen == list(range(1, 11)) and tr.stop_reason == "patience" and tr.stopper.best_epoch == 8
    # patience used up exactly at the cap: the cap ends it
    tr = _cap_trainer(["early_stopping.patience=3", "early_stopping.max_epochs=10"])
    assert _feed(tr, [0.5, 0.6, 0.7, 0.8, 0.1]) == [1, 2, 3, 4] and tr.stop_reason == "cap"
    # one improvement left in the patience at the cap is enough
    tr = _cap_trainer(["early_stopping.patience=3", "early_stopping.max_epochs=10"])
    assert _feed(tr, [0.5, 0.6, 0.7, 0.4, 0.45, 0.46, 0.47]) == [1, 2, 3, 4, 5, 6, 7]
    assert tr.stop_reason == "patience" and tr.stopper.best_epoch == 4
    # a resumed trainer goes on past the cap from its saved count
    tr = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=10"])
    _feed(tr, improving[:5])
    state = tr.state_dict()
    again = _cap_trainer(["early_stopping.patience=2", "early_stopping.max_epochs=10"])
    again.load_state_dict(state)
    assert again.epoch == 5 and not again.finished
    assert _feed(again, [0.9, 0.9]) == [6, 7] and again.stop_reason == "patience" and again.stopper.best_epoch == 5


def test_max_epochs_config_errors_and_the_rules_learning_test():
    with pytest.raises(ConfigError, match=r"early_stopping.max_epochs: got 3, must be 0 .* >= optim.epochs \(4\)"):
        load_config(TrainConfig, None, ["optim.epochs=4", "early_stopping.max_epochs=3"])
    with pytest.raises(ConfigError, match=r"early_stopping.max_epochs: got 8, .*got patience 0"):
        load_config(TrainConfig, None, ["optim.epochs=4", "early_stopping.max_epochs=8", "early_stopping.patience=0"])
    with pytest.raises(ConfigError, match="early_stopping.max_epochs: got -1"):
        EarlyStoppingConfig(max_epochs=-1)
    # a Trainer built directly (the benchmarks do) refuses what the config refuses, rather than ignore max_epochs
    cfg = load_config(TrainConfig, None, ["optim.epochs=4", "model.num_classes=2"])
    for es, match in [
        (EarlyStoppingConfig(patience=0, max_epochs=8), "got 8 with early_stopping.patience 0"),
        (EarlyStoppingConfig(patience=2, max_epochs=3), r"got 3, must be 0 or >= optim.epochs \(4\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            Trainer(cfg.model, cfg.optim, cfg.schedule, slides_per_epoch=4, early_stopping=es)
    assert (
        load_config(TrainConfig, None, ["optim.epochs=4", "early_stopping.max_epochs=4"]).early_stopping.max_epochs == 4
    )
    rule = EarlyStopping("val_loss", patience=2, after_chance=True)
    assert not rule.learning()  # no best yet
    rule.update(1, 1.0, beats_chance=False)
    assert rule.learning()  # chance not beaten, but the curve has just reached its best
    rule.update(2, 0.9, beats_chance=True)
    assert rule.learning()
    rule.update(3, 0.95, beats_chance=True)
    assert rule.learning()  # one bad epoch of two
    assert rule.update(4, 0.95, beats_chance=True) and not rule.learning()
    # before chance is beaten, the curve's own new bests within the patience say it is learning
    rule = EarlyStopping("val_loss", patience=2, after_chance=True)
    for epoch, v in enumerate([0.7, 0.6, 0.65], start=1):
        rule.update(epoch, v, beats_chance=False)
    assert rule.learning() and rule.curve_best_epoch == 2
    rule.update(4, 0.61, beats_chance=False)
    assert not rule.learning() and not rule.stopped  # flat for 2 epochs; the rule itself never stops at chance
    again = EarlyStopping("val_loss", patience=2, after_chance=True)
    again.load_state_dict(rule.state_dict())
    assert (again.curve_best, again.curve_best_epoch, again.last_epoch) == (0.6, 2, 4) and not again.learning()
    rule.restart()
    assert rule.curve_best is None and not rule.learning()


def test_past_the_cap_the_lr_stays_at_its_floor():
    from workers.trainer import lr_factor

    assert lr_factor(100, 100, 5, 0.5) == pytest.approx(0.5)
    assert lr_factor(250, 100, 5, 0.5) == pytest.approx(0.5)


def test_the_summary_line_says_where_training_ended_against_the_cap():
    from pipeline.train import stopping_line

    cfg = load_config(TrainConfig, None, ["optim.epochs=30", "early_stopping.max_epochs=60"])
    best = {"best_epoch": 40.0, "best_val_loss": 0.25}
    line = stopping_line(cfg, {"stopped_epoch": 50.0, **best})
    assert line.startswith("epochs: 50 of at most 60 (optim.epochs 30; past it while still learning) (early stop)")
    assert line.endswith("the model is epoch 40's, best_val_loss=0.25")
    assert "(early stop)" not in stopping_line(cfg, {"stopped_epoch": 60.0, **best})  # max_epochs
    assert "(early stop)" not in stopping_line(cfg, {"stopped_epoch": 30.0, **best})  # the cap
    assert "(early stop)" in stopping_line(cfg, {"stopped_epoch": 20.0, **best})
    plain = load_config(TrainConfig, None, ["optim.epochs=30"])
    assert stopping_line(plain, {"stopped_epoch": 30.0}) == "epochs: 30 of at most 30"
    assert stopping_line(plain, {}) is None
