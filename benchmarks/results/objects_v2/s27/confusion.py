"""Confusion matrix of a trained checkpoint over every slide of a store directory (hard top-k inference).

Usage: python benchmarks/results/objects_v2/s27/confusion.py MODEL.pt STORES_DIR   (STORES_DIR holds manifest.csv)
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from operators.model_io import load_checkpoint
from workers.patches import forward_slide
from workers.store import SlideStore

torch.set_num_threads(1)
ck = load_checkpoint(sys.argv[1])
model = ck[0] if isinstance(ck, tuple) else ck
model.eval()
man = pd.read_csv(Path(sys.argv[2]) / "manifest.csv")
classes = sorted(man["label"].unique())
conf = np.zeros((len(classes), len(classes)), int)
for _, r in man.iterrows():
    with torch.no_grad():
        out = forward_slide(model, SlideStore(r["store"]), training=False)
    conf[classes.index(r["label"]), int(out.logits.argmax())] += 1
print("rows: true class, columns: predicted", classes)
print(conf)
