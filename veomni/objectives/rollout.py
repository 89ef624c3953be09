"""The rollout engine seat and the rows a rollout trains on.

A ``RolloutEngine`` takes prompts (token ids; or, for a VLM, ``ChatSample`` chats with their images and
videos, generated with the model's ``MediaLayout``: M-RoPE positions continued while decoding) and
sampling settings (``veomni.generation.SamplingParams``; ``n``: the group size) and gives, per
prompt, ``n`` ``veomni.generation.Completion``s (prompt by prompt): the sampled tokens and each
token's log-probability under the generating weights (log-softmax at temperature 1); ``sync_weights`` is
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

from veomni.contract.media import MediaLayout
from veomni.data.packing import pack_with_targets
from veomni.generation import Completion, SamplingParams, generate
from veomni.generation.prompts import Prompt, pack_prompts, prompt_ids
from veomni.objectives.grpo import ADVANTAGES

__all__ = ["Completion", "PolicyEngine", "RolloutEngine", "SamplingParams", "pack_rollouts"]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]: ...

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

    def __init__(self, model: nn.Module, device: torch.device, group: dist.ProcessGroup | None,
                 layout: MediaLayout | None = None) -> None:
        """``layout``: the model's, for prompts with media (None: token prompts)."""
        self.model, self.device, self.group, self.layout = model, device, group, layout

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        return generate(self.model, prompts, params, layout=self.layout,
                        lockstep=lockstep_over(self.group, self.device))

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to push: generation runs the trained parameters themselves."""

    def release(self) -> None:
        """Nothing held: ``generate``'s KV cache is gone when it returns."""


def pack_rollouts(prompts: Sequence[Prompt], completions: Sequence[Sequence[int]],
                  advantages: Sequence[float], layout: MediaLayout | None = None) -> dict:
    """One packed row of (prompt + completion) samples as generation saw them (``pack_prompts``: its
    positions and, for chats, the prompts' media at their places, for the model's ``layout``), targets
    on the completion tokens, each position carrying its sample's advantage (``ADVANTAGES``)."""
    ids = [prompt_ids(p) for p in prompts]
    targets = [[False] * len(p) + [True] * len(c) for p, c in zip(ids, completions)]
    batch = pack_prompts(prompts, completions, layout)
    batch["labels"] = pack_with_targets([[*p, *c] for p, c in zip(ids, completions)], targets)["labels"]
    batch["num_samples"] = len(ids)
    lengths = torch.tensor([len(p) + len(c) for p, c in zip(ids, completions)])
    batch[ADVANTAGES] = torch.repeat_interleave(torch.tensor(advantages, dtype=torch.float32), lengths)
    return batch
