"""The CLI's output: Ray's and MLflow's internal messages go to a log file, foveate's own lines, errors and
summaries stay on the terminal, ``-v`` keeps the raw stream (``pipeline.cli.internals_to_file``). No Ray is
started here; the demo's own output is checked in tests/test_demo.py."""

from __future__ import annotations

import logging
import os

import pytest

from pipeline.cli import internals_to_file, main

NATIVE = b"[2026-01-01 12:00:00,000 E 123 456] core_worker.cc:2465: an error of Ray's C++ core worker\n"


def test_internals_go_to_the_log_file_and_foveate_lines_to_the_terminal(tmp_path, capfd, monkeypatch):
    import ray  # noqa: F401 - its import puts a handler on the "ray" logger: taken off while a command runs

    monkeypatch.delenv("RAY_LOG_TO_DRIVER", raising=False)
    ray_handlers = logging.getLogger("ray").handlers[:]
    path = tmp_path / "logs" / "foveate.log"
    with internals_to_file(path, ray=True) as used:
        assert used == path.resolve() and os.environ["RAY_LOG_TO_DRIVER"] == "0"
        assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
        logging.getLogger("pipeline.stage").info("slides ingested: 3/3")
        logging.getLogger("pipeline.stage").debug("a debug line")
        logging.getLogger("ray.train.v2.placement_group_cleaner").warning("Failed to query Ray Train Controller")
        logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
        logging.getLogger("ray").error("Ray could not do it: the reason")
        os.write(2, NATIVE)  # what Ray's C++ code writes to this process's stderr
    out, err = capfd.readouterr()
    shown = out + err
    assert f"Ray/MLflow internals: {path.resolve()}" in err
    assert "slides ingested: 3/3" in err and "a debug line" not in shown
    assert "Ray could not do it: the reason" in err  # errors of Ray and MLflow still reach the terminal
    for internal in ("core_worker.cc", "Failed to query Ray Train Controller", "Creating initial MLflow"):
        assert internal not in shown
    text = path.read_text()
    for line in (
        "slides ingested: 3/3",
        "Failed to query Ray Train Controller",
        "Creating initial MLflow",
        "core_worker.cc",
    ):
        assert line in text
    # everything is put back
    assert logging.getLogger("ray").handlers == ray_handlers and not logging.getLogger("ray").propagate
    assert "RAY_LOG_TO_DRIVER" not in os.environ
    os.write(2, b"after\n")
    assert "after" in capfd.readouterr().err


def test_quiet_shows_warnings_only_and_settings_in_the_environment_win(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("RAY_LOG_TO_DRIVER", "1")
    with internals_to_file(tmp_path / "f.log", -1, ray=False):
        assert os.environ["RAY_LOG_TO_DRIVER"] == "1"
        logging.getLogger("pipeline.stage").info("an info line")
        logging.getLogger("pipeline.stage").warning("slide s1 failed: not a slide")
    err = capfd.readouterr().err
    assert "an info line" not in err and "slide s1 failed: not a slide" in err and "internals" not in err
    assert "an info line" in (tmp_path / "f.log").read_text()


def test_the_command_line_names_the_log_file_and_keeps_errors(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_CONFIGURE_LOGGING", raising=False)
    log_file = tmp_path / "compare.log"
    argv = ["compare", "--experiment", "nope", "--out", str(tmp_path / "out")]
    assert main(["--log-file", str(log_file), *argv]) == 2
    err = capfd.readouterr().err
    assert f"Ray/MLflow internals: {log_file}" in err
    assert "'nope' not found" in err  # the error and its reason, on the terminal
    assert f"Ray's and MLflow's messages: {log_file}" in err
    assert "'nope' not found" in log_file.read_text() and "MLFLOW_CONFIGURE_LOGGING" not in os.environ

    # -v: the raw stream, no log file (and the error raised with its traceback)
    raw = tmp_path / "raw.log"
    with pytest.raises(ValueError, match="'nope' not found"):
        main(["-v", "--log-file", str(raw), *argv])
    assert not raw.exists()


def test_the_demo_log_goes_to_its_workdir(tmp_path):
    import argparse

    from pipeline import demo

    assert demo.log_file(argparse.Namespace(workdir=str(tmp_path / "w"))) == tmp_path / "w" / "foveate.log"
