"""The symmetry an archive's labels keep (``data.label_symmetry``) and the augmentation drawn from it
(``model.augment.symmetry: auto``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from operators.errors import ConfigError
from operators.model_config import AUTO_SYMMETRY_FALLBACK, SYMMETRIES, resolve_symmetry
from pipeline.config import load_config
from pipeline.synthetic.objects import OBJECT_KINDS, _kind_sign
from pipeline.synthetic.tasks import task_label_symmetry
from pipeline.train import TrainConfig
from workers.slide_forward import _SYMMETRY_CODES, _dihedral_index

ROOT = Path(__file__).resolve().parents[1]


def test_resolve_symmetry_auto_takes_the_stated_one_and_rejects_a_larger_explicit_one():
    assert resolve_symmetry("auto", "unknown") == AUTO_SYMMETRY_FALLBACK == "flips"
    for stated in SYMMETRIES:
        assert resolve_symmetry("auto", stated) == stated
        for i, explicit in enumerate(SYMMETRIES):
            if i <= SYMMETRIES.index(stated):
                assert resolve_symmetry(explicit, stated) == explicit
            else:
                with pytest.raises(ConfigError, match=f"data.label_symmetry='{stated}'"):
                    resolve_symmetry(explicit, stated)
        assert resolve_symmetry(stated, "unknown") == stated  # nobody said: the config's value stands
    with pytest.raises(ConfigError, match="model.augment.symmetry must be one of"):
        resolve_symmetry("rot90", "unknown")
    with pytest.raises(ConfigError, match="data.label_symmetry must be one of"):
        resolve_symmetry("auto", "all")


def test_the_loaded_train_config_carries_the_resolved_symmetry():
    gate = ROOT / "configs" / "perturbed_gate.yaml"
    assert load_config(TrainConfig, gate, []).model.augment.symmetry == "flips"  # the archive states nothing
    cfg = load_config(TrainConfig, gate, ["data.label_symmetry=dihedral"])
    assert cfg.model.augment.symmetry == "dihedral" and cfg.data.label_symmetry == "dihedral"
    assert load_config(TrainConfig, gate, ["data.label_symmetry=rot180"]).model.augment.symmetry == "rot180"
    # a one-phase config's explicit `none` stays none whatever the archive states
    mean = ROOT / "configs" / "perturbed_mean.yaml"
    assert load_config(TrainConfig, mean, ["data.label_symmetry=dihedral"]).model.augment.symmetry == "none"
    with pytest.raises(ConfigError, match="turns patches in ways the labels do not keep"):
        load_config(TrainConfig, mean, ["data.label_symmetry=flips", "model.augment.symmetry=dihedral"])
    with pytest.raises(ConfigError, match="data.label_symmetry"):
        load_config(TrainConfig, mean, ["data.label_symmetry=turns"])


def _turned(a: np.ndarray, code: int) -> np.ndarray:
    p = a.shape[0]
    index = _dihedral_index(p, torch.device("cpu"))[code].numpy()
    return a.reshape(-1)[index].reshape(p, p)


def _kind_of(a: np.ndarray) -> str | None:
    """The object kind whose texture ``a`` is, at any shift of its 4-px period; None if no kind's."""
    p = a.shape[0]
    ix, iy = np.arange(p)[None, :], np.arange(p)[:, None]
    for kind, name in enumerate(OBJECT_KINDS):
        for dx in range(4):
            for dy in range(4):
                if np.array_equal(a, _kind_sign(kind, ix + dx, iy + dy)):
                    return name
    return None


@pytest.mark.parametrize("classes", [2, 3, 4, 5])
def test_the_objects_familys_stated_symmetry_keeps_every_class_and_is_the_largest_that_does(classes):
    stated = task_label_symmetry("objects", classes)
    p = 16
    ix, iy = np.arange(p)[None, :], np.arange(p)[:, None]
    names = OBJECT_KINDS[:classes]

    def keeps(symmetry: str) -> bool:
        return all(
            _kind_of(_turned(_kind_sign(kind, ix, iy), code)) == names[kind]
            for kind in range(classes)
            for code in _SYMMETRY_CODES.get(symmetry, (0,))
        )

    assert keeps(stated)
    if stated != "dihedral":
        assert not keeps(SYMMETRIES[SYMMETRIES.index(stated) + 1])
    # the quarter turn makes horizontal stripes vertical: no objects archive keeps dihedral
    assert _kind_of(_turned(_kind_sign(0, ix, iy), 1)) == "vertical"


