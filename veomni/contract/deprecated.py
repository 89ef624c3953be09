"""The previous release's plug-in API, kept working for one release with a deprecation warning.

A family written against that release (docs/adding_a_model.md before the house refactor) used
three module paths that have moved and a task that lacked two things the engine now calls:

- ``veomni.spec`` (and ``.registry``, ``.hooks``, ``.media``) -> ``veomni.contract``,
  ``veomni.parallel.plan`` -> ``veomni.contract.plan``, ``veomni.data.registry`` ->
  ``veomni.data.kinds``: the old modules are shims whose names are read from the new ones
  (``moved_module``), so every class is the same object under both paths;
- ``Task.prepare`` without the ``training`` keyword, and no ``Task.output_metrics``: the engine
  calls such a task through ``CompatibleTask``, which drops the keyword (the task's augmentation
  then also runs on eval batches, as it did) and reports no metrics beyond the loss from a
  pipeline's last stage (as before).

Each use warns with ``PluginAPIDeprecation`` naming the new place or member; the launcher prints
these (``veomni/launch.py``), as Python hides a ``DeprecationWarning`` raised outside ``__main__``.
CHANGELOG.md lists what is deprecated and when it goes.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from veomni.tasks.base import LossOutput

REMOVAL = "it keeps working for one more release and is then removed (CHANGELOG.md)"


class PluginAPIDeprecation(DeprecationWarning):
    """A plug-in uses a name or a task signature of the previous release."""


def moved_module(old: str, new: str) -> Callable[[str], Any]:
    """Warn that module ``old`` is now ``new`` and return the shim's module ``__getattr__``: every name
    is looked up in ``new``, so ``from old import Name`` gives the very object ``new`` holds."""
    warnings.warn(f"{old} moved to {new}: import from {new} (or veomni.plugin_api); {REMOVAL}",
                  PluginAPIDeprecation, stacklevel=3)  # 3: the module that imported the shim
    module = importlib.import_module(new)

    def __getattr__(name: str) -> Any:
        return getattr(module, name)

    return __getattr__


def _takes_training(prepare: Callable[..., Any]) -> bool:
    parameters = inspect.signature(prepare).parameters
    return "training" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _defined_at(obj: Any) -> tuple[str, int]:
    """Where a warning about ``obj`` (a method, a class) points: its source line, else this module."""
    try:
        return inspect.getsourcefile(obj) or __file__, inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return __file__, 1


def task_deprecations(task: Any) -> list[tuple[str, tuple[str, int]]]:
    """What ``task`` lacks of the current ``Task`` protocol that ``CompatibleTask`` makes up for: each
    message with the place in the family's code it is about."""
    where = f"the task {type(task).__name__}"
    found = []
    if callable(getattr(task, "prepare", None)) and not _takes_training(task.prepare):
        found.append((f"{where}: `prepare(batch, generator)` takes no `training` keyword, so its augmentation "
                      "also runs on eval batches; add `training: bool = True` and skip augmentation when it is "
                      "False", _defined_at(task.prepare)))
    if not callable(getattr(task, "output_metrics", None)):
        found.append((f"{where} has no `output_metrics(output, target)`, so under parallel.pp its eval reports the "
                      "loss only; add it (`{}` when the task has no metrics beyond the loss)", _defined_at(type(task))))
    return found


class CompatibleTask:
    """A previous-release task as the engine calls it; every other member is the task's own."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self._takes_training = _takes_training(task.prepare)

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        if self._takes_training:
            return self.task.prepare(batch, generator, training=training)
        return self.task.prepare(batch, generator)

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        if callable(getattr(self.task, "output_metrics", None)):
            return self.task.output_metrics(output, target)
        return {}

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        return self.task(model, batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


def compatible_task(task: Any, family: str) -> Any:
    """``task`` itself when it is a current one; else, with a ``PluginAPIDeprecation`` per gap, wrapped
    in ``CompatibleTask``."""
    found = task_deprecations(task) if callable(getattr(task, "prepare", None)) else []
    for message, (filename, lineno) in found:
        warnings.warn_explicit(f"model family {family!r}: {message} (docs/adding_a_model.md, section 3); {REMOVAL}",
                               PluginAPIDeprecation, filename, lineno)
    return CompatibleTask(task) if found else task


@contextmanager
def deprecations_said() -> Iterator[None]:
    """Around the launcher's checks: say each use of the previous release's plug-in API once, on
    stderr (Python hides a ``DeprecationWarning`` raised outside ``__main__``). Other warnings pass on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginAPIDeprecation)
        try:
            yield
        finally:
            said = set()
            for warning in caught:
                if not issubclass(warning.category, PluginAPIDeprecation):
                    warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
                elif str(warning.message) not in said:
                    said.add(str(warning.message))
                    print(f"[launch] deprecated: {warning.message} ({warning.filename}:{warning.lineno})",
                          file=sys.stderr)
