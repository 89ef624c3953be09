"""Pipeline layout arithmetic: which blocks each stage holds, which stages each rank runs, and
whether a schedule accepts the micro-batch count.

Pure functions of sizes (no process group), so the launcher and the config checks reject a bad
pipeline before any worker starts; ``stages.py`` builds the stages from the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from veomni.config.schema import ParallelConfig
from veomni.errors import BadConfig

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank in a V: rank r runs stages r and 2 * pp - 1 - r."""
LOOPED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Stages dealt round-robin: rank r runs stages r, r + pp, r + 2 pp, ..."""

GRAPH_SCHEDULES = ("GPipe", "1F1B")
"""The schedules of a graph model's layer pipeline (the graph wing's ``layer_pipeline.py``):
chunks of one graph, one stage per rank."""

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Zero-bubble schedules: input gradients first, weight gradients later. FSDP must keep the
stage's parameters gathered between the two (``reshard_after_forward=False``): resharded in
between, the deferred weight gradients land on freed unsharded tensors and are lost."""


class PipelineConfigError(BadConfig):
    """The pipeline settings do not fit the model, the schedule or the batch; says how to fix it."""


class TooFewBlocksError(PipelineConfigError):
    """More pipeline stages than blocks; the launcher adds the model key that sets the block count."""


def virtual_stages(cfg: ParallelConfig) -> int:
    """Stages per rank: ``pp_virtual_stages``, or the schedule's natural count when 0."""
    if cfg.pp_virtual_stages:
        return cfg.pp_virtual_stages
    return 1 if cfg.pp_schedule in SINGLE_STAGE_SCHEDULES else 2


def microbatch_count(cfg: ParallelConfig, grad_accum: int) -> int:
    return cfg.pp_microbatches or grad_accum


def check_pipeline(cfg: ParallelConfig, grad_accum: int, num_blocks: int | None = None,
                   own_schedule: bool = False) -> None:
    """Raise ``PipelineConfigError`` when the schedule, stage count, split or micro-batches do
    not fit. ``num_blocks`` (the model's plan blocks) is checked when known. ``own_schedule``: a
    graph pipeline (the graph wing's ``layer_pipeline.py``) orders its chunks itself and takes any
    number of them, one chunk included, so the torch schedules' micro-batch minimum does not apply."""
    if cfg.pp == 1:
        return
    schedule, v = cfg.pp_schedule, virtual_stages(cfg)
    stages = cfg.pp * v
    if v < 1:
        raise PipelineConfigError(f"parallel.pp_virtual_stages={cfg.pp_virtual_stages} must be >= 0 (0 = auto)")
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise PipelineConfigError(f"parallel.pp_schedule={schedule} runs one stage per rank but "
                                  f"parallel.pp_virtual_stages={v}; set it to 1 (or 0) or pick Interleaved1F1B")
    if schedule in V_SCHEDULES and v != 2:
        raise PipelineConfigError(f"parallel.pp_schedule={schedule} needs exactly 2 stages per rank (a V), got "
                                  f"parallel.pp_virtual_stages={v}; set it to 2 (or 0)")
    if schedule in SPLIT_BACKWARD_SCHEDULES and cfg.activation_checkpointing == "selective":
        raise PipelineConfigError(
            f"parallel.pp_schedule={schedule} runs backward in two passes (input, then weight gradients) and "
            "selective activation checkpointing allows one backward per region; use "
            "parallel.activation_checkpointing full or none, or a schedule without zero bubble")
    if cfg.pp_microbatches < 0:
        raise PipelineConfigError(f"parallel.pp_microbatches={cfg.pp_microbatches} must be >= 0 "
                                  "(0 = train.grad_accum)")
    m = microbatch_count(cfg, grad_accum)
    if grad_accum % m:
        raise PipelineConfigError(
            f"train.grad_accum={grad_accum} loader micro-batches do not divide into parallel.pp_microbatches={m} "
            f"pipeline micro-batches; pick pp_microbatches among the divisors of {grad_accum}")
    if schedule == "1F1B" and m < stages and not own_schedule:
        raise PipelineConfigError(f"parallel.pp_schedule=1F1B needs at least as many micro-batches as stages: "
                                  f"{m} < {stages}; raise train.grad_accum (or parallel.pp_microbatches)")
    if schedule == "DualPipeV" and m < stages:
        raise PipelineConfigError(f"parallel.pp_schedule=DualPipeV needs at least as many micro-batches as stages "
                                  f"(pp x 2 = {stages}), got {m}; raise train.grad_accum (or pp_microbatches)")
    if schedule in LOOPED_SCHEDULES:
        rounds = max(1, m // cfg.pp)
        if m % rounds:
            raise PipelineConfigError(
                f"parallel.pp_schedule={schedule} needs the micro-batch count ({m}) to be a multiple of its rounds "
                f"(max(1, {m} // pp {cfg.pp}) = {rounds}); use a multiple of parallel.pp={cfg.pp}")
    if cfg.pp_layer_split:
        split = cfg.pp_layer_split
        if len(split) != stages or any(not isinstance(n, int) or n < 1 for n in split):
            raise PipelineConfigError(f"parallel.pp_layer_split={split} must list {stages} positive block counts "
                                      f"(pp {cfg.pp} x {v} stages per rank)")
        if num_blocks is not None and sum(split) != num_blocks:
            raise PipelineConfigError(f"parallel.pp_layer_split={split} sums to {sum(split)} but the model has "
                                      f"{num_blocks} blocks")
    if num_blocks is not None and stages > num_blocks:
        raise TooFewBlocksError(f"{stages} pipeline stages (parallel.pp {cfg.pp} x {v} per rank) but the model "
                                  f"has only {num_blocks} blocks; every stage needs at least one block")


def balanced_split(block_sizes: Sequence[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Blocks per stage, contiguous, minimising the largest stage's parameter count.

    ``first_extra`` / ``last_extra`` are the parameters the first / last stage hold besides
    blocks (embedding; final norm and head). Exact min-max partition by dynamic programming:
    O(blocks^2 x stages), instant for any real depth.
    """
    n = len(block_sizes)
    if not 1 <= n_stages <= n:
        raise PipelineConfigError(f"cannot cut {n} blocks into {n_stages} non-empty stages")
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: smallest max-cost of putting blocks[:i] into stages[:s]; cut[s][i] where stage s-1 starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The global stage indices rank ``pp_rank`` runs, in its local order."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def analytic_bubble(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Idle fraction of a step the schedule's own paper predicts, with forward, input-grad and
    weight-grad each costing one unit per stage and no communication cost.

    GPipe / 1F1B: (p - 1) / (m + p - 1). Interleaved 1F1B: the fill and drain shrink by v:
    (p - 1) / (v m + p - 1). Zero-bubble schedules fill the drain with deferred weight
    gradients; their idle time is (p - 1) units of a third of a stage's work against 3 v m
    (ZB-H1 style, 1/3 of 1F1B's), and the V schedules reach about that too.
    """
    p, m, v = pp, microbatches, virtual
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)