def test_synth_writes_what_its_labels_keep(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.synthetic.archive import synth_archive

    synth_archive(tmp_path / "s", count=2, size=2000, fmt="tiff", seed=1, task="shapes", classes=2)
    info = json.loads((tmp_path / "s" / "archive.json").read_text())
    assert info == {"task": "shapes", "classes": 2, "class_names": ["ring", "triangle"], "label_symmetry": "dihedral"}
    assert (
        main(["synth", str(tmp_path / "o"), "--task", "objects", "--classes", "4", "--count", "2", "--size", "2000"])
        == 0
    )
    assert "data.label_symmetry=rot180" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "archive.json").read_text())["label_symmetry"] == "rot180"
    assert task_label_symmetry("checker", 2) == "dihedral"
    with pytest.raises(ValueError, match="classes"):
        task_label_symmetry("objects", 6)


def test_config_show_marks_a_resolved_auto(capsys):
    from pipeline.config_show import provenance

    cfg, sources = provenance(str(ROOT / "configs" / "perturbed_gate.yaml"), ["data.label_symmetry=dihedral"])
    assert cfg.model.augment.symmetry == "dihedral"
    assert sources["model.augment.symmetry"] == "file (auto: data.label_symmetry=dihedral)"
    assert sources["data.label_symmetry"] == "--set"


def test_ingest_carries_the_archives_statement_and_train_says_when_the_config_does_not_follow_it(tmp_path, caplog):
    from pipeline.archive_info import ARCHIVE_INFO, carry_archive_info, read_archive_info, statement_warnings

    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "stores"
    a.mkdir()
    b.mkdir()
    (a / "labels.csv").write_text("path,label\n")
    (a / ARCHIVE_INFO).write_text('{"label_symmetry": "dihedral"}')
    # an input folder's own statement, or the one beside an input file: carried into the store folder
    assert carry_archive_info([a / "labels.csv"], str(out)) == {"label_symmetry": "dihedral"}
    assert read_archive_info(out) == {"label_symmetry": "dihedral"}
    assert read_archive_info(tmp_path / "none") is None
    # the config follows it: nothing to say; it does not: one line naming the file and the fix
    assert statement_warnings(out, "dihedral") == []
    (line,) = statement_warnings(out, "unknown")
    assert str(out / ARCHIVE_INFO) in line and "--set data.label_symmetry=dihedral" in line
    (line,) = statement_warnings(out, "flips")
    assert "'flips'" in line and "'dihedral'" in line and "the config's is used" in line
    assert statement_warnings(tmp_path / "none", "unknown") == []
    # inputs that disagree: nothing carried, a warning names both
    (b / ARCHIVE_INFO).write_text('{"label_symmetry": "rot180"}')
    out2 = tmp_path / "stores2"
    with caplog.at_level("WARNING", logger="pipeline.archive_info"):
        assert carry_archive_info([a, b], str(out2)) is None
    assert "disagree" in caplog.text and "rot180" in caplog.text and not (out2 / ARCHIVE_INFO).exists()
    # a statement that is not one: a clear error before anything is written
    (b / ARCHIVE_INFO).write_text('{"label_symmetry": "mirror"}')
    with pytest.raises(ValueError, match=r"label_symmetry 'mirror' is not one of \['unknown', 'none'"):
        carry_archive_info([b], str(out2))
    (b / ARCHIVE_INFO).write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        carry_archive_info([b], str(out2))
    (b / ARCHIVE_INFO).write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        carry_archive_info([b], str(out2))
    assert not out2.exists()
