"""The rollout phase of an online-RL run in ``--dry-run`` (``train.objective: grpo``), next to the
update phase the main memory table is.

The built-in engine (``veomni.generation``) generates one prompt micro-batch at a time, all of its
``rl.group_size`` samples per prompt together, with a KV cache of ``slots x (longest prompt +
rl.max_new_tokens)`` positions per causal attention layer (keys and values: ``2 x kv_heads x
head_dim`` elements each, in the compute dtype), one slot per sample plus one scratch slot
(``generation/engine.py``). The plan takes each prompt as long as ``data.max_seq_len`` (the longest
the prompt loader keeps), so a micro-batch holds ``max(1, data.tokens_per_micro_batch //
data.max_seq_len)`` prompts: exact for prompts of that length; shorter prompts mean more of them
in shorter rows, so more cache for the new tokens (the plan then underestimates by up to
``extra prompts x group_size x max_new_tokens`` positions). The largest logits of the rollout
(fp32 rows x vocabulary) come from the prefill forward (each prompt once, its group sharing its
cache; at most ``DEFAULT_PREFILL_TOKENS`` prompt tokens at a time) or a decode step (one row per
sample). The sharded state (parameters, gradients,
optimizer, EMA, a reference) and the gathered blocks stay resident through the rollout; the
update's activations do not exist yet. An external engine (``rl.rollout_engine`` other than
``builtin``) sizes its own cache: the plan gives its share of the device's memory instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract.hooks import attention_modules
from veomni.generation.engine import DEFAULT_PREFILL_TOKENS

GiB = 2**30


@dataclass(frozen=True)
class RolloutMemory:
    prompts: int
    """Prompts per micro-batch (one micro-batch generates at a time)."""
    slots: int
    """Cache slots: one per sample (prompts x group_size) plus the scratch slot."""
    positions: int
    """Positions per slot: the longest prompt + max_new_tokens."""
    kv_cache_gb: float
    logits_rows: int
    logits_gb: float


def rollout_memory(cfg: RunConfig, model: nn.Module, attention_patterns: tuple[str, ...],
                   compute_bytes: int) -> RolloutMemory:
    """The built-in engine's rollout memory per rank, from the (meta) model and the run's settings."""
    layers = [module.attention_spec() for _, module in attention_modules(model, attention_patterns)]
    layers = [spec for spec in layers if spec.causal]
    per_position = sum(2 * spec.num_kv_heads * spec.head_dim for spec in layers) * compute_bytes
    longest = cfg.data.max_seq_len
    prompts = max(1, cfg.data.tokens_per_micro_batch // longest)
    samples = prompts * cfg.rl.group_size
    positions = longest + cfg.rl.max_new_tokens
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    rows = max(min(DEFAULT_PREFILL_TOKENS, prompts * longest), samples)
    return RolloutMemory(prompts, samples + 1, positions, (samples + 1) * positions * per_position / GiB,
                         rows, rows * vocab * 4 / GiB)


def rollout_lines(cfg: RunConfig, memory: RolloutMemory | None, resident_gb: float) -> list[str]:
    """The rollout phase's table (``memory`` None: an external engine's share instead)."""
    rl = cfg.rl
    if memory is None:
        return ["rollout phase / rank (estimate, GiB):",
                f"  {rl.rollout_engine} engine: rl.rollout_engine_memory = {rl.rollout_engine_memory:.2f} of the "
                "device (its weights and KV cache, freed between rollouts by its sleep mode)",
                f"  {'resident (sharded state + gathered blocks)':<42}{resident_gb:10.2f}"]
    total = resident_gb + memory.kv_cache_gb + memory.logits_gb
    return [
        "rollout phase / rank (estimate, GiB; the table above is the update phase):",
        f"  {f'KV cache ({memory.slots} slots x {memory.positions} positions)':<42}{memory.kv_cache_gb:10.2f}",
        f"  {f'logits (fp32, {memory.logits_rows} rows)':<42}{memory.logits_gb:10.2f}",
        f"  {'resident (sharded state + gathered blocks)':<42}{resident_gb:10.2f}",
        f"  {'total':<42}{total:10.2f}",
        f"  ({memory.prompts} prompt(s) of data.max_seq_len {cfg.data.max_seq_len} per micro-batch x "
        f"rl.group_size {rl.group_size} samples + 1 scratch slot; rl.max_new_tokens {rl.max_new_tokens})",
    ]
