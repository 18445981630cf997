"""Where stores live: a local folder or an object-storage URL (``s3://bucket/prefix``, any fsspec protocol).

Every byte of a store goes through zarr's store API (:class:`zarr.storage.LocalStore` for a local path,
:class:`zarr.storage.FsspecStore` for a URL), so the same code writes a laptop's disk and a bucket. A *location*
is a plain string: a local path (``~`` expanded, made absolute) or a URL (``scheme://...``; ``file://`` counts
as local).

Credentials and endpoints come from the usual configuration of the filesystem library (for ``s3://``: s3fs /
botocore, i.e. ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/...``), plus:

- ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``): an S3-compatible server (MinIO, Ceph, a local moto
  server) for ``s3://`` URLs;
- ``FOVEATE_STORAGE_OPTIONS``: a JSON object of fsspec storage options merged over those (for example
  ``{"anon": false, "client_kwargs": {"region_name": "eu-west-1"}}``).

Both are read from the environment of the process that opens the store, so Ray workers see what the driver's
environment (or the job's ``runtime_env``) gives them.

Writes of one key are atomic on both kinds (zarr's LocalStore writes a temporary file and renames it; an object
PUT is atomic), which the completion marker relies on. :func:`sync_local` makes a local store's writes durable
(one ``syncfs``); on object storage a PUT that returned is durable.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "is_url",
    "normalize",
    "join",
    "basename",
    "storage_options",
    "open_store",
    "filesystem",
    "get_bytes",
    "put_bytes",
    "delete_keys",
    "delete_prefix",
    "list_keys",
    "exists",
    "children",
    "remove_tree",
    "sync_local",
    "sync_filesystem",
    "read_file",
    "write_file",
    "file_exists",
    "sibling",
    "modified_time",
    "local_path",
    "STORAGE_OPTIONS_ENV",
]

STORAGE_OPTIONS_ENV = "FOVEATE_STORAGE_OPTIONS"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str | os.PathLike) -> bool:
    """True for ``scheme://...`` other than ``file://`` (those are local paths)."""
    text = str(location)
    return bool(_URL.match(text)) and not text.startswith("file://")


def normalize(location: str | os.PathLike) -> str:
    """A URL without its trailing slashes, or an absolute local path (``~`` expanded; ``file://`` stripped)."""
    if not isinstance(location, str | os.PathLike):
        raise TypeError(f"a store location must be a path or URL string, got {type(location).__name__}")
    text = str(location)
    if not text:
        raise ValueError("a store location must not be empty (give a local folder or a URL such as s3://bucket/x)")
    if is_url(text):
        return text.rstrip("/")
    if text.startswith("file://"):
        text = text[len("file://") :]
    return str(Path(text).expanduser().absolute())


def join(base: str | os.PathLike, *names: str) -> str:
    """``base/name/...`` for a URL or a local path."""
    base = str(base).rstrip("/") if is_url(base) else str(base)
    if is_url(base):
        return "/".join([base, *(n.strip("/") for n in names)])
    return str(Path(base, *names))


def basename(location: str | os.PathLike) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def local_path(location: str | os.PathLike) -> Path | None:
    """The local path of ``location``, or None for a URL."""
    return None if is_url(location) else Path(normalize(location))


