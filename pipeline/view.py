"""``foveate view STORES [--predictions P.parquet]``: a local web viewer of slide stores and their predictions.

A small HTTP server from the standard library (:class:`http.server.ThreadingHTTPServer`), bound to 127.0.0.1 by
default (it has no authentication: ``--host`` other than a loopback address logs a warning). Pages and endpoints:

* ``/`` — every ``*.zarr`` in STORES (damaged or incomplete stores listed with their reason), with the label of
  the folder's ``manifest.parquet`` / ``manifest.csv`` and the prediction, probability and status of
  ``--predictions``;
* ``/slide/<id>`` — a deep-zoom view on a canvas (drag to pan, wheel or buttons to zoom) with overlays: the
  tissue mask, the scorer heatmap (the PNG of the predictions row) and the K chosen patches (rank and score;
  a click opens the patch at full resolution);
* ``/tiles/<id>/<level>/<col>/<row>.png|jpg`` — 256-px tiles cut on request (:class:`workers.tiles.TileSource`,
  one LRU of encoded tiles for all slides);
* ``/patch/<id>?x=&y=&w=&h=`` — a level-0 region as PNG (at most :data:`MAX_PATCH_PIXELS` pixels);
* ``/overlay/<id>/tissue.png``, ``/overlay/<id>/heatmap.png``, ``/api/slides``, ``/api/slide/<id>``.

Slide ids in addresses are only looked up among the stores found in STORES; an address never names a file. Nor
does a predictions row: the heatmap of a slide is ``<P stem>_heatmaps/<slide_id>.png`` beside the predictions
file P (what ``foveate score`` writes), read only when its real path lies inside that folder; the ``heatmap``
column of a row is never opened. Image requests (tiles, patches) are served at most ``max_concurrent`` at a time
(:data:`MAX_CONCURRENT`); a request that waits longer than ``queue_timeout_s`` for a slot gets 503 with
``Retry-After``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import math
import socket
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import numpy as np

from pipeline.predictions import read_predictions
from pipeline.view_page import CSS, SLIDE_JS, page, slide_page
from workers.store import SlideStore, verify_store
from workers.tiles import FORMATS, TileCache, TileSource, encode_image

__all__ = [
    "MAX_PATCH_PIXELS",
    "MAX_CONCURRENT",
    "Busy",
    "SlideEntry",
    "UnknownSlide",
    "UnreadableSlide",
    "Viewer",
    "make_server",
    "add_arguments",
    "run",
]

log = logging.getLogger(__name__)

MAX_PATCH_PIXELS = 4096 * 4096
MAX_CONCURRENT = 4  # image requests (tiles, patches) decoded at once; more wait, then get 503
QUEUE_TIMEOUT_S = 2.0  # how long an image request waits for a slot before its 503
TILE_SIZE = 256
TILE_FORMAT = "jpg"
_FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><circle cx="8" cy="8" r="7" fill="#c2185b"/>'
    b'<circle cx="8" cy="8" r="3" fill="#fff"/></svg>'
)


class UnknownSlide(KeyError):
    """An address names a slide id that is not a store of STORES (HTTP 404)."""


class UnreadableSlide(LookupError):
    """The slide's store is damaged or incomplete (HTTP 409; the list shows why)."""


class Busy(RuntimeError):
    """Every image slot is taken and none came free in time (HTTP 503 with ``Retry-After``)."""


@dataclass
class SlideEntry:
    """One ``*.zarr`` folder of STORES.

    Attributes:
        slide_id: the folder name without ``.zarr``.
        path: the store folder.
        store: the open store, or None when it is damaged or incomplete (then ``error`` says why).
        label: the manifest's label, if any.
        row: the predictions row, if any.
    """

    slide_id: str
    path: Path
    store: SlideStore | None = None
    error: str | None = None
    label: str | None = None
    row: dict[str, Any] | None = None
    tiles: TileSource | None = None
    _overlays: dict[str, bytes] = field(default_factory=dict)


