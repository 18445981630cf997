import json, sys
for f in sys.argv[1:]:
    lines = open(f).read().splitlines()
    js = [l for l in lines if l.startswith("{")]
    if js:
        d = json.loads(js[-1])
        print(f"{f[:-4]:18s} acc {d['test_accuracy']:.3f} auc {d['test_auc']:.2f} hits {d['test_hits']:.2f} rec {d['test_recall']:.2f} dhit {d['test_distractor_hits']:.2f} t {d['train_seconds']:.0f}")
    else:
        eps = [l for l in lines if l.startswith("ep")]
        print(f"{f[:-4]:18s} (killed) {eps[-1][:110] if eps else ''}")
