"""Load a recipe: YAML file + dotted CLI overrides -> validated ``RunConfig``.

Every problem is reported as a ``ConfigError`` naming the key, where it came from (file and
line, or the CLI flag) and, for unknown keys, the closest valid key. Nothing here touches
torch.distributed, so a bad recipe fails in the launcher before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from veomni.config.schema import ModelConfig, RunConfig

PATH_KEYS = {
    ("data", "train_path"),
    ("data", "eval_path"),
    ("data", "prepare"),
    ("data", "tokenizer"),
    ("train", "output_dir"),
    ("checkpoint", "init_from_hf"),
}
"""Keys holding paths: relative values in a YAML file are resolved against that file's folder,
relative values given on the command line against the current directory."""


class ConfigError(ValueError):
    """A recipe problem the user must fix; the message says what and where."""


@dataclasses.dataclass
class _Value:
    value: Any
    origin: str  # "recipe.yaml:12" or "--train.lr"
    base_dir: Path  # for resolving relative paths


def _closest(key: str, valid: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid keys: {', '.join(prefix + v for v in sorted(valid))}"


def _flatten_yaml(path: Path) -> dict[tuple[str, ...], _Value]:
    """Read YAML keeping the line of every leaf, as {("train", "lr"): _Value}."""
    text = path.read_text()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    out: dict[tuple[str, ...], _Value] = {}
    if root is None:
        return out
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        for key_node, value_node in node.value:
            key = prefix + (str(key_node.value),)
            origin = f"{path}:{key_node.start_mark.line + 1}"
            # Sections and the model block are walked; any other mapping is a leaf value.
            if isinstance(value_node, yaml.MappingNode) and len(key) == 1:
                walk(value_node, key)
            else:
                value = yaml.safe_load(yaml.serialize(value_node))
                out[key] = _Value(value, origin, path.parent.resolve())

    walk(root, ())
    return out


def _parse_overrides(overrides: list[str]) -> dict[tuple[str, ...], _Value]:
    """``["--train.lr", "3e-4", "--log.wandb=true"]`` -> {("train", "lr"): _Value}."""
    out: dict[tuple[str, ...], _Value] = {}
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
        key = tuple(flag[2:].split("."))
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out[key] = _Value(value, flag, Path.cwd())
    return out


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field annotation, converting only where it is lossless."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if origin in (dict, list):
        if not isinstance(value, origin):
            raise ConfigError(f"{where}: expected a {origin.__name__}, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(value)  # YAML 1.1 reads "3e-4" as a string
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if annotation is Any:
        return value
    raise ConfigError(f"{where}: unsupported field type {annotation}")


def _model_field_types(arch: str, where: str) -> dict[str, Any]:
    """Field name -> type of the registered model's config dataclass."""
    from models.registry import get_model_spec  # importing the zoo registers its models

    try:
        spec = get_model_spec(arch)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return typing.get_type_hints(spec.config_cls)


