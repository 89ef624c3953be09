"""Shared pieces of the parity tests: a tiny model, fixed packed batches, a reference run, and
the one rule by which a parallel run is compared with its single-process reference.

The rule (docs/testing.md, "How parity is judged"): two fp32 runs that differ only in how they
split the work round differently, by a few rounding steps of the values they add up; a parity
bug changes a result by far more. So every tolerance is relative, in units of fp32's resolution
(``FP32_EPS``, one rounding step at magnitude 1): a scalar may differ by ``ulps * eps * |ref|``,
and an element of a tensor by ``ulps * eps * (|ref element| + max |ref|)`` (the tensor's own scale
bounds the rounding of elements that cancel to near zero; a gradient that cancels as a whole
takes a floor from the model's largest gradient, ``assert_grads_parity``). ``PARITY_ULPS`` steps is 7.6e-6
relative: it passes the reordering of fp32 sums on any CPU kernel path and thread count, and
fails an error of 1e-4 relative in a loss, a whole gradient or one element of it
(``tests/house/test_parity_rule.py`` plants those). A test that needs more says why at its call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from veomni.config.schema import ParallelConfig
from veomni.contract import build_model, get_model_spec
from veomni.data.packing import pack_samples
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
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


FP32_EPS = torch.finfo(torch.float32).eps
PARITY_ULPS = 64


def assert_scalar_parity(got: float, want: float, what: str, ulps: float = PARITY_ULPS) -> None:
    """``got`` equals the reference ``want`` up to ``ulps`` fp32 rounding steps of its magnitude."""
    bound = ulps * FP32_EPS * abs(want)
    assert abs(got - want) <= bound, (f"{what}: {got!r} vs reference {want!r} (differ by {abs(got - want):.3g}, "
                                      f"allowed {bound:.3g} = {ulps} fp32 steps of the reference)")


def assert_series_parity(got, want, what: str, ulps: float = PARITY_ULPS) -> None:
    """Two equally long sequences of scalars (losses per step, say), each pair by the rule."""
    got, want = list(got), list(want)
    assert len(got) == len(want), f"{what}: {len(got)} values vs {len(want)} in the reference"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_scalar_parity(g, w, f"{what}[{i}]", ulps)


def assert_parity(got: torch.Tensor, want: torch.Tensor, what: str, ulps: float = PARITY_ULPS,
                  scale: float = 0.0) -> None:
    """Element-wise: ``|got - want| <= ulps * eps * (|want| + max(max |want|, scale))`` (the
    module's rule; ``scale`` floors the tensor's own, see ``assert_grads_parity``)."""
    rtol = ulps * FP32_EPS
    scale = max(scale, want.detach().abs().max().item() if want.numel() else 0.0)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what} ({ulps} fp32 steps of the reference): {m}")


CANCELLED = 1e-2


def assert_grads_parity(got: dict, want: dict, what: str, ulps: float = PARITY_ULPS) -> None:
    """Gradients by name, each by the rule with its scale floored at ``CANCELLED`` times the
    largest gradient of the model: a gradient that is zero in exact arithmetic (a key projection's
    bias under softmax, say) is rounding noise with no scale of its own, as large as the
    rounding of the terms that cancelled, which the model's gradients bound."""
    assert got.keys() == want.keys(), f"{what}: gradients of {sorted(got)} vs {sorted(want)}"
    floor = CANCELLED * max((g.detach().abs().max().item() for g in want.values() if g.numel()), default=0.0)
    for name in want:
        assert_parity(got[name], want[name], f"{what} grad {name}", ulps, scale=floor)


def assert_records_close(ref: dict, got: dict, ulps: float = PARITY_ULPS) -> None:
    """Two ``run_steps`` records (losses, loss terms, gradients, parameters, buffers) agree by the
    rule; a record with another number of steps, or without a parameter or buffer of the reference,
    is refused (a run that stopped early must not pass on the steps it did make)."""
    for key in ("loss", "metrics", "grads"):
        assert len(got[key]) == len(ref[key]), (
            f"{key}: {len(got[key])} steps recorded vs {len(ref[key])} in the reference")
    for key in ("params", "buffers"):
        missing = sorted(ref.get(key, {}).keys() - got.get(key, {}).keys())
        assert not missing, f"{key}: {missing} of the reference not recorded"
    for step, (a, b) in enumerate(zip(ref["loss"], got["loss"])):
        assert_scalar_parity(b, a, f"step {step}: loss", ulps)
    for step, (ma, mb) in enumerate(zip(ref["metrics"], got["metrics"])):
        assert ma.keys() == mb.keys(), f"step {step}: metrics {sorted(ma)} vs {sorted(mb)}"
        for name in (n for n in ma if n.startswith("loss_")):  # moe/* statistics: tests/parallel/test_ep_parity.py
            assert_scalar_parity(mb[name], ma[name], f"step {step}: {name}", ulps)
    for step, (ga, gb) in enumerate(zip(ref["grads"], got["grads"])):
        assert_grads_parity(gb, ga, f"step {step}", ulps)
    for name in ref["params"]:
        assert_parity(got["params"][name], ref["params"][name], f"param {name}", ulps)
    for name in ref.get("buffers", {}):
        assert_parity(got["buffers"][name], ref["buffers"][name], f"buffer {name}", ulps)
