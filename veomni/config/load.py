"""Load a recipe: YAML file + dotted CLI overrides -> validated ``RunConfig``.

Every problem is reported as a ``ConfigError`` naming the key, where it came from (file and
line, or the CLI flag) and, for unknown keys, the closest valid key. Nothing here touches
torch.distributed, so a bad recipe fails in the launcher before any worker starts.

How a flag names a key:

- In the open ``model`` section every dot nests, at any depth:
  ``--model.encoders.image.num_layers 3`` sets ``num_layers`` in ``model: encoders: image:``.
- A closed section (data, parallel, train, checkpoint, log, lora, preference, rl) holds flat fields: ``--train.foo.bar``
  is an unknown key, ``--train.lr.x`` is nested too deep. Only a field typed ``dict`` takes a
  key below it, and everything after the field name is ONE key of that dict, dots included:
  ``--checkpoint.init.encoders.image /p`` sets the key ``"encoders.image"``.
- In YAML (the recipe file, or a block given as a flag's value) the structure is explicit and a
  key is one key, dots included; ``--model.x '{a.b: 1}'`` reaches a model dict key with a dot.

How values combine: the overrides are laid onto the recipe in order, and wherever both sides
hold a mapping they merge key by key, recursively. So ``--model.llm '{hidden_size: 64}'`` changes
one key of the recipe's ``model.llm`` and keeps the others, exactly like
``--model.llm.hidden_size 64``; anything that is not a mapping on both sides (a scalar, a list,
``null``) replaces what was there. Overrides win per leaf.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from veomni.config.hints import suggest
from veomni.config.pretrained import FolderModel, fill_from_folder, read_folder_model
from veomni.config.ranges import check_ranges
from veomni.config.schema import ModelConfig, RunConfig
from veomni.config.types import ConfigError, coerce, dict_entry_type, list_entry_dataclass

PATH_KEYS = {
    ("data", "train_path"),
    ("data", "eval_path"),
    ("data", "prepare"),
    ("data", "tokenizer"),
    ("data", "vae"),
    ("data", "text_encoder"),
    ("train", "output_dir"),
    ("checkpoint", "init_from_hf"),
    ("checkpoint", "prepare"),
    ("lora", "init_from_peft"),
    ("checkpoint", "init"),
}
"""Keys holding paths: relative values in a YAML file are resolved against that file's folder,
relative values given on the command line against the current directory. A field typed ``dict``
listed here holds a path in each of its values (e.g. sub-module -> folder), each resolved by
where that entry was set."""


@dataclasses.dataclass
class _Value:
    """One node of the recipe tree: a leaf value, or a mapping whose ``value`` is ``{key: _Value}``.
    Every node keeps where it was set, so that an error can point at the line or flag to fix."""

    value: Any
    origin: str  # "recipe.yaml:12" or "--train.lr"
    base_dir: Path  # for resolving relative paths

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.value, dict)


def _read_yaml(path: Path) -> _Value:
    """The recipe as a tree: every mapping is walked, so each leaf knows its own line."""
    text = path.read_text()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    base_dir = path.parent.resolve()
    if root is None:
        raise ConfigError(f"{path}: the recipe is empty; it needs at least a model section (model: arch: ...) "
                          "and the data to train on (see docs/configuration.md)")
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    _refuse_duplicate_keys(root, path)

    def convert(node: yaml.Node) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return yaml.safe_load(yaml.serialize(node))
        return {str(key.value): _Value(convert(value), f"{path}:{key.start_mark.line + 1}", base_dir)
                for key, value in node.value}

    return _Value(convert(root), str(path), base_dir)


def _refuse_duplicate_keys(node: yaml.Node, path: Path) -> None:
    """YAML resolves a key given twice in one mapping to its last value, silently: refuse it, in
    every mapping of the file (inside lists too), naming both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            name = str(key.value)
            if name in seen:
                raise ConfigError(f"{path}:{line}: key '{name}' is given twice in one mapping (lines {seen[name]} "
                                  f"and {line}); YAML would silently keep the last one: delete one of them")
            seen[name] = line
            _refuse_duplicate_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path)


