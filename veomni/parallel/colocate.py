"""Balanced encoder work within a step: the encoders' items of every data-parallel rank are
spread over those ranks by encoder cost, and the features go back to the ranks that own them.

With a dynamic image:text mix one rank's micro-batch may hold most of the step's images and the
others wait for it. ``BalancedMediaFn`` replaces a ``MediaHost`` model's ``media_fn`` and, per
micro-batch and modality, on every rank of the group:

1. splits this rank's collated inputs into items (the family's ``MediaKind.split``), prices each
   with the encoder's own FLOPs (``MediaKind.flops`` on the item), and all-gathers the prices
   and each item's row counts;
2. computes the same assignment on every rank (``assign_items``: longest first onto the
   least-loaded rank, ties to the owner so fewer items move);
3. sends each item's input rows to the rank that runs it (uneven ``all_to_all_single``);
4. runs the encoder once on what it received; a rank that received nothing runs the dummy
   input, so every rank joins the encoder's FSDP collectives;
5. returns the features to their owners with the inverse all-to-all, differentiable
   (``all_to_all_single_autograd``), in the owner's item order.

Items are independent inside an encoder (the ViT attends within a frame, the audio encoder
within a clip), so each item's features, and the gradients they send back into the encoder
weights, are the ones the owner would have computed itself: the loss and gradients equal the
unbalanced run's (tested against one process in ``tests/test_colocate.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from veomni.config.schema import ParallelConfig
from veomni.spec.media import MediaHost, MediaItem, MediaKind

logger = logging.getLogger(__name__)


def assign_items(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """``costs[r][i]``: the encoder cost of item ``i`` owned by rank ``r`` -> ``runner[r][i]``: the
    rank that encodes it.

    Greedy longest-processing-time: items by decreasing cost, each onto the least-loaded rank;
    among equally loaded ranks the owner if it is one, else the lowest rank. Equal costs are taken
    by index within the owner, then owner, so equal items of different owners interleave and
    stay home when the ranks are already even. Pure and deterministic: every rank computes the
    same answer from the same gathered costs.
    """
    loads = [0.0] * len(costs)
    runner = [[-1] * len(owned) for owned in costs]
    order = sorted((-cost, index, owner) for owner, owned in enumerate(costs) for index, cost in enumerate(owned))
    for negative_cost, index, owner in order:
        least = min(loads)
        target = owner if loads[owner] == least else loads.index(least)
        runner[owner][index] = target
        loads[target] -= negative_cost
    return runner


class BalancedMediaFn:
    """A ``MediaFn`` that balances encoder work over the ranks of ``group`` (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, kinds: Mapping[str, MediaKind],
                 encoder_configs: Mapping[str, Any]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.kinds = kinds
        self.encoder_configs = encoder_configs

    def __call__(self, name: str, encoder: nn.Module, inputs: Mapping[str, torch.Tensor] | None,
                 dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        kind = self.kinds[name]
        items = kind.split(inputs, self.encoder_configs[name]) if inputs is not None else []
        keys = list(dummy_inputs)  # the same on every rank, items or not
        device = next(iter(dummy_inputs.values())).device
        table = self._gather_items(kind, encoder, items, keys, device)
        runner = assign_items([rows[:, 0].tolist() for rows in table])
        sources = [[i for i, r in enumerate(runner[s]) if r == self.rank] for s in range(self.world)]
        received = {k: self._send_inputs(items, runner[self.rank], table, sources, 2 + j, k, dummy_inputs[k])
                    for j, k in enumerate(keys)}
        back_splits = [int(sum(table[s][i, 1] for i in sources[s])) for s in range(self.world)]
        if sum(back_splits):
            features = encoder(**received)
            if features.shape[0] != sum(back_splits):
                raise ValueError(f"{name}: the encoder produced {features.shape[0]} features for items "
                                 f"announcing {sum(back_splits)}")
        else:  # zero rows of the dummy's features: the backward still reaches the encoder's collectives
            features = encoder(**dummy_inputs)[:0]
        mine = [int(n) for n in table[self.rank][:, 1].tolist()]
        home_splits = [sum(n for n, r in zip(mine, runner[self.rank]) if r == d) for d in range(self.world)]
        home = funcol.all_to_all_single_autograd(features.contiguous(), home_splits, back_splits, self.group)
        return home[self._original_order(mine, runner[self.rank], device)]

    def _gather_items(self, kind: MediaKind, encoder: nn.Module, items: list[MediaItem], keys: list[str],
                      device: torch.device) -> list[torch.Tensor]:
        """Every rank's items as rows ``[cost, feature rows, input rows per key]`` (float64: exact
        for integers below 2**53)."""
        rows = torch.tensor([[kind.flops(encoder, item.inputs), item.num_tokens,
                              *(item.inputs[k].shape[0] for k in keys)] for item in items],
                            dtype=torch.float64, device=device).reshape(len(items), 2 + len(keys))
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([len(items)], dtype=torch.long, device=device), group=self.group)
        counts = [int(c) for c in counts]
        padded = torch.zeros(max(counts), rows.shape[1], dtype=torch.float64, device=device)
        padded[: len(items)] = rows
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        return [table[:n] for table, n in zip(gathered, counts)]

    def _send_inputs(self, items: list[MediaItem], my_runners: list[int], table: list[torch.Tensor],
                     sources: list[list[int]], column: int, key: str, dummy: torch.Tensor) -> torch.Tensor:
        """One input key's rows of the items each rank runs, received in (source rank, item) order;
        moved in the dummy's dtype (the encoder's input dtype, which every rank knows)."""
        outgoing = [i for d in range(self.world) for i, r in enumerate(my_runners) if r == d]
        send = (torch.cat([items[i].inputs[key] for i in outgoing]).to(dummy.dtype) if outgoing
                else dummy.new_empty((0, *dummy.shape[1:])))
        send_splits = [sum(items[i].inputs[key].shape[0] for i, r in enumerate(my_runners) if r == d)
                       for d in range(self.world)]
        recv_splits = [int(sum(table[s][i, column] for i in sources[s])) for s in range(self.world)]
        received = dummy.new_empty((sum(recv_splits), *dummy.shape[1:]))
        dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=self.group)
        return received

    def _original_order(self, feature_rows: list[int], my_runners: list[int], device: torch.device) -> torch.Tensor:
        """Row index that reorders features received grouped by runner rank into item order."""
        starts, offset = {}, 0
        for d in range(self.world):
            for i, r in enumerate(my_runners):
                if r == d:
                    starts[i], offset = offset, offset + feature_rows[i]
        if not feature_rows:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(starts[i], starts[i] + n, device=device) for i, n in enumerate(feature_rows)])


