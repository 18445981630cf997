"""An external frozen encoder from a local TorchScript file (``model.features.kind: torchscript``).

Every encoder here is a small TorchScript module the test builds and saves to ``tmp_path``; nothing is downloaded.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from operators.checkpoint import (
    checkpoint_dict,
    checkpoint_digest,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)
from operators.config import from_dict, to_dict
from operators.encoders import TorchScriptEncoder
from operators.errors import ConfigError
from operators.model import FoveateModel
from operators.model_config import (
    AggregatorConfig,
    EvidenceConfig,
    FeaturesConfig,
    GeometryConfig,
    ModelConfig,
    SelectionConfig,
)
from operators.resnet import ResNet, ResNetConfig
from operators.scorer import ScorerConfig
from workers.slide_forward import forward_slide
from workers.store import write_store_from_array

torch.set_num_threads(1)
# the test builds its encoders with torch.jit.script, which torch >= 2.13 marks deprecated (as all of TorchScript)
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning")

DIM = 12
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Recorder(nn.Module):
    """[M, 3, s, s] -> [M, DIM]; keeps the last input it saw in ``seen`` (a TorchScript attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, DIM)
        self.seen = torch.zeros(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.detach()
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


class NotFeatures(nn.Module):
    """A module of the wrong output shape: [M, 3, s, s] -> [M, 8, s, s]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _save(module: nn.Module, path) -> str:
    torch.manual_seed(0)
    torch.jit.script(module).save(str(path))
    return str(path)


@pytest.fixture
def enc_path(tmp_path):
    torch.manual_seed(0)
    return _save(Recorder(), tmp_path / "enc.pt")


def _cfg(path: str, **features) -> ModelConfig:
    features = {"input_size": 32, "input_um": 32.0, "mean": MEAN, "std": STD, **features}
    return ModelConfig(
        geometry=GeometryConfig(scorer_downsample=8.0),
        scorer=ScorerConfig(channels=8, pool="mean"),
        selection=SelectionConfig(k=4, num_samples=16, sigma=0.1),
        evidence=EvidenceConfig(explore_cells=4, explore_strata=0, rare_cells=0, neutral_cells=2),
        aggregator=AggregatorConfig(hidden=16),
        features=FeaturesConfig(kind="torchscript", path=path, **features),
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    img = np.full((512, 512, 3), 245, np.uint8)
    img[64:448, 96:448] = np.clip(200 + rng.integers(-30, 30, (384, 352, 3)), 0, 255).astype(np.uint8)
    img[120:150, 200:230] = (40, 20, 90)
    # level-0 mpp 0.5: input_um 32 is a 64-px grid cell, resampled to the encoder's 32 px
    return write_store_from_array(tmp_path_factory.mktemp("enc") / "s.zarr", img, tile_size=128, min_size=64)


def test_the_config_resolves_the_geometry_from_the_encoder(enc_path):
    cfg = _cfg(enc_path)
    f = cfg.features
    assert f.kind == "torchscript" and f.frozen and f.feature_dim is None
    assert cfg.geometry.patch_input == 32 and cfg.geometry.patch_size_um == 32.0 and cfg.geometry.patch_size is None
    geo = cfg.slide_geometry(0.5)
    assert (geo.patch_size, geo.stride, geo.patch_input) == (64, 32, 32)
    assert cfg.slide_geometry(0.25).patch_size == 128  # a 40x slide: the same 32 µm
    # the YAML form, through to_dict and back
    data = {"features": {"kind": "torchscript", "path": enc_path, "input_size": 32, "input_um": 32, "mean": list(MEAN)}}
    loaded = from_dict(ModelConfig, data)
    assert loaded.geometry.patch_size_um == 32.0 and loaded.features.mean == MEAN and loaded.features.std is None
    assert from_dict(ModelConfig, to_dict(loaded)) == loaded
    # a geometry that agrees is kept; frozen: false is overridden (always frozen)
    same = from_dict(ModelConfig, {**data, "geometry": {"patch_size_um": 32, "patch_input": 32}})
    assert same == loaded
    assert FeaturesConfig(kind="torchscript", path=enc_path, frozen=False).frozen
    # input_size alone: the pixel grid stays, the patches are resampled
    px = ModelConfig(features=FeaturesConfig(kind="torchscript", path=enc_path, input_size=48))
    assert (px.slide_geometry().patch_size, px.slide_geometry().patch_input) == (64, 48)


def test_geometry_that_conflicts_with_the_encoder_names_both_keys(enc_path):
    ts = {"kind": "torchscript", "path": enc_path}
    cases = [
        ({"patch_input": 64}, {"input_size": 32}, r"model.geometry.patch_input=64 and model.features.input_size=32"),
        ({"patch_size_um": 64}, {"input_um": 32}, r"model.geometry.patch_size_um=64.0 and model.features.input_um=32"),
        ({"patch_size": 64}, {"input_um": 32}, r"model.geometry.patch_size=64 .* and model.features.input_um=32"),
        ({"patch_size": 96}, {"input_um": 32}, r"model.geometry.patch_size=96 .* and model.features.input_um=32"),
        ({"stride": 16}, {"input_um": 32}, r"model.geometry.stride=16 .* and model.features.input_um=32"),
    ]
    for geometry, features, match in cases:
        with pytest.raises(ConfigError, match=match):
            from_dict(ModelConfig, {"geometry": geometry, "features": {**ts, **features}})
    with pytest.raises(ConfigError, match=r"model.geometry.patch_size=96 .* and model.features.input_um"):
        ModelConfig(geometry=GeometryConfig(patch_size=96), features=FeaturesConfig(**ts, input_um=32.0))


def test_bad_features_settings_say_what_was_expected():
    with pytest.raises(ConfigError, match=r"model.features.path: kind torchscript needs the TorchScript file"):
        from_dict(ModelConfig, {"features": {"kind": "torchscript"}})
    with pytest.raises(ConfigError, match=r"model.features.path applies to kind torchscript only"):
        FeaturesConfig(path="enc.pt")
    with pytest.raises(ConfigError, match=r"model.features.widths applies to kind resnet only, got \(8,\)"):
        from_dict(FeaturesConfig, {"kind": "torchscript", "path": "e.pt", "widths": [8], "blocks": [1]})
    with pytest.raises(ConfigError, match=r"model.features.mean applies to kind torchscript only"):
        FeaturesConfig(mean=MEAN)
    with pytest.raises(ConfigError, match=r"model.features.std must be 3 numbers .* got \(1.0, 2.0\)"):
        from_dict(FeaturesConfig, {"kind": "torchscript", "path": "e.pt", "std": [1, 2]})
    with pytest.raises(ConfigError, match=r"model.features.std\[1\] must be a finite number in \(0, inf\), got 0.0"):
        FeaturesConfig(kind="torchscript", path="e.pt", std=(1.0, 0.0, 1.0))
    with pytest.raises(ConfigError, match=r"features.kind: expected one of \['resnet', 'torchscript'\]"):
        from_dict(ModelConfig, {"features": {"kind": "onnx"}})
    with pytest.raises(ConfigError, match=r"model.features.input_size must be an int >= 8, got 4"):
        FeaturesConfig(input_size=4)
    with pytest.raises(ConfigError, match=r"model.features.blocks must list one int >= 1 per entry of widths"):
        FeaturesConfig(widths=(8, 16), blocks=(1,))


def test_old_shape_features_mappings_load_unchanged():
    old = {"widths": [8, 16], "blocks": [1, 2], "feature_dim": 24, "norm": "batch", "frozen": True, "weights": None}
    f = from_dict(ModelConfig, {"features": old}).features
    assert f == FeaturesConfig(widths=(8, 16), blocks=(1, 2), feature_dim=24, norm="batch", frozen=True)
    assert f.kind == "resnet" and f.resnet() == ResNetConfig(**{**old, "widths": (8, 16), "blocks": (1, 2)})
    assert FeaturesConfig().resnet() == ResNetConfig() and FeaturesConfig().feature_dim == 64
    # the network's own config, as earlier code passed it, is taken as the resnet section
    assert ModelConfig(features=ResNetConfig(widths=(8, 16), blocks=(1, 2), feature_dim=24)).features == (
        FeaturesConfig(widths=(8, 16), blocks=(1, 2), feature_dim=24)
    )
    # a checkpoint written before the kinds: state dict and config load as they were
    cfg = ModelConfig(features=FeaturesConfig(widths=(8, 16), blocks=(1, 1), feature_dim=16))
    torch.manual_seed(0)
    model = FoveateModel(cfg).eval()
    ckpt = checkpoint_dict(model, cfg, ["a", "b"])
    assert "torchscript" not in ckpt
    for key in ("kind", "path", "input_size", "input_um", "mean", "std"):
        del ckpt["model_config"]["features"][key]
    again, cfg2, _ = model_from_checkpoint(ckpt)
    assert cfg2 == cfg and isinstance(again.features, ResNet)
    x, pos = torch.rand(1, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.zeros(1, 4, 2)
    with torch.no_grad():
        assert torch.equal(model(x, pos), again(x, pos))


def test_the_encoder_is_built_frozen_with_its_feature_size_found(enc_path):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(enc_path))
    enc = model.features
    assert isinstance(enc, TorchScriptEncoder) and enc.feature_dim == DIM and model.feature_dim == DIM
    assert [m.in_features for m in model.aggregator.modules() if isinstance(m, nn.Linear)] == [DIM]
    assert model.instance_head.in_features == DIM
    assert all(not p.requires_grad for p in enc.parameters()) and len(list(enc.parameters())) == 4
    model.train()
    assert model.scorer.training and not enc.training and not enc.module.training
    # the frozen weights stay out of the state dict and load back from the file
    assert not [k for k in model.state_dict() if k.startswith("features.")]
    before = {k: v.clone() for k, v in enc.module.state_dict().items()}
    model.load_state_dict(model.state_dict())
    assert all(torch.equal(before[k], v) for k, v in enc.module.state_dict().items())
    # an explicit feature_dim is checked against the module's
    assert FoveateModel(_cfg(enc_path, feature_dim=DIM)).feature_dim == DIM
    with pytest.raises(ConfigError, match=rf"feature_dim=7 but the module of model.features.path '{enc_path}'"):
        FoveateModel(_cfg(enc_path, feature_dim=7))
    # a copy (the trainer's moving average) is a model of its own
    twin = copy.deepcopy(model)
    assert twin.features.module is not enc.module and twin.feature_dim == DIM


def test_the_encoder_sees_normalised_patches_of_its_input_size(enc_path, store):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(enc_path)).eval()
    raw = []
    model.features.register_forward_pre_hook(lambda m, args: raw.append(args[0].detach().clone()))
    out = forward_slide(model, store, training=False)
    seen = model.features.module.seen
    assert tuple(seen.shape) == (4, 3, 32, 32) and tuple(raw[-1].shape) == (4, 3, 32, 32)
    assert float(raw[-1].min()) >= 0 and float(raw[-1].max()) <= 1
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(seen, (raw[-1] - mean) / std, rtol=0, atol=1e-6)
    assert out.logits.shape == (1, 2) and torch.isfinite(out.logits).all()
    # without mean/std the module gets the [0, 1] patches as they are
    plain = FoveateModel(_cfg(enc_path, mean=None, std=None)).eval()
    p = torch.rand(3, 3, 32, 32)
    plain.embed(p)
    assert torch.equal(plain.features.module.seen, p)
    with pytest.raises(ValueError, match=r"takes 32-px patches \(model.features.input_size\), got \(16, 16\)"):
        plain.embed(torch.rand(3, 3, 16, 16))


def test_training_trains_the_scorer_and_aggregator_never_the_encoder(enc_path, store):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(enc_path)).train()
    enc = dict(model.features.module.named_parameters())
    frozen = {k: v.detach().clone() for k, v in enc.items()}
    head = {k: v.detach().clone() for k, v in model.aggregator.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter offered: the frozen ones are skipped
    g = torch.Generator().manual_seed(0)
    out = forward_slide(model, store, training=True, generator=g, target=1)
    assert {"instance", "rank", "neutral"} <= set(out.aux_losses)
    loss = torch.nn.functional.cross_entropy(out.logits, torch.tensor([1])) + sum(out.aux_losses.values())
    loss.backward()
    assert all(p.grad is None for p in enc.values())
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.scorer.parameters())
    opt.step()
    assert all(torch.equal(frozen[k], p) for k, p in enc.items())
    assert any(not torch.equal(head[k], p) for k, p in model.aggregator.named_parameters())
    # a gradient carried by the patches (soft patches with scorer_grad > 0) flows through the frozen encoder
    patches = torch.rand(2, 3, 32, 32, requires_grad=True)
    model.embed(patches).sum().backward()
    assert patches.grad is not None and float(patches.grad.abs().sum()) > 0
    assert all(p.grad is None for p in enc.values())


def test_a_checkpoint_scores_without_the_torchscript_file(tmp_path, enc_path, store):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(enc_path))
    for p in model.aggregator.parameters():  # trained weights, not the initial zeros
        p.data.normal_()
    model.eval()
    before = forward_slide(model, store, training=False)
    path = save_checkpoint(tmp_path / "ckpt" / "model.pt", model, model.cfg, ["a", "b"])
    raw = torch.load(path, weights_only=True)  # the file's bytes as a uint8 tensor: weights_only reads them
    data = Path(enc_path).read_bytes()
    assert raw["torchscript"].dtype == torch.uint8 and raw["torchscript"].numpy().tobytes() == data
    assert os.path.getsize(path) < len(data) + 64 * 1024  # the bytes as they are, the weights not repeated
    assert not [k for k in raw["state_dict"] if k.startswith("features.")]
    os.remove(enc_path)
    loaded, cfg, names = load_checkpoint(path)
    assert cfg == model.cfg and names == ["a", "b"]
    after = forward_slide(loaded, store, training=False)
    assert torch.equal(before.logits, after.logits) and torch.equal(before.cell_indices, after.cell_indices)
    # the loaded model keeps the bytes: its own checkpoint is the same model (same digest) without the file
    again = checkpoint_dict(loaded, cfg, ["a", "b"])
    assert torch.equal(again["torchscript"], raw["torchscript"]) and checkpoint_digest(again) == checkpoint_digest(raw)
    other = dict(raw, torchscript=torch.cat([raw["torchscript"], torch.zeros(1, dtype=torch.uint8)]))
    assert checkpoint_digest(other) != checkpoint_digest(raw)
    # the model built from the missing path fails, naming it; so does a checkpoint written after the file changed
    with pytest.raises(FileNotFoundError, match=rf"model.features.path '{enc_path}': no such file"):
        FoveateModel(cfg)
    _save(Recorder(), enc_path)
    fresh = FoveateModel(cfg)
    _save(NotFeatures(), enc_path)
    with pytest.raises(RuntimeError, match="changed since the model was built"):
        checkpoint_dict(fresh, cfg, ["a", "b"])
    # pickled code under "torchscript" is still refused by weights_only
    torch.save({**raw, "torchscript": nn.Linear(2, 2)}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="never unpickles code"):
        load_checkpoint(tmp_path / "evil.pt")


def test_unusable_files_are_errors_naming_the_path(tmp_path):
    missing = str(tmp_path / "none.pt")
    with pytest.raises(FileNotFoundError, match=rf"model.features.path '{missing}': no such file"):
        FoveateModel(_cfg(missing))
    state = tmp_path / "state_dict.pt"
    torch.save(nn.Linear(2, 2).state_dict(), state)
    with pytest.raises(ValueError, match=rf"model.features.path '{state}' is not a TorchScript module"):
        FoveateModel(_cfg(str(state)))
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=rf"model.features.path '{text}' is not a TorchScript module"):
        FoveateModel(_cfg(str(text)))
    wrong = _save(NotFeatures(), tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match=rf"'{wrong}': the module must map .* it gave \(2, 8, 32, 32\)"):
        FoveateModel(_cfg(wrong))
