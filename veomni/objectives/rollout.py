"""The rollout engine seat and the rows a rollout trains on.

A ``RolloutEngine`` takes token prompts and sampling settings and gives, per prompt, the sampled
completion's tokens and each token's log-probability under the generating weights (log-softmax at
temperature 1); ``sync_weights`` is called after every policy update, before the next rollout, so
an engine that holds its own copy of the weights (an external server) takes the trained ones.

The built-in ``PolicyEngine`` generates with the trained model itself, in the training processes:
its weights *are* the trained weights (nothing to push), one step per forward pass of every live
sequence packed into one row, without a KV cache (``generate_packed``). Under FSDP every rank must
run the same number of forward passes (each gathers the sharded weights), so ranks decode in lock
step until every rank's sequences are done, a rank with nothing left feeding a one-token row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from veomni.data.packing import pack_with_targets
from veomni.objectives.grpo import ADVANTAGES
from veomni.parallel.sequence import full_sequence_attention


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0: greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    """Each token's log-probability under the generating weights (log-softmax at temperature 1)."""
    finish_reason: str = "length"
    """``stop`` (a stop token ended it, kept as its last token) or ``length``."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def sync_weights(self, model: nn.Module) -> None: ...


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from fp32 ``logits`` [vocab]: the argmax at temperature 0, else a sample after the
    temperature, top-k and top-p (nucleus) cuts."""
    if params.temperature <= 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        before = torch.softmax(ordered, -1).cumsum(-1) - torch.softmax(ordered, -1)
        logits = logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter(0, order, before > params.top_p),
                                    float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def _packed_logits(model: nn.Module, rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """The next-token logits [len(rows), vocab] after each row, from one packed forward."""
    ids = [t for row in rows for t in row]
    lengths = torch.tensor([len(row) for row in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    logits = model(torch.tensor(ids, device=device), positions.to(device), cu.to(device), int(lengths.max()))
    return logits[(cu[1:] - 1).long().to(device)].float().cpu()


@torch.no_grad()
def generate_packed(model: nn.Module, prompts: list[list[int]], params: SamplingParams, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> list[Completion]:
    """Complete every prompt (prompt ``i`` samples from the generator seeded ``params.seed + i``);
    ``group``: the ranks that must run the same number of forward passes (None: this process alone)."""
    was_training = model.training
    model.eval()
    out = [Completion([]) for _ in prompts]
    generators = [torch.Generator().manual_seed(params.seed + i) for i in range(len(prompts))]
    live = list(range(len(prompts)))
    stops = set(params.stop_token_ids)
    with full_sequence_attention(model):
        for _ in range(params.max_new_tokens):
            busy = torch.tensor([float(bool(live))])
            if group is not None:
                dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
            if not busy.item():
                break
            rows = [prompts[i] + out[i].tokens for i in live] or [[0]]
            logits = _packed_logits(model, rows, device)
            still = []
            for i, row_logits in zip(live, logits):
                token = pick_token(row_logits, params, generators[i])
                out[i].tokens.append(token)
                out[i].logprobs.append(float(torch.log_softmax(row_logits, -1)[token]))
                if token in stops:
                    out[i].finish_reason = "stop"
                else:
                    still.append(i)
            live = still
    model.train(was_training)
    return out


class PolicyEngine:
    """The built-in engine: the trained model generates in the training processes."""

    def __init__(self, model: nn.Module, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.model, self.device, self.group = model, device, group

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_packed(self.model, prompts, params, self.device, self.group)

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to push: generation runs the trained parameters themselves."""


def pack_rollouts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  advantages: Sequence[float]) -> dict:
    """One packed row of (prompt + completion) samples, targets on the completion tokens, each
    position carrying its sample's advantage (``ADVANTAGES``)."""
    samples = [list(p) + list(c) for p, c in zip(prompts, completions)]
    batch = pack_with_targets(samples, [[False] * len(p) + [True] * len(c) for p, c in zip(prompts, completions)])
    lengths = torch.tensor([len(s) for s in samples])
    batch[ADVANTAGES] = torch.repeat_interleave(torch.tensor(advantages, dtype=torch.float32), lengths)
    return batch
