"""pipeline.runtime.init_ray's decisions and pipeline.tracking.resolve_tracking_uri's precedence, without
starting anything (ray.init is replaced by a recorder)."""

from __future__ import annotations

import pytest

from pipeline.runtime import REPO_ROOT, init_ray
from pipeline.tracking import resolve_tracking_uri


@pytest.fixture
def calls(monkeypatch):
    import ray

    recorded: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: recorded.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return recorded


def test_in_process_defaults(calls):
    assert init_ray(num_cpus=3, object_store_memory=2**27, env_vars={"OMP_NUM_THREADS": "1"}) is True
    (kw,) = calls
    assert kw["num_cpus"] == 3 and kw["object_store_memory"] == 2**27 and kw["include_dashboard"] is False
    assert kw["runtime_env"] == {"env_vars": {"PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}}
    assert kw["configure_logging"] is False


def test_joining_a_cluster_keeps_the_jobs_runtime_env(calls, monkeypatch):
    init_ray("auto", num_cpus=3)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    init_ray(num_cpus=3)
    assert calls == [{"address": "auto", "log_to_driver": True}, {"address": None, "log_to_driver": True}]


def test_a_job_submission_address_is_dropped(calls, monkeypatch):
    import os

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    init_ray(num_cpus=2)
    assert "RAY_ADDRESS" not in os.environ and calls[0]["num_cpus"] == 2 and "address" not in calls[0]


def test_an_initialised_ray_is_reused(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("must not start Ray"))
    assert init_ray() is False


def test_tracking_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative sqlite:///x.db is created (owner-only) in the working folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert resolve_tracking_uri("sqlite:///x.db", default_dir=tmp_path) == "sqlite:///x.db"
    assert resolve_tracking_uri(default_dir=tmp_path) == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri(default_dir=tmp_path / "w") == f"sqlite:///{(tmp_path / 'w').resolve() / 'mlflow.db'}"
    assert (tmp_path / "w").is_dir()
