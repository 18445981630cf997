"""foveate view: the HTTP endpoints on real stores and real prediction rows (tiny untrained model), slide-id
validation, and the page driven in a headless system Chromium (Playwright; skipped without a Chromium).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.view import Viewer, make_server
from workers.store import COMPLETE_MARKER, SlideStore, write_store_from_array
from workers.tiles import TileSource

GOOD = ["s0", "s1", "s2"]
CLASSES = ["benign", "tumour"]
REPO = Path(__file__).resolve().parents[1]


def _slide(seed: int) -> np.ndarray:
    """A 1200x900 slide: white background, a textured pinkish tissue block at a seed-dependent place."""
    rng = np.random.default_rng(seed)
    img = np.full((900, 1200, 3), 245, np.uint8)
    y0, x0 = 60 + 30 * seed, 80 + 40 * seed
    tissue = rng.integers(90, 210, (600, 800, 3), dtype=np.uint8)
    tissue[..., 1] //= 2
    img[y0 : y0 + 600, x0 : x0 + 800] = tissue
    return img


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Stores (three good, one incomplete, one with corrupt metadata), a manifest.csv with labels, and a
    predictions file from the real scoring workers (one error row) with heatmaps."""
    import torch
    from flat_model_config import flat_config

    from operators.checkpoint import checkpoint_dict
    from operators.model import FoveateModel
    from pipeline.predictions import PredictionWriter
    from workers.scoring import ClassifierWorker, ScorerWorker

    root = tmp_path_factory.mktemp("view")
    stores = root / "stores"
    for i, sid in enumerate([*GOOD, "incomplete", "broken"]):
        write_store_from_array(stores / f"{sid}.zarr", _slide(i), tile_size=128, min_size=128)
    (stores / "incomplete.zarr" / COMPLETE_MARKER).unlink()
    (stores / "broken.zarr" / "zarr.json").write_text("{ not json")
    (stores / "manifest.csv").write_text("slide_id,label\ns0,benign\ns1,tumour\ns2,benign\n")
    cfg = flat_config(
        **{
            "patch_size": 64,
            "k": 3,
            "scorer_downsample": 8.0,
            "num_classes": len(CLASSES),
            "aggregator": "attention_mil",
            "aggregator_hidden": 8,
            "scorer": {"channels": 8},
            "features": {"widths": [8, 8], "blocks": [1, 1], "feature_dim": 8},
        },
    )
    torch.manual_seed(0)
    ckpt = checkpoint_dict(FoveateModel(cfg).eval(), cfg, CLASSES)
    items = ScorerWorker(ckpt, device="cpu").score_batch(
        [(s, str(stores / f"{s}.zarr")) for s in [*GOOD, "incomplete"]]
    )
    rows = ClassifierWorker(ckpt, heatmap_dir=root / "predictions_heatmaps", model_name="tiny").classify_batch(items)
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "error"]
    writer = PredictionWriter(root / "predictions.parquet")
    for r in rows:
        writer.add(r)
    writer.flush(force=True)
    return {"root": root, "stores": stores, "predictions": root / "predictions.parquet", "rows": rows}


