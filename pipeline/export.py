"""``foveate export``: a predictions file as files a slide viewer opens (GeoJSON for QuPath).

``foveate export --predictions P.parquet --format geojson --out DIR`` writes ``DIR/<slide_id>.geojson`` for each
``ok`` row: the K patches the model chose as boxes in level-0 pixels, classified with the slide's prediction (the
conversion and the properties: :mod:`workers.export`). Rows with ``status=error`` get no file and are listed in
the summary, as are rows whose slide id could name a file outside ``DIR`` (refused; exit status 1).

The scorer heatmap is not exported as tiles: the predictions file holds the path of the heatmap PNG, not the
per-cell scores (see :mod:`workers.export`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.predictions import read_predictions
from workers.export import class_colors, geojson_filename, prediction_features

__all__ = ["FORMATS", "ExportResult", "export", "add_arguments", "run"]

log = logging.getLogger(__name__)

FORMATS = ("geojson",)


@dataclass
class ExportResult:
    """What :func:`export` did.

    Attributes:
        out_dir: the output folder.
        written: the files written, in slide-id order.
        skipped: ``(slide_id, error)`` of the rows with ``status=error`` (no file).
        rejected: ``(slide_id, reason)`` of the rows whose slide id cannot be a file name in ``out_dir``.
    """

    out_dir: Path
    written: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)


def _write_atomic(path: Path, data: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or an interrupt leaves no temporary behind
        raise


def export(predictions: str | Path, out: str | Path, *, fmt: str = "geojson") -> ExportResult:
    """Write one file per ``ok`` row of a ``foveate score`` predictions file.

    Args:
        predictions: the Parquet file of ``foveate score --out`` (a local path or an object-storage URL).
        out: output folder (created if missing); existing files of the same slides are replaced.
        fmt: output format, one of :data:`FORMATS`.

    Returns:
        :class:`ExportResult` (files written, error rows skipped, slide ids refused).

    Raises:
        FileNotFoundError: ``predictions`` does not exist.
        ValueError: ``fmt`` is not a known format, ``predictions`` is not a predictions file, or ``out`` is a file.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    from workers import storage

    if storage.is_url(predictions):  # an object-storage URL (s3://..., as foveate score --out writes it)
        path: str | Path = storage.normalize(predictions)
        found = storage.file_exists(path)
    else:
        path = Path(predictions)
        found = path.is_file()
    if not found:
        raise FileNotFoundError(f"--predictions: no such file {str(path)!r} (the Parquet file of foveate score --out)")
    rows = sorted(read_predictions(path, option="--predictions"), key=lambda r: str(r["slide_id"]))
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out must be a folder, got the existing file {str(out_dir)!r}")
    from pipeline.outputs import writable_folder

    writable_folder(out_dir, "--out")  # a read-only or forbidden folder: one line before anything is written
    result = ExportResult(out_dir=out_dir)
    ok = [r for r in rows if r.get("status") == "ok"]
    colors = class_colors(ok)  # one colour per class across all slides
    for row in rows:
        sid = row["slide_id"]
        if row.get("status") != "ok":
            result.skipped.append((str(sid), str(row.get("error") or f"status {row.get('status')!r}")))
            continue
        try:
            name = geojson_filename(sid)
        except (ValueError, TypeError) as exc:
            log.warning("%s", exc)
            result.rejected.append((str(sid), str(exc)))
            continue
        target = out_dir / name
        _write_atomic(target, json.dumps(prediction_features(row, colors), allow_nan=False) + "\n")
        result.written.append(target)
    log.info("wrote %d GeoJSON file(s) to %s", len(result.written), out_dir)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--predictions", required=True, metavar="P.parquet", help="predictions file written by foveate score --out"
    )
    parser.add_argument(
        "--format", dest="fmt", choices=FORMATS, default="geojson", help="output format (default geojson, for QuPath)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for <slide_id>.geojson (created)")


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run(args: argparse.Namespace) -> int:
    res = export(args.predictions, args.out, fmt=args.fmt)
    print(f"{len(res.written)} GeoJSON file(s) in {res.out_dir} (level-0 pixels, one box per chosen patch)")
    if res.skipped:
        print(f"no file for {len(res.skipped)} slide(s) that failed scoring (status=error):")
        for sid, err in res.skipped:
            print(f"  {sid}: {_one_line(err)}")
    if res.rejected:
        print(f"refused {len(res.rejected)} slide id(s) that could name a file outside {res.out_dir}:")
        for sid, _reason in res.rejected:
            print(f"  {sid!r}")
    if res.written:
        print("QuPath: open the slide, then File > Import objects from file... (or drop the .geojson on the viewer)")
    return 1 if res.rejected else 0
