"""Model checkpoints (torch.load weights_only=True) and MLflow model logging/loading."""

from __future__ import annotations

import os

import pytest
import torch
from flat_model_config import flat_config

from operators.checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_dict,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)
from operators.model import FoveateModel
from operators.model_config import ModelConfig
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from pipeline.mlflow_model import load_model, log_model

CLASSES = ["benign", "in situ", "invasive"]


def _model(seed: int = 0) -> tuple[FoveateModel, ModelConfig]:
    cfg = flat_config(
        patch_size=16,
        k=3,
        num_classes=3,
        aggregator="transformer",
        aggregator_hidden=8,
        transformer_heads=2,
        transformer_layers=1,
        scorer=ScorerConfig(channels=4, num_layers=2, pool="mean"),
        features=ResNetConfig(widths=(4, 8), blocks=(1, 1), feature_dim=8),
    )
    torch.manual_seed(seed)
    return FoveateModel(cfg).eval(), cfg


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.rand(2, 3, 3, 16, 16, generator=g), torch.rand(2, 3, 2, generator=g)


def _same(a: FoveateModel, b: FoveateModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    x, pos = _inputs()
    with torch.no_grad():
        assert torch.equal(a(x, pos), b(x, pos))


def test_checkpoint_round_trip_weights_only(tmp_path):
    model, cfg = _model()
    path = save_checkpoint(
        tmp_path / "m.pt", model, cfg, CLASSES, train_config={"optim": {"lr": 0.1}}, metadata={"epoch": 3}
    )
    raw = torch.load(path, weights_only=True)  # plain content only: no pickled classes
    assert raw["format"] == CHECKPOINT_FORMAT
    assert raw["class_names"] == CLASSES
    assert raw["model_config"]["num_classes"] == 3 and raw["model_config"]["features"]["widths"] == [4, 8]
    assert raw["train_config"] == {"optim": {"lr": 0.1}} and raw["metadata"] == {"epoch": 3}
    loaded, cfg2, classes = load_checkpoint(path)
    assert cfg2 == cfg and classes == CLASSES and not loaded.training
    _same(model, loaded)
    other, _ = _model(seed=1)
    with pytest.raises(AssertionError):
        _same(model, other)  # the comparison can fail
    with pytest.raises(ValueError, match="not a foveate model checkpoint"):
        model_from_checkpoint({"state_dict": {}})
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")
    d = checkpoint_dict(model, cfg, CLASSES)
    assert all(v.device.type == "cpu" for v in d["state_dict"].values())


def test_log_model_and_load_from_every_uri(tmp_path):
    import mlflow

    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = mlflow.MlflowClient(uri)
    from pipeline.tracking import get_or_create_experiment

    exp = get_or_create_experiment(client, "io-test", uri)
    run_id = client.create_run(exp).info.run_id
    model, cfg = _model()
    model_uri = log_model(model, cfg, CLASSES, run_id=run_id, tracking_uri=uri, registered_model_name="foveate-io-test")
    assert model_uri.startswith("models:/")
    assert client.get_run(run_id).info.status == "RUNNING"  # the caller ends the run
    # the logged model is in the run's experiment with its artifacts under the sqlite file's folder
    info = mlflow.models.get_model_info(model_uri)
    assert info.signature is not None  # the whole pipeline: stores in, foveate score rows out (test_serving.py)
    assert info.signature.inputs.input_names() == ["store", "slide_id"]
    assert [f"prob_{c}" for c in CLASSES] == info.signature.outputs.input_names()[-3:]
    logged = client.get_logged_model(model_uri.split("/", 1)[1].strip("/"))
    assert logged.experiment_id == exp and logged.source_run_id == run_id
    assert str(tmp_path) in logged.artifact_location  # beside the sqlite file, not ./mlruns
    for u in (model_uri, f"runs:/{run_id}", f"runs:/{run_id}/model", "models:/foveate-io-test/1"):
        loaded, cfg2, classes = load_model(u, tracking_uri=uri)
        assert cfg2 == cfg and classes == CLASSES, u
        _same(model, loaded)
    # the pyfunc flavour rebuilds the same network from the checkpoint it carries
    flavour = mlflow.pyfunc.load_model(model_uri).unwrap_python_model()
    _same(model, flavour._scorer.model)
    _same(model, flavour._classifier.model)
    with pytest.raises(ValueError, match="could not load model"):
        load_model(f"runs:/{run_id}/nothing-here", tracking_uri=uri)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.pt")
