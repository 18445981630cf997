"""What a training-mode selection puts in the bag: distinct cells and overlap with the hard top-k, per slide.

Usage: python benchmarks/results/objects_v2/s27/bag.py MODEL.pt STORES_DIR [SIGMA]
"""

import glob
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from operators.model_io import load_checkpoint
from workers.patches import prepare_slide, slide_geometry
from workers.store import SlideStore

torch.set_num_threads(1)
ck = load_checkpoint(sys.argv[1])
model = ck[0] if isinstance(ck, tuple) else ck
model.eval()
sigma = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
g = torch.Generator().manual_seed(0)
for p in sorted(glob.glob(sys.argv[2] + "/*.zarr"))[:8]:
    si = prepare_slide(SlideStore(p), model.cfg)
    geo = si.geometry if si.geometry is not None else slide_geometry(si.store, model.cfg)
    with torch.no_grad():
        sc = model.local_maxima(model.score(si.lowres_u8[None], si.cell_mask[None], geo), tuple(si.cell_mask.shape))
        hard = set(model.select(sc, training=False).primary[0].tolist())
        res = []
        for _ in range(5):
            cells = model.select(sc, training=True, sigma=sigma, generator=g).primary[0].tolist()
            res.append((len(set(cells)), len(set(cells) & hard)))
        top = torch.sort(sc[0][torch.isfinite(sc[0])], descending=True).values[:12]
    print(Path(p).name[:12], "distinct/in hard top-k", res, "top-12 scores", [round(float(x), 2) for x in top])
