"""Per misread held-out slide: objects (majority/minority) found by the hard top-k, and the prediction."""
import sys, json
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import numpy as np, torch
import robustness as rb
from pipeline.model_io import load_checkpoint
from workers.patches import forward_slide, slide_geometry
from workers.store import SlideStore
ckpt, config, stores = sys.argv[1], sys.argv[2], Path(sys.argv[3])
split = rb.load_split(config, stores, [])
model, cfg, _ = load_checkpoint(ckpt); model.eval()
stats = {"ok": [], "bad": []}
with torch.no_grad():
    for rec in split.test:
        store = SlideStore(rec.store)
        out = forward_slide(model, store, training=False, sigma=0.0)
        p = torch.softmax(out.logits.reshape(-1).float(), -1).numpy()
        patch = slide_geometry(store, cfg).patch_size
        xy = out.coords_l0.numpy().reshape(-1, 2)
        boxes = split.boxes[rec.store]
        lab = split.class_names[rec.target]
        maj = [b for b in boxes if b["kind"] == lab]; mino = [b for b in boxes if b["kind"] != lab]
        _, tmaj = rb.hits_of(xy, patch, maj); _, tmin = rb.hits_of(xy, patch, mino)
        pred = int(p.argmax())
        row = dict(n=len(boxes), maj=f"{tmaj}/{len(maj)}", mino=f"{tmin}/{len(mino)}", p_true=round(float(p[rec.target]), 3))
        stats["ok" if pred == rec.target else "bad"].append(row)
print("misread:", stats["bad"])
ok = stats["ok"]
print("correct: n", len(ok), "all majority found", sum(r["maj"].split("/")[0] == r["maj"].split("/")[1] for r in ok))
