"""The rollout engine seat and the rows a rollout trains on.

A ``RolloutEngine`` takes token prompts and sampling settings (``veomni.generation.SamplingParams``)
and gives, per prompt, a ``veomni.generation.Completion``: the sampled tokens and each token's
log-probability under the generating weights (log-softmax at temperature 1); ``sync_weights`` is
called after every policy update, before the next rollout, so an engine that holds its own copy of
the weights (an external server) takes the trained ones, and ``release`` after the rollout, so it
can free its device memory while the policy trains. Engines are picked by ``rl.rollout_engine``
(``rollout_engines.py``).

The built-in ``PolicyEngine`` generates with the trained model itself, in the training processes,
through ``veomni.generation`` (batched, with a KV cache): its weights *are* the trained weights
(nothing to push). Under FSDP every rank must run the same number of forward passes (each gathers
the sharded weights), so ranks decode in lock step until every rank's sequences are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from veomni.data.packing import pack_with_targets
from veomni.generation import Completion, SamplingParams, generate
from veomni.objectives.grpo import ADVANTAGES

__all__ = ["Completion", "PolicyEngine", "RolloutEngine", "SamplingParams", "pack_rollouts"]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def sync_weights(self, model: nn.Module) -> None: ...

    def release(self) -> None:
        """The rollout is over: free what the engine holds on the device until the next
        ``sync_weights`` (an external engine's KV cache and weight copy), so the update has it."""
        ...


def lockstep_over(group: dist.ProcessGroup | None, device: torch.device) -> Callable[[bool], bool] | None:
    """``generate``'s lockstep over ``group``: whether every rank is done (None: one process)."""
    if group is None:
        return None

    def every_rank_done(done: bool) -> bool:
        flag = torch.tensor([float(done)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())
    return every_rank_done


class PolicyEngine:
    """The built-in engine: the trained model generates in the training processes."""

    def __init__(self, model: nn.Module, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.model, self.device, self.group = model, device, group

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate(self.model, prompts, params, lockstep=lockstep_over(self.group, self.device))

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to push: generation runs the trained parameters themselves."""

    def release(self) -> None:
        """Nothing held: ``generate``'s KV cache is gone when it returns."""


def pack_rollouts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  advantages: Sequence[float]) -> dict:
    """One packed row of (prompt + completion) samples, targets on the completion tokens, each
    position carrying its sample's advantage (``ADVANTAGES``)."""
    samples = [list(p) + list(c) for p, c in zip(prompts, completions)]
    batch = pack_with_targets(samples, [[False] * len(p) + [True] * len(c) for p, c in zip(prompts, completions)])
    lengths = torch.tensor([len(s) for s in samples])
    batch[ADVANTAGES] = torch.repeat_interleave(torch.tensor(advantages, dtype=torch.float32), lengths)
    return batch
