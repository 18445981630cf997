"""Shared test fixtures and markers.

Markers (``pyproject.toml``): ``ray`` = starts or uses Ray (every test using the :func:`ray_local` or
:func:`ray_own` fixture gets it automatically; a test that starts Ray through a command or a subprocess carries it
explicitly); ``e2e`` = runs a foveate command or a subprocess pipeline end to end; ``cluster`` = starts a real Ray
head and MLflow server (``infra/local/up.sh``); ``slow`` = takes more than ~10 s; ``gpu`` = needs CUDA.
``pytest -m "not slow"`` is the quick loop; ``pytest -m "not ray and not cluster"`` runs the Ray-free part.

Ray in tests: :func:`ray_local` is one in-process Ray shared by every module that only submits work to it, started
on first use and again after a module that needed its own (:func:`ray_own`: modules whose tests kill actors or need
Ray started after their own set-up); a test marked ``ray`` or ``cluster`` that uses neither fixture starts Ray its
own way and runs with the shared one shut down. Test order does not matter.

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


RAY_INIT_ARGS = {  # 2 CPUs, small object store, the source tree on the workers' PYTHONPATH, one OpenMP thread each
    "num_cpus": 2,
    "include_dashboard": False,
    "object_store_memory": 80 * 1024**2,
    "configure_logging": False,
    "log_to_driver": False,
    "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}},
}
_RAY = {"shared": None, "own": None}  # the head node id of the shared Ray / of a module's own Ray, when up


def _ray_node() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def stop_shared_ray() -> None:
    """Shut the shared in-process Ray down if it is the one running (it starts again at its next use)."""
    import ray

    if _RAY["shared"] is not None and _ray_node() == _RAY["shared"]:
        ray.shutdown()
    _RAY["shared"] = None


@pytest.fixture(scope="session")
def _ray_session():
    yield
    stop_shared_ray()


@pytest.fixture()
def ray_local(_ray_session):
    """The shared in-process Ray (:data:`RAY_INIT_ARGS`), kept up across tests and modules; started lazily, so
    also after a module that ran its own Ray (:func:`ray_own`) or a test that needed none running."""
    import ray

    node = _ray_node()
    if node is not None and node == _RAY["own"]:
        raise pytest.UsageError("a module that uses ray_own cannot use ray_local too")
    if node is None or node != _RAY["shared"]:
        if node is not None:
            ray.shutdown()  # a Ray some test left running: not ours to share
        ray.init(**RAY_INIT_ARGS)
        _RAY["shared"] = _ray_node()
    yield


@pytest.fixture(scope="module")
def ray_own():
    """A module's own in-process Ray (same arguments as the shared one), started after the module fixtures
    requested before it (e.g. environment the workers must inherit) and shut down after the module; the shared
    Ray is shut down first. For modules whose tests kill actors or processes of Ray."""
    import ray

    stop_shared_ray()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(**RAY_INIT_ARGS)
    _RAY["own"] = _ray_node()
    try:
        yield
    finally:
        _RAY["own"] = None
        ray.shutdown()


@pytest.fixture(autouse=True)
def _no_shared_ray_for_tests_that_start_their_own(request):
    """A test marked ``ray``/``cluster`` without a Ray fixture starts Ray its own way (a command in-process, a
    subprocess, a cluster whose clients join with ``--address auto``): the shared Ray must not be running then."""
    if {"ray_local", "ray_own"}.isdisjoint(request.fixturenames) and (
        request.node.get_closest_marker("ray") or request.node.get_closest_marker("cluster")
    ):
        stop_shared_ray()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if {"ray_local", "ray_own"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    # the long modules first: those with a real cluster, then those with end-to-end runs, then the rest, each
    # group in file order. With ``-n 2 --dist loadscope --no-loadscope-reorder`` a module runs whole on one worker in
    # this order (xdist would otherwise order modules by their number of tests: a one-test cluster module last), so the
    # short modules fill the end instead of one worker finishing a long end-to-end test alone.
    rank: dict[str, int] = {}
    for item in items:
        mod = item.nodeid.split("::", 1)[0]
        r = 0 if item.get_closest_marker("cluster") else 1 if item.get_closest_marker("e2e") else 2
        rank[mod] = min(rank.get(mod, 2), r)
    items.sort(key=lambda it: rank[it.nodeid.split("::", 1)[0]])  # stable: file and test order kept per group
