"""Seconds per training slide-step (forward_slide with the evidence losses + backward) of a config at grid stride
64 against 32 (+ nms_ties first), interleaved in one process so both see the same load. The model is freshly
initialised (same seed for both); slides are the first N training stores. Usage: stride_cost.py <config> <stores> [N]"""
import dataclasses, sys, time
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import torch
torch.set_num_threads(1)
import robustness as rb
from pipeline.config import load_config
from pipeline.train import TrainConfig
from operators.model import FoveateModel
from workers.patches import forward_slide
from workers.store import SlideStore
config, stores = sys.argv[1], Path(sys.argv[2])
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
split = rb.load_split(config, stores, [])
cfg = load_config(TrainConfig, f"/work/main/configs/{config}.yaml", [f"data.stores={stores}"])
recs = split.train[:n]
models = {}
for stride in (64, 32):
    torch.manual_seed(0)
    mc = dataclasses.replace(cfg.model, num_classes=len(split.class_names), stride=stride,
                             nms_ties="first" if stride < 64 else "keep")
    models[stride] = FoveateModel(mc)
times = {64: [], 32: []}
for rnd in range(3):
    for stride, model in models.items():
        model.train()
        g = torch.Generator().manual_seed(rnd)
        for rec in recs:
            t = time.perf_counter()
            out = forward_slide(model, SlideStore(rec.store), training=True, generator=g, target=rec.target,
                                rarity=0.5, rare_scale=1.0)
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([rec.target]))
            (loss + sum(out.aux_losses.values())).backward()
            model.zero_grad(set_to_none=True)
            if rnd:  # round 0 warms the slide caches of both
                times[stride].append(time.perf_counter() - t)
for stride, ts in times.items():
    ts = sorted(ts)
    print(f"stride {stride}: median {ts[len(ts) // 2]:.3f} s per slide-step, mean {sum(ts) / len(ts):.3f} (n {len(ts)})")
