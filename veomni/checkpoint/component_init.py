"""Initialise named sub-modules from local pretrained folders (``checkpoint.init``).

Real multimodal runs start from pretrained parts: a VLM from a pretrained LLM and a pretrained
vision tower, later a VAE or a text encoder. ``checkpoint.init`` maps a sub-module path of the model
(``llm``, ``encoders.image``) to a local folder; ``checkpoint.init_from_hf`` is the entry of the
whole model (path ``""``). A folder is either

- a Hugging Face / diffusers folder: the adapter registered for its ``config.json`` type
  (``veomni.contract.hf_adapter_for_model_type``) maps its config and weight names to ours, and its
  config must equal the sub-module's own (``ConfiguredModule.config``; the adapter's
  ``free_fields`` aside), or the load is refused naming each field that differs; or
- ``*.safetensors`` already in our parameter names (nothing to compare).

Loading is strict. The launcher runs the same checks before any worker starts, from
``config.json`` alone (``check_init``), and refuses a frozen part that nothing loads
(``frozen_problems``): it would train nothing and stay random. The trainer loads into rank 0's
full CPU copy after the seeded init (``load_components``), only when not resuming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veomni.checkpoint.hf_io import CONFIG_FILE, read_hf_config, read_safetensors
from veomni.config.schema import CheckpointConfig
from veomni.contract import ConfiguredModule, HFAdapter
from veomni.errors import BadCheckpoint, BadConfig, MissingInput

WHOLE_MODEL = ""
_LISTED = 8  # names shown of a long list of parameters


def init_entries(cfg: CheckpointConfig) -> dict[str, str]:
    """Sub-module path -> folder: ``init_from_hf`` as the whole model's entry, then ``init``, enclosing
    modules before the ones inside them (a nested entry overrides its part of an enclosing one)."""
    if cfg.init_from_hf and WHOLE_MODEL in cfg.init:
        raise BadConfig("checkpoint.init_from_hf and checkpoint.init[''] both name the whole model: "
                        "keep one")
    entries = {WHOLE_MODEL: cfg.init_from_hf, **cfg.init} if cfg.init_from_hf else dict(cfg.init)
    return dict(sorted(entries.items(), key=lambda item: (item[0] != WHOLE_MODEL, item[0].count("."))))


def _key(path: str) -> str:
    return "checkpoint.init_from_hf" if path == WHOLE_MODEL else f"checkpoint.init.{path}"


def _label(path: str) -> str:
    return "the model" if path == WHOLE_MODEL else f"'{path}'"


def component_paths(model: nn.Module) -> list[str]:
    """What a ``checkpoint.init`` key usually names: the model's direct children, a ``ModuleDict``
    child listed by its entries (``encoders.image``)."""
    paths = []
    for name, child in model.named_children():
        paths += [f"{name}.{key}" for key in child] if isinstance(child, nn.ModuleDict) else [name]
    return paths


def find_component(model: nn.Module, path: str) -> nn.Module:
    """The sub-module at ``path``; ValueError listing the model's components otherwise."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        components = ", ".join(component_paths(model))
        raise BadConfig(f"{_key(path)}: the model has no sub-module '{path}'; its components: {components} "
                        "(or any sub-module path inside them)") from None


@dataclass(frozen=True)
class PretrainedFolder:
    """One folder, read as far as its config: the weights are read only by ``state_dict``."""

    path: Path
    adapter: HFAdapter | None
    """The adapter of its ``config.json`` type; None for safetensors in our own names."""
    config: Any
    """Our config dataclass, from ``config.json`` (None without an adapter)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = read_safetensors(self.path)
        return tensors if self.adapter is None else self.adapter.state_dict_from_hf(tensors, self.config)

    def describe(self) -> str:
        if self.adapter is None:
            return f"{self.path} (safetensors in our parameter names)"
        return f"{self.path} (Hugging Face folder, {type(self.config).__name__})"


def read_folder(path: str | Path) -> PretrainedFolder:
    """A folder of ``checkpoint.init`` with its config (no weights read); FileNotFoundError or
    ValueError saying what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        raise MissingInput(f"{folder} does not exist or is not a folder")
    if (folder / CONFIG_FILE).is_file():
        adapter, config = read_hf_config(folder)
        return PretrainedFolder(folder, adapter, config)
    if not any(folder.glob("*.safetensors")):
        raise MissingInput(f"{folder} holds neither a {CONFIG_FILE} (a Hugging Face / diffusers folder) "
                           "nor *.safetensors (weights in our own parameter names)")
    return PretrainedFolder(folder, None, None)


