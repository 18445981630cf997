"""Same checkpoint, same hard top-k bags: held-out accuracy of the mean aggregator's readout (mean of the patches'
logits, as trained) against a soft vote (mean of the patches' probabilities) and a hard vote (majority of the
patches' argmax, ties by the mean logits), and the mean of each patch's centred logits squashed by
c * tanh(./c) (a bound on what one patch can add). Usage: readout.py <config> <stores> <model.pt> [...]"""
import sys
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import torch
import robustness as rb
from pipeline.model_io import load_checkpoint
from workers.patches import forward_slide
from workers.store import SlideStore
config, stores = sys.argv[1], Path(sys.argv[2])
CLIPS = (0.5, 1, 2, 4)
split = rb.load_split(config, stores, [])
for ckpt in sys.argv[3:]:
    model, cfg, _ = load_checkpoint(ckpt); model.eval()
    seen = {}
    head = model.aggregator.head
    orig = model.aggregator.forward
    def fwd(features, positions=None, weights=None):
        seen["f"] = features
        return orig(features, positions, weights)
    model.aggregator.forward = fwd
    ok = {"mean": 0, "soft_vote": 0, "hard_vote": 0, **{f"clip{c}": 0 for c in CLIPS}}
    with torch.no_grad():
        for rec in split.test:
            out = forward_slide(model, SlideStore(rec.store), training=False, sigma=0.0)
            per = head(seen["f"][0])  # [K, C]
            mean = per.mean(0)
            soft = torch.softmax(per, -1).mean(0)
            votes = torch.bincount(per.argmax(-1), minlength=per.shape[1]).float() + 1e-3 * torch.softmax(mean, -1)
            assert torch.allclose(mean, out.logits.reshape(-1), atol=1e-5)
            centred = per - per.mean(-1, keepdim=True)  # each patch's logits about their mean over classes
            clipped = [(f"clip{c}", (c * torch.tanh(centred / c)).mean(0)) for c in CLIPS]
            for name, v in (("mean", mean), ("soft_vote", soft), ("hard_vote", votes), *clipped):
                ok[name] += int(int(v.argmax()) == rec.target)
    n = len(split.test)
    print(ckpt.split("/")[-2], {k: round(v / n, 3) for k, v in ok.items()}, flush=True)
