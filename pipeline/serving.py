"""The logged model as a product: an MLflow ``pyfunc`` model of the whole foveated pipeline.

``foveate train`` logs every model with :func:`pipeline.mlflow_model.log_model` as an MLflow *python function*
model whose input is a table of slide stores and whose output is one ``foveate score`` row per store::

    import mlflow, pandas as pd
    m = mlflow.pyfunc.load_model("models:/foveate-demo@champion")
    m.predict(pd.DataFrame({"store": ["/data/stores/slide-1.zarr"]}))
    #  slide_id status error prediction probability probabilities patches heatmap seconds store model scored_at prob_<c>...

or, served: ``mlflow models serve -m <uri> --env-manager local`` and ``POST /invocations`` with
``{"dataframe_records": [{"store": "/data/stores/slide-1.zarr"}]}``.

Input (:func:`input_schema`): ``store`` (a ``foveate ingest`` store path; required) and ``slide_id`` (optional;
default: the store's folder name without ``.zarr``). Output (:func:`output_schema`): the columns of a
``foveate score`` row (:data:`workers.scoring.ROW_FIELDS`, see :mod:`pipeline.predictions`) plus
``prob_<class>`` per class; ``patches`` holds the K chosen level-0 boxes ``x, y, w, h`` with their ``score``.
A store that cannot be scored (missing, corrupt, incomplete) gives a row with ``status="error"`` and a
one-line ``error``, never an exception: a served model answers every request.

What a served model may open: only stores under its *serve roots* (:func:`serve_roots`). ``$FOVEATE_SERVE_ROOTS``
(read at each request) lists them, separated by commas (or by ``:`` as in ``PATH``; a ``scheme://`` stays whole):
local folders and ``s3://bucket[/prefix]`` prefixes. Unset, the roots are those the model was logged with: the
folder of its training stores (``data.stores``) and of its input example. A store elsewhere, a local path whose
real path (links followed, ``..`` removed) leaves every root, ``file://`` outside them, and every other scheme
(``http://``, ``https://``, ``gs://``, ``memory://``, ...) get an error row naming the roots, before anything is
opened: no request leaves the server for a store it was not configured to read. At most ``$FOVEATE_SERVE_MAX_STORES``
(default :data:`MAX_STORES`) stores per request; a larger request is refused with HTTP 400 (not left to time out).

The model is logged *from code* (``mlflow.models.set_model`` in :mod:`pipeline.serving_entry`), so the
artifact holds no pickled Python object: the weights travel as the foveate checkpoint (a state dict and the
resolved model config, read with ``torch.load(weights_only=True)``), foveate's own packages travel as
``code_paths``, and the requirements are foveate's runtime dependencies as version ranges. Predictions run
the same code as ``foveate score`` (:class:`workers.scoring.ScorerWorker` then
:class:`workers.scoring.ClassifierWorker`), one slide at a time, without Ray.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.exceptions import MlflowException

__all__ = [
    "FoveatePythonModel",
    "input_schema",
    "output_schema",
    "signature",
    "serve_roots",
    "parse_roots",
    "check_store",
    "RequestRefused",
    "CHECKPOINT_ARTIFACT",
    "SERVE_ROOTS_ENV",
    "MAX_STORES_ENV",
    "MAX_STORES",
]

log = logging.getLogger(__name__)

CHECKPOINT_ARTIFACT = "checkpoint"  # key of the checkpoint in the pyfunc model's artifacts
SERVE_ROOTS_ENV = "FOVEATE_SERVE_ROOTS"
MAX_STORES_ENV = "FOVEATE_SERVE_MAX_STORES"
MAX_STORES = 100  # stores per request (default); more is refused with HTTP 400
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ROOT_SCHEMES = ("s3",)


def _split_scheme(location: str) -> tuple[str, str]:
    """``(scheme, rest)`` of a root or store location: a local path (``file://`` dropped) gives ``("", path)``;
    another scheme its lower-cased name and the normalised path after ``://`` without outer slashes."""
    m = _SCHEME.match(location)
    scheme = m.group(1).lower() if m else ""
    if scheme == "file":
        return "", location[len("file://") :]
    if scheme:
        return scheme, posixpath.normpath(location[m.end() :]).strip("/")
    return "", location


class StoreRefused(ValueError):
    """A store outside the serve roots (its row gets this message as its error)."""


class RequestRefused(MlflowException, ValueError):
    """A request the model does not take as a whole (HTTP 400 from ``mlflow models serve``)."""


def _local_root(text: str) -> str:
    return os.path.realpath(os.path.expanduser(text))


def parse_roots(text: str, *, source: str = f"${SERVE_ROOTS_ENV}") -> list[str]:
    """Serve roots from a comma- (or ``:``-) separated list of local folders and ``s3://bucket[/prefix]``.

    Local folders become their real paths; ``file://`` counts as local.

    Raises:
        ValueError: a root of another scheme, a relative local folder, or an ``s3://`` root without a bucket.
    """
    roots = []
    for part in re.split(r",|:(?!//)", text):
        part = part.strip()
        if not part:
            continue
        scheme, rest = _split_scheme(part)
        if scheme:
            if scheme not in _ROOT_SCHEMES:
                raise ValueError(
                    f"{source}: root {part!r} has scheme {scheme!r}; allowed: local folders and "
                    f"{', '.join(s + '://bucket[/prefix]' for s in _ROOT_SCHEMES)}"
                )
            key = rest
            if not key or key == "." or key.startswith(".."):
                raise ValueError(f"{source}: root {part!r} names no bucket (expected s3://bucket[/prefix])")
            roots.append(f"{scheme}://{key}")
        else:
            part = rest
            if not os.path.isabs(os.path.expanduser(part)):
                raise ValueError(f"{source}: root {part!r} is not an absolute folder")
            roots.append(_local_root(part))
    return list(dict.fromkeys(roots))


def serve_roots(logged: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The roots in force: ``$FOVEATE_SERVE_ROOTS`` when set (even empty: then nothing is served), else
    ``logged`` (those recorded when the model was logged)."""
    text = os.environ.get(SERVE_ROOTS_ENV)
    if text is not None:
        return parse_roots(text)
    return parse_roots(",".join(str(r) for r in logged), source="the model's logged serve roots")


def check_store(store: str, roots: list[str]) -> str:
    """The location to open for ``store`` if it lies under one of ``roots`` (a local store: its real path).

    Raises:
        StoreRefused: another scheme, or a location outside every root (nothing was opened or requested).
    """
    where = ", ".join(roots) if roots else "none"
    advice = f"serve roots: {where}; set ${SERVE_ROOTS_ENV} to serve other folders or s3:// prefixes"
    scheme, rest = _split_scheme(store)
    if not scheme:
        store = rest
    if scheme:
        if scheme not in _ROOT_SCHEMES:
            raise StoreRefused(
                f"store {store!r}: scheme {scheme!r} is not served (only local folders and s3:// under the "
                f"serve roots; {advice})"
            )
        key = rest
        loc = f"{scheme}://{key}"
        if ".." not in key.split("/") and any(loc.startswith(r + "/") for r in roots if _SCHEME.match(r)):
            return loc
        raise StoreRefused(f"store {store!r} is outside the serve roots ({advice})")
    if not os.path.isabs(os.path.expanduser(store)):
        raise StoreRefused(f"store {store!r} is not an absolute path ({advice})")
    real = _local_root(store)
    for r in roots:
        if not _SCHEME.match(r) and (real == r or real.startswith(r.rstrip("/") + "/")):
            return real
    raise StoreRefused(f"store {store!r} is outside the serve roots (real path {real!r}; {advice})")


def max_stores() -> int:
    """Stores per request: ``$FOVEATE_SERVE_MAX_STORES`` or :data:`MAX_STORES`.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    raw = os.environ.get(MAX_STORES_ENV, "").strip()
    if not raw:
        return MAX_STORES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"${MAX_STORES_ENV} must be a positive integer (stores per request), got {raw!r}")
    return n


def input_schema():
    """``store`` (string, required) and ``slide_id`` (string, optional)."""
    from mlflow.types import ColSpec, Schema

    return Schema([ColSpec("string", "store"), ColSpec("string", "slide_id", required=False)])


def output_schema(class_names: list[str] | tuple[str, ...]):
    """The columns of a ``foveate score`` row plus ``prob_<class>`` per class."""
    from mlflow.types import ColSpec, Schema
    from mlflow.types.schema import Array, Object, Property

    from pipeline.predictions import prob_column

    box = Object([Property(n, "long") for n in ("x", "y", "w", "h")] + [Property("score", "double")])  # level-0 pixels
    cols = [
        ColSpec("string", "slide_id"),
        ColSpec("string", "status"),
        ColSpec("string", "error", required=False),
        ColSpec("string", "prediction", required=False),
        ColSpec("double", "probability", required=False),
        ColSpec(Object([Property(str(c), "double", required=False) for c in class_names]), "probabilities"),
        ColSpec(Array(box), "patches"),
        ColSpec("string", "heatmap", required=False),
        ColSpec("double", "seconds"),
        ColSpec("string", "store"),
        ColSpec("string", "model"),
        ColSpec("string", "scored_at"),
    ]
    cols += [ColSpec("double", prob_column(str(c)), required=False) for c in class_names]
    return Schema(cols)


def signature(class_names: list[str] | tuple[str, ...]):
    from mlflow.models import ModelSignature

    return ModelSignature(inputs=input_schema(), outputs=output_schema(class_names))


def _slide_id(store: str) -> str:
    name = str(store).rstrip("/").rsplit("/", 1)[-1]  # a local path or an object-storage URL
    return name[: -len(".zarr")] if name.endswith(".zarr") else name


class FoveatePythonModel(mlflow.pyfunc.PythonModel):
    """Slide stores in, ``foveate score`` rows out (see the module docstring).

    The scorer runs on CUDA when there is one (``FOVEATE_DEVICE=cpu`` forces the CPU); patch reading,
    features and aggregation on the CPU, as in ``foveate score``.
    """

    def load_context(self, context) -> None:
        import torch

        from workers.scoring import ClassifierWorker, ScorerWorker

        path = context.artifacts[CHECKPOINT_ARTIFACT]
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        name = str((ckpt.get("metadata") or {}).get("model_name", ""))
        self._scorer = ScorerWorker(ckpt, device=os.environ.get("FOVEATE_DEVICE") or None)
        self._classifier = ClassifierWorker(ckpt, heatmap_dir=None, model_name=name)
        self.class_names = [str(c) for c in self._classifier.class_names]
        self.logged_roots = [str(r) for r in ((getattr(context, "model_config", None) or {}).get("serve_roots") or [])]
        log.info("serve roots: %s", serve_roots(self.logged_roots) or "none")

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """``model_input``: a DataFrame (or list of dicts / dict of lists) with a ``store`` column."""
        from pipeline.predictions import prob_column
        from workers.scoring import ROW_FIELDS, error_row

        df = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if "store" not in df.columns:
            raise ValueError(
                f"input must have a 'store' column (a foveate ingest store path; optional 'slide_id'), "
                f"got columns {list(df.columns)}"
            )
        limit = max_stores()
        if len(df) > limit:
            from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

            raise RequestRefused(
                f"this request names {len(df)} stores; at most {limit} per request (${MAX_STORES_ENV}): "
                "split it into several requests",
                error_code=INVALID_PARAMETER_VALUE,
            )
        roots = serve_roots(getattr(self, "logged_roots", []))
        rows = []
        for rec in df.to_dict(orient="records"):
            store = rec.get("store")
            sid = rec.get("slide_id")
            if not isinstance(store, str) or not store.strip():
                rows.append(error_row(str(sid or ""), str(store), f"store must be a non-empty path, got {store!r}"))
                continue
            sid = sid if isinstance(sid, str) and sid else _slide_id(store)
            try:
                location = check_store(store.strip(), roots)
            except StoreRefused as exc:
                log.warning("%s", exc)
                rows.append(error_row(sid, store, str(exc)))
                continue
            try:
                item = self._scorer.score_one(sid, location)
                row = self._classifier.classify_batch([item])[0]
            except Exception as exc:  # the workers catch per-slide errors; this is the last line of defence
                log.exception("scoring %s failed", store)
                row = error_row(sid, store, f"{type(exc).__name__}: {exc}")
            rows.append(row)
        out = pd.DataFrame(rows, columns=list(ROW_FIELDS))
        for c in self.class_names:
            out[prob_column(c)] = [(r.get("probabilities") or {}).get(c) for r in rows]
        return out
