"""How much of each informative object one grid cell can hold: per object, the largest fraction of its box inside
a single patch_size window of a grid with the given stride (level-0 px). Usage: coverage.py <config> <stores>"""
import sys
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import numpy as np
import robustness as rb
config, stores = sys.argv[1], Path(sys.argv[2])
split = rb.load_split(config, stores, [])
patch = 64
def best(b, stride):
    def axis(lo, size):
        starts = np.arange((lo // stride - 2) * stride, lo + size + stride, stride)
        return np.clip(np.minimum(starts + patch, lo + size) - np.maximum(starts, lo), 0, None).max() / size
    return axis(b["x"], b["width"]) * axis(b["y"], b["height"])
for stride in (64, 32, 16):
    cov = np.array([best(b, stride) for r in split.test for b in split.boxes[r.store]])
    print(f"stride {stride}: objects {cov.size}, median coverage {np.median(cov):.2f}, < 0.75: {np.mean(cov < 0.75):.2f},"
          f" < 0.5: {np.mean(cov < 0.5):.2f}")
for name in sys.argv[3:]:
    rec = [r for r in split.test if name in r.store][0]
    lab = split.class_names[rec.target]
    print(name, [(b["kind"] == lab, round(best(b, 64), 2), round(best(b, 32), 2)) for b in split.boxes[rec.store]])
