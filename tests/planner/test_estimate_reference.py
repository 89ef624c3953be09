"""--dry-run prices a preference run's reference model: a full frozen fp32 copy sharded like the
policy (the policy's own parameter memory, again), nothing under LoRA (the base serves), nothing for sft."""

from __future__ import annotations

from veomni.config.schema import ParallelConfig, RunConfig
from veomni.contract import load_plugins
from veomni.parallel.mesh import ParallelDims
from veomni.planner.estimate import estimate, format_report

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=128)


def _estimate(objective: str, lora_rank: int = 0, dp_shard: int = 2):
    load_plugins(["models"])
    cfg = RunConfig()
    cfg.model.options = dict(TINY)
    cfg.train.objective, cfg.lora.rank = objective, lora_rank
    cfg.parallel = ParallelConfig(dp_shard=dp_shard)
    dims = ParallelDims.resolve(cfg.parallel, dp_shard)
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
