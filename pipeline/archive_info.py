"""An archive's statement about its labels: ``archive.json`` beside the slides, carried into the store folder.

``foveate synth`` writes ``archive.json`` (the family, its classes and ``label_symmetry``, the turns and mirrors of
the square every label keeps); a lab may write one by hand beside its slides, with ``label_symmetry`` only::

    {"label_symmetry": "dihedral"}

``foveate ingest`` copies the statement of the input folders into the store folder (:func:`carry_archive_info`),
so it travels with the stores. ``foveate train`` reads it there (:func:`statement_warnings`) and says so when the
config does not follow it: the config stays what decides (``data.label_symmetry``), and the run logs it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from operators.model_config import LABEL_SYMMETRIES
from workers import storage

__all__ = ["ARCHIVE_INFO", "parse_archive_info", "read_archive_info", "carry_archive_info", "statement_warnings"]

log = logging.getLogger(__name__)

#: the statement's file name, beside the slides and in the store folder
ARCHIVE_INFO = "archive.json"


def parse_archive_info(data: bytes | str, where: str) -> dict[str, Any]:
    """The statement in ``data`` (the text of an ``archive.json``), checked.

    Raises:
        ValueError: not a JSON object, or a ``label_symmetry`` that is not one of
            :data:`operators.model_config.LABEL_SYMMETRIES` (``where`` names the file in the message).
    """
    try:
        info = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ValueError(f'{where}: expected a JSON object such as {{"label_symmetry": "dihedral"}}, got {info!r}')
    sym = info.get("label_symmetry")
    if sym is not None and sym not in LABEL_SYMMETRIES:
        raise ValueError(f"{where}: label_symmetry {sym!r} is not one of {list(LABEL_SYMMETRIES)}")
    return info


def read_archive_info(folder: str | Path) -> dict[str, Any] | None:
    """The statement in ``<folder>/archive.json`` (a local folder or an object-storage URL); None when absent."""
    where = storage.join(str(folder), ARCHIVE_INFO)
    data = storage.read_file(where)
    return None if data is None else parse_archive_info(data, where)


def carry_archive_info(inputs: Sequence[str | Path], out: str) -> dict[str, Any] | None:
    """Copy the inputs' ``archive.json`` into the store folder ``out``; returns the statement carried (None: none).

    An input folder's own ``archive.json`` counts, and so does the one beside an input file or CSV manifest. When
    inputs state different label symmetries nothing is carried (a warning names them): a merged archive keeps
    only what each of its parts keeps, which the one who knows the task must state.

    Raises:
        ValueError: an input's ``archive.json`` is not a valid statement (:func:`parse_archive_info`), before
            anything is written.
    """
    found: dict[str, dict[str, Any]] = {}
    for inp in inputs:
        p = Path(inp)
        if storage.is_url(str(inp)):
            continue
        f = (p if p.is_dir() else p.parent) / ARCHIVE_INFO
        if f.is_file() and str(f) not in found:
            found[str(f)] = parse_archive_info(f.read_bytes(), str(f))
    if not found:
        return None
    symmetries = {str(info.get("label_symmetry")) for info in found.values()}
    if len(symmetries) > 1:
        said = ", ".join(f"{f}: {info.get('label_symmetry')}" for f, info in found.items())
        log.warning("the inputs' %s disagree on label_symmetry (%s): none carried into %s", ARCHIVE_INFO, said, out)
        return None
    source, info = next(iter(found.items()))
    storage.write_file(storage.join(out, ARCHIVE_INFO), (json.dumps(info, indent=2) + "\n").encode())
    log.info("archive statement %s carried into %s (label_symmetry: %s)", source, out, info.get("label_symmetry"))
    return info


def statement_warnings(stores: str | Path, label_symmetry: str) -> list[str]:
    """What ``foveate train`` says when the config's ``data.label_symmetry`` does not follow the stores' own
    statement: one line per mismatch (empty when they agree, or when the stores state nothing)."""
    try:
        info = read_archive_info(stores)
    except ValueError as exc:
        return [f"ignored: {exc}"]
    stated = None if info is None else info.get("label_symmetry")
    if stated is None or stated == label_symmetry:
        return []
    where = storage.join(str(stores), ARCHIVE_INFO)
    if label_symmetry == "unknown":
        return [
            f"{where} states label_symmetry {stated!r} but data.label_symmetry is 'unknown' (model.augment.symmetry "
            f"'auto' then turns patches by the fallback): --set data.label_symmetry={stated} follows the statement"
        ]
    return [f"data.label_symmetry is {label_symmetry!r}, but {where} states {stated!r}: the config's is used"]
