"""The GPU path of a LoRA run, checked on the CPU: the frozen base stored in bf16 beside fp32
adapters under FSDP2 (real gloo ranks). FSDP2 requires one dtype only among the parameters that
train, so the base shards in bf16 with the adapters in fp32 in the same units; a step moves only
the adapters, and the dtype rule picks bf16 only for a GPU under bf16 compute."""

from __future__ import annotations

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import sample_lengths, tiny_model
from veomni.adapters.lora import add_lora, base_dtype, init_lora
from veomni.config.schema import LoraConfig, ParallelConfig
from veomni.contract import get_model_spec
from veomni.data.packing import pack_samples
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh


@pytest.mark.parametrize("device, mixed, setting, want", [
    ("cuda", "auto", "auto", torch.bfloat16), ("cuda", "bf16", "auto", torch.bfloat16),
    ("cuda", "fp32", "auto", torch.float32), ("cuda", "auto", "fp32", torch.float32),
    ("cpu", "auto", "auto", torch.float32), ("cpu", "auto", "bf16", torch.float32),
    ("cuda", "fp32", "bf16", torch.bfloat16),
])
def test_the_base_is_stored_in_bf16_only_on_a_gpu_under_bf16(device, mixed, setting, want):
    assert base_dtype(LoraConfig(rank=4, base_dtype=setting), device, mixed) == want
    assert base_dtype(LoraConfig(rank=0), device, mixed) is None  # without LoRA nothing is cast


def _bf16_base_step(rank, world):
    meshes = build_mesh(ParallelDims.resolve(ParallelConfig(), world), "cpu")
    model = tiny_model()
    add_lora(model, LoraConfig(rank=4, alpha=8.0))
    init_lora(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    task = get_model_spec("llm").task(model.config)
    model = parallelize(model, ParallelConfig(), meshes, "cpu", frozen_dtype=torch.bfloat16)
    dtypes = {name: (p.dtype, p.requires_grad) for name, p in model.named_parameters()}
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    batch = task.prepare(pack_samples(sample_lengths(4, seed=rank)))
    task(model, batch).loss_sum.backward()
    optimizer.step()
    moved = {name: not torch.equal(before[name], p.full_tensor()) for name, p in model.named_parameters()}
    grads = {name: p.grad is not None for name, p in model.named_parameters()}
    return dtypes, moved, grads


def test_a_bf16_frozen_base_shards_beside_fp32_adapters_and_stays_put():
    for dtypes, moved, grads in run_distributed(_bf16_base_step, 2):
        adapters = {n for n in dtypes if n.endswith(("lora_A", "lora_B"))}
        assert adapters
        for name, (dtype, trains) in dtypes.items():
            if name in adapters:
                assert dtype == torch.float32 and trains and grads[name], name
            else:
                assert dtype == torch.bfloat16 and not trains and not grads[name] and not moved[name], name
        assert any(moved[n] for n in adapters)
