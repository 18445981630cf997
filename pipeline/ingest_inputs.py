"""Ingest inputs (driver side): turn files, directories and CSV manifests into one
:class:`workers.ingest_source.SlideFile` per slide.

slide_id rule (deterministic, filesystem-safe, unique): ``<stem>-<h8>`` where ``stem`` is the file name
without its extension (for a DICOM slide: the folder name), reduced to ``[A-Za-z0-9._-]`` and at most 48
characters, and ``h8`` the first 8 hex digits of the SHA-1 of the absolute source path (for DICOM: the
folder path plus the series UID; for a slide on object storage: its URL). The same source always gets the same
id, two sources never share one.

Inputs may be object-storage URLs (``s3://bucket/archive/``: listed recursively through fsspec; a single object;
or a CSV manifest object whose relative paths are relative to the CSV's prefix). Their slides are copied to each
tiler's local scratch when opened (:class:`workers.ingest_source.SlideScratch`).
"""

from __future__ import annotations

import csv
import hashlib
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workers import storage
from workers.ingest_source import SlideFile

__all__ = ["SLIDE_EXTENSIONS", "SlideFile", "discover_inputs", "make_slide_id"]

log = logging.getLogger(__name__)

SLIDE_EXTENSIONS = (
    ".svs",
    ".tif",
    ".tiff",
    ".ndpi",
    ".vms",
    ".vmu",
    ".scn",
    ".mrxs",
    ".bif",
    ".svslide",
    ".dcm",
    ".qptiff",
)


