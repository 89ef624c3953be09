"""Registry of model architectures: name -> config dataclass, module class, HF adapter.

Recipes name a model by ``model.arch`` and pass ``model.options`` as config fields; HF folders
are matched to an architecture by their ``model_type``. Importing ``models`` registers the zoo.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn


class HFAdapter(Protocol):
    """Pure name/config mapping between one of our architectures and HF transformers."""

    hf_model_types: tuple[str, ...]

    def config_from_hf(self, hf_config: Any) -> Any: ...

    def config_to_hf(self, cfg: Any) -> Any: ...

    def state_dict_from_hf(self, hf_sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]: ...

    def state_dict_to_hf(self, sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: its config dataclass, the module built from it, an optional HF adapter."""

    name: str
    config_cls: type
    model_cls: type[nn.Module]
    hf_adapter: HFAdapter | None = None


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec``; registering a different spec under a taken name is an error."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def registered_models() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(registered_models())}") from None


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The spec whose HF adapter handles HF ``model_type`` (e.g. "qwen3")."""
    for spec in _REGISTRY.values():
        if spec.hf_adapter is not None and model_type in spec.hf_adapter.hf_model_types:
            return spec
    known = sorted(t for s in _REGISTRY.values() if s.hf_adapter for t in s.hf_adapter.hf_model_types)
    raise ValueError(f"no registered model handles HF model_type {model_type!r}; known: {', '.join(known)}")


def build_config(name: str, options: Mapping[str, Any]) -> Any:
    """The validated config of model ``name`` from ``options``; unknown keys name the closest one."""
    spec = get_model_spec(name)
    fields = [f.name for f in dataclasses.fields(spec.config_cls)]
    for key in options:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(fields)}"
            raise ValueError(f"unknown option {key!r} for model {name!r}{hint}")
    config = spec.config_cls(**options)
    config.validate()
    return config


def build_model(name: str, options: Mapping[str, Any]) -> tuple[Any, nn.Module]:
    """``(config, model)`` for model ``name``; build under ``torch.device("meta")`` to defer memory."""
    config = build_config(name, options)
    return config, get_model_spec(name).model_cls(config)
