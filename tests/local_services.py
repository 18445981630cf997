"""Helpers shared by the tests (and benchmarks) that start real local services: a moto S3 server on 127.0.0.1
and a look at which processes are still alive. Not a test module (pytest collects ``test_*.py`` only); test
files import it directly (``tests/`` is on ``sys.path`` under pytest), benchmarks add ``tests/`` to ``sys.path``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["moto_s3", "boto3_credentials", "live_pids_mentioning"]


def boto3_credentials(env: dict[str, str]) -> dict[str, str]:
    """``boto3.client(...)`` keyword arguments for the ``AWS_*`` variables of :func:`moto_s3`."""
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[tuple[object, dict[str, str]]]:
    """A moto S3 server on a free port of 127.0.0.1 with one bucket: yields ``(boto3 client, AWS_* variables)``.
    The variables are only returned; callers that need them in ``os.environ`` (Ray workers inherit it) set them."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **boto3_credentials(env))
        client.create_bucket(Bucket=bucket)
        yield client, env
    finally:
        server.stop()


def live_pids_mentioning(text: str) -> list[int]:
    """PIDs of non-zombie processes (other than this one) whose command line contains ``text``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append(int(proc.name))
    return out
