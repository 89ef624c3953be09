"""Registry of model families: name -> ``ModelSpec``; and which packages fill it.

A spec is the whole contract between a family and the engine (in the spirit of torchtitan's
TrainSpec): its config dataclass, the builder, the task it trains with, the dataset kind it
reads, its cost model, its parameter rules and an optional Hugging Face adapter. The engine
looks families up here by ``model.arch``; it never imports them. Which packages register
families is configuration (``plugins`` in a recipe, default the zoo ``models``): a package
outside this repository adds a family by calling ``register_model`` when imported.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from veomni.contract.deprecated import compatible_task
from veomni.contract.hooks import CostModel, ParamRule, SampleWriter, TrainableModel

if TYPE_CHECKING:
    from veomni.tasks.base import Task

DEFAULT_PLUGINS = ("models",)


class HFAdapter(Protocol):
    """Pure name/config mapping between one of our configs and a Hugging Face / diffusers one."""

    hf_model_types: tuple[str, ...]
    """``model_type`` values of ``config.json`` this adapter reads."""

    free_fields: tuple[str, ...]
    """Fields of our config a recipe may set independently of a pretrained folder, because they do
    not change what the loaded weights compute (initialisation scale, context length, input
    budgets, training-only options). ``checkpoint.init`` requires every other field to equal the
    folder's. A field holding a block of options (an omni model's ``llm``) is compared option by
    option, and an option inside it is named by its dotted path (``llm.init_std``)."""

    def config_from_hf(self, hf_config: Any) -> Any: ...

    def config_to_hf(self, cfg: Any) -> Any: ...

    def state_dict_from_hf(self, hf_sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]: ...

    def state_dict_to_hf(self, sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]: ...

    def loaded_name(self, name: str) -> str:
        """The path a folder's weight or module ``name`` has once the library has loaded it (what
        PEFT targets): ``name`` itself, unless the library renames on load (transformers 5 holds
        Qwen2.5-VL's ``model.layers.*`` as ``model.language_model.layers.*``)."""
        ...


def _no_rules(config: Any) -> Sequence[ParamRule]:
    return ()


@dataclass(frozen=True)
class ModelSpec:
    """One model family as the engine sees it."""

    name: str
    config_cls: type
    """Dataclass of the family's options (a recipe's ``model`` section); has ``validate()``."""
    build: Callable[[Any], nn.Module]
    """config -> the plain model (a ``TrainableModel``); called under ``torch.device("meta")``
    to defer memory."""
    task: Callable[[Any], Task]
    """config -> the task the family trains with (``veomni.tasks``)."""
    dataset: str
    """The registered dataset kind it reads (``veomni.data.kinds``); a recipe may override
    it with ``data.kind``."""
    cost: CostModel
    param_rules: Callable[[Any], Sequence[ParamRule]] = _no_rules
    """config -> optimizer rules tried before the engine's default (no decay for 1-D tensors)."""
    hf_adapter: HFAdapter | None = None
    sample_writer: Callable[[Any, Any], SampleWriter] | None = None
    """(model config, data config) -> the writer of validation samples (``train.sample_interval``);
    None for families that have nothing to show but their metrics."""
    blocks_option: str = "num_layers"
    """The option holding the count of the plan's ``blocks`` (dotted into a section: an omni
    model's ``llm.num_layers``); the pipeline memory estimate builds the model with 1 and 2."""

    def instantiate(self, config: Any) -> nn.Module:
        """``build(config)``, checked to be a model the engine can train."""
        model = self.build(config)
        if not isinstance(model, nn.Module) or not isinstance(model, TrainableModel):
            raise TypeError(f"model family {self.name!r}: build() returned {type(model).__name__}, which is not an "
                            "nn.Module with parallel_plan() and init_weights() (veomni.contract.TrainableModel)")
        return model

    def build_task(self, config: Any) -> Task:
        """``task(config)`` as the engine calls it: a task written against the previous release (no
        ``training`` keyword on ``prepare``, no ``output_metrics``) is adapted, with a deprecation
        warning (``veomni/contract/deprecated.py``)."""
        return compatible_task(self.task(config), self.name)


_MODELS: dict[str, ModelSpec] = {}
_ADAPTERS: list[HFAdapter] = []
_LOADED: set[str] = set()


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` (and its HF adapter); a different spec under a taken name is an error."""
    existing = _MODELS.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    _MODELS[spec.name] = spec
    if spec.hf_adapter is not None:
        register_hf_adapter(spec.hf_adapter)
    return spec


def register_hf_adapter(adapter: HFAdapter) -> HFAdapter:
    """Make ``adapter`` the reader of its ``hf_model_types`` (also for components such as a
    vision tower that are not families of their own); re-registering the same one is a no-op."""
    if adapter in _ADAPTERS:
        return adapter
    for other in _ADAPTERS:
        taken = set(other.hf_model_types) & set(adapter.hf_model_types)
        if taken:
            raise ValueError(f"HF model_type(s) {sorted(taken)} already have an adapter")
    _ADAPTERS.append(adapter)
    return adapter


def registered_models() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return _MODELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_MODELS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; known models: {', '.join(registered_models()) or 'none'} "
                         f"(plugins loaded: {', '.join(sorted(_LOADED)) or 'none'})") from None


def hf_adapter_for_model_type(model_type: str) -> HFAdapter:
    """The adapter that reads HF ``model_type`` (e.g. "qwen3")."""
    for adapter in _ADAPTERS:
        if model_type in adapter.hf_model_types:
            return adapter
    known = sorted(t for a in _ADAPTERS for t in a.hf_model_types)
    raise ValueError(f"no registered adapter handles HF model_type {model_type!r}; known: {', '.join(known)}")


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The family whose spec's adapter reads HF ``model_type``."""
    adapter = hf_adapter_for_model_type(model_type)
    for spec in _MODELS.values():
        if spec.hf_adapter is adapter:
            return spec
    raise ValueError(f"HF model_type {model_type!r} is read by a component adapter, not by a model family; "
                     "load it into a sub-module with checkpoint.init")


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
    return config, get_model_spec(name).instantiate(config)


def load_plugins(entries: Sequence[str] = DEFAULT_PLUGINS) -> None:
    """Import the packages that register model families and dataset kinds (once each).

    An entry is a module name importable from ``sys.path`` (``models``, ``my_pkg.families``) or
    the path of a package folder or ``.py`` file (its parent folder joins ``sys.path``, so the
    package's own relative imports work). Raises ImportError saying which entry failed.
    """
    for entry in entries:
        if entry in _LOADED:
            continue
        path = Path(entry)
        try:
            if path.suffix == ".py" or path.is_dir():
                _import_path(path)
            else:
                importlib.import_module(entry)
        except ImportError as exc:
            raise ImportError(f"plugin {entry!r} could not be imported ({exc}); list importable module names or "
                              "package folders under the recipe's 'plugins'") from exc
        _LOADED.add(entry)


def _import_path(path: Path) -> None:
    if not path.exists():
        raise ImportError(f"no such file or folder: {path}")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.import_module(path.stem if path.suffix == ".py" else path.name)
