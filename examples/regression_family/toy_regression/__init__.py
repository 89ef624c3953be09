"""An example model family from outside the engine: a residual-MLP regressor on float rows.

Importing this package registers the ``toy_regressor`` model family and the ``toy_regression``
dataset kind; a recipe loads it with ``model.plugins: [path/to/toy_regression]``. Nothing here
touches ``torch.distributed``: FSDP, checkpoints, resume and metrics come from the engine.
See docs/adding_a_model.md.
"""

from veomni.plugin_api import ModelSpec, register_model

from . import data  # noqa: F401  (registers the toy_regression dataset kind)
from .config import ToyRegressorConfig
from .cost import RegressionCost
from .model import ToyRegressor
from .task import RegressionTask

register_model(ModelSpec(
    name="toy_regressor",
    config_cls=ToyRegressorConfig,
    build=ToyRegressor,
    task=lambda config: RegressionTask(config.input_noise),
    dataset="toy_regression",
    cost=RegressionCost(),
))

__all__ = ["RegressionTask", "ToyRegressor", "ToyRegressorConfig"]
