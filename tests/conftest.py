"""Shared test fixtures and markers.

Markers (``pyproject.toml``): ``ray`` = uses an in-process Ray (every test using the :func:`ray_local` fixture
gets it automatically); ``cluster`` = starts a real Ray head and MLflow server (``infra/local/up.sh``);
``slow`` = takes more than ~30 s; ``gpu`` = needs CUDA. E.g. ``pytest -m "not ray and not cluster"`` runs the
fast, Ray-free part.

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
    # symlinks resolved: ingest resolves slide paths before deriving ids (one slide, one id), so tests that
    # compare manifest sources with fixture paths must use the real path (a ../shared that is a symlink)
    return FIXTURES.resolve()


@pytest.fixture()
def fresh_venv(tmp_path):
    """``make(pip=False) -> python``: a fresh virtual environment in ``tmp_path/venv`` (with its own pip when
    ``pip``) that sees this environment's installed packages through a .pth line listing our site-packages. A
    .pth *line* does not run the .pth files in that folder, so the editable install of the checkout stays
    invisible: ``import pipeline`` works there only from what the test installs or ships."""
    import subprocess
    import sys
    import sysconfig

    def make(pip: bool = False) -> Path:
        venv = tmp_path / "venv"
        subprocess.run(
            [sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]), str(venv)], check=True, timeout=300
        )
        py = venv / "bin" / "python"
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
        Path(site, "zz_deps.pth").write_text("\n".join(ours) + "\n")
        return py

    return make


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri(tmp_path, monkeypatch):
    """Never let a test write ./mlflow.db: point MLflow at a per-test sqlite file unless a test overrides it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.fixture(scope="module")
def ray_local():
    """One in-process Ray per test module (2 CPUs, small object store, the source tree on the workers'
    PYTHONPATH, one OpenMP thread per worker), shut down after the module."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        configure_logging=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
