"""model.experimental.neighbour_views: in training the bag holds each selected cell's grid neighbours as further
views (their features, pooled with the K cells'); inference reads the K cells alone; the grid's neighbour indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from operators.config import from_dict
from operators.errors import ConfigError
from operators.model import FoveateModel
from operators.model_config import ModelConfig
from workers.patches import PatchGrid, prepare_slide
from workers.slide_forward import forward_slide
from workers.store import write_store_from_array


def _cfg(views: int = 4, selector: str = "hard", **evidence) -> ModelConfig:
    return from_dict(
        ModelConfig,
        {
            "geometry": {"patch_size": 32, "scorer_downsample": 4},
            "selection": {"selector": selector, "k": 3},
            "scorer": {"channels": 4, "num_layers": 2},
            "features": {"widths": [4, 8], "blocks": [1, 1], "feature_dim": 8},
            "evidence": evidence,
            "augment": {"color_jitter": 0.0},
            "experimental": {"neighbour_views": views},
            "num_classes": 2,
        },
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    img = np.full((256, 256, 3), 240, np.uint8)
    img[32:224, 32:224] = rng.integers(60, 200, (192, 192, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("views") / "s.zarr"
    write_store_from_array(path, img, tile_size=64, min_size=64)
    return str(path)


def test_grid_neighbours():
    g = PatchGrid.from_size((128, 96), 32, 32)  # 3 rows x 4 columns
    assert g.shape == (3, 4)
    assert g.neighbours(torch.tensor([5]), 4).tolist() == [[1, 4, 6, 9]]
    assert g.neighbours(torch.tensor([5]), 8).tolist() == [[0, 1, 2, 4, 6, 8, 9, 10]]
    assert g.neighbours(torch.tensor([0, 11]), 4).tolist() == [[0, 0, 1, 4], [7, 10, 11, 11]]  # edges: the cell itself
    with pytest.raises(ValueError, match="count must be 4 or 8"):
        g.neighbours(torch.tensor([0]), 2)


@pytest.mark.parametrize("views", [4, 8])
def test_training_bag_holds_the_views_and_inference_does_not(store, views):
    torch.manual_seed(0)
    model = FoveateModel(_cfg(views, instance_weight=0.0, rank_weight=0.0, rare_cells=0, neutral_cells=0)).train()
    out = forward_slide(model, store, training=True, target=1)
    cells = out.cell_indices.cpu()
    slide = prepare_slide(store, model.cfg)
    view_cells = slide.grid.neighbours(cells, views).flatten()
    assert view_cells.numel() == 3 * views and out.info["cells_read"] == 3 + torch.unique(view_cells).numel()
    with torch.no_grad():
        bag_cells = torch.cat([cells, view_cells])
        feats = model.embed(slide.reader.read(bag_cells).float() / 255)
        pos = slide.grid.cell_centres(bag_cells)
        want = model.aggregate(feats[None], pos[None], None)
    torch.testing.assert_close(out.logits.detach(), want, rtol=0, atol=1e-5)
    # inference: the K cells alone, as a model without views
    model.eval()
    plain = FoveateModel(_cfg(0, instance_weight=0.0, rank_weight=0.0, rare_cells=0, neutral_cells=0)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        a = forward_slide(model, store, training=False)
        b = forward_slide(plain, store, training=False)
    assert a.info["cells_read"] == b.info["cells_read"] == 3
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def test_views_config_is_checked():
    for bad in (1, 2, -4, True, 4.0):
        with pytest.raises(ConfigError, match="neighbour_views"):
            _cfg(bad)
    with pytest.raises(ConfigError, match="needs model.selection.selector perturbed or hard"):
        _cfg(4, selector="sinkhorn")
    assert _cfg(4, selector="perturbed").experimental.neighbour_views == 4
