"""Rewards of online RL (``train.objective: grpo``): Python callables named in the recipe.

``rl.rewards`` lists dotted paths ``package.module.function``; each function takes one completion's
text (decoded without special tokens) and its prompt's metadata (the prompt record's other
fields: e.g. the hidden ``answer``) and returns a float. The rollout sums them, weighted by
``rl.reward_weights``, on the rank that generated the completion; every completion of a prompt
(its group) is generated and scored on one rank, so the group's advantage needs no exchange.

Shipped: ``exact_match`` (1 when the completion, stripped and with runs of whitespace made one
space, equals the metadata's ``answer``) and ``format_match`` (1 when the stripped completion
matches the metadata's ``format`` regular expression in full). The launcher imports every named
reward before any worker starts (``reward_problems``).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from veomni.config.schema import RunConfig

RewardFn = Callable[[str, Mapping[str, Any]], float]


def _normal(text: str) -> str:
    return " ".join(text.split())


def exact_match(completion: str, meta: Mapping[str, Any]) -> float:
    """1.0 when the completion equals ``meta["answer"]`` up to surrounding and repeated whitespace."""
    return float(_normal(completion) == _normal(str(meta["answer"])))


def format_match(completion: str, meta: Mapping[str, Any]) -> float:
    """1.0 when the stripped completion matches the regular expression ``meta["format"]`` in full."""
    return float(re.fullmatch(str(meta["format"]), completion.strip()) is not None)


def load_reward(path: str) -> RewardFn:
    """The callable at dotted ``path`` (``package.module.function``)."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"rl.rewards: {path!r} is not a dotted path package.module.function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"rl.rewards: cannot load {path!r} ({error}); name a function importable on the "
                         "workers' PYTHONPATH, e.g. veomni.objectives.rewards.exact_match") from None
    if not callable(fn):
        raise ValueError(f"rl.rewards: {path!r} is not callable")
    return fn


def reward_problems(cfg: RunConfig) -> list[str]:
    """The launcher's check: every ``rl.rewards`` entry loads."""
    problems = []
    for path in cfg.rl.rewards:
        try:
            load_reward(path)
        except ValueError as error:
            problems.append(str(error))
    if not cfg.rl.rewards:
        problems.append("rl.rewards is empty: name at least one reward function")
    return problems


class Rewards:
    """The run's rewards, summed with their weights."""

    def __init__(self, paths: Sequence[str], weights: Sequence[float] = ()) -> None:
        self.fns = [load_reward(path) for path in paths]
        self.weights = list(weights) or [1.0] * len(self.fns)

    def __call__(self, completions: Sequence[str], metas: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """[N] the weighted sum of every reward of each completion."""
        return torch.tensor([sum(w * float(fn(text, meta)) for fn, w in zip(self.fns, self.weights))
                             for text, meta in zip(completions, metas)], dtype=torch.float32)