def _manifest_labels(folder: Path) -> dict[str, str]:
    """``slide_id -> label`` from ``manifest.parquet`` (else ``manifest.csv``) of a store folder ({} if none)."""
    import pandas as pd

    for name, reader in (("manifest.parquet", pd.read_parquet), ("manifest.csv", pd.read_csv)):
        p = folder / name
        if not p.is_file():
            continue
        try:
            df = reader(p)
        except Exception as exc:
            log.warning("could not read %s: %s", p, exc)
            return {}
        if "slide_id" not in df.columns or "label" not in df.columns:
            return {}
        return {str(s): str(v) for s, v in zip(df["slide_id"], df["label"]) if v is not None and v == v and v != ""}
    return {}


class Viewer:
    """The slides a server shows: every ``*.zarr`` folder of ``stores`` and the rows of ``predictions``.

    Args:
        stores: one folder or several folders of ``<slide_id>.zarr`` stores (a slide id seen twice keeps the
            first folder's store).
        predictions: a predictions file of ``foveate score`` (optional).
        cache_bytes: budget of the encoded-tile LRU shared by all slides.
        max_concurrent: image requests (tiles, patches) cut at once (each holds up to a tile or a
            :data:`MAX_PATCH_PIXELS` patch in memory); the others wait.
        queue_timeout_s: how long an image request waits for a slot before it is answered 503.

    Raises:
        FileNotFoundError: a stores folder or the predictions file does not exist.
        ValueError: the predictions file is not one; ``max_concurrent`` < 1 or ``queue_timeout_s`` < 0.
    """

    def __init__(
        self,
        stores: str | Path | list[str | Path],
        predictions: str | Path | None = None,
        *,
        cache_bytes: int = 256 * 2**20,
        max_concurrent: int = MAX_CONCURRENT,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
    ):
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent must be an int >= 1 (image requests at once), got {max_concurrent!r}")
        if not isinstance(queue_timeout_s, int | float) or not math.isfinite(queue_timeout_s) or queue_timeout_s < 0:
            raise ValueError(f"queue_timeout_s must be a finite number of seconds >= 0, got {queue_timeout_s!r}")
        self.image_slots = threading.BoundedSemaphore(max_concurrent)
        self.max_concurrent = max_concurrent
        self.queue_timeout_s = float(queue_timeout_s)
        self.heatmap_dir: Path | None = None
        folders = [Path(s) for s in (stores if isinstance(stores, list | tuple) else [stores])]
        if not folders:
            raise ValueError("expected at least one STORES folder, got none")
        self.cache = TileCache(cache_bytes)
        rows: dict[str, dict[str, Any]] = {}
        if predictions is not None:
            p = Path(predictions)
            if not p.is_file():
                raise FileNotFoundError(f"--predictions: no such file {str(p)!r} (the Parquet file of foveate score)")
            rows = {str(r["slide_id"]): r for r in read_predictions(p, option="--predictions")}
            # the only folder overlays are read from (what foveate score writes beside its --out)
            self.heatmap_dir = p.parent / f"{p.name.removesuffix('.parquet')}_heatmaps"
        self.slides: dict[str, SlideEntry] = {}
        for folder in folders:
            if not folder.is_dir():
                raise FileNotFoundError(f"STORES: no such directory {str(folder)!r}")
            labels = _manifest_labels(folder)
            for d in sorted(q for q in folder.iterdir() if q.is_dir() and q.name.endswith(".zarr")):
                sid = d.name[: -len(".zarr")]
                if sid in self.slides:
                    log.warning("slide id %r in %s already seen in another folder; showing the first", sid, folder)
                    continue
                self.slides[sid] = self._open(sid, d, labels.get(sid), rows.get(sid))
        self.predictions = rows
        log.info("%d slide store(s), %d prediction row(s)", len(self.slides), len(rows))

    def _open(self, sid: str, path: Path, label: str | None, row: dict[str, Any] | None) -> SlideEntry:
        entry = SlideEntry(slide_id=sid, path=path, label=label, row=row)
        problems = verify_store(path)
        if problems:
            entry.error = "; ".join(problems)
            return entry
        try:
            entry.store = SlideStore(path)
        except Exception as exc:  # a damaged store is listed with its reason, never fatal to the page
            entry.error = f"{type(exc).__name__}: {exc}"
            return entry
        entry.tiles = TileSource(entry.store, tile_size=TILE_SIZE, cache=self.cache)
        return entry

    # ------------------------------------------------------------------ lookups
    def entry(self, slide_id: str) -> SlideEntry:
        """The slide of an address's id.

        Raises:
            UnknownSlide: no store of STORES has this id.
        """
        if not isinstance(slide_id, str) or slide_id not in self.slides:
            raise UnknownSlide(slide_id)
        return self.slides[slide_id]

    def readable(self, slide_id: str) -> SlideEntry:
        """Like :meth:`entry`, and the store must be open.

        Raises:
            UnknownSlide: unknown id. UnreadableSlide: the store is damaged or incomplete.
        """
        e = self.entry(slide_id)
        if e.store is None:
            raise UnreadableSlide(f"slide {slide_id!r} cannot be shown: {e.error}")
        return e

    # ------------------------------------------------------------------ JSON
    def summary(self, e: SlideEntry) -> dict[str, Any]:
        """The row of ``/api/slides``."""
        row = e.row or {}
        return {
            "slide_id": e.slide_id,
            "url": "/slide/" + quote(e.slide_id, safe=""),
            "readable": e.store is not None,
            "store_error": e.error,
            "label": e.label,
            "status": row.get("status"),
            "error": row.get("error"),
            "prediction": row.get("prediction"),
            "probability": _finite(row.get("probability")),
            "width": e.store.dimensions[0] if e.store else None,
            "height": e.store.dimensions[1] if e.store else None,
        }

    def heatmap_path(self, e: SlideEntry) -> Path | None:
        """The heatmap PNG of a slide with a predictions row: ``<P stem>_heatmaps/<slide_id>.png`` beside the
        predictions file, if it exists and its real path (links followed) lies inside that folder. The row's own
        ``heatmap`` path is never opened (a crafted row could name any file)."""
        if e.row is None or self.heatmap_dir is None:
            return None
        folder = self.heatmap_dir.resolve()
        p = (folder / f"{e.slide_id}.png").resolve()
        if not p.is_relative_to(folder) or p.parent != folder or not p.is_file():
            if p.exists() or (folder / f"{e.slide_id}.png").is_symlink():
                log.warning("heatmap of slide %r leads outside %s; not shown", e.slide_id, folder)
            return None
        return p

    @contextlib.contextmanager
    def image_slot(self):
        """Hold one of the ``max_concurrent`` image slots while the block runs.

        Raises:
            Busy: no slot came free within ``queue_timeout_s``.
        """
        if not self.image_slots.acquire(timeout=self.queue_timeout_s):
            raise Busy(
                f"viewer busy: {self.max_concurrent} image request(s) already being served "
                f"(--max-concurrent); retry shortly"
            )
        try:
            yield
        finally:
            self.image_slots.release()

    def details(self, slide_id: str) -> dict[str, Any]:
        """``/api/slide/<id>``: geometry, levels and tile grid, overlays and the predictions row."""
        e = self.readable(slide_id)
        q = quote(slide_id, safe="")
        levels = []
        for lv, ((w, h), ds) in enumerate(zip(e.store.level_dimensions, e.store.downsamples)):
            cols, rows = e.tiles.grid(lv)
            levels.append({"width": w, "height": h, "downsample": ds, "cols": cols, "rows": rows})
        row = e.row or {}
        patches = [
            {k: (float(p[k]) if k == "score" else int(p[k])) for k in ("x", "y", "w", "h", "score")}
            for p in (row.get("patches") or [])
        ]
        return {
            **self.summary(e),
            "mpp": e.store.meta.mpp,
            "tile_size": TILE_SIZE,
            "tile_format": TILE_FORMAT,
            "tile_url": f"/tiles/{q}/",
            "patch_url": f"/patch/{q}",
            "levels": levels,
            "tissue_url": f"/overlay/{q}/tissue.png",
            "heatmap_url": f"/overlay/{q}/heatmap.png" if self.heatmap_path(e) else None,
            "patches": patches,
            "probabilities": row.get("probabilities"),
        }

    # ------------------------------------------------------------------ images
    def tissue_png(self, slide_id: str) -> bytes:
        """The tissue mask as an RGBA PNG (green, half transparent, where there is tissue)."""
        e = self.readable(slide_id)
        if "tissue" not in e._overlays:
            mask, _ = e.store.tissue_mask()
            rgba = np.zeros((*mask.shape, 4), np.uint8)
            rgba[mask] = (0, 200, 0, 110)
            e._overlays["tissue"] = encode_image(rgba, "png")
        return e._overlays["tissue"]

    def heatmap_png(self, slide_id: str) -> bytes:
        """The bytes of the slide's heatmap PNG.

        Raises:
            FileNotFoundError: the row names no heatmap or the file is gone.
        """
        e = self.readable(slide_id)
        p = self.heatmap_path(e)
        if p is None:
            raise FileNotFoundError(f"no heatmap for slide {slide_id!r}")
        return p.read_bytes()

    def patch_png(self, slide_id: str, x: int, y: int, w: int, h: int) -> bytes:
        """A level-0 region as PNG.

        Raises:
            ValueError: a non-positive size, more than :data:`MAX_PATCH_PIXELS` pixels, or a region outside the slide.
        """
        e = self.readable(slide_id)
        if w < 1 or h < 1:
            raise ValueError(f"w and h must be >= 1, got w={w} h={h}")
        if w * h > MAX_PATCH_PIXELS:
            raise ValueError(f"w*h must be at most {MAX_PATCH_PIXELS} pixels, got {w}x{h}")
        W, H = e.store.dimensions
        if x >= W or y >= H or x + w <= 0 or y + h <= 0:
            raise ValueError(f"region ({x}, {y}, {w}, {h}) lies outside the slide (0, 0, {W}, {H})")
        return encode_image(e.store.read_region((x, y), 0, (w, h)), "png")

    # ------------------------------------------------------------------ HTML
    def index_html(self) -> str:
        import html

        def cell(v: Any) -> str:
            if v is None or (isinstance(v, float) and math.isnan(v)):
                return "<td></td>"
            if isinstance(v, float):
                return f"<td>{v:.3f}</td>"
            return f"<td>{html.escape(str(v))}</td>"

        rows = []
        for e in self.slides.values():
            s = self.summary(e)
            name = html.escape(e.slide_id)
            link = f'<a href="{html.escape(s["url"])}">{name}</a>' if e.store is not None else name
            problem = e.error or (s["error"] if s["status"] == "error" else None)
            status = "store damaged or incomplete" if e.error else s["status"]
            rows.append(
                f'<tr class=slide data-slide="{name}"><td>{link}</td>{cell(s["label"])}{cell(s["prediction"])}'
                f"{cell(s['probability'])}{cell(status)}"
                + (f"<td class=err>{html.escape(problem)}</td>" if problem else "<td></td>")
                + "</tr>"
            )
        body = (
            f"<header><strong>foveate view</strong><span>{len(self.slides)} slide(s)</span></header><main>"
            "<table id=slides><thead><tr><th>slide</th><th>label</th><th>prediction</th><th>probability</th>"
            "<th>status</th><th>error</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></main>"
        )
        return page("foveate view", body)