def _tree(value: Any, origin: str, base_dir: Path) -> _Value:
    """A plain value (a YAML block from the command line) as a tree whose nodes all share one origin."""
    if isinstance(value, dict):
        value = {str(key): _tree(child, origin, base_dir) for key, child in value.items()}
    return _Value(value, origin, base_dir)


def _flag_path(flag: str) -> tuple[str, ...]:
    """The key a flag sets. In the open ``model`` section every dot nests
    (``--model.encoders.image.num_layers``). A closed section holds flat fields, so after the field
    name the rest is ONE key of that (dict-typed) field, dots included: ``--checkpoint.init.encoders.image``
    -> ``("checkpoint", "init", "encoders.image")``, since such keys name sub-modules."""
    section, _, rest = flag[2:].partition(".")
    path = (section, *(rest.split(".") if section == "model" else rest.split(".", 1)))
    if "" in path:
        raise ConfigError(f"unexpected argument '{flag}': overrides look like --section.key VALUE")
    return path


def _parse_overrides(overrides: list[str]) -> list[tuple[tuple[str, ...], _Value]]:
    """``["--train.lr", "3e-4", "--log.wandb=true"]`` -> [(("train", "lr"), _Value), ...] in order."""
    out: list[tuple[tuple[str, ...], _Value]] = []
    i = 0
    while i < len(overrides):
        flag = overrides[i]
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument '{flag}': overrides look like --section.key VALUE")
        if "=" in flag:
            flag, raw = flag.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"{flag} needs a value")
            raw = overrides[i + 1]
            i += 2
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out.append((_flag_path(flag), _tree(value, flag, Path.cwd())))
    return out


def _merge(base: _Value | None, over: _Value) -> _Value:
    """``over`` laid onto ``base``: two mappings merge key by key, recursively, so keys ``over`` does not
    name keep ``base``'s values; anything else (a leaf on either side) is replaced by ``over``."""
    if base is None or not (base.is_mapping and over.is_mapping):
        return over
    merged = dict(base.value)
    for key, child in over.value.items():
        merged[key] = _merge(merged.get(key), child)
    return _Value(merged, base.origin, base.base_dir)


def _merge_at(root: _Value, path: tuple[str, ...], value: _Value) -> _Value:
    """``root`` with ``value`` merged in at ``path``; mappings missing on the way are created."""
    for key in reversed(path):
        value = _Value({key: value}, value.origin, value.base_dir)
    return _merge(root, value)


def _plain(node: _Value) -> Any:
    if node.is_mapping:
        return {key: _plain(child) for key, child in node.value.items()}
    return node.value


def _origins(node: _Value, prefix: str = "") -> dict[str, str]:
    """Dotted key -> where it was set, for every key of the tree (mappings included)."""
    out: dict[str, str] = {}
    if node.is_mapping:
        for key, child in node.value.items():
            out[prefix + key] = child.origin
            out.update(_origins(child, f"{prefix}{key}."))
    return out


def _load_plugins(plugins: list[str], plugins_where: str) -> None:
    """Import the ``model.plugins`` packages, which register the families. A plugin that does not
    import is blamed on where ``model.plugins`` was set (a recipe line or the command line)."""
    from veomni.contract import load_plugins

    try:
        load_plugins(plugins)
    except ImportError as exc:
        raise ConfigError(f"{plugins_where}: {exc}") from None


def _model_field_types(arch: str, where: str) -> dict[str, Any]:
    """Field name -> type of the registered model's config dataclass (plugins loaded)."""
    from veomni.contract import get_model_spec

    try:
        spec = get_model_spec(arch)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return typing.get_type_hints(spec.config_cls)


def _plugins(node: _Value | None) -> list[str]:
    """``model.plugins``: module names as given, paths (``/`` or ``.py`` inside) resolved against the
    recipe's folder (or the cwd on the command line), like other path keys."""
    if node is None:
        return ModelConfig().plugins
    entries = coerce(_plain(node), list[str], f"{node.origin}: model.plugins")
    return [str((node.base_dir / os.path.expanduser(e)).resolve()) if "/" in e or e.endswith(".py") else e
            for e in entries]


