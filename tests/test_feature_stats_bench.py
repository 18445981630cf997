"""benchmarks/feature_stats.py: a checkpoint re-tested with the exact feature statistics of its training slides,
what the trainer does when training ends; a model without a standardisation is refused."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from benchmark_modules import load_benchmark


def test_retest_refreshes_the_statistics_on_the_training_slides_only(tmp_path):
    from test_two_phase import _config
    from tiny_stores import rare_structures_views

    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from workers.slide_forward import forward_slide
    from workers.store import SlideStore

    load_benchmark("robustness")
    fs = load_benchmark("feature_stats")
    recs = rare_structures_views(tmp_path)
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
