"""The training slide table: labels from CSV / manifest, class order, deterministic split, worker shards."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.data import (
    DataConfig,
    build_slide_table,
    load_labels,
    order_classes,
    shard,
    split_train_val,
)
from workers.store import COMPLETE_MARKER, write_store_from_array


def _stores(root: Path, ids: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    img = np.full((48, 48, 3), 230, np.uint8)
    img[8:40, 8:40] = (190, 110, 170)
    for sid in ids:
        write_store_from_array(root / f"{sid}.zarr", img, tile_size=32, min_size=32)
    return root


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    return _stores(tmp_path_factory.mktemp("stores"), [f"s{i:02d}" for i in range(12)])


def test_multiclass_labels_from_csv(stores, tmp_path):
    csv = tmp_path / "labels.csv"
    labels = {f"s{i:02d}": ["tumour", "normal", "stroma"][i % 3] for i in range(12)}
    labels.pop("s11")  # a store without a label is skipped
    rows = [{"slide_id": k, "label": v} for k, v in labels.items()] + [{"slide_id": "ghost", "label": "normal"}]
    pd.DataFrame(rows).to_csv(csv, index=False)
    table = build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    assert table.class_names == ("normal", "stroma", "tumour")
    assert [r.slide_id for r in table.records] == [f"s{i:02d}" for i in range(11)]
    for r in table.records:
        assert r.label == labels[r.slide_id]
        assert table.class_names[r.target] == r.label
        assert Path(r.store).is_absolute() and r.store.endswith(f"{r.slide_id}.zarr")
    # an explicit class order is kept (and saved with the model as the index mapping)
    table2 = build_slide_table(DataConfig(stores=str(stores), labels=str(csv), classes=("tumour", "stroma", "normal")))
    assert table2.class_names == ("tumour", "stroma", "normal")
    assert {r.slide_id: r.target for r in table2.records}["s00"] == 0


def test_integer_labels_sort_numerically_and_path_column(stores, tmp_path):
    csv = tmp_path / "labels.csv"
    # a `path` column (as in foveate synth's labels.csv) maps to the store by the file's stem
    rows = [{"path": f"/archive/s{i:02d}.svs", "label": [2, 10, 1][i % 3]} for i in range(12)]
    pd.DataFrame(rows).to_csv(csv, index=False)
    table = build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    assert table.class_names == ("1", "2", "10")
    assert {r.slide_id: r.label for r in table.records}["s01"] == "10"
    assert order_classes({"b", "a", "c"}) == ("a", "b", "c")
    with pytest.raises(ValueError, match="not in data.classes"):
        order_classes({"a", "b"}, ("a",))


def test_labels_from_manifest_skip_failed_and_incomplete(tmp_path):
    root = _stores(tmp_path / "stores", ["a", "b", "c", "d", "e"])
    os.remove(root / "e.zarr" / COMPLETE_MARKER)  # an interrupted ingest: skipped
    pd.DataFrame(
        {
            "slide_id": ["a", "b", "c", "d", "e", "f"],
            "source": [f"/src/{x}.svs" for x in "abcdef"],
            "status": ["ok", "ok", "ok", "failed", "ok", "failed"],
            "label": ["0", "1", "1", "0", "0", None],
        }
    ).to_parquet(root / "manifest.parquet")
    assert load_labels("manifest", root) == {"a": "0", "b": "1", "c": "1", "e": "0"}
    table = build_slide_table(DataConfig(stores=str(root), labels="manifest"))
    assert [(r.slide_id, r.target) for r in table.records] == [("a", 0), ("b", 1), ("c", 1)]
    # a CSV `path` resolves through the manifest's `source` column
    csv = tmp_path / "labels.csv"
    pd.DataFrame({"path": ["/src/a.svs", "/src/b.svs", "/src/c.svs"], "grade": ["x", "y", "x"]}).to_csv(
        csv, index=False
    )
    assert load_labels(str(csv), root, label_column="grade") == {"a": "x", "b": "y", "c": "x"}


def test_bad_inputs_give_clear_errors(stores, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.stores"):
        build_slide_table(DataConfig(stores=str(tmp_path / "nope"), labels="manifest"))
    with pytest.raises(FileNotFoundError, match="manifest.parquet"):
        build_slide_table(DataConfig(stores=str(stores), labels="manifest"))
    with pytest.raises(FileNotFoundError, match="no such CSV"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(tmp_path / "missing.csv")))
    csv = tmp_path / "l.csv"
    pd.DataFrame({"slide_id": ["s00"], "diagnosis": ["x"]}).to_csv(csv, index=False)
    with pytest.raises(ValueError, match="no label column 'label'.*diagnosis"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    pd.DataFrame({"name": ["s00"], "label": ["x"]}).to_csv(csv, index=False)
    with pytest.raises(ValueError, match="'slide_id' or a 'path' column"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    pd.DataFrame({"slide_id": ["s00", "s01"], "label": ["x", "x"]}).to_csv(csv, index=False)
    with pytest.raises(ValueError, match="at least two classes"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    pd.DataFrame({"slide_id": ["s00", "s00"], "label": ["x", "y"]}).to_csv(csv, index=False)
    with pytest.raises(ValueError, match="two labels"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))
    pd.DataFrame({"slide_id": ["zz"], "label": ["x"]}).to_csv(csv, index=False)
    with pytest.raises(ValueError, match="no labelled slide"):
        build_slide_table(DataConfig(stores=str(stores), labels=str(csv)))


def _records(n: int, classes: int = 2):
    from pipeline.data import SlideRecord

    return tuple(SlideRecord(f"s{i:03d}", f"/x/s{i:03d}.zarr", str(i % classes), i % classes) for i in range(n))


def test_split_is_deterministic_and_stratified():
    recs = _records(40, classes=3)
    a = split_train_val(recs, 0.25, seed=7)
    b = split_train_val(tuple(reversed(recs)), 0.25, seed=7)  # input order does not matter
    assert a == b
    train, val = a
    assert {r.slide_id for r in train}.isdisjoint({r.slide_id for r in val})
    assert len(train) + len(val) == 40
    counts = Counter(r.target for r in val)
    assert counts == {0: 4, 1: 3, 2: 3}  # classes of 14, 13, 13 slides: round(0.25 * n)
    other = split_train_val(recs, 0.25, seed=8)
    assert other[1] != val
    # every class keeps at least one slide on each side
    small = _records(4, classes=2)
    tr, va = split_train_val(small, 0.1, seed=0)
    assert sorted(r.target for r in va) == [0, 1] and sorted(r.target for r in tr) == [0, 1]
    assert split_train_val(small, 0.0, seed=0) == (list(small), [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(small, 1.0, seed=0)


def test_shards_cover_the_epoch_with_equal_lengths():
    recs = list(_records(7))
    for world in (1, 2, 3):
        parts = [shard(recs, r, world, epoch=3, seed=1) for r in range(world)]
        assert len({len(p) for p in parts}) == 1
        assert len(parts[0]) == -(-7 // world)
        assert {x.slide_id for p in parts for x in p} == {x.slide_id for x in recs}
    # same permutation on every worker; a new one each epoch
    assert shard(recs, 0, 2, epoch=0, seed=1) == shard(recs, 0, 2, epoch=0, seed=1)
    assert [x.slide_id for x in shard(recs, 0, 1, epoch=0, seed=1)] != [
        x.slide_id for x in shard(recs, 0, 1, epoch=1, seed=1)
    ]
    # evaluation: no shuffle, no padding
    ev = [shard(recs, r, 3) for r in range(3)]
    assert sum(len(p) for p in ev) == 7 and ev[0] == recs[0::3]
    with pytest.raises(ValueError, match="rank"):
        shard(recs, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard(recs, 0, 0)
