"""The sectioned model config: defaults are the recipe, every field documented, flat keys of earlier versions
load (with a deprecation naming the new key), removed switches are refused, ``foveate config show``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging

import pytest
import yaml
from flat_model_config import FLAT_DEFAULTS, flat_config

import operators.model_config as mc
from operators.checkpoint import build_model
from operators.config import from_dict, to_dict
from operators.errors import ConfigError
from operators.model_config import FLAT_KEYS, REMOVED_KEYS, ModelConfig, upgrade_flat_keys
from pipeline.config import load_config, shipped_config
from pipeline.train_config import TrainConfig

# the model section every shipped accuracy config stated before the sections existed (flat keys)
OLD_PERTURBED_MEAN = {
    "selector": "perturbed",
    "aggregator": "mean",
    "sigma": 0.05,
    "entropy_weight": 0.01,
    "alpha": 0.05,
    "explore_cells": 8,
    "explore_strata": 8,
    "evidence": "label",
    "selection_grad": 0.0,
    "instance_weight": 0.01,
    "rank_weight": 0.1,
    "rare_cells": 32,
    "neutral_cells": 8,
    "color_jitter": 0.2,
    "nms_radius": 1,
    "patch_size": 64,
    "stride": 32,
    "nms_ties": "first",
    "k": 8,
    "scorer_downsample": 16,
    "tissue_threshold": 0.1,
    "num_samples": 64,
    "max_support": 1,
    "scorer": {"channels": 16, "num_layers": 4, "pool": "max"},
    "features": {"widths": [16, 32, 64], "blocks": [1, 1, 1], "feature_dim": 64},
    "aggregator_hidden": 64,
    "transformer_layers": 1,
    "transformer_heads": 2,
}


def test_the_defaults_are_the_recipe_the_shipped_configs_stated():
    old, new = from_dict(ModelConfig, OLD_PERTURBED_MEAN), ModelConfig()
    # the recipe, every key spelled out, is the defaults (the settings of the selector and aggregator it uses)
    assert old.slide_geometry() == new.slide_geometry() and old.geometry.tissue_threshold == 0.1
    for name in ("scorer", "evidence", "augment", "features", "experimental", "num_classes", "mpp"):
        assert getattr(old, name) == getattr(new, name), name
    active = lambda c: (dataclasses.replace(c.selection, sinkhorn=None, lapsum=None, attention=None), c.aggregator.kind)
    assert active(old) == active(new) and old.aggregator.hidden == new.aggregator.hidden
    shipped = load_config(TrainConfig, shipped_config("perturbed_mean")).model
    assert shipped == ModelConfig()
    # the other shipped configs differ from the recipe in one section each
    mil = load_config(TrainConfig, shipped_config("perturbed_attention_mil")).model
    assert mil == dataclasses.replace(ModelConfig(), aggregator=mc.AggregatorConfig(kind="attention_mil"))
    sinkhorn = load_config(TrainConfig, shipped_config("sinkhorn")).model
    assert sinkhorn.selection.soft == mc.SinkhornConfig() and sinkhorn.selection.soft.draw == "slot_modes"
    assert load_config(TrainConfig, shipped_config("lapsum")).model.selection.soft.alpha == 0.01
    assert ModelConfig().geometry.stride_l0 == 32 and ModelConfig().slide_geometry().stride == 32


def test_every_field_of_every_section_has_a_docstring():
    tree = ast.parse(inspect.getsource(mc))
    sections = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")}
    assert {"GeometryConfig", "SelectionConfig", "EvidenceConfig", "AggregatorConfig", "ModelConfig"} <= set(sections)
    for name, node in sections.items():
        body = node.body
        fields = [(i, s) for i, s in enumerate(body) if isinstance(s, ast.AnnAssign)]
        assert fields, name
        for i, stmt in fields:
            doc = body[i + 1] if i + 1 < len(body) else None
            ok = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
            assert ok and doc.value.value.strip(), f"{name}.{stmt.target.id} has no docstring"


def test_flat_keys_load_in_their_sections_with_one_deprecation_each(caplog):
    with caplog.at_level(logging.WARNING, logger="operators.config"):
        cfg = from_dict(
            ModelConfig, {"k": 4, "aggregator": "attention_mil", "mean_skip": False, "evidence": "confidence"}
        )
    assert cfg.selection.k == 4 and cfg.aggregator.kind == "attention_mil" and cfg.evidence.target == "confidence"
    assert not cfg.aggregator.attention_mil.mean_skip and not cfg.aggregator.transformer.mean_skip
    notes = [r.getMessage() for r in caplog.records]
    assert "model.k is deprecated: use model.selection.k" in notes
    assert "model.aggregator is deprecated: use model.aggregator.kind" in notes
    assert any(
        n.startswith("model.mean_skip is deprecated: use model.aggregator.attention_mil.mean_skip and") for n in notes
    )
    assert len(notes) == 5 and "keys not given take today's defaults" in notes[-1]
    # sectioned keys load silently; a flat key beside its section merges into it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="operators.config"):
        nested = from_dict(ModelConfig, {"selection": {"k": 4}, "aggregator": {"kind": "attention_mil"}})
    assert not caplog.records and nested.selection.k == 4
    assert from_dict(ModelConfig, {"selection": {"selector": "lapsum"}, "k": 3}).selection.k == 3
    with pytest.raises(ConfigError, match=r"model.k=3 and model.selection.k=5 conflict"):
        from_dict(ModelConfig, {"selection": {"k": 5}, "k": 3})
    # through a YAML file and --set, as foveate train reads them
    assert (
        load_config(TrainConfig, None, ["model.k=5", "model.stride=null", "model.patch_size=96"]).model.geometry.stride
        == 96
    )
    # every flat key has a place that exists
    for key, targets in FLAT_KEYS.items():
        for target in targets:
            node = ModelConfig()
            for part in target.split("."):
                assert hasattr(node, part), f"{key} -> {target}"
                node = getattr(node, part)


def test_a_checkpoint_with_every_flat_key_loads_exactly_and_silently(caplog):
    old = {
        **FLAT_DEFAULTS,
        **REMOVED_KEYS,
        "patch_size": 128,
        "stride": None,  # earlier: no overlap
        "patch_size_um": None,
        "stride_um": None,
        "patch_input": None,
        "scorer_downsample": 16.0,
        "scorer_mpp": None,
        "scorer": {"channels": 32, "num_layers": 4, "pool": "mean", "tile": 1024},
        "features": {"widths": [16, 32, 64, 128], "blocks": [1, 1, 1, 1], "feature_dim": 128},
        "num_classes": 3,
        "mpp": 0.5,
    }
    with caplog.at_level(logging.WARNING):
        model, cfg = build_model(old)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert cfg == flat_config(num_classes=3, mpp=0.5)
    assert cfg.geometry.stride == 128 and cfg.selection.scorer_grad == 1.0 and cfg.evidence.instance_weight == 0
    assert model.instance_head is None and cfg.scorer.pool == "mean" and cfg.features.feature_dim == 128
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg  # the sectioned form round-trips


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_removed_switches_load_only_at_their_off_value(key):
    off = REMOVED_KEYS[key]
    assert upgrade_flat_keys({key: off, "k": 4})[0] == {"selection": {"k": 4}}
    on = True if isinstance(off, bool) else 3 if isinstance(off, int) else 0.25
    with pytest.raises(ConfigError, match=rf"model.{key} was removed .* got {on}"):
        from_dict(ModelConfig, {key: on})


def test_bad_values_and_unknown_keys_name_the_key_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['model.selection.kk'\].*allowed: .*'k'"):
        load_config(TrainConfig, None, ["model.selection.kk=3"])
    with pytest.raises(ConfigError, match=r"model.selection.selector: expected one of .*'perturbed'.* got 'topk'"):
        load_config(TrainConfig, None, ["model.selection.selector=topk"])
    with pytest.raises(ConfigError, match=r"model.selection.k must be an int >= 1, got 0"):
        load_config(TrainConfig, None, ["model.selection.k=0"])
    with pytest.raises(ConfigError, match=r"model.aggregator.hidden \(10\) must be a multiple of .*heads \(4\)"):
        from_dict(ModelConfig, {"aggregator": {"kind": "transformer", "hidden": 10, "transformer": {"heads": 4}}})
    with pytest.raises(ConfigError, match="rank_weight > 0 needs model.evidence.instance_weight > 0"):
        from_dict(ModelConfig, {"evidence": {"instance_weight": 0.0, "rare_cells": 0}})


def test_config_show_prints_the_effective_config_with_the_source_of_each_value(capsys):
    from pipeline.cli import main

    assert main(["config", "show", "--config", "demo", "--set", "model.selection.k=4", "--set", "optim.epochs=3"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert lines["k"].split("#")[1].strip() == "--set" and " 4 " in lines["k"] + " "
    assert lines["stride"].rstrip().endswith("# file") and "64" in lines["stride"]
    assert lines["patch_size"].rstrip().endswith("# default")
    assert lines["epochs"].rstrip().endswith("# --set")
    # the output is a config file that gives the same config
    shown = yaml.safe_load(out)
    want = load_config(TrainConfig, shipped_config("demo"), ["model.selection.k=4", "optim.epochs=3"])
    assert from_dict(TrainConfig, shown) == want
    assert main(["config", "show", "--section", "model"]) == 0
    assert capsys.readouterr().out.startswith("model:\n")
    assert main(["config", "show", "--section", "nope"]) == 2
    # a file whose section is empty (`model: {}`, as the shipped perturbed_mean.yaml) states none of its values
    assert main(["config", "show", "--config", "perturbed_mean", "--section", "model"]) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert lines["k"].rstrip().endswith("# default") and lines["selector"].rstrip().endswith("# default")
