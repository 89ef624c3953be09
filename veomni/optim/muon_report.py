"""``--dry-run``'s Muon lines: the owner plan of ``muon_sharded.py`` laid out for a recipe's meta
model and layout (no process group, nothing allocated): Newton-Schulz FLOPs per rank (max / mean,
the balance) and the bytes the gathers and scatters move per step.

It mirrors the runtime: a 2-D matrix is split over the ``shard_size`` FSDP ranks and planned
there; an expert stack under ``parallel.ep`` keeps ``E / ep`` whole experts per EP slice, whose
rows the ``ep_fsdp`` ranks split (each expert planned there); without EP, FSDP's ``Shard(0)`` of
the stack leaves whole experts on each rank (``torch.chunk`` counts), orthogonalised in place.
Replicas (HSDP) repeat the shard group's plan. Per pipeline stage the same holds for its blocks;
the lines here take the whole model as one stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract.hooks import ParamRule
from veomni.contract.plan import flatten_plan, match_modules
from veomni.optim.groups import clean_name, optimizer_groups
from veomni.optim.muon_plan import ns_flops, plan_owners

BYTES_PER_ELEMENT = 4
"""The fp32 momentum update each shard sends (and gets back)."""


def muon_loads(model: nn.Module, cfg: RunConfig, shard_size: int, ep: int, rules: Sequence[ParamRule] = ()
               ) -> tuple[list[float], float]:
    """(Newton-Schulz FLOPs of each of the ``shard_size`` ranks of one shard group, bytes that group
    moves per step)."""
    muon_params = [p for g in optimizer_groups(model, cfg.train, cfg.optim, rules).get("muon", []) for p in g["params"]]
    experts = tuple(clean_name(n) + "." for n, _ in match_modules(model, flatten_plan(model.parallel_plan()).experts))
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    steps = cfg.optim.muon_ns_steps
    ep_fsdp = shard_size // ep
    dense, expert_units, loads, moved = [], [], [0.0] * shard_size, 0.0
    for p in muon_params:
        rows, cols = p.shape[-2:]
        if p.ndim == 3 and names[id(p)].startswith(experts) and ep > 1:
            expert_units += [ns_flops(rows, cols, steps)] * (p.shape[0] // ep)
            moved += ep * (p.shape[0] // ep) * _round_trip(rows * cols, ep_fsdp)
        elif p.ndim == 3:  # whole experts per rank, torch.chunk's counts
            per_rank = -(-p.shape[0] // shard_size)
            for rank in range(shard_size):
                loads[rank] += max(0, min(per_rank, p.shape[0] - rank * per_rank)) * ns_flops(rows, cols, steps)
        else:
            dense.append(ns_flops(rows, cols, steps))
            moved += _round_trip(rows * cols, shard_size)
    for rank, load in enumerate(plan_owners(dense, shard_size).loads):
        loads[rank] += load
    if expert_units:
        expert_plan = plan_owners(expert_units, ep_fsdp).loads
        for rank in range(shard_size):  # (ep_fsdp, ep) row-major: rank = i * ep + j
            loads[rank] += expert_plan[rank // ep]
    return loads, moved


def _round_trip(elements: int, ranks: int) -> float:
    """Bytes of one matrix's gather to its owner and scatter back: every other rank's shard, twice."""
    return 2.0 * BYTES_PER_ELEMENT * elements * (ranks - 1) / ranks


def muon_report_lines(model: nn.Module, cfg: RunConfig, shard_size: int, ep: int,
                      rules: Sequence[ParamRule] = ()) -> list[str]:
    loads, moved = muon_loads(model, cfg, shard_size, ep, rules)
    mean = sum(loads) / len(loads)
    balance = max(loads) / mean if mean else 1.0
    return [f"muon owner plan ({shard_size} ranks per shard group, ep={ep}): Newton-Schulz "
            f"{sum(loads) / 1e12:.2f} TFLOP/step, per rank max {max(loads) / 1e12:.3f} / mean {mean / 1e12:.3f}"
            f" TFLOP = balance {balance:.3f}",
            f"muon gathers + scatters: {moved / 2**30:.2f} GiB/step per shard group "
            f"({moved / shard_size / 2**20:.1f} MiB per rank)"]
