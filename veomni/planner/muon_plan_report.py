"""``--dry-run``'s Muon lines: the owner plan of ``veomni/optim/muon_sharded.py`` laid out for a
recipe's meta model and layout (no process group, nothing allocated): Newton-Schulz FLOPs per rank
(max / mean, the balance), the matrices whose iteration a team of ranks splits, and the bytes the
gathers, scatters and the teams' exchanges move per step.

It mirrors the runtime: a 2-D matrix is split over the ``shard_size`` FSDP ranks and planned
there; an expert stack under ``parallel.ep`` keeps ``E / ep`` whole experts per EP slice, whose
rows the ``ep_fsdp`` ranks split (each expert planned there); without EP, FSDP's ``Shard(0)`` of
the stack leaves whole experts on each rank (``torch.chunk`` counts), orthogonalised in place.
Replicas (HSDP) repeat the shard group's plan. Under a pipeline each stage has its own optimizers
and so its own plan over its blocks' matrices; a pipeline rank's load is the sum over the stages
it runs, and the lines give each pipeline rank's plan and the balance over all ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract.hooks import ParamRule
from veomni.contract.plan import flatten_plan, match_modules
from veomni.optim.groups import clean_name, optimizer_groups
from veomni.optim.muon_plan import ns_flops, plan_owners
from veomni.parallel.mesh import ParallelDims
from veomni.parallel.pipeline.layout import stage_ids, virtual_stages
from veomni.parallel.pipeline.stages import stage_block_counts

BYTES_PER_ELEMENT = 4
"""The fp32 momentum update each shard sends (and gets back); the teams' Gram and polynomial
exchanges are counted at the same width (half of it with the bf16 iteration on GPU)."""


@dataclass
class MuonLoads:
    """One shard group's plan: Newton-Schulz FLOPs of each rank and what it moves per step."""

    loads: list[float]
    moved: float
    units: int = 0
    split: int = 0
    """Units whose iteration a team of several ranks splits."""
    largest_team: int = 1

    def add(self, other: MuonLoads) -> MuonLoads:
        return MuonLoads([a + b for a, b in zip(self.loads, other.loads)], self.moved + other.moved,
                         self.units + other.units, self.split + other.split,
                         max(self.largest_team, other.largest_team))


