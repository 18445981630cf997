"""Re-evaluate a robustness checkpoint with a different K at inference (hard top-k)."""
import dataclasses, sys, json
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import robustness as rb
from pipeline.model_io import load_checkpoint
import pipeline.model_io as mio
ckpt, config, stores = sys.argv[1], sys.argv[2], Path(sys.argv[3])
ks = [int(k) for k in sys.argv[4].split(",")]
split = rb.load_split(config, stores, [])
orig = mio.load_checkpoint
for k in ks:
    def patched(path, *a, _k=k, **kw):
        model, cfg, extra = orig(path, *a, **kw)
        model.cfg = dataclasses.replace(model.cfg, k=_k)
        return model, cfg, extra
    mio.load_checkpoint = patched
    r = rb.evaluate_checkpoint(ckpt, split)
    print(json.dumps({"k": k, **{a: round(b, 4) for a, b in r.items()}}), flush=True)
