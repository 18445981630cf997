"""The pages of ``foveate view``: foveate's own small HTML, CSS and JavaScript (no third-party code, nothing
fetched at run time). :mod:`pipeline.view` serves them; the slide page talks to its JSON and tile endpoints.
"""

from __future__ import annotations

import html

__all__ = ["CSS", "SLIDE_JS", "page", "slide_page"]

CSS = """
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, sans-serif; color: #222; background: #fafafa; }
header { padding: 8px 14px; background: #263238; color: #eceff1; display: flex; gap: 16px; align-items: center;
  flex-wrap: wrap; }
header a { color: #80cbc4; }
main { padding: 14px; }
table { border-collapse: collapse; background: #fff; }
th, td { border: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #eceff1; }
td.err { color: #b71c1c; max-width: 40em; }
.controls label { margin-right: 10px; white-space: nowrap; }
.controls button { min-width: 2.2em; }
body.slide { display: flex; flex-direction: column; height: 100vh; overflow: hidden; }
#view { display: block; flex: 1 1 0; min-height: 0; width: 100%; background: #fff; cursor: grab; }
#view.dragging { cursor: grabbing; }
#status { font-size: 12px; color: #b0bec5; }
#legend { display: none; align-items: center; gap: 6px; font-size: 12px; }
#legend .bar { width: 120px; height: 10px; border: 1px solid #90a4ae;
  background: linear-gradient(to right, #000004, #420a68, #932667, #dd513a, #fca50a, #fcffa4); }
"""


def page(title: str, body: str, *, scripts: tuple[str, ...] = (), body_attrs: str = "") -> str:
    """A whole HTML document (``title`` is escaped here; ``body`` must already be escaped)."""
    tags = "".join(f'<script src="{html.escape(s)}"></script>' for s in scripts)
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><link rel=stylesheet href=/static/viewer.css></head>"
        f"<body{body_attrs}>{body}{tags}</body></html>"
    )


def slide_page(slide_id: str, api_url: str) -> str:
    """The deep-zoom page of one slide; ``api_url`` is the (quoted) ``/api/slide/<id>`` address."""
    sid = html.escape(slide_id)
    body = (
        f'<header><a href="/">&larr; slides</a><strong>{sid}</strong><span id=summary></span>'
        '<span class=controls><button id=zoom-in title="zoom in">+</button>'
        '<button id=zoom-out title="zoom out">&minus;</button><button id=zoom-fit>fit</button></span>'
        "<span class=controls>"
        "<label><input type=checkbox id=show-tissue> tissue</label>"
        "<label><input type=checkbox id=show-heatmap> heatmap</label>"
        "<label><input type=checkbox id=show-patches> patches</label></span>"
        "<span id=legend>score low <span class=bar></span> high</span>"
        "<span id=status></span></header>"
        "<canvas id=view></canvas>"
    )
    return page(
        slide_id, body, scripts=("/static/viewer.js",), body_attrs=f' class=slide data-api="{html.escape(api_url)}"'
    )


