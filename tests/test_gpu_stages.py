"""The scoring stages and the trainer on CUDA (skipped without a GPU): the same cells and probabilities as on the
CPU in float32, bf16 autocast close to float32, a training epoch on the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_stores import checker_stores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _config():
    from flat_model_config import flat_config

    from operators.resnet import ResNetConfig
    from operators.scorer import ScorerConfig

    return flat_config(
        patch_size=32,
        scorer_downsample=4.0,
        k=3,
        num_classes=2,
        scorer=ScorerConfig(channels=8),
        features=ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=16),
        color_jitter=0.0,
    )


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel

    root, _ = checker_stores(tmp_path_factory.mktemp("gpu"), ["a", "b"], [0, 200], count=6)
    torch.manual_seed(0)
    cfg = _config()
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, ["a", "b"])
    return ckpt, [(f"s{i:02d}", str(root / f"s{i:02d}.zarr")) for i in range(6)]


def test_cuda_stages_match_the_cpu(slides):
    from workers.scoring import ClassifierWorker, ScorerWorker

    ckpt, todo = slides
    cpu = ScorerWorker(ckpt, device="cpu", precision="fp32").score_batch(todo)
    gpu = ScorerWorker(ckpt, device="cuda", precision="fp32").score_batch(todo)
    assert {i["device"] for i in gpu} == {"cuda"}
    for a, b in zip(cpu, gpu):
        np.testing.assert_array_equal(a["cells"], b["cells"])
        np.testing.assert_allclose(a["scores"], b["scores"], rtol=1e-3, atol=1e-4)
    rows_cpu = ClassifierWorker(ckpt, device="cpu").classify_batch(cpu)
    rows_gpu = ClassifierWorker(ckpt, device="cuda").classify_batch(gpu)
    for a, b in zip(rows_cpu, rows_gpu):
        assert a["patches"][0]["x"] == b["patches"][0]["x"]
        for c in ("a", "b"):
            assert a["probabilities"][c] == pytest.approx(b["probabilities"][c], abs=1e-4)


def test_cuda_bf16_is_close_to_float32(slides):
    from workers.scoring import ClassifierWorker, ScorerWorker

    ckpt, todo = slides
    ref = ScorerWorker(ckpt, device="cuda", precision="fp32").score_batch(todo)
    low = ScorerWorker(ckpt, device="cuda", precision="bf16").score_batch(todo)
    shared = np.mean([len(set(a["cells"]) & set(b["cells"])) / len(a["cells"]) for a, b in zip(ref, low)])
    assert shared >= 0.5
    a_rows = ClassifierWorker(ckpt, device="cuda", precision="fp32").classify_batch(ref)
    b_rows = ClassifierWorker(ckpt, device="cuda", precision="bf16").classify_batch(ref)
    for a, b in zip(a_rows, b_rows):
        assert max(abs(a["probabilities"][c] - b["probabilities"][c]) for c in ("a", "b")) < 0.05


def test_a_training_epoch_on_cuda(slides):
    from workers.trainer import OptimConfig, ScheduleConfig, Trainer

    _, todo = slides
    records = [SimpleNamespace(store=path, target=i % 2) for i, (_, path) in enumerate(todo)]
    tr = Trainer(
        _config(),
        OptimConfig(epochs=1, accumulate=2, lr=0.01, warmup=0),
        ScheduleConfig(),
        slides_per_epoch=len(records),
        device="cuda",
    )
    before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    result = tr.train_epoch(records)
    assert next(tr.model.parameters()).device.type == "cuda"
    assert result.n == len(records) and np.isfinite(result.loss)
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