def load_config(recipe: str | os.PathLike, overrides: list[str] | None = None) -> RunConfig:
    """Read, merge and validate a recipe. Raises ``ConfigError`` on any problem."""
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    tree = _read_yaml(path)
    for key, value in _parse_overrides(overrides or []):
        tree = _merge_at(tree, key, value)

    cfg = RunConfig()
    section_types = typing.get_type_hints(RunConfig)
    model_node = _Value({}, str(path), tree.base_dir)
    for section, node in tree.value.items():
        if section not in section_types:
            hint = suggest(section, list(section_types))
            raise ConfigError(f"{node.origin}: unknown section '{section}'{hint}")
        if not node.is_mapping:
            raise ConfigError(f"{node.origin}: section '{section}' must be a mapping of keys")
        if section == "model":
            model_node = node  # filled last: the model section may come from checkpoint.init_from_hf
        else:
            _fill_section(getattr(cfg, section), section, node)
    for section, name in PATH_KEYS:  # defaults and values never set: relative to the cwd
        section_obj = getattr(cfg, section)
        setattr(section_obj, name, _absolute(getattr(section_obj, name)))
    origins = _origins(tree)
    cfg.model.origins = {key: origin for key, origin in origins.items() if key.startswith("model.")}
    folder = _fill_model(cfg.model, model_node, cfg.checkpoint.init_from_hf)
    if folder is not None:
        fill_from_folder(cfg, folder)
    check_ranges(cfg, origins)
    return cfg


def _fill_model(model: ModelConfig, node: _Value, init_from_hf: str | None) -> FolderModel | None:
    """The open section: ``arch`` and ``plugins``, then the registered model's config fields. What a
    ``dict`` field holds (``model.encoders.image``) is the model config's own business: its
    ``validate`` checks it. Returns the ``init_from_hf`` folder's model (``veomni.config.pretrained``),
    whose family is the arch when the recipe names none."""
    arch_node = node.value.get("arch")
    plugins_node = node.value.get("plugins")
    model.plugins = _plugins(plugins_node)
    _load_plugins(model.plugins, plugins_node.origin if plugins_node else "model.plugins (default)")
    folder = read_folder_model(init_from_hf)
    if arch_node is not None:
        model.arch = coerce(arch_node.value, str, f"{arch_node.origin}: model.arch")
    elif folder is not None:
        model.arch = folder.arch
    fields = _model_field_types(model.arch, arch_node.origin if arch_node else "model.arch")
    for name, child in node.value.items():
        if name in ("arch", "plugins"):
            continue
        if name not in fields:
            hint = f"for model arch '{model.arch}'{suggest(name, ['arch', 'plugins', *fields], 'model')}"
            raise ConfigError(f"{child.origin}: unknown key 'model.{name}' {hint}")
        model.options[name] = _build_value(child, fields[name], f"model.{name}")
    return folder


def _fill_section(section_obj: Any, section: str, node: _Value, path_fields: frozenset[str] | None = None) -> None:
    """A closed section (or one entry of a list of dataclasses, ``path_fields`` naming its path
    fields): every key must be one of its dataclass fields."""
    hints = typing.get_type_hints(type(section_obj))
    if path_fields is None:
        path_fields = frozenset(name for key, name in PATH_KEYS if key == section)
    for name, child in node.value.items():
        if name not in hints:
            hint = suggest(name, list(hints), section)
            raise ConfigError(f"{child.origin}: unknown key '{section}.{name}'{hint}")
        setattr(section_obj, name, _build_value(child, hints[name], f"{section}.{name}", name in path_fields))


