"""Muon's orthogonalisation on sharded parameters (FSDP2 / HSDP / EP DTensors), by structure.

A DTensor's placements say how its matrices lie over the ranks:

- a ``Shard`` of the leading (expert) dim of a 3-D stack keeps whole experts on each rank (EP,
  or FSDP's default ``Shard(0)`` of the stack): those are orthogonalised where they are;
- a ``Shard`` of a matrix dim (FSDP2's ``Shard(0)`` of a 2-D weight, ``Shard(1)`` of an expert
  stack under EP x FSDP) splits each matrix over one mesh dim's group: each matrix (each local
  expert) gets an owner in that group by the balanced plan (``muon_plan.py``), its shards are
  gathered there (padded to equal size, as ``torch.chunk`` cuts them), orthogonalised, and
  scattered back. All gathers are issued first, asynchronously, so the owners' math overlaps
  the transfers still in flight; the scatters likewise overlap the remaining math. A matrix the
  plan gives a team of several ranks has its iteration split over them (``muon_split.py``);
- ``Replicate`` dims (HSDP's replicas) do the same work in each replica group independently.

Any other layout (two mesh dims splitting matrix dims) falls back to the whole tensor on every
rank (correct, but every rank does all the work). One process sees plain tensors: the iteration
on each, as ``Muon`` does itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from veomni.optim.muon import newton_schulz, ns_dtype, orthogonalize_tensor
from veomni.optim.muon_plan import BALANCE_TARGET, ns_flops, plan_owners
from veomni.optim.muon_split import ShardedMatrix, split_orthogonalize


def _matrix_shard_dims(update: DTensor) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every ``Shard`` that splits a matrix dim (the last two)."""
    first_matrix_dim = update.ndim - 2
    return [(mesh_dim, p.dim) for mesh_dim, p in enumerate(update.placements)
            if isinstance(p, Shard) and p.dim >= first_matrix_dim]


def sharded_orthogonalize(params: list[Tensor], updates: list[Tensor], group: dict[str, Any],
                          split_balance: float = BALANCE_TARGET) -> list[Tensor]:
    """``Muon.orthogonalize`` for a mix of plain and DTensor updates (see the module docstring);
    ``split_balance`` is the plan's (``muon_plan.plan_owners``' ``target``)."""
    results: list[Tensor | None] = [None] * len(updates)
    units: list[ShardedMatrix] = []
    pieces: dict[int, list[Tensor | None]] = {}
    for slot, update in enumerate(updates):
        if not isinstance(update, DTensor):
            results[slot] = orthogonalize_tensor(update, group)
            continue
        splits = _matrix_shard_dims(update)
        if not splits:  # whole matrices (experts) on this rank
            local = orthogonalize_tensor(update.to_local(), group).to(update.dtype)
            results[slot] = DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                               shape=update.shape, stride=update.stride())
        elif len(splits) > 1:
            whole = orthogonalize_tensor(update.full_tensor(), group).to(update.dtype)
            results[slot] = distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
        else:
            mesh_dim, tensor_dim = splits[0]
            pg = update.device_mesh.get_group(mesh_dim)
            local = update.to_local()
            shape = tuple(update.shape[-2:])
            matrix_dim = tensor_dim - (update.ndim - 2)
            stack = [None] if update.ndim == 2 else range(local.shape[0])
            pieces[slot] = [None] * len(stack)
            for expert in stack:
                piece = local if expert is None else local[expert]
                units.append(ShardedMatrix(slot, expert, piece, matrix_dim, update.shape[tensor_dim], shape, pg))
    _gather_orthogonalize_scatter(units, pieces, group, split_balance)
    for slot, parts in pieces.items():
        update = updates[slot]
        local = parts[0] if update.ndim == 2 else torch.stack(parts)
        results[slot] = DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                           shape=update.shape, stride=update.stride())
    return results


def _gather_orthogonalize_scatter(units: list[ShardedMatrix], pieces: dict[int, list], group: dict[str, Any],
                                  split_balance: float) -> None:
    """Per process group, teams by the plan. Units of one owner: gathers all issued before any
    math, then each owned matrix orthogonalised as its gather lands and its scatter issued at once;
    then the units whose iteration a team splits (``muon_split.py``)."""
    by_group: dict[dist.ProcessGroup, list[ShardedMatrix]] = {}
    for unit in units:
        by_group.setdefault(unit.group, []).append(unit)
    pending, split = [], []
    for pg, members in by_group.items():
        size, me = dist.get_world_size(pg), dist.get_rank(pg)
        plan = plan_owners([ns_flops(*u.shape, group["ns_steps"]) for u in members], size,
                           [min(u.shape) for u in members], split_balance)
        split.append([(unit, team) for unit, team in zip(members, plan.teams) if len(team) > 1])
        gathers = []
        for unit, owner in ((u, team[0]) for u, team in zip(members, plan.teams) if len(team) == 1):
            chunk = math.ceil(unit.full / size)
            padded = _pad(unit.local, unit.dim, chunk)
            bucket = [torch.empty_like(padded) for _ in range(size)] if owner == me else None
            work = dist.gather(padded, bucket, group=pg, group_dst=owner, async_op=True)
            gathers.append((unit, owner, chunk, padded, bucket, work))
        for unit, owner, chunk, padded, bucket, work in gathers:
            work.wait()
            scatter_list = None
            if owner == me:
                whole = torch.cat(bucket, dim=unit.dim).narrow(unit.dim, 0, unit.full)
                dtype = ns_dtype(group["ns_dtype"], whole.device)
                ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                ortho = _pad(ortho.to(padded.dtype), unit.dim, chunk * size)
                scatter_list = list(ortho.split(chunk, dim=unit.dim))
            received = torch.empty_like(padded)
            pending.append((unit, received, dist.scatter(received, scatter_list, group=pg, group_src=owner,
                                                         async_op=True)))
    for unit, received, work in pending:
        work.wait()
        piece = received.narrow(unit.dim, 0, unit.local.shape[unit.dim])
        pieces[unit.slot][0 if unit.expert is None else unit.expert] = piece
    for team_units in split:
        for (unit, _), piece in zip(team_units, split_orthogonalize(team_units, group)):
            pieces[unit.slot][0 if unit.expert is None else unit.expert] = piece


def _pad(tensor: Tensor, dim: int, size: int) -> Tensor:
    """``tensor`` zero-padded along ``dim`` to ``size`` (contiguous, as collectives need)."""
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor.contiguous()
    pad_shape = list(tensor.shape)
    pad_shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim).contiguous()
