"""Values of a recipe checked against the schema's type annotations.

``coerce`` converts only where it is lossless (an int where a float is expected, YAML 1.1's
"3e-4" string for a float) and otherwise raises ``ConfigError`` naming where the value came
from; kept apart from the loader, which decides *where* values go. A float must be finite: no key
gives ``.nan`` or ``.inf`` a meaning, and a non-finite value passes every range check silently
(``.nan < 0`` is false) to do something else than asked (a source of weight ``.inf`` is never drawn).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from veomni.errors import BadConfig


class ConfigError(BadConfig):
    """A recipe problem the user must fix; the message says what and where."""


def coerce(value: Any, annotation: Any, where: str) -> Any:
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
                return coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(coerce(v, args[0], where) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, where) for v, a in zip(value, args))
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
        try:
            number = float(value)  # YAML 1.1 reads "3e-4" as a string
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if annotation is Any:
        return value
    raise ConfigError(f"{where}: unsupported field type {annotation}")


def dict_entry_type(annotation: Any) -> Any:
    """``V`` of a ``dict[K, V]`` annotation, also inside ``X | None``; None for any other type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((t for t in map(dict_entry_type, typing.get_args(annotation)) if t is not None), None)
    if typing.get_origin(annotation) is dict:
        return typing.get_args(annotation)[1]
    return None


def list_entry_dataclass(annotation: Any) -> type | None:
    """``C`` of a ``list[C]`` annotation whose entries are a dataclass (``data.sources``); None otherwise."""
    if typing.get_origin(annotation) is list:
        (entry,) = typing.get_args(annotation)
        if dataclasses.is_dataclass(entry):
            return entry
    return None