def config_problems(path: str, module: nn.Module, folder: PretrainedFolder) -> list[str]:
    """Why ``folder``'s config does not fit ``module`` (empty when it does, or has no config)."""
    if folder.adapter is None:
        return []
    where = f"{_key(path)}: {folder.path}"
    if not isinstance(module, ConfiguredModule):
        return [f"{where} is a Hugging Face folder, but {_label(path)} ({type(module).__name__}) keeps no "
                "config to check it against; load it from safetensors in our parameter names instead"]
    ours, theirs = module.config, folder.config
    if type(ours) is not type(theirs):
        return [f"{where} holds a {type(theirs).__name__} model, but {_label(path)} is built from a "
                f"{type(ours).__name__}: point it at a folder of that kind, or the key at the matching "
                "sub-module"]
    free = folder.adapter.free_fields
    compared = [(name, mine, folders) for f in dataclasses.fields(theirs)
                for name, mine, folders in _options(getattr(ours, f.name), getattr(theirs, f.name), f.name)
                if not any(name == field or name.startswith(field + ".") for field in free)]
    derived = {id(config): _derived(folder.adapter, config) for config in (ours, theirs)}

    def same_derived(name: str) -> bool:
        """Both sides derive the same value, and each states it or leaves it unset (None): a value
        the round trip loses (``capacity_factor``, which Hugging Face cannot state) still differs."""
        values = [(_at(config, name), _at(derived[id(config)], name)) for config in (ours, theirs)]
        return _same(values[0][1], values[1][1]) and all(given is None or _same(given, value)
                                                         for given, value in values)

    differences = [f"{name}: recipe {mine!r}, folder {folders!r}"
                   for name, mine, folders in compared if not _same(mine, folders) and not same_derived(name)]
    if not differences:
        return []
    return [f"{where} does not fit the recipe's {_label(path)} ({type(ours).__name__}): "
            f"{'; '.join(differences)}. Set the recipe's model config to the folder's {CONFIG_FILE}, or "
            "point at a folder that matches"]


def _options(ours: Any, theirs: Any, name: str):
    """``(dotted name, ours, theirs)`` of one config field, descending into blocks of options both
    sides hold as mappings (an omni model's ``llm`` and ``encoders``), so that a difference is named
    ``llm.hidden_size`` and an adapter's ``free_fields`` may name an option inside a block."""
    if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
        for key in dict.fromkeys([*ours, *theirs]):
            yield from _options(ours.get(key), theirs.get(key), f"{name}.{key}")
    else:
        yield name, ours, theirs


def _at(config: Any, name: str) -> Any:
    """The option at dotted ``name`` of ``config`` (None where a block lacks it)."""
    field, *keys = name.split(".")
    value = getattr(config, field)
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal, a list comparing equal to the tuple of its items (a YAML list against a default tuple)."""
    def canonical(value: Any) -> Any:
        return tuple(canonical(v) for v in value) if isinstance(value, (list, tuple)) else value

    return canonical(a) == canonical(b)


def _derived(adapter: Any, config: Any) -> Any:
    """``config`` as the folder would state it: through the adapter to Hugging Face's config and back,
    so that a value left to be derived (Qwen2's ``head_dim``: hidden size / heads) and the same value
    written out compare equal; ``config`` itself when the adapter cannot write it."""
    try:
        return adapter.config_from_hf(adapter.config_to_hf(config))
    except (ValueError, TypeError, KeyError, AttributeError):
        return config


def check_init(model: nn.Module, entries: Mapping[str, str]) -> list[str]:
    """What is wrong with each of ``entries`` for ``model`` (a meta copy will do: only configs are
    read): a path the model lacks, a folder that is missing or unreadable, or whose config differs."""
    problems = []
    for path, folder_path in entries.items():
        try:
            module = find_component(model, path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if not Path(folder_path).exists():
            problems.append(f"{_key(path)}: folder does not exist: {folder_path}")
            continue
        try:
            folder = read_folder(folder_path)
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"{_key(path)}: {exc}")
            continue
        problems += config_problems(path, module, folder)
    return problems


def unloaded_frozen(model: nn.Module, loaded: list[str]) -> list[str]:
    """The outermost sub-modules (or lone parameters) whose parameters are all frozen
    (``requires_grad=False``) and that no path in ``loaded`` covers."""
    params = dict(model.named_parameters())
    frozen = {name for name, param in params.items() if not param.requires_grad}

    def inside(name: str, prefix: str) -> bool:
        return prefix == WHOLE_MODEL or name == prefix or name.startswith(prefix + ".")

    found: list[str] = []
    for name in sorted(frozen):
        if any(inside(name, prefix) for prefix in [*loaded, *found]):
            continue
        parts = name.split(".")
        prefixes = (".".join(parts[:depth]) for depth in range(1, len(parts)))
        found.append(next((prefix for prefix in prefixes
                           if all(n in frozen for n in params if inside(n, prefix))), name))
    return found


def frozen_problems(model: nn.Module, entries: Mapping[str, str]) -> list[str]:
    """A frozen part that no entry loads trains nothing and stays at its random init: refuse it."""
    return [f"'{part}' is frozen (its parameters have requires_grad=False) but nothing loads it: a frozen "
            f"component that was never loaded trains nothing. Add checkpoint.init.{part}: "
            "/path/to/pretrained (or an entry for a module around it), or stop freezing it (e.g. remove it "
            "from model.freeze)"
            for part in unloaded_frozen(model, list(entries))]


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return (", ".join(names[:_LISTED]) + more) or "none"


def load_components(model: nn.Module, entries: Mapping[str, str],
                    added: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Load each entry's folder into its sub-module of ``model`` (rank 0's full copy), strictly;
    returns one log line per entry. Raises ValueError on a mismatching config or parameter set.
    ``added`` tells the names no pretrained folder holds (LoRA adapters): they keep their values."""
    lines = []
    for path, folder_path in entries.items():
        module = find_component(model, path)
        folder = read_folder(folder_path)
        problems = config_problems(path, module, folder)
        if problems:
            raise BadCheckpoint("\n".join(problems))
        state = folder.state_dict()
        expected = {name for name in module.state_dict() if not added(name)}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise BadCheckpoint(f"{_key(path)}: {folder.path} does not hold the parameters of {_label(path)}: "
                                f"missing {_listed(missing)}; unexpected {_listed(unexpected)}")
        module.load_state_dict(state, strict=not any(added(name) for name in module.state_dict()))
        lines.append(f"{_label(path)} initialised from {folder.describe()}")
    return lines
