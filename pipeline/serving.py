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
from typing import Any

import mlflow.pyfunc
import pandas as pd

__all__ = ["FoveatePythonModel", "input_schema", "output_schema", "signature", "CHECKPOINT_ARTIFACT"]

log = logging.getLogger(__name__)

CHECKPOINT_ARTIFACT = "checkpoint"  # key of the checkpoint in the pyfunc model's artifacts


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
        rows = []
        for rec in df.to_dict(orient="records"):
            store = rec.get("store")
            sid = rec.get("slide_id")
            if not isinstance(store, str) or not store.strip():
                rows.append(error_row(str(sid or ""), str(store), f"store must be a non-empty path, got {store!r}"))
                continue
            sid = sid if isinstance(sid, str) and sid else _slide_id(store)
            try:
                item = self._scorer.score_one(sid, store)
                row = self._classifier.classify_batch([item])[0]
            except Exception as exc:  # the workers catch per-slide errors; this is the last line of defence
                log.exception("scoring %s failed", store)
                row = error_row(sid, store, f"{type(exc).__name__}: {exc}")
            rows.append(row)
        out = pd.DataFrame(rows, columns=list(ROW_FIELDS))
        for c in self.class_names:
            out[prob_column(c)] = [(r.get("probabilities") or {}).get(c) for r in rows]
        return out
