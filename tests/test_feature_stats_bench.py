"""benchmarks/feature_stats.py: a checkpoint re-tested with the exact feature statistics of its training slides,
what the trainer does when training ends; a model without a standardisation is refused."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_retest_refreshes_the_statistics_on_the_training_slides_only(tmp_path):
    from test_two_phase import _config
    from tiny_stores import rare_structures_image

    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore, write_store_from_array

    sys.path.insert(0, str(ROOT / "benchmarks"))
    _load("robustness")
    fs = _load("feature_stats")
    img = rare_structures_image()
    recs = []
    for i, view in enumerate((img, img[::-1], img[:, ::-1], np.roll(img, 200, axis=1), np.roll(img, 300, axis=0))):
        write_store_from_array(tmp_path / f"s{i}.zarr", np.ascontiguousarray(view), tile_size=128, min_size=64)
        recs.append(SimpleNamespace(store=str(tmp_path / f"s{i}.zarr"), target=i % 2))
    cfg = _config(discovery=False)
    cfg = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, standardise=True))
    torch.manual_seed(0)
    model = FoveateModel(cfg).eval()
    no_boxes = {r.store: [] for r in recs}
    split = SimpleNamespace(train=recs[:4], test=recs[4:], class_names=["a", "b"], boxes=no_boxes, distractors=no_boxes)
    row = fs.retest(model, split)
    assert row["rows"] == 4 * cfg.selection.k and row["shift_median"] > 0
    outs = []  # standardised by the refreshed statistics, the training slides' features have mean 0
    hook = model.feature_norm.register_forward_hook(lambda _m, _a, out: outs.append(out.double()))
    with torch.no_grad():
        for rec in split.train:
            forward_slide(model, SlideStore(rec.store), training=False)
        hook.remove()
        probs = torch.softmax(forward_slide(model, SlideStore(recs[4].store), training=False).logits.reshape(-1), -1)
    torch.testing.assert_close(
        torch.cat(outs).mean(0), torch.zeros(outs[0].shape[-1], dtype=torch.float64), rtol=0, atol=1e-4
    )
    assert row["refreshed_accuracy"] == float(int(probs.argmax()) == recs[4].target)
    # the command: a checkpoint without a standardisation is refused with its reason
    plain = FoveateModel(_config(discovery=False))
    torch.save(checkpoint_dict(plain, plain.cfg, ["a", "b"]), tmp_path / "model.pt")
    with pytest.raises(SystemExit, match="no feature standardisation"):
        fs.main(["--stores", str(tmp_path), "--checkpoint", str(tmp_path / "model.pt")])
