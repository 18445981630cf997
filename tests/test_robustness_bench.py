"""benchmarks/robustness.py: the hit-rate geometry, the oracle's cell choice, the summary and argument checks, the
gate encoder it pretrains in-process (one tiny epoch), what a gated model's candidates hold, and a tiny in-process
training that early-stops on a validation split carved from the training slides."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from benchmark_modules import load_benchmark

from operators.model import FoveateModel
from workers.slide_forward import gate_candidates

# a model small enough for an in-process training of a few epochs on tiny stores
_TINY_MODEL = [
    "model.geometry.patch_size=32",
    "model.geometry.stride=32",
    "model.geometry.scorer_downsample=4",
    "model.selection.k=2",
    "model.selection.num_samples=4",
    "model.scorer.channels=4",
    "model.scorer.num_layers=2",
    "model.features.widths=[4, 8]",
    "model.features.blocks=[1, 1]",
    "model.features.feature_dim=8",
]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rb():
    return load_benchmark("robustness")


def test_hits_of(rb):
    boxes = [{"x": 100, "y": 100, "width": 40, "height": 40}, {"x": 1000, "y": 0, "width": 32, "height": 32}]
    xy = np.array([[64, 64], [128, 128], [140, 100], [0, 0], [968, 0], [1032, 0]])
    hit, touched = rb.hits_of(xy, 64, boxes)
    assert hit.tolist() == [True, True, False, False, True, False]  # half-open boxes: x=140 misses [100, 140)
    assert touched == 2
    assert rb.hits_of(xy, 64, [])[1] == 0


class _Grid:
    def __init__(self, gh, gw, p):
        self.shape, self.stride, self.patch_size, self.num_cells = (gh, gw), p, p, gh * gw

    def cell_xy_l0(self, idx):
        idx = torch.as_tensor(idx)
        return torch.stack([(idx % self.shape[1]) * self.stride, (idx // self.shape[1]) * self.stride], -1)


class _Slide:
    def __init__(self):
        self.grid = _Grid(10, 10, 64)
        self.cell_mask = torch.ones(10, 10, dtype=torch.bool)


def test_oracle_cells_cover_every_object_first(rb):
    si = _Slide()
    # object 0 straddles four cells, mostly in cell (1, 1); object 1 inside cell (5, 7)
    boxes = [
        {"x": 50, "y": 50, "width": 40, "height": 40},
        {"x": 7 * 64 + 8, "y": 5 * 64 + 8, "width": 40, "height": 40},
    ]
    cells = rb.oracle_cells(si, boxes, 3, np.random.default_rng(0))
    assert len(cells) == 3 and len(set(cells.tolist())) == 3
    assert {11, 57} <= set(cells.tolist())  # each object's best cell
    # "overlap" (default): then every other cell that overlaps an object, by overlap
    cells8 = rb.oracle_cells(si, boxes, 8, np.random.default_rng(0))
    assert {0, 1, 10, 11, 57} <= set(cells8.tolist()) and len(set(cells8.tolist())) == 8
    # "distinct": a second, partial view of a small object is not taken (it would count the object twice)
    si.cell_mask.view(-1)[[0, 1, 10]] = False  # object 0's other cells: not tissue, so no random fill lands there
    assert {0, 1, 10} <= set(rb.oracle_cells(si, boxes, 8, np.random.default_rng(0), bag="overlap").tolist())
    for seed in range(5):
        got = set(rb.oracle_cells(si, boxes, 8, np.random.default_rng(seed), bag="distinct").tolist())
        assert len(got) == 8 and {11, 57} <= got and not got & {0, 1, 10}, (seed, got)
    # ... but an object larger than a cell gets the cells that cover the rest of it
    wide = [{"x": 0, "y": 128, "width": 192, "height": 64}]  # exactly cells 20, 21, 22
    assert {20, 21, 22} <= set(rb.oracle_cells(si, wide, 8, np.random.default_rng(0), bag="distinct").tolist())
    shifted = [{"x": 16, "y": 128, "width": 130, "height": 64}]  # 48 / 64 / 18 px columns in cells 20 / 21 / 22
    si.cell_mask.view(-1)[22] = False
    got = set(rb.oracle_cells(si, shifted, 8, np.random.default_rng(0), bag="distinct").tolist()) & {20, 21, 22}
    assert got == {20, 21}, got
    with pytest.raises(ValueError, match="bag must be one of"):
        rb.oracle_cells(si, boxes, 8, np.random.default_rng(0), bag="all")


def test_summary_success_rate(rb):
    rows = [
        {"task": "t", "config": "c", "seed": s, "test_accuracy": a, "hit_rate": h, "train_seconds": 10.0}
        for s, (a, h) in enumerate([(1.0, 0.5), (0.96, 0.4), (0.5, 0.0)])
    ]
    rows.append({"task": "t", "config": "c", "seed": 9, "error": "RuntimeError: boom"})
    (s,) = rb.summarise(rows)
    assert s["runs"] == 3 and s["failed_runs"] == 1 and s["successes"] == 2
    assert s["median_accuracy"] == 0.96 and s["worst_accuracy"] == 0.5 and s["median_hit_rate"] == 0.4


def test_cli_rejects_unknown_task_and_config(rb, capsys):
    with pytest.raises(SystemExit):
        rb.main(["--tasks", "nope"])
    assert "unknown task 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rb.main(["--tasks", "checker-quick", "--configs", "nope"])
    assert "unknown config(s) ['nope']" in capsys.readouterr().err
    assert "perturbed_mean" in rb.available_configs() and "demo" not in rb.available_configs()


def test_in_process_runs_refuse_several_jobs(rb, capsys):
    # threads of one process share torch's global RNG: the second run's weights would not be its seed's
    with pytest.raises(SystemExit):
        rb.main(["--tasks", "checker-quick", "--configs", "perturbed_mean", "--in-process", "--jobs", "2"])
    err = capsys.readouterr().err
    assert "--in-process takes --jobs 1, got --jobs 2" in err and "--merge" in err


def test_merge_combines_processes_and_keeps_the_last_duplicate(rb, tmp_path, capsys):
    def row(seed, acc, config="c"):
        return {"task": "t", "config": config, "seed": seed, "test_accuracy": acc, "train_seconds": 10.0}

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    a.write_text(json.dumps({"command": "a", "rows": [row(0, 1.0), row(2, 0.5), row(0, 0.9, "d")]}))
    b.write_text(json.dumps({"command": "b", "rows": [row(1, 0.97), row(2, 0.96)], "oracle": []}))
    assert rb.main(["--merge", str(a), str(b), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["config"], r["seed"], r["test_accuracy"]) for r in d["rows"]] == [
        ("c", 0, 1.0),
        ("c", 1, 0.97),
        ("c", 2, 0.96),
        ("d", 0, 0.9),
    ]
    c, dd = d["summary"]
    assert (c["config"], c["runs"], c["successes"], c["worst_accuracy"]) == ("c", 3, 3, 0.96)
    assert (dd["config"], dd["runs"], dd["successes"]) == ("d", 1, 0)
    assert [p["command"] for p in d["merged_from"]] == ["a", "b"]
    assert "3/3" in capsys.readouterr().out


def test_count_and_size_keep_the_drawing_version_and_its_data_folder(rb):
    (task,) = rb.resolve_tasks("shapes-8class", count=384, size="3072")
    assert (task.count, task.size, task.version, task.classes) == (384, "3072", "v2", 8)
    assert task.key == "shapes-8class-384x3072-v2"
    assert rb.resolve_tasks("checker")[0].key == "checker-80x2048-3072"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        rb.resolve_tasks("checker,nope")


def test_bag_row_decides_by_class_name_not_the_synth_class_index(rb):
    def box(x, cls, index):
        return {"x": x, "y": 0, "width": 10, "height": 10, "class": cls, "class_index": index}

    # three 'star' glyphs and two others; the synth's class_index order is not the sorted names' order
    boxes = [box(0, "star", 6), box(100, "star", 6), box(200, "star", 6), box(300, "arrow", 4), box(400, "ring", 0)]
    xy = np.array([[0, 0], [100, 0], [300, 0], [1000, 0]])  # two stars, the arrow, and a patch on nothing
    row = rb.bag_row(xy, 32, boxes, "star", distractors=[])
    assert row["hit_rate"] == 0.75 and row["object_recall"] == 0.6 and row["all_objects"] == 0.0
    assert row["decidable"] == 1.0 and row["distractor_hit_rate"] == 0.0
    assert rb.bag_row(xy, 32, boxes, "arrow")["decidable"] == 0.0
    assert rb.bag_row(xy[[0, 2]], 32, boxes, "star")["decidable"] == 0.0  # 1 : 1 is a tie
    assert "distractor_hit_rate" not in rb.bag_row(xy, 32, boxes, "star")
    kinds = [{k: v for k, v in b.items() if k not in ("class", "class_index")} | {"kind": b["class"]} for b in boxes]
    assert rb.bag_row(xy, 32, kinds, "star")["decidable"] == 1.0  # the objects family names its boxes' kind


def test_gate_encoder_pretrain_is_pretrained_in_process_once_per_split(rb, tmp_path, capsys):
    from types import SimpleNamespace

    from operators.config import from_dict
    from operators.resnet import ResNet
    from pipeline.train_config import TrainConfig
    from workers.store import write_store_from_array

    stores = []
    for i in range(3):
        img = np.full((192, 192, 3), 240, np.uint8)
        img[32:160, 32:160] = (200, 120, 180)
        img[32:160, 32:160] += np.random.default_rng(i).integers(0, 30, (128, 128, 1), dtype=np.uint8)
        write_store_from_array(tmp_path / f"s{i}.zarr", img, tile_size=64, min_size=64)
        stores.append(SimpleNamespace(store=str(tmp_path / f"s{i}.zarr")))
    model = {
        "geometry": {"patch_size": 32, "scorer_downsample": 4},
        "selection": {"k": 2, "num_samples": 4},
        "scorer": {"channels": 4, "num_layers": 2},
        "features": {"widths": [4, 8], "blocks": [1, 1], "feature_dim": 8},
        "experimental": {"gate_candidates": 4, "gate_clusters": 2, "gate_encoder": "pretrain"},
    }
    cfg = from_dict(
        TrainConfig,
        {
            "model": model,
            "schedule": {"select_until": 0.5},
            "pretrain": {"epochs": 1, "batch_size": 4, "patches_per_slide": 2, "projection_dim": 8},
        },
    )
    state = rb._gate_init(cfg, cfg.model, stores[:2], tmp_path / "w")
    assert "pretrained in" in capsys.readouterr().out
    ResNet(cfg.model.features.resnet()).load_state_dict(state)  # the gate encoder's architecture
    (cached,) = (tmp_path / "w" / "gate_encoders").glob("*.pt")
    again = rb._gate_init(cfg, cfg.model, stores[:2], tmp_path / "w")  # the next seed of the task: the cache
    assert "(cached)" in capsys.readouterr().out
    assert all(torch.equal(again[k], v) for k, v in state.items())
    rb._gate_init(cfg, cfg.model, stores[1:], tmp_path / "w")  # another split: its own encoder
    assert len(list((tmp_path / "w" / "gate_encoders").glob("*.pt"))) == 2
    plain = from_dict(TrainConfig, {"model": {**model, "experimental": {}}})
    assert rb._gate_init(plain, plain.model, stores, tmp_path / "w") is None


def test_val_fraction_early_stops_on_training_slides_and_never_sees_the_held_out_ones(rb, tmp_path):
    from tiny_stores import checker_stores

    from pipeline.config import load_config
    from pipeline.data import build_slide_table, split_train_val
    from pipeline.train_config import TrainConfig

    stores, labels = checker_stores(tmp_path / "stores", ["neg", "pos"], [0, 80], count=12)
    overrides = [
        f"data.labels={labels}",
        "data.val_fraction=0.34",
        "optim.epochs=6",
        "optim.accumulate=1",
        *_TINY_MODEL,
        # no epoch improves val_loss by 10: epoch 1 stays the best, and the count starts at once
        "early_stopping.patience=1",
        "early_stopping.min_delta=10",
        "early_stopping.after_chance=false",
    ]
    log = tmp_path / "run.log"
    res = rb.run_training_in_process("demo", stores, 0, overrides, tmp_path / "w", "run", log, val_fraction=0.25)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # the demo schedule keeps exploring for half of the 6 epochs: the earliest stop is after epoch 3
    assert res["stop_reason"] == "patience" and [ln["epoch"] for ln in lines] == [1, 2, 3]
    assert res["metrics"]["stopped_epoch"] == 3 and res["metrics"]["best_epoch"] == 1
    # the validation split is carved from the training slides; the held-out ones are in neither
    cfg = load_config(TrainConfig, ROOT / "configs" / "demo.yaml", [f"data.stores={stores}", *overrides])
    train, held_out = split_train_val(build_slide_table(cfg.data).records, 0.34, cfg.data.seed)
    fit, val = split_train_val(train, 0.25, cfg.data.seed + 1)
    assert res["validation_slides"] == len(val) == 2 and len(fit) == 6 and len(held_out) == 4
    assert not {r.slide_id for r in held_out} & {r.slide_id for r in train}
    assert Path(res["checkpoint"]).is_file()
    # without a validation split of its own the rule would follow the held-out slides: refused
    with pytest.raises(ValueError, match="early stopping on the held-out split"):
        rb.run_training_in_process("demo", stores, 0, overrides, tmp_path / "w", "run2", log)


def test_a_gated_model_reports_what_its_candidates_hold(rb, tmp_path):
    """The gate's candidates (the scorer's top-N local maxima) are scored like the bag: a box on one candidate and one
    on no candidate give a candidate recall of 1/2, a bag recall no higher, and no candidates_ keys without a gate."""
    from test_gate import _gated_config
    from test_two_phase import _config, _store

    from workers.patches import prepare_slide

    store = _store(tmp_path)
    torch.manual_seed(0)
    model = FoveateModel(_gated_config()).eval()
    slide = prepare_slide(store, model.cfg)
    with torch.no_grad():
        scores = model.score(slide.lowres_u8[None], slide.cell_mask[None], slide.geometry)
        cells, values = gate_candidates(model, scores, tuple(slide.cell_mask.shape))
        model.gate.fit(model.gate_encode(slide.reader.read(cells).float() / 255).double(), values)
    xy = slide.grid.cell_xy_l0(cells).numpy().reshape(-1, 2)
    p = slide.grid.patch_size
    inside = {"x": int(xy[0, 0]) + 1, "y": int(xy[0, 1]) + 1, "width": 2, "height": 2}
    free = np.ones(slide.grid.num_cells, bool)  # a cell no candidate overlaps
    all_xy = slide.grid.cell_xy_l0(torch.arange(slide.grid.num_cells)).numpy().reshape(-1, 2)
    free &= ~rb.overlaps(
        all_xy, p, [{"x": int(x) - p + 1, "y": int(y) - p + 1, "width": 2 * p - 2, "height": 2 * p - 2} for x, y in xy]
    ).any(1)
    (fx, fy) = all_xy[np.flatnonzero(free)[0]]
    outside = {"x": int(fx) + 1, "y": int(fy) + 1, "width": 2, "height": 2}
    rec = SimpleNamespace(store=str(store.path) if hasattr(store, "path") else str(store), target=0)
    split = rb.Split(["a", "b"], [], [rec], {rec.store: [inside, outside]}, {rec.store: []})
    got = rb.evaluate_model(model, split)
    assert got["candidates_object_recall"] == 0.5 and got["candidates_all_objects"] == 0.0
    assert got["object_recall"] <= got["candidates_object_recall"]
    plain = rb.evaluate_model(FoveateModel(_config()).eval(), split)
    assert not any(k.startswith("candidates_") for k in plain)


def test_prepare_data_waits_for_another_benchmark_preparing_the_same_data(rb, tmp_path, monkeypatch):
    """Two benchmarks on one data folder: the second waits on the first's lock and then uses its data; it never
    starts a second synth into the same folder."""
    import fcntl
    import threading

    calls = []
    monkeypatch.setattr(rb, "_run", lambda cmd, log: calls.append(cmd))  # nothing may run in the waiting one
    task = rb.Task("checker", "checker", 2, 4, "512", "zstd")
    d = tmp_path / "data" / task.key
    d.mkdir(parents=True)
    got = {}
    with open(d / ".prepare.lock", "a") as held:  # the first benchmark, preparing
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: got.update(stores=rb.prepare_data(task, tmp_path)))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not calls  # waiting, nothing started
        (d / "READY").write_text("{}\n")  # the first one finishes
    t.join(10)
    assert not t.is_alive() and got["stores"] == d / "stores" and not calls


def test_the_oracle_ends_with_its_training_bags_feature_statistics(rb):
    from operators.config import from_dict
    from operators.model_config import ModelConfig

    feats = {"widths": [4], "blocks": [1], "feature_dim": 4}
    torch.manual_seed(0)
    model = FoveateModel(from_dict(ModelConfig, {"features": {**feats, "standardise": True}, "num_classes": 2}))
    g = torch.Generator().manual_seed(0)
    bags = [
        (torch.randint(0, 256, (3, 3, 16, 16), generator=g, dtype=torch.uint8), torch.rand(3, 2, generator=g), i % 2)
        for i in range(4)
    ]
    assert rb.refresh_bag_statistics(model, bags) == 12
    rows = []
    hook = model.feature_norm.register_forward_hook(lambda _m, _a, out: rows.append(out))
    rb.predict_bags(model, bags)
    hook.remove()
    out = torch.cat(rows)  # standardised by the bags' own statistics: mean 0
    torch.testing.assert_close(out.mean(0), torch.zeros(4), rtol=0, atol=1e-4)
    plain = FoveateModel(from_dict(ModelConfig, {"features": feats, "num_classes": 2}))
    assert rb.refresh_bag_statistics(plain, bags) == 0


def test_a_saved_state_resumes_to_the_same_model(rb, tmp_path):
    """``save_state_at`` E writes the trainer's state and the evaluated model after epoch E and training goes on; a
    run resumed from that state ends with the same weights as the run that saved it."""
    from tiny_stores import checker_stores

    stores, labels = checker_stores(tmp_path / "stores", ["neg", "pos"], [0, 80], count=8)
    overrides = [
        f"data.labels={labels}",
        "data.val_fraction=0.25",
        "optim.epochs=3",
        "optim.accumulate=2",
        "early_stopping.patience=0",
        *_TINY_MODEL,
    ]
    w = tmp_path / "w"
    full = rb.run_training_in_process("demo", stores, 0, overrides, w, "full", tmp_path / "a.log", save_state_at=1)
    state = w / "train" / "full" / "state-e1.pt"
    assert state.is_file() and (w / "train" / "full" / "model-e1.pt").is_file()
    assert torch.load(state, weights_only=False)["epoch"] == 1
    res = rb.run_training_in_process("demo", stores, 0, overrides, w, "resumed", tmp_path / "b.log", resume_state=state)
    assert [json.loads(ln)["epoch"] for ln in (tmp_path / "b.log").read_text().splitlines()] == [2, 3]
    a = torch.load(full["checkpoint"], weights_only=False)["state_dict"]
    b = torch.load(res["checkpoint"], weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
