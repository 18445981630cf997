"""One-line reasons for object storage that cannot be used: wrong credentials, a dead endpoint, a missing bucket.

s3fs answers "does this bucket exist?" with False for a refused signature and for an endpoint that does not
answer alike, so ``foveate ingest --out s3://...`` used to say "bucket does not exist" for an authentication
failure. :func:`check_bucket` lists the bucket once (one attempt, short timeouts) and tells the three apart;
:func:`describe_failure` turns an exception of any listing or read into a line that names the bucket, the endpoint
and where the credentials came from (never the secret itself).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from workers import storage

__all__ = [
    "check_bucket",
    "check_location",
    "describe_failure",
    "credential_source",
    "endpoint_of",
    "is_access_failure",
]

log = logging.getLogger(__name__)

_CHECK_CONFIG = {"connect_timeout": 5, "read_timeout": 20, "retries": {"max_attempts": 1}}


def endpoint_of(url: str) -> str:
    """The endpoint ``url`` is reached through (``$AWS_ENDPOINT_URL``... or the provider's default)."""
    opts = storage.storage_options(url)
    ep = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
    if ep:
        return str(ep)
    return "AWS's default S3 endpoint" if storage.normalize(url).startswith(("s3://", "s3a://")) else "its default"


def credential_source(url: str) -> str:
    """Where the credentials for ``url`` come from, in words (no secret is shown)."""
    opts = storage.storage_options(url)
    if opts.get("anon"):
        return f"anonymous access (anon in ${storage.STORAGE_OPTIONS_ENV})"
    if opts.get("key") or opts.get("secret"):
        return f"the key in ${storage.STORAGE_OPTIONS_ENV}"
    if opts.get("profile"):
        return f"profile {opts['profile']!r} of ${storage.STORAGE_OPTIONS_ENV}"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        key = os.environ["AWS_ACCESS_KEY_ID"]
        return f"AWS_ACCESS_KEY_ID from the environment ({key[:4]}…)"
    if os.environ.get("AWS_PROFILE"):
        return f"profile {os.environ['AWS_PROFILE']!r} (AWS_PROFILE) of ~/.aws"
    return "no credentials in the environment (AWS_ACCESS_KEY_ID unset: botocore's default chain, ~/.aws or instance metadata)"


def _bucket(url: str) -> str:
    return storage.normalize(url).split("://", 1)[1].split("/", 1)[0]


def _kind(exc: BaseException) -> str:
    """``"auth"``, ``"missing"``, ``"unreachable"`` or ``"other"``."""
    names = {type(e).__name__ for e in _chain(exc)}
    text = " ".join(str(e) for e in _chain(exc))
    if isinstance(exc, PermissionError) or names & {"NoCredentialsError", "PartialCredentialsError"}:
        return "auth"
    if any(s in text for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken")):
        return "auth"
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:
        return "missing"
    if names & {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ClientConnectorError",
        "ConnectionRefusedError",
        "ConnectionError",
        "ServerDisconnectedError",
        "gaierror",
        "TimeoutError",
    }:
        return "unreachable"
    return "other"


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def is_access_failure(exc: BaseException) -> bool:
    """True for refused credentials and for an endpoint that does not answer."""
    return _kind(exc) in ("auth", "unreachable")


def describe_failure(url: str, exc: BaseException, *, what: str) -> str:
    """One line: ``what`` (e.g. ``--out 's3://b/x'``) could not be used, why, naming bucket, endpoint and
    credential source."""
    bucket, endpoint = _bucket(url), endpoint_of(url)
    detail = " ".join(str(exc).split())[:200] or type(exc).__name__
    kind = _kind(exc)
    if kind == "auth":
        return (
            f"{what}: bucket {bucket!r} at {endpoint} refused the credentials ({detail}); credentials used: "
            f"{credential_source(url)}"
        )
    if kind == "unreachable":
        return (
            f"{what}: cannot reach the endpoint {endpoint} for bucket {bucket!r} ({type(exc).__name__}: {detail}); "
            f"check AWS_ENDPOINT_URL and the network (credentials: {credential_source(url)})"
        )
    if kind == "missing":
        return f"{what}: bucket {bucket!r} does not exist at {endpoint} (create it first)"
    return (
        f"{what}: bucket {bucket!r} at {endpoint} failed ({type(exc).__name__}: {detail}); credentials: "
        f"{credential_source(url)}"
    )


def check_bucket(url: str, *, what: str) -> None:
    """List the bucket of ``url`` once (one attempt, short timeouts).

    Raises:
        ValueError: one line from :func:`describe_failure` (auth refused, endpoint unreachable, no such bucket).
    """
    url = storage.normalize(url)
    bucket = _bucket(url)
    try:
        fs = _check_filesystem(url)
        fs.ls(bucket, refresh=True)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(describe_failure(url, exc, what=what)) from exc


def check_location(url: str, *, what: str) -> None:
    """List the folder/prefix ``url`` once (one attempt, short timeouts), so that a command reading or writing
    under it fails at once with one line instead of a traceback after its retries. A prefix that does not exist
    yet is fine when its bucket exists (then the bucket is listed to tell a missing bucket apart).

    Raises:
        ValueError: one line from :func:`describe_failure` (auth refused, endpoint unreachable, no such bucket).
    """
    url = storage.normalize(url)
    try:
        fs = _check_filesystem(url)
        fs.ls(url.split("://", 1)[1].rstrip("/"), refresh=True)
    except FileNotFoundError:
        check_bucket(url, what=what)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(describe_failure(url, exc, what=what)) from exc


def _check_filesystem(url: str) -> Any:
    import fsspec

    opts = dict(storage.storage_options(url))
    protocol = url.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        opts["config_kwargs"] = {**_CHECK_CONFIG, **(opts.get("config_kwargs") or {})}
        opts["skip_instance_cache"] = True
    return fsspec.filesystem(protocol, **opts)
