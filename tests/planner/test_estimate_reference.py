"""--dry-run prices a preference run's reference model: a full frozen fp32 copy sharded like the
policy (the policy's own parameter memory, again), nothing under LoRA (the base serves), nothing for sft."""

from __future__ import annotations

from veomni.config.schema import ParallelConfig, RunConfig
from veomni.contract import load_plugins
from veomni.parallel.mesh import ParallelDims
from veomni.planner.estimate import estimate, format_report

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=128)

LARGER = dict(vocab_size=65536, hidden_size=1024, intermediate_size=4096, num_heads=16, num_kv_heads=4, head_dim=64)
"""Hundreds of MiB of parameters per pipeline rank: the table's two decimals show them."""


def _estimate(objective: str, lora_rank: int = 0, dp_shard: int = 2, pp: int = 1, **options):
    load_plugins(["models"])
    cfg = RunConfig()
    cfg.model.options = {**TINY, **options}
    cfg.train.objective, cfg.lora.rank = objective, lora_rank
    cfg.parallel = ParallelConfig(dp_shard=dp_shard, pp=pp)
    dims = ParallelDims.resolve(cfg.parallel, dp_shard * pp)
    return cfg, dims, estimate(cfg, dims, compute_on_gpu=False)


def test_the_reference_costs_one_sharded_fp32_copy_and_nothing_under_lora_or_sft() -> None:
    cfg, dims, dpo = _estimate("dpo")
    assert dpo.reference_gb == dpo.params_gb > 0
    assert "reference model (frozen fp32 copy, 1/2)" in format_report(cfg, dims, dpo, "cpu")
    assert _estimate("sft")[2].reference_gb == 0.0
    assert _estimate("simpo")[2].reference_gb == 0.0, "SimPO is reference-free"
    cfg, dims, lora = _estimate("dpo", lora_rank=4)
    assert lora.reference_gb == 0.0 and "reference model (the base: no copy)" in format_report(cfg, dims, lora, "cpu")
    assert _estimate("dpo", dp_shard=4)[2].reference_gb == dpo.reference_gb / 2


def test_a_pipeline_prices_each_ranks_frozen_copy_of_its_own_stages() -> None:
    """Per pipeline rank, the reference is the rank's stages once more in fp32 (p+g+opt holds 4 fp32
    copies under AdamW: parameters, gradients and two moments), in the rank's total."""
    cfg, dims, dpo = _estimate("dpo", pp=2, **LARGER)
    table = format_report(cfg, dims, dpo, "cpu").splitlines()
    header = next(i for i, line in enumerate(table) if line.strip().startswith("pp rank"))
    assert "reference" in table[header]
    for row in table[header + 1:header + 3]:
        states, reference, gathered, _, activations, total = map(float, row.split()[4:])
        assert reference > 0 and abs(reference - states / 4) < 0.011
        assert abs(total - (states + reference + gathered + activations)) < 0.021
    cfg, dims, lora = _estimate("dpo", lora_rank=4, pp=2, **LARGER)
    assert "reference" not in format_report(cfg, dims, lora, "cpu")
