"""Entry point of the logged pyfunc model ("models from code", :mod:`pipeline.serving`): MLflow runs this file
when it loads the model; it only names the model class, so the artifact holds no pickled object."""

import mlflow.models

from pipeline.serving import FoveatePythonModel

mlflow.models.set_model(FoveatePythonModel())