def make_slide_id(stem: str, key: str) -> str:
    """``<safe stem>-<sha1(key)[:8]>``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:48] or "slide"
    return f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def _file_input(path: Path, carried: dict[str, Any] | None = None) -> SlideFile:
    # resolved (symlinks followed, no '..'): one slide file has one id however it is written
    rp = path.resolve()
    ap = str(rp)
    stem = rp.name
    for ext in SLIDE_EXTENSIONS:
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
            break
    return SlideFile(make_slide_id(stem, ap), ap, ap, dict(carried or {}), (ap,))


def _url_input(url: str, carried: dict[str, Any] | None = None) -> SlideFile:
    url = storage.normalize(url)
    stem = storage.basename(url)
    for ext in SLIDE_EXTENSIONS:
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
            break
    return SlideFile(make_slide_id(stem, url), url, url, dict(carried or {}), (url,))


def _walk_url(url: str) -> list[SlideFile]:
    """The slide objects under a URL prefix (recursive listing; the files inside a ``.mrxs`` folder are not
    slides of their own)."""
    fs, path = storage.filesystem(url)
    scheme = storage.normalize(url).split("://", 1)[0]
    out = []
    for key in sorted(fs.find(path)):
        parts = key.split("/")
        if not key.lower().endswith(SLIDE_EXTENSIONS) or any(p.lower().endswith(".mrxs") for p in parts[:-1]):
            continue
        out.append(_url_input(f"{scheme}://{key}"))
    return out


def _url_kind(url: str) -> str:
    """``"dir"``, ``"file"`` or ``"missing"`` for an object-storage URL."""
    fs, path = storage.filesystem(url)
    try:
        if fs.isdir(path):
            return "dir"
        return "file" if fs.isfile(path) else "missing"
    except FileNotFoundError:
        return "missing"


def _dicom_series_key(path: Path) -> str:
    """Series UID of a DICOM file via OpenSlide ('' where OpenSlide cannot open it)."""
    try:
        import openslide

        with openslide.OpenSlide(str(path)) as s:
            return s.properties.get("dicom.SeriesInstanceUID") or s.properties.get("openslide.quickhash-1", "")
    except Exception:
        return ""


def _dicom_inputs(files: list[Path], carried: dict[str, Any] | None = None) -> list[SlideFile]:
    """Group the .dcm files of one folder by series: one whole-slide image (all its levels) per series."""
    groups: dict[str, list[Path]] = {}
    for f in sorted(files):
        key = _dicom_series_key(f) or f"file:{f.name}"
        groups.setdefault(key, []).append(f)
    out = []
    for key, fs in groups.items():
        folder = fs[0].parent.resolve()
        if key.startswith("file:"):
            out.append(_file_input(fs[0], carried))
            continue
        sid = make_slide_id(folder.name, f"{folder}#{key}")
        out.append(
            SlideFile(sid, str(fs[0].resolve()), str(folder), dict(carried or {}), tuple(str(f.resolve()) for f in fs))
        )
    return out


def _files_under(directory: Path) -> list[Path]:
    """Every file under ``directory``, following linked folders: a folder whose real path was already walked (a
    second link to it, or a link back up that would loop) is skipped with a warning naming it."""
    import os

    seen: set[str] = set()
    found: list[Path] = []
    for top, dirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            log.warning("input folder %s is %s, already listed (a second link or a loop); skipped", top, real)
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found.extend(Path(top, f) for f in files)
    return found


def _walk(directory: Path) -> list[SlideFile]:
    by_folder_dcm: dict[Path, list[Path]] = {}
    out: list[SlideFile] = []
    for f in sorted(_files_under(directory)):
        if not f.is_file() or not f.name.lower().endswith(SLIDE_EXTENSIONS):
            continue
        if f.suffix.lower() == ".dcm":
            by_folder_dcm.setdefault(f.parent, []).append(f)
        elif f.suffix.lower() == ".mrxs" or f.parent.suffix.lower() != ".mrxs":
            out.append(_file_input(f))
    for _folder, files in sorted(by_folder_dcm.items()):
        out.extend(_dicom_inputs(files))
    return out


def _read_csv_manifest(path: Path | str) -> list[SlideFile]:
    """A CSV manifest (a local file or an object-storage URL): a ``path`` column (file or folder, local or a URL;
    relative to the CSV) and any columns to carry into the manifest (e.g. ``label``). Columns that
    ``foveate ingest`` writes itself are refused; a blank ``path`` fails its own row; two rows for the same slide
    that carry different values are refused, naming both."""
    import io

    from pipeline.ingest_manifest import MANIFEST_COLUMNS

    remote = storage.is_url(path)
    if remote:
        path = storage.normalize(path)
        rows = list(csv.DictReader(io.StringIO((storage.read_file(path) or b"").decode())))
        path_name, path_stem = storage.basename(path), storage.basename(path).rsplit(".", 1)[0]
    else:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        path_name, path_stem = path.name, path.stem
    if not rows or "path" not in rows[0]:
        raise ValueError(f"CSV manifest {path} needs a 'path' column; got columns {list(rows[0]) if rows else []}")
    reserved = [c for c in rows[0] if c in MANIFEST_COLUMNS]
    if reserved:
        raise ValueError(
            f"CSV manifest {path}: column(s) {reserved} are written by foveate ingest itself (manifest columns "
            f"{MANIFEST_COLUMNS}); rename them (e.g. 'case_{reserved[0]}') to carry them"
        )
    out = []
    for n, row in enumerate(rows, start=2):  # line numbers as a spreadsheet shows them (header = line 1)
        carried = {k: v for k, v in row.items() if k != "path" and k is not None}
        raw = (row.get("path") or "").strip()
        if not raw:  # never walk the CSV's own folder for a blank cell: a row that fails with its reason
            where = storage.sibling(path, "") if remote else str(path.resolve().parent) + "/"
            blank = f"{where}<blank path in {path_name} line {n}>"
            out.append(SlideFile(make_slide_id(f"blank-{path_stem}-line{n}", blank), blank, blank, carried, ()))
            continue
        if storage.is_url(raw) or (remote and not raw.startswith("/")):
            url = raw if storage.is_url(raw) else storage.sibling(path, raw)
            kind = _url_kind(url)
            if kind == "dir":
                out.extend(SlideFile(i.slide_id, i.path, i.source, carried, i.files) for i in _walk_url(url))
            else:
                out.append(_url_input(url, carried))
            continue
        p = Path(raw)
        if not p.is_absolute():
            p = path.parent / p
        if p.is_dir():
            out.extend(SlideFile(i.slide_id, i.path, i.source, carried, i.files) for i in _walk(p))
        elif p.suffix.lower() == ".dcm" and p.is_file():
            out.extend(_dicom_inputs([p], carried))
        else:
            out.append(_file_input(p, carried))
    first: dict[str, SlideFile] = {}
    for i in out:
        prev = first.setdefault(i.slide_id, i)
        if prev is not i and prev.carried != i.carried:
            diff = sorted(k for k in set(prev.carried) | set(i.carried) if prev.carried.get(k) != i.carried.get(k))
            raise ValueError(
                f"CSV manifest {path} lists {i.source} twice with different values of {diff}: "
                f"{[prev.carried.get(k) for k in diff]} and {[i.carried.get(k) for k in diff]}; keep one row"
            )
    return out


def discover_inputs(inputs: Iterable[str | Path]) -> list[SlideFile]:
    """Expand INPUT arguments (files, directories searched recursively, CSV manifests with a ``path`` column).

    Missing paths are kept (as inputs that will fail with a clear reason), so every argument gets a
    manifest row. Duplicates (same slide_id) are dropped, first one wins. Explicit DICOM files of one
    series given separately are merged into one slide.
    """
    out: list[SlideFile] = []
    dcm_explicit: dict[Path, list[Path]] = {}
    for raw in inputs:
        if storage.is_url(raw):
            url = storage.normalize(raw)
            try:
                kind = _url_kind(url)
                if kind == "dir":
                    out.extend(_walk_url(url))
                elif url.lower().endswith(".csv") and kind == "file":
                    out.extend(_read_csv_manifest(url))
                else:  # a slide object (a missing one fails its own row when a tiler opens it)
                    out.append(_url_input(url))
            except (ValueError, FileNotFoundError):
                raise
            except Exception as exc:  # refused credentials, a dead endpoint: one line naming what failed
                from workers.bucket_check import describe_failure

                raise ValueError(describe_failure(url, exc, what=f"input {url!r}")) from exc
            continue
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p))
        elif p.is_file() and p.suffix.lower() == ".csv":
            out.extend(_read_csv_manifest(p))
        elif p.is_file() and p.suffix.lower() == ".dcm":
            dcm_explicit.setdefault(p.parent, []).append(p)
        else:
            out.append(_file_input(p))
    for _folder, files in dcm_explicit.items():
        out.extend(_dicom_inputs(files))
    seen: set[str] = set()
    uniq = []
    for i in out:
        if i.slide_id not in seen:
            seen.add(i.slide_id)
            uniq.append(i)
    return uniq
