"""Re-evaluate robustness checkpoints with another grid stride (and NMS tie rule) at inference (hard top-k), the
same weights. Usage: strideeval.py <config> <stores> <stride>[:1],... <model.pt> [...] (":1": model.nms_ties first)"""
import dataclasses, sys, json
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import robustness as rb
import pipeline.model_io as mio
config, stores = sys.argv[1], Path(sys.argv[2])
variants = [tuple(int(x) for x in v.split(":")) for v in sys.argv[3].split(",")]
split = rb.load_split(config, stores, [])
orig = mio.load_checkpoint
for ckpt in sys.argv[4:]:
    row = {}
    for v in variants:
        def patched(path, *a, _v=v, **kw):
            model, cfg, extra = orig(path, *a, **kw)
            upd = {"stride": _v[0], "nms_ties": "first" if len(_v) > 1 and _v[1] else "keep"}
            model.cfg = dataclasses.replace(model.cfg, **upd)
            return model, cfg, extra
        mio.load_checkpoint = patched
        r = rb.evaluate_checkpoint(ckpt, split)
        row[":".join(map(str, v))] = {a: round(b, 3) for a, b in r.items() if a in ("eval_accuracy", "eval_auc", "object_recall", "hit_rate")}
    print(ckpt.split("/")[-2], json.dumps(row), flush=True)