def load_config(recipe: str | os.PathLike, overrides: list[str] | None = None) -> RunConfig:
    """Read, merge and validate a recipe. Raises ``ConfigError`` on any problem."""
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    values = _flatten_yaml(path)
    values.update(_parse_overrides(overrides or []))

    cfg = RunConfig()
    section_types = typing.get_type_hints(RunConfig)
    arch_value = values.get(("model", "arch"))
    arch = arch_value.value if arch_value else ModelConfig().arch
    model_fields = _model_field_types(arch, arch_value.origin if arch_value else "model.arch")

    for key, item in values.items():
        section = key[0]
        if section not in section_types:
            raise ConfigError(f"{item.origin}: unknown section '{section}'{_closest(section, list(section_types))}")
        if len(key) == 1:
            raise ConfigError(f"{item.origin}: section '{section}' must be a mapping of keys")
        name = key[1]
        dotted = ".".join(key)
        if len(key) > 2:
            raise ConfigError(f"{item.origin}: '{dotted}' is nested too deep; sections hold flat keys")
        where = f"{item.origin}: {dotted}"
        if section == "model" and name != "arch":
            if name not in model_fields:
                valid = ["arch", *model_fields]
                raise ConfigError(f"{item.origin}: unknown key '{dotted}' for model arch '{arch}'{_closest(name, valid, 'model.')}")
            cfg.model.options[name] = _coerce(item.value, model_fields[name], where)
            continue
        section_obj = getattr(cfg, section)
        section_hints = typing.get_type_hints(type(section_obj))
        if name not in section_hints:
            raise ConfigError(f"{item.origin}: unknown key '{dotted}'{_closest(name, list(section_hints), section + '.')}")
        value = _coerce(item.value, section_hints[name], where)
        if (section, name) in PATH_KEYS and isinstance(value, str):
            value = str((item.base_dir / os.path.expanduser(value)).resolve())
        setattr(section_obj, name, value)
    for section, name in PATH_KEYS:  # defaults and values never set: relative to the cwd
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value and not os.path.isabs(value):
            setattr(getattr(cfg, section), name, str(Path(value).resolve()))
    _check_ranges(cfg, values)
    return cfg


def _check_ranges(cfg: RunConfig, values: dict[tuple[str, ...], _Value]) -> None:
    """Cross-field and range rules the types alone cannot express."""

    def where(*key: str) -> str:
        item = values.get(key)
        return f"{item.origin}: {'.'.join(key)}" if item else ".".join(key) + " (default)"

    rules = [
        (cfg.train.max_steps >= 1, ("train", "max_steps"), "must be >= 1"),
        (cfg.train.grad_accum >= 1, ("train", "grad_accum"), "must be >= 1"),
        (cfg.train.lr > 0, ("train", "lr"), "must be > 0"),
        (0 <= cfg.train.min_lr_ratio <= 1, ("train", "min_lr_ratio"), "must be in [0, 1]"),
        (cfg.train.warmup_steps >= 0, ("train", "warmup_steps"), "must be >= 0"),
        (cfg.train.max_grad_norm >= 0, ("train", "max_grad_norm"), "must be >= 0 (0 disables clipping)"),
        (cfg.train.eval_batches >= 1, ("train", "eval_batches"), "must be >= 1"),
        (cfg.checkpoint.keep_last >= 1, ("checkpoint", "keep_last"), "must be >= 1"),
        (cfg.checkpoint.interval >= 0, ("checkpoint", "interval"), "must be >= 0 (0 saves at the end only)"),
        (cfg.data.max_seq_len >= 2, ("data", "max_seq_len"), "must be >= 2"),
        (cfg.data.num_workers >= 0, ("data", "num_workers"), "must be >= 0"),
        (0 <= cfg.data.max_bad_fraction <= 1, ("data", "max_bad_fraction"), "must be in [0, 1]"),
        (cfg.data.tokens_per_micro_batch >= cfg.data.max_seq_len, ("data", "tokens_per_micro_batch"),
         (f"({cfg.data.tokens_per_micro_batch}) must be >= data.max_seq_len ({cfg.data.max_seq_len}) "
          "so that every sample fits a micro-batch")),
    ]
    max_positions = cfg.model.options.get("max_position_embeddings")
    if max_positions is not None:
        rules.append((cfg.data.max_seq_len <= max_positions, ("data", "max_seq_len"),
                      f"({cfg.data.max_seq_len}) exceeds model.max_position_embeddings ({max_positions})"))
    for ok, key, message in rules:
        if not ok:
            raise ConfigError(f"{where(*key)} {message}")


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (model options flattened into the model section), for saving."""
    out = dataclasses.asdict(cfg)
    model = out.pop("model")
    out = {"model": {"arch": model["arch"], **model["options"]}, **out}
    for section in out.values():
        for key, value in section.items():
            if isinstance(value, tuple):
                section[key] = list(value)
    return out


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
