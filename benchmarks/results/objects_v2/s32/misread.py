"""Which held-out slides each checkpoint misreads (hard top-k), with the slide's objects (majority/minority kinds
and sizes) and how many of them the bag holds. Usage: misread.py <config> <stores> <model.pt> [...]"""
import sys
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from collections import Counter
from pathlib import Path
import torch
import robustness as rb
from pipeline.model_io import load_checkpoint
from workers.patches import forward_slide, slide_geometry
from workers.store import SlideStore
config, stores = sys.argv[1], Path(sys.argv[2])
split = rb.load_split(config, stores, [])
count = Counter()
for ckpt in sys.argv[3:]:
    model, cfg, _ = load_checkpoint(ckpt); model.eval()
    bad = []
    with torch.no_grad():
        for rec in split.test:
            store = SlideStore(rec.store)
            out = forward_slide(model, store, training=False, sigma=0.0)
            p = torch.softmax(out.logits.reshape(-1).float(), -1)
            if int(p.argmax()) != rec.target:
                patch = slide_geometry(store, cfg).patch_size
                xy = out.coords_l0.numpy().reshape(-1, 2)
                boxes = split.boxes[rec.store]
                lab = split.class_names[rec.target]
                maj = [b for b in boxes if b["kind"] == lab]; mino = [b for b in boxes if b["kind"] != lab]
                _, tmaj = rb.hits_of(xy, patch, maj); _, tmin = rb.hits_of(xy, patch, mino)
                name = Path(rec.store).name
                count[name] += 1
                bad.append((name, f"maj {tmaj}/{len(maj)} min {tmin}/{len(mino)}", round(float(p[rec.target]), 3)))
    print(ckpt.split("/")[-2], bad, flush=True)
print("misread by how many checkpoints:", count.most_common())