def muon_loads(model: nn.Module, cfg: RunConfig, shard_size: int, ep: int, rules: Sequence[ParamRule] = (),
               blocks: Sequence[str] | None = None) -> MuonLoads:
    """One shard group's plan for the Muon matrices (of ``blocks`` only, when given: a stage's)."""
    muon_params = [p for g in optimizer_groups(model, cfg.train, cfg.optim, rules).get("muon", []) for p in g["params"]]
    experts = tuple(clean_name(n) + "." for n, _ in match_modules(model, flatten_plan(model.parallel_plan()).experts))
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    if blocks is not None:
        inside = tuple(block + "." for block in blocks)
        muon_params = [p for p in muon_params if names[id(p)].startswith(inside)]
    steps, target = cfg.optim.muon_ns_steps, cfg.optim.muon_split_balance
    ep_fsdp = shard_size // ep
    dense, expert_units, result = [], [], MuonLoads([0.0] * shard_size, 0.0)
    for p in muon_params:
        rows, cols = p.shape[-2:]
        if p.ndim == 3 and names[id(p)].startswith(experts) and ep > 1:
            expert_units += [(rows, cols)] * (p.shape[0] // ep)
            result.moved += ep * (p.shape[0] // ep) * _round_trip(rows * cols, ep_fsdp)
        elif p.ndim == 3:  # whole experts per rank, torch.chunk's counts
            per_rank = -(-p.shape[0] // shard_size)
            for rank in range(shard_size):
                result.loads[rank] += max(0, min(per_rank, p.shape[0] - rank * per_rank)) * ns_flops(rows, cols, steps)
        else:
            dense.append((rows, cols))
            result.moved += _round_trip(rows * cols, shard_size)
    result = result.add(_group_plan(dense, shard_size, steps, target, repeat=1))
    if expert_units:
        plan = _group_plan(expert_units, ep_fsdp, steps, target, repeat=ep)
        # (ep_fsdp, ep) row-major: rank = i * ep + j, each EP slice the same plan
        result = result.add(MuonLoads([plan.loads[rank // ep] for rank in range(shard_size)], plan.moved,
                                      plan.units, plan.split, plan.largest_team))
    return result


def _group_plan(shapes: list[tuple[int, int]], ranks: int, steps: int, target: float, repeat: int) -> MuonLoads:
    """The plan of one shard group's units; its teams' exchanges (each step, a member sends its
    s x s Gram part to the k - 1 others and its rows of the polynomial too) times ``repeat`` groups."""
    plan = plan_owners([ns_flops(*shape, steps) for shape in shapes], ranks, [min(shape) for shape in shapes], target)
    sizes = [len(team) for team in plan.teams]
    exchanged = sum(steps * (k * k - 1) * min(shape) ** 2 for shape, k in zip(shapes, sizes))
    return MuonLoads(list(plan.loads), repeat * BYTES_PER_ELEMENT * exchanged, repeat * len(shapes),
                     repeat * sum(k > 1 for k in sizes), max(sizes, default=1))


def _round_trip(elements: int, ranks: int) -> float:
    """Bytes of one matrix's gather to its owner and scatter back: every other rank's shard, twice."""
    return 2.0 * BYTES_PER_ELEMENT * elements * (ranks - 1) / ranks


def _pipeline_ranks(model: nn.Module, cfg: RunConfig, dims: ParallelDims) -> list[list[list[str]]]:
    """Per pipeline rank, the block names of each stage it runs."""
    counts = stage_block_counts(model, cfg.parallel)
    blocks = [name for name, _ in match_modules(model, model.parallel_plan().blocks)]
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [[blocks[starts[s]:starts[s] + counts[s]] for s in
             stage_ids(rank, dims.pp, virtual_stages(cfg.parallel), cfg.parallel.pp_schedule)]
            for rank in range(dims.pp)]


def _describe(plan: MuonLoads) -> str:
    mean = sum(plan.loads) / len(plan.loads)
    balance = max(plan.loads) / mean if mean else 1.0
    split = (f"; {plan.split} of {plan.units} matrices split over teams of up to {plan.largest_team} ranks"
             if plan.split else "")
    return (f"Newton-Schulz {sum(plan.loads) / 1e12:.2f} TFLOP/step, per rank max {max(plan.loads) / 1e12:.3f} / "
            f"mean {mean / 1e12:.3f} TFLOP = balance {balance:.3f}{split}")


def muon_report_lines(model: nn.Module, cfg: RunConfig, dims: ParallelDims, rules: Sequence[ParamRule] = ()
                      ) -> list[str]:
    shard, ep = dims.shard_size, dims.ep
    head = f"muon owner plan ({shard} ranks per shard group, ep={ep}, split above {cfg.optim.muon_split_balance:g})"
    if dims.pp == 1:
        plan = muon_loads(model, cfg, shard, ep, rules)
        return [f"{head}: {_describe(plan)}",
                f"muon gathers + scatters + team exchanges: {plan.moved / 2**30:.2f} GiB/step per shard group "
                f"({plan.moved / shard / 2**20:.1f} MiB per rank)"]
    per_rank = []
    for stages in _pipeline_ranks(model, cfg, dims):
        plans = [muon_loads(model, cfg, shard, ep, rules, blocks) for blocks in stages]
        per_rank.append((stages, functools.reduce(MuonLoads.add, plans)))
    plans = [plan for _, plan in per_rank]
    everything = MuonLoads([load for plan in plans for load in plan.loads], sum(p.moved for p in plans),
                           sum(p.units for p in plans), sum(p.split for p in plans), max(p.largest_team for p in plans))
    lines = [f"{head}, per pipeline stage; all {dims.pp} x {shard} ranks: {_describe(everything)}"]
    for rank, (stages, plan) in enumerate(per_rank):
        lines.append(f"  pp rank {rank} ({sum(len(s) for s in stages)} blocks in {len(stages)} stage(s)): "
                     f"{_describe(plan)}; moves {plan.moved / 2**30:.2f} GiB/step "
                     f"({plan.moved / shard / 2**20:.1f} MiB per rank)")
    return lines
