"""Static estimates for ``--dry-run``: parameters, FLOPs per unit of work and per-rank memory.

A unit is what one row element of the family's task is (its batch contract's ``unit``: a token
for language models, a sample for a per-row regression); the report names it.

The model is built on the meta device, so the estimate costs no memory even for full-size
recipes. Memory per rank (bytes):

- parameters, gradients: fp32 master copies, sharded over ``dp_shard x sp``;
- optimizer: the registered optimizer's fp32 state tensors per parameter (AdamW 2, Muon 1, SGD 0;
  ``OptimizerEntry.states``), sharded likewise; a weight EMA
  (``train.ema_decay``) one more fp32 copy, sharded likewise;
- under LoRA (``lora.rank`` > 0) gradients, optimizer and EMA cover only what trains, and the
  frozen base is stored in its own dtype (bf16 on GPU); the report then shows full fine-tuning
  beside it;
- gathered parameters: FSDP holds the root's parameters (embeddings, head; kept gathered) plus
  two blocks (the current one and the prefetched next) unsharded in the compute dtype; with
  expert parallelism a block gathers only its ``E / ep`` local experts;
- activations: the family's per-unit estimate (its spec's cost model) for the checkpointing
  mode, times the units a rank holds (the micro-batch budget, divided by the ``sp x cp`` ranks
  that split each row).

An online-RL run (an objective registered with ``rollouts``) adds its rollout phase's table after the
memory table, which is then the update phase's (``rollout_plan.py``).

Under sequence or context parallelism a "sequence split" section follows: each way to split a
row over the ``sp x cp`` ranks, with its attention traffic and buffers (``sequence_split.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from veomni.adapters.lora import add_lora, base_dtype, trainable_counts
from veomni.config.schema import LoraConfig, RunConfig
from veomni.contract import build_model, get_model_spec
from veomni.contract.graph_model import GraphCost
from veomni.contract.hooks import attention_modules
from veomni.contract.plan import flatten_plan, match_modules
from veomni.objectives.registry import frozen_copies, objective_entry, reference_copies
from veomni.optim import get_optimizer
from veomni.parallel.mesh import ParallelDims
from veomni.planner.graph_plan import graph_plan
from veomni.planner.rollout_plan import RolloutMemory, rollout_lines, rollout_memory
from veomni.planner.sequence_split import AttentionShape, sequence_split_lines

GiB = 2**30


@dataclass
class Estimate:
    total_params: int
    trainable_params: int
    """All of them, or under LoRA the adapters and the modules ``lora.train`` names."""
    activated_params: int
    """Parameters one unit uses (MoE: only its k routed experts); = total for dense models."""
    flops_per_unit: float
    """Per unit of the family's task (a token for LMs)."""
    unit: str
    """The task's unit (its batch contract's ``unit``)."""
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    gathered_gb: float
    activations_gb: float
    compute_bytes: int = 4
    """Bytes per element of gathered parameters and activations (2 under bf16 compute)."""
    model_lines: list[str] = field(default_factory=list)
    """Lines the family adds about itself (its cost model's ``report_lines``, e.g. VWN's overhead)."""
    history_gb: float = 0.0
    """Graph models in chunked runs: the per-layer history tables (``graph_plan.py``)."""
    ema_gb: float = 0.0
    """The weight EMA's fp32 copy (``train.ema_decay``)."""
    sequence_lines: list[str] = field(default_factory=list)
    """Under sp or cp > 1: each way to split a row over those ranks (``sequence_split.py``)."""
    reference_gb: float = 0.0
    """The objective's frozen copies of the model (a preference run's reference policy; 0 under LoRA,
    whose reference is the base with its adapters off)."""
    rollout: RolloutMemory | None = None
    """Online RL with the built-in engine: the rollout phase's own memory (``rollout_plan.py``)."""

    @property
    def total_gb(self) -> float:
        return (self.params_gb + self.grads_gb + self.optimizer_gb + self.ema_gb + self.gathered_gb
                + self.activations_gb + self.history_gb + self.reference_gb)