SLIDE_JS = r"""
"use strict";
(function () {
  const canvas = document.getElementById("view");
  const ctx = canvas.getContext("2d");
  const $ = (id) => document.getElementById(id);
  // state: level-0 coordinate (ox, oy) at the canvas' top-left corner, scale = canvas px per level-0 px
  const S = { scale: 1, ox: 0, oy: 0 };
  const V = (window.viewer = { info: null, state: S, level: null, loaded: new Set(), failed: [], pending: 0,
                               patchUrl: null, draws: 0 });
  const tiles = new Map();
  let info = null, tissue = null, heat = null, queued = false;

  function image(url, onready) {
    const img = new Image();
    V.pending++;
    img.onload = () => { V.pending--; V.loaded.add(url); onready && onready(); redraw(); };
    img.onerror = () => { V.pending--; V.failed.push(url); console.error("could not load " + url); };
    img.src = url;
    return img;
  }

  function tile(level, col, row, request) {
    const url = info.tile_url + level + "/" + col + "/" + row + "." + info.tile_format;
    let t = tiles.get(url);
    if (!t && request) { t = { img: image(url) }; tiles.set(url, t); }
    return t && V.loaded.has(url) ? t.img : null;
  }

  function levelFor(scale) {  // the largest level whose downsample <= the wanted one (OpenSlide's rule)
    const want = 1 / scale;
    let best = 0;
    info.levels.forEach((l, i) => { if (l.downsample <= want * 1.0001) best = i; });
    return best;
  }

  function drawLevel(lv, request) {
    const L = info.levels[lv], ts = info.tile_size, span = ts * L.downsample;
    const W = canvas.width / S.scale, H = canvas.height / S.scale;
    const c0 = Math.max(0, Math.floor(S.ox / span)), c1 = Math.min(L.cols - 1, Math.floor((S.ox + W) / span));
    const r0 = Math.max(0, Math.floor(S.oy / span)), r1 = Math.min(L.rows - 1, Math.floor((S.oy + H) / span));
    for (let r = r0; r <= r1; r++) {
      for (let c = c0; c <= c1; c++) {
        const img = tile(lv, c, r, request);
        if (!img) continue;
        const k = L.downsample * S.scale;
        ctx.drawImage(img, (c * span - S.ox) * S.scale, (r * span - S.oy) * S.scale,
                      img.naturalWidth * k, img.naturalHeight * k);
      }
    }
  }

  function ranked() {
    const p = (info.patches || []).slice();
    p.sort((a, b) => b.score - a.score);
    return p.map((q, i) => Object.assign({ rank: i + 1 }, q));
  }

  function draw() {
    queued = false;
    V.draws++;
    ctx.fillStyle = "#cfd8dc";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const lv = levelFor(S.scale), last = info.levels.length - 1;
    V.level = lv;
    for (let l = last; l >= lv; l--) drawLevel(l, l === lv || l === last);
    const x0 = -S.ox * S.scale, y0 = -S.oy * S.scale, w = info.width * S.scale, h = info.height * S.scale;
    ctx.imageSmoothingEnabled = false;
    if ($("show-tissue").checked && tissue && tissue.complete) ctx.drawImage(tissue, x0, y0, w, h);
    ctx.imageSmoothingEnabled = true;
    if ($("show-heatmap").checked && heat && heat.complete) {
      ctx.globalAlpha = 0.6;
      ctx.drawImage(heat, x0, y0, w, h);
      ctx.globalAlpha = 1;
    }
    if ($("show-patches").checked) {
      ctx.lineWidth = 2;
      ctx.font = "bold 12px sans-serif";
      for (const p of ranked()) {
        const bx = (p.x - S.ox) * S.scale, by = (p.y - S.oy) * S.scale;
        ctx.strokeStyle = "#00e5ff";
        ctx.strokeRect(bx, by, p.w * S.scale, p.h * S.scale);
        const label = "#" + p.rank + " " + p.score.toFixed(3);
        ctx.fillStyle = "rgba(0,0,0,0.7)";
        ctx.fillRect(bx, by - 15, ctx.measureText(label).width + 6, 15);
        ctx.fillStyle = "#00e5ff";
        ctx.fillText(label, bx + 3, by - 3);
      }
    }
    $("status").textContent = "level " + lv + " (downsample " + info.levels[lv].downsample + "), zoom " +
      S.scale.toFixed(3) + ", " + V.loaded.size + " image(s) loaded" +
      (V.failed.length ? ", " + V.failed.length + " failed" : "");
  }

  function redraw() { if (!queued && info) { queued = true; requestAnimationFrame(draw); } }

  function resize() {
    if (canvas.width === canvas.clientWidth && canvas.height === canvas.clientHeight) return;
    canvas.width = canvas.clientWidth;
    canvas.height = canvas.clientHeight;
    redraw();
  }

  function fit() {
    S.scale = 0.95 * Math.min(canvas.width / info.width, canvas.height / info.height);
    S.ox = (info.width - canvas.width / S.scale) / 2;
    S.oy = (info.height - canvas.height / S.scale) / 2;
    redraw();
  }

  function zoom(f, cx, cy) {
    if (cx === undefined) { cx = canvas.width / 2; cy = canvas.height / 2; }
    const minScale = 0.25 * Math.min(canvas.width / info.width, canvas.height / info.height);
    const s = Math.min(8, Math.max(minScale, S.scale * f));
    const x = S.ox + cx / S.scale, y = S.oy + cy / S.scale;
    S.scale = s;
    S.ox = x - cx / s;
    S.oy = y - cy / s;
    redraw();
  }

  function patchAt(cx, cy) {
    if (!$("show-patches").checked) return null;
    const x = S.ox + cx / S.scale, y = S.oy + cy / S.scale;
    return ranked().find((p) => x >= p.x && x < p.x + p.w && y >= p.y && y < p.y + p.h) || null;
  }

  let drag = null;
  canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, y: e.clientY, moved: 0 }; });
  window.addEventListener("mousemove", (e) => {
    if (!drag) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    drag.moved += Math.abs(dx) + Math.abs(dy);
    if (drag.moved > 3) canvas.classList.add("dragging");
    S.ox -= dx / S.scale;
    S.oy -= dy / S.scale;
    drag.x = e.clientX;
    drag.y = e.clientY;
    redraw();
  });
  window.addEventListener("mouseup", (e) => {
    if (drag && drag.moved <= 3 && e.target === canvas) {
      const p = patchAt(e.offsetX, e.offsetY);
      if (p) {
        V.patchUrl = info.patch_url + "?x=" + p.x + "&y=" + p.y + "&w=" + p.w + "&h=" + p.h;
        window.open(V.patchUrl, "_blank");
      }
    }
    drag = null;
    canvas.classList.remove("dragging");
  });
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    zoom(Math.exp(-e.deltaY * 0.0015), e.offsetX, e.offsetY);
  }, { passive: false });
  $("zoom-in").onclick = () => zoom(2);
  $("zoom-out").onclick = () => zoom(0.5);
  $("zoom-fit").onclick = fit;
  for (const id of ["show-tissue", "show-patches"]) $(id).onchange = redraw;
  $("show-heatmap").onchange = () => {
    $("legend").style.display = $("show-heatmap").checked ? "flex" : "none";
    redraw();
  };
  new ResizeObserver(resize).observe(canvas);  // the header's height changes with its text, not only the window
  V.zoom = zoom;
  V.fit = fit;

  fetch(document.body.dataset.api).then((r) => {
    if (!r.ok) throw new Error("slide metadata: HTTP " + r.status);
    return r.json();
  }).then((d) => {
    info = V.info = d;
    const pred = d.prediction ? d.prediction + " (" + Number(d.probability).toFixed(3) + ")" : "";
    $("summary").textContent = d.width + " x " + d.height + " px" + (d.label ? ", label " + d.label : "") +
      (pred ? ", prediction " + pred : "");
    if (d.tissue_url) tissue = image(d.tissue_url);
    if (d.heatmap_url) heat = image(d.heatmap_url);
    else $("show-heatmap").disabled = true;
    if (!d.patches || !d.patches.length) $("show-patches").disabled = true;
    canvas.width = canvas.clientWidth;
    canvas.height = canvas.clientHeight;
    fit();
  }).catch((e) => { console.error(String(e)); $("status").textContent = String(e); });
})();
"""