def _build_value(node: _Value, annotation: Any, dotted: str, is_path: bool = False) -> Any:
    """The plain value of ``node`` checked against ``annotation``. A mapping given to a ``dict`` field
    is checked entry by entry, so that a wrong entry names its own line or flag and a path entry
    resolves against its own folder; a mapping given to any other field is an error."""
    entry_type = dict_entry_type(annotation)
    if node.is_mapping and entry_type is not None:
        return {key: _build_value(child, entry_type, f"{dotted}.{key}", is_path)
                for key, child in node.value.items()}
    if node.is_mapping and node.value and annotation is not Any:
        key, child = next(iter(node.value.items()))
        raise ConfigError(f"{child.origin}: '{dotted}.{key}' is nested too deep: '{dotted}' takes one value, "
                          "not a mapping of keys")
    entry_cls = list_entry_dataclass(annotation)
    if entry_cls is not None:
        return [_build_entry(entry, entry_cls, f"{dotted}[{index}]", node)
                for index, entry in enumerate(coerce(_plain(node), list[Any], f"{node.origin}: {dotted}"))]
    value = coerce(_plain(node), annotation, f"{node.origin}: {dotted}")
    if is_path and isinstance(value, str) and value:  # empty: unset (as _absolute keeps it), not the file's folder
        value = str((node.base_dir / os.path.expanduser(value)).resolve())
    return value


ENTRY_PATH_FIELDS = frozenset({"path", "prepare"})
"""Fields of a list entry (``data.sources[i]``) holding paths, resolved against where the list was written."""


def _build_entry(entry: Any, cls: type, dotted: str, node: _Value) -> Any:
    """One mapping of a list of dataclass entries (``data.sources``), checked like a closed section."""
    if not isinstance(entry, dict):
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{node.origin}: {dotted} must be a mapping of {names}, got {entry!r}")
    built = cls()
    _fill_section(built, dotted, _tree(entry, node.origin, node.base_dir), ENTRY_PATH_FIELDS)
    return built


def _absolute(value: Any) -> Any:
    """A path field's value (or each value of a dict of paths) made absolute against the cwd."""
    if isinstance(value, dict):
        return {key: _absolute(item) for key, item in value.items()}
    if isinstance(value, str) and value and not os.path.isabs(value):
        return str(Path(value).resolve())
    return value


def locate_model_error(cfg: RunConfig, error: Exception) -> str:
    """An error from the model config's own validation, prefixed with where the keys it names were set.

    The loader cannot check what a model's ``dict`` fields hold (``model.encoders.image`` takes the
    modality's config fields), so a mistake there surfaces when the model is built. Its message names
    the key as a dotted path (``model.encoders.image.out_hidden_size (96) must equal ...``) or as
    ``'num_layer' in model.encoders.image``: the most specific recipe key it names gives the file:line
    or flag. A model config's own fields are named bare (``num_heads (8) must be a multiple of
    num_kv_heads (3)``): every one the recipe set is located, in the order the message names them.
    A message naming no key the recipe set is only prefixed with ``model``."""
    message = str(error)
    for key in sorted(cfg.model.origins, key=len, reverse=True):
        parent, _, name = key.rpartition(".")
        if re.search(rf"({re.escape(key)}|'{re.escape(name)}' in {re.escape(parent)})(?!\.?\w)", message):
            return f"{cfg.model.origins[key]}: {message}"
    named = {}
    for key, origin in cfg.model.origins.items():
        name = key.removeprefix("model.")
        found = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", message) if "." not in name else None
        if found:
            named[found.start()] = origin
    if not named:
        return f"model: {message}"
    where = ", ".join(dict.fromkeys(named[position] for position in sorted(named)))
    return f"{where}: model.{message}" if 0 in named else f"{where}: model: {message}"


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (model options flattened into the model section; ``plugins`` only when not
    the default zoo), for saving."""
    out = dataclasses.asdict(cfg)
    model = out.pop("model")
    plugins = {"plugins": model["plugins"]} if model["plugins"] != ModelConfig().plugins else {}
    out = {"model": {"arch": model["arch"], **plugins, **model["options"]}, **out}
    for section in out.values():
        for key, value in section.items():
            if isinstance(value, tuple):
                section[key] = list(value)
    return out


def dump_config(cfg: RunConfig | dict[str, Any]) -> str:
    """The YAML of ``cfg`` (or of its ``config_to_dict``, when the caller has it already)."""
    return yaml.safe_dump(cfg if isinstance(cfg, dict) else config_to_dict(cfg), sort_keys=False)