def check_encoder_balance(model: nn.Module, cfg: ParallelConfig) -> list[str]:
    """Why ``parallel.encoder_balance`` cannot apply to this model and layout (empty when it can)."""
    if not cfg.encoder_balance:
        return []
    if not isinstance(model, MediaHost):
        return [f"parallel.encoder_balance: {type(model).__name__} runs no media encoders; remove the key"]
    split = [f"parallel.{k}={v}" for k, v in (("sp", cfg.sp), ("cp", cfg.cp), ("pp", cfg.pp)) if v > 1]
    if split:
        return [f"parallel.encoder_balance with {', '.join(split)} is not supported yet: the balanced features "
                "would have to reach the ranks holding their sequence slice or pipeline stage; use data "
                "parallelism only, or set parallel.encoder_balance: false"]
    return []


def apply_encoder_balance(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Install ``BalancedMediaFn`` over ``group`` (the data-parallel ranks); None (one rank) keeps
    the local default, there being nothing to balance."""
    if not isinstance(model, MediaHost):
        raise ValueError(f"parallel.encoder_balance: {type(model).__name__} runs no media encoders")
    if group is None:
        logger.info("parallel.encoder_balance: one data-parallel rank, nothing to balance")
        return
    config = model.media_config()
    model.media_fn = BalancedMediaFn(group, config.media_kinds(), config.encoder_configs)
    logger.info("encoder work balanced over %d data-parallel ranks (%s)", dist.get_world_size(group),
                ", ".join(config.encoder_configs))
