"""Usage: python milatt.py SAVED_MODEL (selection_hits.py --save-model) | CHECKPOINT/model.pt STORES

Where does a trained model's attention-MIL attention go on held-out slides: majority objects, the minority
object, distractors, background? And single-patch predictions on those cells."""

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import torch

from operators.model import FoveateModel
from workers.patches import forward_slide

torch.set_num_threads(1)
sys.path.append(str(ROOT / "benchmarks"))  # after the project's own packages (benchmarks/operators.py)
from selection_hits import box_overlap, sidecars

if sys.argv[1].endswith("model.pt"):  # a robustness.py checkpoint + its stores dir: the held-out split of data.seed 0
    from pipeline.data import build_slide_table, split_train_val
    from pipeline.model_io import load_checkpoint

    m, cfg_, _ = load_checkpoint(sys.argv[1])
    m.eval()
    stores_dir = sys.argv[2]

    from pipeline.data import DataConfig

    table = build_slide_table(DataConfig(stores=stores_dir, labels="manifest", val_fraction=0.3, seed=0))
    tr, te = split_train_val(table.records, 0.3, 0)
    ck = {"test": [r.store for r in te], "class_names": list(table.class_names)}
else:
    ck = torch.load(sys.argv[1], weights_only=False)
    m = FoveateModel(ck["cfg"])
    m.load_state_dict(ck["state"])
    m.eval()
    stores_dir = str(__import__("pathlib").Path(ck["test"][0]).parent)
side = sidecars(stores_dir)
names = ck["class_names"]
tot = collections.Counter()
n = 0
correct = 0
wrong_detail = []
for st in ck["test"]:
    sc = side[str(__import__("pathlib").Path(st).resolve())]
    with torch.no_grad():
        out = forward_slide(m, st, training=False)
    att = getattr(m.aggregator, "last_attention", None)
    att = att[0] if att is not None else torch.full((out.coords_l0.shape[0],), 1.0 / out.coords_l0.shape[0])
    label = sc["label"]
    p = 64
    cats = []
    for x, y in out.coords_l0.tolist():
        best = None
        for b in sc["structures"]:
            if box_overlap(int(x), int(y), p, b) > 0:
                best = "major" if b["kind"] == label else "minor"
                break
        if best is None:
            for b in sc["distractors"]:
                if box_overlap(int(x), int(y), p, b) > 0:
                    best = "distr"
                    break
        cats.append(best or "bg")
    for c, a in zip(cats, att.tolist()):
        tot[c] += a
    n += 1
    pred = names[int(out.logits.argmax())]
    correct += pred == label
    if pred != label:
        wrong_detail.append((label, pred, [(c, round(a, 2)) for c, a in zip(cats, att.tolist())]))
print("acc", correct / n, {k: round(v / n, 3) for k, v in tot.items()})
for w in wrong_detail:
    print(w)
