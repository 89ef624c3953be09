"""The contract between the engine and a model family: specs, typed hooks, parameter rules.

Model families (the zoo under ``models/``, or a user's own package) import from here and
register into it; the engine reads the registry and never imports a family. See
docs/design.md, "The model spec".
"""

from veomni.contract.families import (
    HFAdapter,
    ModelSpec,
    build_config,
    build_model,
    get_model_spec,
    hf_adapter_for_model_type,
    load_plugins,
    register_hf_adapter,
    register_model,
    registered_models,
    spec_for_hf_model_type,
)
from veomni.contract.hooks import ConfiguredModule, CostModel, MoEHooks, ParamRule, SampleWriter, TrainableModel

__all__ = [
    "ConfiguredModule",
    "CostModel",
    "HFAdapter",
    "ModelSpec",
    "MoEHooks",
    "ParamRule",
    "SampleWriter",
    "TrainableModel",
    "build_config",
    "build_model",
    "get_model_spec",
    "hf_adapter_for_model_type",
    "load_plugins",
    "register_hf_adapter",
    "register_model",
    "registered_models",
    "spec_for_hf_model_type",
]
