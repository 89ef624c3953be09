"""--dry-run plans a GRPO run's two phases: the rollout's KV cache and logits beside the update's
table, and the frozen reference only when ``rl.kl_coef > 0`` (none is built at 0).

The expected figures are the formula written out from the model's options (layers, kv heads, head
dim, vocabulary) and the run's settings: one prompt micro-batch generates at a time, each prompt
taken as long as ``data.max_seq_len``, ``rl.group_size`` samples each plus one scratch slot, each
of ``max_seq_len + rl.max_new_tokens`` positions, keys and values in the compute dtype; the logits
of the largest forward in fp32 (a prefill of every prompt once, its group sharing it, at most 8192
tokens, or a decode step's row per sample)."""

from __future__ import annotations

import pytest

from veomni.config.schema import ParallelConfig, RunConfig
from veomni.contract import load_plugins
from veomni.parallel.mesh import ParallelDims
from veomni.planner.estimate import estimate, format_report

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=256)
GiB = 2**30


def _grpo(on_gpu: bool = False, **settings) -> tuple[RunConfig, ParallelDims, object]:
    load_plugins(["models"])
    cfg = RunConfig()
    cfg.model.options = dict(TINY)
    cfg.train.objective = "grpo"
    cfg.parallel = ParallelConfig(dp_shard=2)
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    dims = ParallelDims.resolve(cfg.parallel, 2)
    return cfg, dims, estimate(cfg, dims, compute_on_gpu=on_gpu)


@pytest.mark.parametrize("on_gpu, settings, prompts", [
    (False, dict(data__max_seq_len=32, data__tokens_per_micro_batch=40, rl__group_size=2, rl__max_new_tokens=4), 1),
    (True, dict(data__max_seq_len=64, data__tokens_per_micro_batch=256, rl__group_size=8, rl__max_new_tokens=16), 4),
], ids=["cpu-fp32", "gpu-bf16"])
def test_the_rollout_phase_prices_the_kv_cache_and_the_logits(on_gpu: bool, settings: dict, prompts: int) -> None:
    cfg, dims, est = _grpo(on_gpu, **settings)
    longest, group, new = settings["data__max_seq_len"], settings["rl__group_size"], settings["rl__max_new_tokens"]
    compute_bytes = 2 if on_gpu else 4
    kv = (prompts * group + 1) * (longest + new) * TINY["num_layers"] * 2 * TINY["num_kv_heads"] * TINY["head_dim"]
    assert est.rollout.kv_cache_gb * GiB == kv * compute_bytes
    rows = max(min(8192, prompts * longest), prompts * group)
    assert est.rollout.logits_gb * GiB == rows * TINY["vocab_size"] * 4
    report = format_report(cfg, dims, est, "cpu")
    assert "rollout phase / rank" in report and f"KV cache ({prompts * group + 1} slots x {longest + new}" in report
    resident = est.params_gb + est.grads_gb + est.optimizer_gb + est.gathered_gb + est.reference_gb
    total = float(report.split("rollout phase")[1].split("total")[1].split()[0])
    assert abs(total - (resident + est.rollout.kv_cache_gb + est.rollout.logits_gb)) < 0.006


def test_the_reference_is_planned_only_with_a_kl_penalty() -> None:
    cfg, dims, without = _grpo(rl__kl_coef=0.0)
    assert without.reference_gb == 0.0 and "reference model" not in format_report(cfg, dims, without, "cpu")
    cfg, dims, with_kl = _grpo(rl__kl_coef=0.05)
    assert with_kl.reference_gb == with_kl.params_gb > 0
    assert "reference model (frozen fp32 copy, 1/2)" in format_report(cfg, dims, with_kl, "cpu")


def test_an_external_engine_is_planned_by_its_memory_share() -> None:
    cfg, dims, est = _grpo(rl__rollout_engine="vllm", rl__rollout_engine_memory=0.4)
    assert est.rollout is None
    assert "vllm engine: rl.rollout_engine_memory = 0.40 of the device" in format_report(cfg, dims, est, "cpu")