def estimate(cfg: RunConfig, dims: ParallelDims, compute_on_gpu: bool) -> Estimate:
    with torch.device("meta"):
        model_cfg, model = build_model(cfg.model.arch, cfg.model.options)
        add_lora(model, cfg.lora)
    spec = get_model_spec(cfg.model.arch)
    cost = spec.cost
    trainable, total = trainable_counts(model)
    frozen_dtype = base_dtype(cfg.lora, "cuda" if compute_on_gpu else "cpu", cfg.parallel.mixed_precision)
    frozen_bytes = frozen_dtype.itemsize if frozen_dtype is not None else 4
    seq = cfg.data.max_seq_len
    flops_per_unit = cost.sample_flops(model, seq) / seq
    compute_bytes = 2 if (cfg.parallel.mixed_precision == "bf16" or
                          (cfg.parallel.mixed_precision == "auto" and compute_on_gpu)) else 4
    plan = flatten_plan(model.parallel_plan())
    blocks = match_modules(model, plan.blocks)
    block_params = sorted((sum(p.numel() for p in b.parameters()) for _, b in blocks), reverse=True)
    root_params = total - sum(block_params)
    expert_params = sum(p.numel() for _, m in match_modules(model, plan.experts) for p in m.parameters())
    not_local = expert_params * (1 - 1 / dims.ep) / max(1, len(blocks))  # per block, left on other EP ranks
    shard = dims.shard_size
    optimizer_states = get_optimizer(cfg.train.optimizer).states
    activations = cost.activation_bytes_per_unit(model, compute_bytes, cfg.parallel.activation_checkpointing)
    activated = cost.activated_params(model)
    graph = (graph_plan(cfg, dims, model, cost, activations, model_cfg)
             if plan.message_passing and isinstance(cost, GraphCost) else None)
    activations_per_rank = activations * cfg.data.tokens_per_micro_batch / dims.row_ranks
    attention = attention_modules(model, plan.attention) if dims.row_ranks > 1 else []
    sequence_lines = []
    if attention:
        first = attention[0][1].attention_spec()
        shape = AttentionShape(len(attention), first.num_heads, first.num_kv_heads, first.head_dim)
        sequence_lines = sequence_split_lines(shape, cfg.data.tokens_per_micro_batch, dims.sp, dims.cp, dims.cp_mesh,
                                              compute_bytes, cfg.parallel.activation_checkpointing,
                                              cfg.train.grad_accum, activations_per_rank)
    return Estimate(
        total_params=total,
        activated_params=activated,
        flops_per_unit=flops_per_unit,
        unit=spec.build_task(model_cfg).contract.unit,
        trainable_params=trainable,
        params_gb=(4 * trainable + frozen_bytes * (total - trainable)) / shard / GiB,
        grads_gb=4 * trainable / shard / GiB,
        optimizer_gb=optimizer_states * 4 * trainable / shard / GiB,
        ema_gb=4 * trainable / shard / GiB if cfg.train.ema_decay else 0.0,
        gathered_gb=compute_bytes * (root_params + sum(block_params[:2]) - 2 * not_local) / GiB,
        activations_gb=activations_per_rank / GiB,
        compute_bytes=compute_bytes,
        model_lines=cost.report_lines(model, seq) + (graph.lines if graph else []),
        history_gb=graph.history_gb if graph else 0.0,
        sequence_lines=sequence_lines,
        reference_gb=frozen_copies(cfg) * 4 * total / shard / GiB,
        rollout=(rollout_memory(cfg, model, plan.attention, compute_bytes)
                 if objective_entry(cfg.train.objective).rollouts and cfg.rl.rollout_engine == "builtin" else None),
    )


