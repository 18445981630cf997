"""`pip install .` (not editable) gives a working foveate: a wheel built from the checkout, installed into a fresh
virtual environment, runs from any folder without the checkout and finds its shipped configs as package data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import resolve_config_path, shipped_config, shipped_configs

REPO = Path(__file__).resolve().parents[1]


def test_shipped_configs_from_the_checkout():
    configs = shipped_configs()
    assert {"demo", "perturbed_mean", "attention_sampling"} <= set(configs)
    assert all(p.parent == REPO / "configs" for p in configs.values())  # the checkout's own files first
    assert shipped_config("demo") == shipped_config("demo.yaml") == REPO / "configs" / "demo.yaml"
    # a --config path that does not exist here falls back to the shipped config of that name
    assert resolve_config_path("configs/demo.yaml").resolve() == (REPO / "configs" / "demo.yaml").resolve()
    assert resolve_config_path("sinkhorn") == REPO / "configs" / "sinkhorn.yaml"
    with pytest.raises(ValueError, match=r"no shipped config 'nope'; shipped configs: \[.*'demo'"):
        shipped_config("nope")
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="config file not found: /no/such.yaml .*shipped configs"):
        resolve_config_path("/no/such.yaml")


@pytest.mark.slow
@pytest.mark.e2e
def test_wheel_installs_and_runs_without_the_checkout(tmp_path, fresh_venv):
    import shutil

    # build from a copy of the sources, so no build/ or *.egg-info is left in the checkout
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("pipeline", "operators", "workers", "configs"):
        shutil.copytree(REPO / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("foveate-*.whl"))
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"pipeline/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")} <= names
    # a fresh environment with its own pip and foveate; the heavy dependencies seen from this one (fresh_venv)
    py = fresh_venv(pip=True)
    venv, bindir = py.parents[1], py.parent
    inst = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inst.returncode == 0, inst.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = (
        "import json, pipeline\n"
        "from pipeline.config import shipped_configs, resolve_config_path\n"
        "print(json.dumps({'pipeline': pipeline.__file__, 'configs': {k: str(v) for k, v in shipped_configs().items()},"
        " 'demo': str(resolve_config_path('configs/demo.yaml'))}))\n"
    )
    res = subprocess.run([str(py), "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(got["pipeline"]).is_relative_to(venv)  # the installed package, not the checkout
    for p in (REPO / "configs").glob("*.yaml"):
        installed = Path(got["configs"][p.stem])
        assert installed.is_relative_to(venv) and installed.read_bytes() == p.read_bytes(), p.name
    assert Path(got["demo"]) == Path(got["configs"]["demo"])
    help_ = subprocess.run([str(bindir / "foveate"), "--help"], cwd=work, env=env, capture_output=True, text=True)
    assert help_.returncode == 0 and "demo" in help_.stdout, help_.stderr[-2000:]
    synth = subprocess.run(
        [str(bindir / "foveate"), "synth", str(work / "slides"), "--count", "2", "--size", "2048", "--seed", "1"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert synth.returncode == 0, synth.stderr[-3000:]
    assert (work / "slides" / "labels.csv").is_file()
