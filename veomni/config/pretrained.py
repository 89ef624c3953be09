"""The model section read from ``checkpoint.init_from_hf``, as ``from_pretrained`` users expect.

A recipe that starts from a Hugging Face / diffusers folder need not restate its ``config.json``
under our names: the family's adapter (the same mapping the launch-time comparison and the weight
import use, ``veomni.contract.hf_folder``) turns the folder's config into ours, and every model
option the recipe does not set is taken from it. Recipe keys then override, leaf by leaf inside
blocks (an omni model's ``llm``), and the launcher still compares the result with the folder, so an
override that would break loading (another width, another rope) is refused, one that does not (a
free field such as ``max_position_embeddings``) is kept. ``model.arch`` may be left out: the family
whose adapter reads the folder's ``model_type`` / ``_class_name`` is taken. A folder that also holds
a tokenizer is ``data.tokenizer`` when the recipe names none.

Nothing is filled when the key is unset, the folder is absent (the launcher names it; one that
``checkpoint.prepare`` builds is read after the build), it holds safetensors in our own names, or no
family reads it (the launcher's ``checkpoint.init_from_hf`` check then says why); a recipe ``arch``
of another family is left to that check too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veomni.config.schema import RunConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A folder holding either of these is loadable by ``AutoTokenizer.from_pretrained``."""


@dataclass(frozen=True)
class FolderModel:
    """What a whole-model folder says about the model section."""

    config_file: Path
    arch: str
    """The registered family whose adapter reads the folder."""
    config_cls: type
    options: dict[str, Any]
    """Every field of our config, as plain YAML values (lists, not tuples)."""
    has_tokenizer: bool


def read_folder_model(folder: str | None) -> FolderModel | None:
    """The folder's model, or None when there is nothing to fill from (see the module docstring)."""
    from veomni.contract import spec_for_hf_model_type
    from veomni.contract.hf_folder import CONFIG_FILE, read_config_json, read_hf_config

    if not folder or not (Path(folder) / CONFIG_FILE).is_file():
        return None
    path = Path(folder)
    try:
        spec = spec_for_hf_model_type(read_config_json(path)[0])
        _, config = read_hf_config(path)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # the launcher's check of checkpoint.init_from_hf reports it with its key
    options = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    return FolderModel(path / CONFIG_FILE, spec.name, type(config), options,
                       any((path / name).is_file() for name in TOKENIZER_FILES))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _under(folder_value: Any, recipe_value: Any) -> Any:
    """``recipe_value`` laid over ``folder_value``: two mappings merge key by key, recursively."""
    if isinstance(folder_value, dict) and isinstance(recipe_value, dict):
        return {**folder_value, **{key: _under(folder_value.get(key), value) for key, value in recipe_value.items()}}
    return recipe_value


def _leaf_origins(value: Any, key: str, origin: str, origins: dict[str, str]) -> None:
    """Mark ``key`` (and every key inside a block) as set by ``origin`` where nothing else set it."""
    origins.setdefault(key, origin)
    if isinstance(value, dict):
        for name, item in value.items():
            _leaf_origins(item, f"{key}.{name}", origin, origins)


def fill_from_folder(cfg: RunConfig, folder: FolderModel) -> None:
    """The folder's options under the recipe's (when the recipe's family is the folder's), and its
    tokenizer as ``data.tokenizer`` when unset. Options taken from the folder are located at its
    ``config.json`` (``ModelConfig.origins``), so a model error about them points there."""
    from veomni.contract import get_model_spec

    if not cfg.data.tokenizer and folder.has_tokenizer:
        cfg.data.tokenizer = str(folder.config_file.parent)
    if get_model_spec(cfg.model.arch).config_cls is not folder.config_cls:
        return
    recipe = cfg.model.options
    cfg.model.options = {name: _under(value, recipe[name]) if name in recipe else value
                         for name, value in folder.options.items()}
    for name, value in folder.options.items():
        _leaf_origins(value, f"model.{name}", str(folder.config_file), cfg.model.origins)


def folder_keys(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """``(model keys taken from the init_from_hf folder, model keys the recipe sets)`` at top level,
    for the launcher's line saying where the model section came from."""
    from veomni.contract.hf_folder import CONFIG_FILE

    config_file = str(Path(cfg.checkpoint.init_from_hf or "") / CONFIG_FILE)
    top = {key.removeprefix("model."): origin for key, origin in cfg.model.origins.items() if key.count(".") == 1}
    from_folder = [key for key in cfg.model.options if top.get(key) == config_file]
    return from_folder, [key for key in top if top[key] != config_file]
