"""Per-pipeline-rank memory for ``--dry-run`` under ``parallel.pp > 1``.

Each pipeline rank holds its stages' parameters (sharded by FSDP over the stage's
``dp_shard x sp`` ranks), their gradients and optimizer state, the gathered parameters FSDP keeps
(two blocks plus the stage's embedding / head, with only a block's ``E / ep`` local experts under
expert parallelism; the whole stage when a zero-bubble schedule keeps it gathered), and the
activations of the micro-batches it has in flight, which is what distinguishes the schedules:

- GPipe: every micro-batch of every local stage (all forwards come before the backwards);
- 1F1B: ``min(m, p - r)`` on rank ``r``;
- interleaved (1F1B and zero bubble): ``min(v m, (v - 1) p + 2 (p - 1 - r) + 1)`` stage-chunks
  (the warm-up depth of torch's interleaved schedules);
- V schedules (ZBV, DualPipeV): ``min(v m, 2 p)`` stage-chunks, about the V's depth.

A stage-chunk is one micro-batch through one stage's blocks. The head's logits count once on
the rank holding the last stage (it runs each micro-batch's backward right after its forward),
m times under GPipe. Per-block activation bytes come from the model's own estimate, taken at one and
two layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from veomni.config.schema import RunConfig
from veomni.contract import build_model, get_model_spec
from veomni.contract.plan import match_modules
from veomni.objectives.registry import frozen_copies
from veomni.optim import get_optimizer
from veomni.parallel.mesh import ParallelDims
from veomni.parallel.pipeline.layout import (
    SINGLE_STAGE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    microbatch_count,
    stage_ids,
    virtual_stages,
)
from veomni.parallel.pipeline.stages import stage_block_counts

GiB = 2**30


def in_flight(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int) -> int:
    """Stage-chunks of activations a rank holds at its peak (see the module docstring)."""
    p, v, m, r = pp, virtual, microbatches, pp_rank
    if schedule == "GPipe":
        return v * m
    if schedule in SINGLE_STAGE_SCHEDULES:
        return min(m, p - r)
    if schedule in V_SCHEDULES:
        return min(v * m, 2 * p)
    return min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1)


def _with_blocks(arch: str, options: Mapping[str, Any], blocks: int) -> dict[str, Any]:
    """``options`` with the pipelined blocks' count (the family's ``ModelSpec.blocks_option``) set."""

    def replaced(section: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
        inner = blocks if len(keys) == 1 else replaced(section.get(keys[0]) or {}, keys[1:])
        return {**section, keys[0]: inner}

    return replaced(options, get_model_spec(arch).blocks_option.split("."))


def _activation_bytes(cfg: RunConfig, layers: int, bytes_per_elem: int) -> float:
    with torch.device("meta"):
        _, model = build_model(cfg.model.arch, _with_blocks(cfg.model.arch, cfg.model.options, layers))
    cost = get_model_spec(cfg.model.arch).cost
    return cost.activation_bytes_per_unit(model, bytes_per_elem, cfg.parallel.activation_checkpointing)


def _gathered_block_sizes(model, blocks: list, block_sizes: list[int], ep: int) -> list[float]:
    """What FSDP gathers of each block: its dense weights and, under EP, its ``E / ep`` local experts."""
    experts = match_modules(model, model.parallel_plan().experts)
    expert_params = [sum(p.numel() for path, module in experts if path.startswith(name + ".")
                         for p in module.parameters()) for name, _ in blocks]
    return [size - (1 - 1 / ep) * e for size, e in zip(block_sizes, expert_params)]


def pipeline_memory_lines(cfg: RunConfig, dims: ParallelDims, compute_bytes: int, unit: str = "token") -> list[str]:
    par = cfg.parallel
    with torch.device("meta"):
        _, model = build_model(cfg.model.arch, cfg.model.options)
    plan = model.parallel_plan()
    blocks = match_modules(model, plan.blocks)
    block_sizes = [sum(p.numel() for p in b.parameters()) for _, b in blocks]
    gathered_sizes = _gathered_block_sizes(model, blocks, block_sizes, dims.ep)
    total = sum(p.numel() for p in model.parameters())
    counts = stage_block_counts(model, par)
    v, m = virtual_stages(par), microbatch_count(par, cfg.train.grad_accum)
    per_block_act = _activation_bytes(cfg, 2, compute_bytes) - _activation_bytes(cfg, 1, compute_bytes)
    head_act = _activation_bytes(cfg, 1, compute_bytes) - per_block_act
    pieces = list(plan.stages)
    container = next(piece for piece in pieces if blocks and blocks[0][0].startswith(piece + "."))
    index = pieces.index(container)
    before = sum(p.numel() for n in pieces[:index] for p in model.get_submodule(n).parameters())
    after = total - before - sum(block_sizes)
    shard = dims.shard_size
    optimizer_states = get_optimizer(cfg.train.optimizer).states
    copies = frozen_copies(cfg)
    rows_per_mb = cfg.train.grad_accum // m
    tokens = rows_per_mb * cfg.data.tokens_per_micro_batch
    keep_whole = par.pp_schedule in SPLIT_BACKWARD_SCHEDULES or not par.reshard_after_forward
    lines = [f"pipeline      {par.pp_schedule}: {len(counts)} stages ({par.pp} ranks x {v}), blocks per stage "
             f"{counts}, {m} micro-batches of up to {tokens} {unit}s per step"]
    if dims.ep > 1:
        lines.append(f"pipeline x EP each stage's {shard} ranks split its experts {dims.ep}-way "
                     f"(ep_fsdp {dims.ep_fsdp} x ep {dims.ep}); aux losses and expert loads are kept per stage")
    lines += [
             "memory / rank by pipeline rank (estimate, GiB; params/grads/optimizer fp32 sharded "
             f"1/{shard}):",
             f"  {'pp rank':<8}{'stages':<10}{'blocks':>7}{'params (B)':>12}{'p+g+opt':>10}"
             + (f"{'reference':>10}" if copies else "") + f"{'gathered':>10}{'in flight':>10}{'activ.':>9}{'total':>9}"]
    for r in range(par.pp):
        ids = stage_ids(r, par.pp, v, par.pp_schedule)
        params, gathered, n_blocks, holds_head = 0, 0.0, 0, False
        for s in ids:
            start = sum(counts[:s])
            sizes = block_sizes[start:start + counts[s]]
            extra = (before if s == 0 else 0) + (after if s == len(counts) - 1 else 0)
            params += sum(sizes) + extra
            n_blocks += counts[s]
            local = gathered_sizes[start:start + counts[s]]
            gathered += (sum(local) if keep_whole else sum(sorted(local, reverse=True)[:2])) + extra
            holds_head = holds_head or s == len(counts) - 1
        flight = in_flight(par.pp_schedule, par.pp, v, m, r)
        # blocks: the average local stage per chunk in flight; the head's logits: one micro-batch
        # (the last stage runs each backward right after its forward), all of them under GPipe
        act_chunk = per_block_act * n_blocks / len(ids) * flight
        act_chunk += head_act * (m if par.pp_schedule == "GPipe" else 1) if holds_head else 0
        states = (4 + 4 + 4 * optimizer_states) * params / shard / GiB
        reference = copies * 4 * params / shard / GiB  # an objective's frozen fp32 copy of these stages
        gathered_gb = compute_bytes * gathered / GiB
        act_gb = act_chunk * tokens / dims.row_ranks / GiB
        total_gb = states + reference + gathered_gb + act_gb
        lines.append(f"  {r:<8}{','.join(map(str, ids)):<10}{n_blocks:>7}{params / 1e9:>12.3f}{states:>10.2f}"
                     + (f"{reference:>10.2f}" if copies else "")
                     + f"{gathered_gb:>10.2f}{flight:>10}{act_gb:>9.2f}{total_gb:>9.2f}")
    return lines
