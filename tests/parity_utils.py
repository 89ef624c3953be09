"""Shared pieces of the parity tests: a tiny model, fixed packed batches, a reference run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from veomni.config.schema import ParallelConfig
from veomni.data.packing import pack_samples
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.spec import build_model, get_model_spec
from veomni.train.step import clip_and_step, forward_backward

TINY_LLM = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=128, family="qwen3", qk_norm=True)


def tiny_model(seed: int = 0, arch: str = "llm", **overrides):
    torch.manual_seed(seed)
    _, model = build_model(arch, {**TINY_LLM, **overrides})
    model.init_weights()
    return model


def sample_lengths(n: int, seed: int = 1) -> list[list[int]]:
    """``n`` samples of varied lengths (3..40 tokens) with fixed content."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (n,), generator=gen).tolist()
    return [torch.randint(0, TINY_LLM["vocab_size"], (n_,), generator=gen).tolist() for n_ in lengths]


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        out[name.replace("_checkpoint_wrapped_module.", "")] = (
            grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    return {name.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for name, p in model.named_parameters()}


def run_steps(micro_batches_per_step: list[list[list[list[int]]]], parallel: ParallelConfig | None = None,
              lr: float = 0.5, arch: str = "llm", options: dict | None = None, prepare=None) -> dict:
    """Train with SGD on this rank's micro-batches (step -> micro-batch -> samples; under
    sequence parallelism every rank of an SP group passes the same samples and keeps its
    slice) and record, per step, the global loss, the task's loss terms (``loss_*``) and MoE
    statistics (``moe/*``), and the full gradients; then the final parameters.
    ``arch``/``options`` pick the model (tiny LLM dimensions by default; options can make it a
    mixture of experts); ``prepare`` may edit the built model before it is parallelised.

    SGD keeps the comparison exact: AdamW amplifies 1e-8 rounding in near-zero gradients.
    """
    world = dist.get_world_size()
    dims = ParallelDims.resolve(parallel or ParallelConfig(), world)
    meshes = build_mesh(dims, "cpu")
    model = tiny_model(arch=arch, **(options or {}))
    if prepare is not None:
        prepare(model)
    task = get_model_spec(arch).task(model.config)
    model = parallelize(model, parallel or ParallelConfig(), meshes, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    record = {"loss": [], "grads": [], "metrics": []}
    for micro_batches in micro_batches_per_step:
        batches = [shard_batch(task.prepare(pack_samples(samples)), meshes.row_split, task.contract)
                   for samples in micro_batches]
        metrics = forward_backward(model, task, batches, meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({k: v for k, v in metrics.items() if k.startswith(("loss_", "moe/"))})
        record["grads"].append(full_grads(model))
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(model)
    record["buffers"] = {name.replace("_checkpoint_wrapped_module.", ""): b.detach().clone()
                         for name, b in model.named_buffers()}
    return record


def assert_records_close(ref: dict, got: dict, atol: float = 1e-6) -> None:
    for step, (a, b) in enumerate(zip(ref["loss"], got["loss"])):
        assert abs(a - b) < atol, f"step {step}: loss {a} vs {b}"
    for step, (ma, mb) in enumerate(zip(ref["metrics"], got["metrics"])):
        assert ma.keys() == mb.keys(), f"step {step}: metrics {sorted(ma)} vs {sorted(mb)}"
        for name in (n for n in ma if n.startswith("loss_")):  # moe/* statistics: tests/test_ep_parity.py
            assert abs(ma[name] - mb[name]) < atol, f"step {step}: {name} {ma[name]} vs {mb[name]}"
    for step, (ga, gb) in enumerate(zip(ref["grads"], got["grads"])):
        assert ga.keys() == gb.keys()
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], atol=atol, rtol=1e-5, msg=f"step {step} grad {name}")
    for name in ref["params"]:
        torch.testing.assert_close(got["params"][name], ref["params"][name], atol=atol, rtol=1e-5,
                                   msg=f"param {name}")
    for name in ref.get("buffers", {}):
        torch.testing.assert_close(got["buffers"][name], ref["buffers"][name], atol=atol, rtol=0,
                                   msg=f"buffer {name}")