def storage_options(url: str) -> dict[str, Any]:
    """fsspec storage options of ``url``: ``$FOVEATE_STORAGE_OPTIONS`` (JSON object) over the endpoint of
    ``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL`` for ``s3://``. Raises ValueError for malformed JSON."""
    opts: dict[str, Any] = {}
    if str(url).startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"${STORAGE_OPTIONS_ENV} must be a JSON object, got {raw[:80]!r} ({exc})") from None
        if not isinstance(extra, dict):
            raise ValueError(f"${STORAGE_OPTIONS_ENV} must be a JSON object, got {type(extra).__name__}")
        opts.update(extra)
    return opts


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` of a URL or local path (a fresh listing cache each call)."""
    import fsspec

    if not is_url(url):
        return fsspec.filesystem("file"), normalize(url)
    fs, path = fsspec.core.url_to_fs(url, **storage_options(url))
    fs.invalidate_cache()
    return fs, path


def open_store(location: str | os.PathLike, *, read_only: bool = False) -> Any:
    """A zarr store rooted at ``location`` (LocalStore for a path, FsspecStore for a URL)."""
    import zarr

    loc = normalize(location)
    if not is_url(loc):
        return zarr.storage.LocalStore(loc, read_only=read_only)
    try:
        return zarr.storage.FsspecStore.from_url(loc, storage_options=storage_options(loc), read_only=read_only)
    except ImportError as exc:
        raise ValueError(
            f"cannot open {loc}: the filesystem package of its scheme is not installed ({exc}); for s3:// "
            "install s3fs (pip install 'foveate[s3]')"
        ) from exc


def _sync(coro: Any) -> Any:
    from zarr.core.sync import sync

    return sync(coro)


def get_bytes(store: Any, key: str) -> bytes | None:
    """The value of ``key`` (None when absent)."""
    from zarr.core.buffer import default_buffer_prototype

    buf = _sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


def _buffer(data: bytes | memoryview) -> Any:
    import numpy as np
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_array_like(np.frombuffer(data, dtype=np.uint8))


def put_bytes(store: Any, items: dict[str, bytes] | Iterable[tuple[str, bytes]]) -> None:
    """Set each ``key -> bytes`` (concurrently; each key written atomically)."""
    import asyncio

    pairs = list(items.items()) if isinstance(items, dict) else list(items)
    if not pairs:
        return
    if len(pairs) == 1:
        _sync(store.set(pairs[0][0], _buffer(pairs[0][1])))
        return

    async def _all() -> None:
        await asyncio.gather(*(store.set(k, _buffer(v)) for k, v in pairs))

    _sync(_all())


def delete_keys(store: Any, keys: Iterable[str]) -> None:
    """Delete each key that exists (absent keys are fine)."""
    import asyncio

    keys = list(keys)
    if not keys:
        return

    async def _del(k: str) -> None:
        try:
            await store.delete(k)
        except FileNotFoundError:
            pass

    async def _all() -> None:
        await asyncio.gather(*(_del(k) for k in keys))

    _sync(_all())


def delete_prefix(store: Any, prefix: str) -> None:
    """Delete every key under ``prefix/`` (on a local disk the folder too)."""
    _sync(store.delete_dir(prefix.rstrip("/")))


def list_keys(store: Any, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` (sorted; full keys). A local folder (zarr's ``LocalStore``) is walked with
    ``os.scandir`` in the calling thread, not on zarr's one event-loop thread (whose ``rglob`` + ``stat`` per file
    serialised every reader thread behind one listing: a 1-GP store holds ~16,000 chunk files)."""
    from zarr.storage import LocalStore

    if isinstance(store, LocalStore):
        return sorted(_walk_keys(Path(store.root), prefix))

    async def _all() -> list[str]:
        return [k async for k in store.list_prefix(prefix)]

    fs = getattr(store, "fs", None)
    if fs is not None:  # object storage: no stale listing from fsspec's cache
        fs.invalidate_cache()
    return sorted(_sync(_all()))


def _walk_keys(root: Path, prefix: str) -> list[str]:
    """The keys of the files under ``root / prefix`` (the keys ``LocalStore.list_prefix`` yields)."""
    base = len(str(root)) + 1
    out = []
    for folder, _dirs, files in os.walk(root / prefix.rstrip("/")):
        rel = folder[base:].replace(os.sep, "/")
        out.extend(f"{rel}/{f}" if rel else f for f in files)
    return out


def exists(store: Any, key: str) -> bool:
    return bool(_sync(store.exists(key)))


def children(location: str | os.PathLike, suffix: str = "") -> list[tuple[str, str]]:
    """``[(name, location)]`` of the folders/prefixes directly under ``location`` whose name ends with
    ``suffix`` (sorted by name); ``[]`` when ``location`` does not exist."""
    loc = normalize(location)
    if not is_url(loc):
        root = Path(loc)
        if not root.is_dir():
            return []
        return [(p.name, str(p)) for p in sorted(root.iterdir()) if p.is_dir() and p.name.endswith(suffix)]
    fs, path = filesystem(loc)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") == "directory" and name.endswith(suffix):
            out.append((name, join(loc, name)))
    return sorted(out)


def remove_tree(location: str | os.PathLike) -> None:
    """Remove a folder/prefix and everything under it (absent is fine)."""
    import shutil

    loc = normalize(location)
    if not is_url(loc):
        shutil.rmtree(loc, ignore_errors=True)
        return
    fs, path = filesystem(loc)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def read_file(location: str | os.PathLike) -> bytes | None:
    """The bytes of a file / object (None when absent)."""
    loc = normalize(location)
    if not is_url(loc):
        p = Path(loc)
        return p.read_bytes() if p.is_file() else None
    fs, path = filesystem(loc)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def file_exists(location: str | os.PathLike) -> bool:
    loc = normalize(location)
    if not is_url(loc):
        return Path(loc).exists()
    fs, path = filesystem(loc)
    return bool(fs.exists(path))


def write_file(location: str | os.PathLike, data: bytes) -> None:
    """Replace a file / object with ``data`` atomically (local: temporary file, fsync, rename; object storage:
    one PUT)."""
    loc = normalize(location)
    if is_url(loc):
        fs, path = filesystem(loc)
        fs.pipe_file(path, data)
        return
    p = Path(loc)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def modified_time(location: str | os.PathLike) -> float:
    """Last modification of a file / object, in seconds since the epoch."""
    loc = normalize(location)
    if not is_url(loc):
        return Path(loc).stat().st_mtime
    fs, path = filesystem(loc)
    m = fs.modified(path)
    return m.timestamp()


def sibling(location: str | os.PathLike, name: str) -> str:
    """``name`` in the folder / prefix holding ``location``."""
    loc = normalize(location)
    if is_url(loc):
        return loc.rsplit("/", 1)[0] + "/" + name
    return str(Path(loc).with_name(name))


_syncfs: Any = None


def sync_filesystem(path: str) -> None:
    """Flush everything written to the filesystem holding ``path`` — file data, new files and folders — with one
    ``syncfs(2)`` (Linux; ``sync()`` elsewhere). One call per ingest region instead of an ``fdatasync`` per
    chunk file: ``benchmarks/ingest.py --no-fsync-too`` measured 3-15 % against 22-31 % of the throughput
    (RESULTS.md)."""
    global _syncfs
    if _syncfs is None:
        import ctypes

        try:
            _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
        except (AttributeError, OSError):
            _syncfs = False
    if not _syncfs:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _syncfs(fd) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def sync_local(store: Any) -> None:
    """Make what was written to a local store durable (one ``syncfs`` of its filesystem); nothing on object
    storage (a PUT that returned is durable)."""
    root = getattr(store, "root", None)
    if isinstance(root, Path) and root.exists():
        sync_filesystem(str(root))