def _memory_rows(cfg: RunConfig, dims: ParallelDims, est: Estimate) -> list[tuple[str, float]]:
    shard = dims.shard_size
    lora = cfg.lora.rank > 0
    return [
        (f"parameters ({'fp32 + frozen base' if lora else 'fp32'}, 1/{shard})", est.params_gb),
        (f"gradients (fp32{', trained only' if lora else ''}, 1/{shard})", est.grads_gb),
        (f"optimizer ({cfg.train.optimizer}, 1/{shard})", est.optimizer_gb),
        *([(f"weight EMA (fp32, 1/{shard})", est.ema_gb)] if est.ema_gb else []),
        *([(f"reference model ({'the base: no copy' if lora else f'frozen fp32 copy, 1/{shard}'})", est.reference_gb)]
          if reference_copies(cfg) else []),
        ("gathered params (root + 2 blocks" + (f", E/{dims.ep} exp.)" if dims.ep > 1 else ")"),
         est.gathered_gb),
        (f"activations (checkpointing={cfg.parallel.activation_checkpointing})", est.activations_gb),
        *([("history tables (graph chunks)", est.history_gb)] if est.history_gb else []),
        ("total", est.total_gb),
    ]


def format_report(cfg: RunConfig, dims: ParallelDims, est: Estimate, device_desc: str,
                  full: Estimate | None = None) -> str:
    """``full``: the same run without LoRA, shown beside a LoRA run's memory."""
    unit = est.unit
    step_units = cfg.train.grad_accum * cfg.data.tokens_per_micro_batch * dims.dp_size
    memory = _memory_rows(cfg, dims, est)
    if dims.pp > 1:  # each rank holds only its stages: the per-pipeline-rank table replaces the totals
        from veomni.planner.pipeline_memory import pipeline_memory_lines

        memory_lines = pipeline_memory_lines(cfg, dims, est.compute_bytes, unit)
        if est.history_gb:
            memory_lines.append(f"  + history tables (graph chunks): {est.history_gb:.3f} GiB on the rank with the "
                                "most layers, on top of its total")
    elif full is not None:
        whole = [value for _, value in _memory_rows(replace(cfg, lora=LoraConfig()), dims, full)]
        memory_lines = [f"memory / rank (estimate, GiB):{'LoRA':>26}{'full FT':>10}",
                        *(f"  {name:<42}{value:10.2f}{other:10.2f}" for (name, value), other in zip(memory, whole))]
    else:
        memory_lines = ["memory / rank (estimate, GiB):", *(f"  {name:<42}{value:10.2f}" for name, value in memory)]
    lines = [
        f"layout        {dims.describe()}",
        f"devices       {device_desc}",
        f"parameters    {est.total_params:,} ({est.total_params / 1e9:.3f} B)",
        *([f"trainable     {est.trainable_params:,} ({100 * est.trainable_params / est.total_params:.2f}%: "
           f"LoRA rank {cfg.lora.rank}{' + ' + ', '.join(cfg.lora.train) if cfg.lora.train else ''})"]
          if cfg.lora.rank > 0 else []),
        f"activated     {est.activated_params:,} ({est.activated_params / 1e9:.3f} B) per {unit}",
        f"model FLOPs   {est.flops_per_unit / 1e9:.3f} GFLOP per {unit} (forward+backward, in a sample of "
        f"data.max_seq_len {cfg.data.max_seq_len} {unit}s)",
        *est.model_lines,
        f"per step      {cfg.train.grad_accum} micro-batch(es) x {cfg.data.tokens_per_micro_batch} {unit}s x "
        f"{dims.dp_size} dp ranks = {step_units:,} {unit}s",
        *memory_lines,
        *(rollout_lines(cfg, est.rollout, est.total_gb - est.activations_gb - est.history_gb)
          if objective_entry(cfg.train.objective).rollouts else []),
        *est.sequence_lines,
    ]
    return "\n".join(lines)