@pytest.fixture(scope="module")
def server(data):
    viewer = Viewer(data["stores"], data["predictions"])
    srv = make_server(viewer, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield {"viewer": viewer, "url": f"http://127.0.0.1:{srv.server_port}"}
    srv.shutdown()
    srv.server_close()


def _get(url: str, headers: dict | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def _png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_index_and_api_list_every_store(data, server):
    status, ctype, body = _get(server["url"] + "/")
    assert status == 200 and ctype.startswith("text/html")
    page = body.decode()
    for sid in [*GOOD, "incomplete", "broken"]:
        assert f'data-slide="{sid}"' in page
    assert 'href="/slide/s0"' in page and 'href="/slide/broken"' not in page
    assert "benign" in page and "tumour" in page
    _, _, body = _get(server["url"] + "/api/slides")
    by_id = {r["slide_id"]: r for r in json.loads(body)}
    assert set(by_id) == {*GOOD, "incomplete", "broken"}
    assert by_id["s1"]["label"] == "tumour" and by_id["s1"]["status"] == "ok"
    assert by_id["s1"]["prediction"] in CLASSES and 0 < by_id["s1"]["probability"] <= 1
    assert not by_id["incomplete"]["readable"] and "incomplete" in by_id["incomplete"]["store_error"]
    assert by_id["incomplete"]["status"] == "error" and by_id["incomplete"]["error"]
    assert not by_id["broken"]["readable"] and "metadata" in by_id["broken"]["store_error"]
    assert "incomplete" in page.split('data-slide="incomplete"')[1].split("</tr>")[0]


def test_slide_api_tiles_patch_and_overlays(data, server):
    url = server["url"]
    _, _, body = _get(url + "/api/slide/s0")
    info = json.loads(body)
    store = SlideStore(data["stores"] / "s0.zarr")
    assert (info["width"], info["height"]) == store.dimensions == (1200, 900)
    assert [lv["downsample"] for lv in info["levels"]] == list(store.downsamples)
    row = next(r for r in data["rows"] if r["slide_id"] == "s0")
    assert info["patches"] == [{k: p[k] for k in ("x", "y", "w", "h", "score")} for p in row["patches"]]
    assert len(info["patches"]) == 3 and info["heatmap_url"]
    src = TileSource(store)
    for level in range(store.level_count):
        cols, rows = src.grid(level)
        status, ctype, png = _get(f"{url}/tiles/s0/{level}/{cols - 1}/{rows - 1}.png")
        assert status == 200 and ctype == "image/png"
        np.testing.assert_array_equal(_png(png), src.pixels(level, cols - 1, rows - 1))
    status, ctype, jpg = _get(f"{url}/tiles/s0/0/0/0.jpg")
    assert status == 200 and ctype == "image/jpeg" and jpg[:2] == b"\xff\xd8"
    p = info["patches"][0]
    status, ctype, png = _get(f"{url}/patch/s0?x={p['x']}&y={p['y']}&w={p['w']}&h={p['h']}")
    assert status == 200 and ctype == "image/png"
    np.testing.assert_array_equal(_png(png), store.read_region((p["x"], p["y"]), 0, (p["w"], p["h"])))
    status, _, png = _get(f"{url}/overlay/s0/tissue.png")
    mask, _ = store.tissue_mask()
    tissue = np.asarray(Image.open(io.BytesIO(png)))
    assert status == 200 and tissue.shape == (*mask.shape, 4)
    np.testing.assert_array_equal(tissue[..., 3] > 0, mask)
    status, _, png = _get(f"{url}/overlay/s0/heatmap.png")
    assert status == 200 and png == Path(row["heatmap"]).read_bytes()
    assert _get(f"{url}/slide/s0")[0] == 200


@pytest.mark.parametrize(
    "path,status",
    [
        ("/slide/nope", 404),
        ("/slide/..%2Fstores%2Fs0", 404),
        ("/slide/%2e%2e", 404),
        ("/api/slide/..%2F..%2Fetc%2Fpasswd", 404),
        ("/tiles/..%2Fs0/0/0/0.png", 404),
        ("/tiles/s0.zarr/0/0/0.png", 404),
        ("/overlay/%2Fetc%2Fpasswd/heatmap.png", 404),
        ("/patch/..?x=0&y=0&w=8&h=8", 404),
        ("/slide/incomplete", 409),
        ("/tiles/broken/0/0/0.png", 409),
        ("/tiles/s0/9/0/0.png", 400),
        ("/tiles/s0/0/99/0.png", 400),
        ("/tiles/s0/0/0/-1.png", 400),
        ("/tiles/s0/0/x/0.png", 400),
        ("/tiles/s0/0/0/0.gif", 400),
        ("/patch/s0?x=0&y=0&w=0&h=8", 400),
        ("/patch/s0?x=0&y=0&w=5000&h=5000", 400),
        ("/patch/s0?x=5000&y=0&w=8&h=8", 400),
        ("/patch/s0?x=0&y=0&w=8", 400),
        ("/static/../pipeline/view.py", 404),
        ("/nothing/here", 404),
    ],
)
def test_bad_addresses(server, path, status):
    """Slide ids are looked up among the stores of STORES only (no path from an address is opened)."""
    got, ctype, body = _get(server["url"] + path)
    assert got == status, body
    assert ctype == "application/json" and "error" in json.loads(body)


def test_host_header_checked_and_non_loopback_warns(data, server, caplog):
    assert _get(server["url"] + "/", {"Host": "evil.example:80"})[0] == 403
    assert _get(server["url"] + "/", {"Host": "localhost:1"})[0] == 200
    with caplog.at_level(logging.WARNING, logger="pipeline.view"):
        srv = make_server(server["viewer"], "0.0.0.0", 0)
        srv.server_close()
    assert "no authentication" in caplog.text
    with pytest.raises(ValueError, match="--port must be in"):
        make_server(server["viewer"], "127.0.0.1", 70000)
    with pytest.raises(FileNotFoundError, match="STORES"):
        Viewer(data["root"] / "nope")
    with pytest.raises(FileNotFoundError, match="--predictions"):
        Viewer(data["stores"], data["root"] / "nope.parquet")


def _start_cli(data) -> tuple[subprocess.Popen, str]:
    """``foveate view`` as a real process on a free port; returns it and its address."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pipeline", "view", str(data["stores"]), "--predictions", str(data["predictions"])]
    proc = subprocess.Popen([*cmd, "--port", "0"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"http://[\d.]+:\d+/", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no address in {line!r}")
    return proc, m.group(0).rstrip("/")


@pytest.mark.e2e
def test_cli_serves(data):
    proc, url = _start_cli(data)
    try:
        status, _, body = _get(url + "/api/slides")
        assert status == 200 and len(json.loads(body)) == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _chromium() -> str | None:
    for name in (os.environ.get("FOVEATE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.slow
@pytest.mark.e2e
def test_browser(data):
    """The page in a headless Chromium: every store listed, a slide's tiles at two zoom levels without console
    errors, the patch overlay drawn where the patches are, a click on a box naming its /patch address."""
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium executable found (apt-get install chromium, or set FOVEATE_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (test extra)")
    artifacts = REPO / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    proc, url = _start_cli(data)
    messages: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
            # the page's CSP forbids eval, which Playwright's wait_for_function uses; only the test bypasses it
            page = browser.new_page(viewport={"width": 1000, "height": 760}, bypass_csp=True)
            page.on("console", lambda m: messages.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
            page.goto(url + "/")
            listed = page.eval_on_selector_all("tr.slide", "rows => rows.map(r => r.dataset.slide)")
            assert sorted(listed) == sorted([*GOOD, "incomplete", "broken"])
            page.click("a[href='/slide/s0']")
            page.wait_for_function("window.viewer && window.viewer.info && window.viewer.pending === 0")
            page.click("#zoom-out")
            page.click("#zoom-out")
            page.wait_for_function("window.viewer.pending === 0 && window.viewer.level > 0")
            first = page.evaluate("window.viewer.level")
            n_first = page.evaluate("window.viewer.loaded.size")
            assert first > 0 and n_first > 0
            for _ in range(4):
                page.click("#zoom-in")
            page.wait_for_function("window.viewer.pending === 0 && window.viewer.level === 0")
            loaded = page.evaluate("Array.from(window.viewer.loaded)")
            assert any("/tiles/s0/0/" in u for u in loaded) and any(f"/tiles/s0/{first}/" in u for u in loaded)
            assert page.evaluate("window.viewer.failed") == []
            page.click("#zoom-fit")
            page.wait_for_function("window.viewer.pending === 0")
            info = page.evaluate("window.viewer.info")
            st = page.evaluate("window.viewer.state")
            page.wait_for_timeout(200)
            canvas = page.locator("#view")
            before = _png(canvas.screenshot())
            page.check("#show-patches")
            page.wait_for_timeout(300)
            after = _png(canvas.screenshot())
            diff = np.abs(before.astype(int) - after.astype(int)).sum(-1) > 30
            assert diff.any()
            inside = np.zeros_like(diff)
            for q in info["patches"]:  # the boxes and their labels (drawn just above each box)
                x0, y0 = (q["x"] - st["ox"]) * st["scale"], (q["y"] - st["oy"]) * st["scale"]
                x1, y1 = x0 + q["w"] * st["scale"], y0 + q["h"] * st["scale"]
                inside[max(0, int(y0) - 20) : int(y1) + 3, max(0, int(x0) - 3) : int(x1) + 120] = True
            assert diff[inside].sum() > 50
            ys, xs = np.nonzero(diff & ~inside)
            assert len(ys) == 0, (
                f"pixels changed away from the patches: {list(zip(xs[:5], ys[:5]))}, {info['patches']}, {st}"
            )
            page.check("#show-heatmap")
            page.check("#show-tissue")
            page.wait_for_timeout(200)
            page.uncheck("#show-tissue")
            page.wait_for_timeout(200)
            q = info["patches"][0]
            box = canvas.bounding_box()
            cx = box["x"] + (q["x"] + q["w"] / 2 - st["ox"]) * st["scale"]
            cy = box["y"] + (q["y"] + q["h"] / 2 - st["oy"]) * st["scale"]
            with page.context.expect_page() as popup:
                page.mouse.click(cx, cy)
            assert page.evaluate("window.viewer.patchUrl") == f"/patch/s0?x={q['x']}&y={q['y']}&w={q['w']}&h={q['h']}"
            popup.value.close()
            page.screenshot(path=str(artifacts / "view.png"))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert messages == [], messages