_LOOPBACK_NAMES = {"localhost"}


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a ``Host`` header without its port (``[::1]:8000`` -> ``[::1]``)."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0]


def _handler(viewer: Viewer, *, check_host: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "foveate-view"
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm and the client's
            # delayed ACK hold the body back ~40 ms on every keep-alive response
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt: str, *args: Any) -> None:  # requests go to the debug log, not stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(
            self, status: int, body: bytes, ctype: str, *, cache: bool = False, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self'; object-src 'none'")
            self.send_header("Cache-Control", "private, max-age=3600" if cache else "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps({"error": message}).encode(), "application/json", headers=headers)

        def _json(self, obj: Any) -> None:
            self._send(200, json.dumps(obj, default=_json_default, allow_nan=False).encode(), "application/json")

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            if check_host:  # a page of another site reaching the loopback server by DNS rebinding is refused
                if not _is_loopback(_host_name(self.headers.get("Host") or "")):
                    return self._error(HTTPStatus.FORBIDDEN, f"Host {self.headers.get('Host')!r} is not loopback")
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            try:
                self._route(parts, parse_qs(url.query))
            except UnknownSlide as exc:
                self._error(HTTPStatus.NOT_FOUND, f"no slide {exc.args[0]!r} in STORES")
            except UnreadableSlide as exc:
                self._error(HTTPStatus.CONFLICT, str(exc))
            except Busy as exc:
                self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), {"Retry-After": "1"})
            except FileNotFoundError as exc:
                self._error(HTTPStatus.NOT_FOUND, str(exc))
            except (ValueError, TypeError) as exc:
                self._error(HTTPStatus.BAD_REQUEST, str(exc))
            except Exception as exc:  # pragma: no cover - a bug; keep serving
                log.exception("GET %s failed", self.path)
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

        def _route(self, parts: list[str], query: dict[str, list[str]]) -> None:
            html_type = "text/html; charset=utf-8"
            match parts:
                case [""] | []:
                    self._send(200, viewer.index_html().encode(), html_type)
                case ["favicon.ico"]:
                    self._send(200, _FAVICON, "image/svg+xml", cache=True)
                case ["static", "viewer.css"]:
                    self._send(200, CSS.encode(), "text/css; charset=utf-8")
                case ["static", "viewer.js"]:
                    self._send(200, SLIDE_JS.encode(), "text/javascript; charset=utf-8")
                case ["api", "slides"]:
                    self._json([viewer.summary(e) for e in viewer.slides.values()])
                case ["api", "slide", sid]:
                    self._json(viewer.details(sid))
                case ["slide", sid]:
                    viewer.readable(sid)
                    api = "/api/slide/" + quote(sid, safe="")
                    self._send(200, slide_page(sid, api).encode(), html_type)
                case ["tiles", sid, level, col, name]:
                    row, _, fmt = name.partition(".")
                    if fmt not in FORMATS:
                        raise ValueError(f"tile format must be one of {sorted(FORMATS)}, got {fmt!r}")
                    e = viewer.readable(sid)
                    with viewer.image_slot():
                        data = e.tiles.tile(_int("level", level), _int("col", col), _int("row", row), fmt)
                    self._send(200, data, FORMATS[fmt][1], cache=True)
                case ["overlay", sid, "tissue.png"]:
                    self._send(200, viewer.tissue_png(sid), "image/png", cache=True)
                case ["overlay", sid, "heatmap.png"]:
                    self._send(200, viewer.heatmap_png(sid), "image/png")
                case ["patch", sid]:
                    args = {}
                    for k in ("x", "y", "w", "h"):
                        if k not in query:
                            raise ValueError(f"/patch needs x, y, w and h (level-0 pixels), {k} is missing")
                        args[k] = _int(k, query[k][0])
                    viewer.readable(sid)
                    with viewer.image_slot():
                        data = viewer.patch_png(sid, **args)
                    self._send(200, data, "image/png")
                case _:
                    self._error(HTTPStatus.NOT_FOUND, f"no such page {self.path!r}")

    return Handler


