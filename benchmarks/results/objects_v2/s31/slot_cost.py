"""Milliseconds per call of slot_mode_sample (K 8, 64 draws) against one attention_sample draw, one thread.

python benchmarks/results/objects_v2/s31/slot_cost.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch  # noqa: E402

from operators import attention_sample, slot_mode_sample  # noqa: E402

torch.set_num_threads(1)
for n in (700, 65536):
    s = torch.rand(1, n) / 0.05
    g = torch.Generator().manual_seed(0)
    for name, f in (
        ("slot_modes", lambda: slot_mode_sample(s, 8, num_samples=64, generator=g)),
        ("one draw", lambda: attention_sample(torch.softmax(s, 1), 8, replace=False, generator=g)),
    ):
        f()
        t = time.perf_counter()
        for _ in range(50):
            f()
        print(n, name, round((time.perf_counter() - t) / 50 * 1e3, 3), "ms")
