"""Discovery itself, per selector: a short training run on a tiny task moves the scorer's hard top-k onto the
informative cells (regression guard for "the scorer learns where to look", not only for the loss going down).

The task (made here, 12 slides of 1024 px): pink noisy tissue with nuclei-like specks, 10 dark flat
*distractor* discs (the most salient thing at low resolution, in both classes) and 4 *informative* discs whose
fine texture (a 2-px checkerboard vs flat, equal mean colour) carries the label and is invisible at the scorer's
1/16 scale. At initialisation the top-k lands on an informative disc for ~4 % of the chosen cells; the scorer
must learn to prefer the informative discs from what the full-resolution patches tell the classifier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flat_model_config import flat_config

from operators.model import FoveateModel
from operators.resnet import ResNetConfig
from operators.scorer import ScorerConfig
from workers.slide_forward import forward_slide
from workers.store import write_store_from_array

SIZE, PATCH, SLIDES, EPOCHS = 1024, 64, 12, 15


def _disc(img, cy, cx, r, fill):
    y0, y1 = int(max(cy - r, 0)), int(min(cy + r + 1, SIZE))
    x0, x1 = int(max(cx - r, 0)), int(min(cx + r + 1, SIZE))
    yy, xx = np.mgrid[y0:y1, x0:x1]
    d = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    img[y0:y1, x0:x1][d] = fill(yy[d], xx[d])


def _slide(seed: int, label: int, n_informative: int = 4, n_distractors: int = 10):
    rng = np.random.default_rng(seed)
    img = np.clip(np.array([225, 150, 195]) + rng.integers(-20, 20, (SIZE, SIZE, 3)), 0, 255).astype(np.float32)
    for _ in range(300):
        _disc(img, *rng.uniform(0, SIZE, 2), rng.uniform(3, 6), lambda y, x: np.array([110, 70, 150], np.float32))
    placed: list[tuple[float, float, float]] = []
    while len(placed) < n_informative + n_distractors:
        r = rng.uniform(18, 30)
        cy, cx = rng.uniform(r + 8, SIZE - r - 8, 2)
        if all(np.hypot(cy - a, cx - b) >= r + c + 40 for a, b, c in placed):
            placed.append((cy, cx, r))
    boxes = []
    for i, (cy, cx, r) in enumerate(placed):
        if i < n_informative:

            def fill(y, x):
                checker = (((y // 2) + (x // 2)) % 2) * 2 - 1
                return np.array([135, 85, 165], np.float32)[None] + (label * 60.0 * checker)[:, None]

            boxes.append((cx - r, cy - r, 2 * r, 2 * r))
        else:

            def fill(y, x):
                return np.repeat(np.array([[70, 50, 110]], np.float32), len(y), 0)

        _disc(img, cy, cx, r, fill)
    return img.astype(np.uint8), boxes


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("discovery")
    out = []
    for i in range(SLIDES):
        img, boxes = _slide(100 + i, i % 2)
        out.append((write_store_from_array(d / f"s{i}.zarr", img, tile_size=256, min_size=64), i % 2, boxes))
    return out


def _hit_rate(model, task) -> float:
    """Fraction of the hard top-k cells that overlap an informative disc, over all slides."""
    model.eval()
    hits = []
    with torch.no_grad():
        for store, _, boxes in task:
            out = forward_slide(model, store, training=False)
            for x, y in out.coords_l0.tolist():
                hits.append(
                    any(x < bx + bw and bx < x + PATCH and y < by + bh and by < y + PATCH for bx, by, bw, bh in boxes)
                )
    return float(np.mean(hits))


@pytest.mark.slow
@pytest.mark.parametrize("selector", ["perturbed", "attention", "lapsum", "sinkhorn"])
def test_training_moves_the_top_k_onto_the_informative_cells(task, selector):
    torch.set_num_threads(1)
    cfg = flat_config(
        patch_size=PATCH,
        k=4,
        selector=selector,
        scorer_downsample=16.0,
        num_samples=32,
        max_support=2,
        mask_extra=4 if selector in ("lapsum", "sinkhorn") else 0,
        explore_cells=8,
        explore_strata=8,
        instance_weight=1.0,
        rank_weight=0.1,
        scorer=ScorerConfig(channels=8, num_layers=3, pool="mean"),
        features=ResNetConfig(widths=(8, 16, 32), blocks=(1, 1, 1), feature_dim=32),
    )
    torch.manual_seed(0)
    model = FoveateModel(cfg)
    before = _hit_rate(model, task)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)
    order_rng = np.random.default_rng(0)
    history = []
    for _ in range(EPOCHS):
        model.train()
        order = order_rng.permutation(SLIDES)
        for start in range(0, SLIDES, 4):
            opt.zero_grad()
            for i in order[start : start + 4]:
                store, target, _ = task[i]
                out = forward_slide(model, store, training=True, sigma=0.05, generator=gen, target=target)
                ce = torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([target]))
                (ce + sum(v.sum() for v in out.aux_losses.values())).div(4).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        history.append(_hit_rate(model, task))
    after = max(history[-3:])
    assert before < 0.15, f"the task must start with the top-k off the informative cells, got {before:.2f}"
    assert after >= 0.3 and after >= 4 * before, (
        f"{selector}: the top-k did not move onto the informative cells: hit rate {before:.2f} -> {history}"
    )
