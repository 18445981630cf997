"""Shared test fixtures.

Real OpenSlide fixtures come from ``$FOVEATE_OPENSLIDE_FIXTURES`` (default ``../shared/fixtures/openslide``
beside the clone); tests needing them skip with a clear reason where the folder is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("FOVEATE_OPENSLIDE_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures" / "openslide"))


@pytest.fixture(scope="session")
def openslide_fixtures() -> Path:
    """Folder of OpenSlide's own small test slides (boxes.tiff, small.svs, boxes_0.dcm, broken ones)."""
    if not (FIXTURES / "boxes.tiff").is_file():
        pytest.skip(f"OpenSlide fixtures not found at {FIXTURES} (set FOVEATE_OPENSLIDE_FIXTURES)")
    return FIXTURES


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri(tmp_path, monkeypatch):
    """Never let a test write ./mlflow.db: point MLflow at a per-test sqlite file unless a test overrides it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