def _finite(v: Any) -> float | None:
    """A probability for JSON: None for a missing or NaN value."""
    return None if v is None or not math.isfinite(float(v)) else float(v)


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, tuple | set):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def make_server(viewer: Viewer, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``viewer`` bound to ``host:port`` (port 0: a free port; see ``server.server_port``).

    A loopback server answers only requests whose ``Host`` header names a loopback address. Call
    ``serve_forever()`` (e.g. in a thread) and ``shutdown()``.

    Raises:
        TypeError: ``port`` is not an int. ValueError: ``port`` outside 0-65535.
    """
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, got {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    loopback = _is_loopback(host)
    if not loopback:
        log.warning(
            "foveate view is listening on %s: the viewer has no authentication; anyone who can reach this address "
            "sees every slide in STORES",
            host,
        )
    server = ThreadingHTTPServer((host, port), _handler(viewer, check_host=loopback))
    server.daemon_threads = True
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", nargs="+", metavar="STORES", help="folder(s) of <slide_id>.zarr stores")
    parser.add_argument(
        "--predictions", metavar="P.parquet", help="predictions file of foveate score --out (patches, heatmaps)"
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; the viewer has no authentication)"
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=MAX_CONCURRENT,
        metavar="N",
        help=f"tile and patch requests cut at once (default {MAX_CONCURRENT}); others wait up to "
        f"{QUEUE_TIMEOUT_S:g} s, then get 503 with Retry-After",
    )


def run(args: argparse.Namespace) -> int:
    viewer = Viewer(args.stores, args.predictions, max_concurrent=args.max_concurrent)
    server = make_server(viewer, args.host, args.port)
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in str(host) else host
    print(f"foveate view: {len(viewer.slides)} slide(s) at http://{shown}:{port}/ (Ctrl-C to stop)", flush=True)
    thread = threading.Thread(target=server.serve_forever, name="foveate-view", daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0
