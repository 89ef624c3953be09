"""The bare ViT under FSDP2 (the engine's ``apply_fsdp`` over its ``parallel_plan``) at 2 gloo
ranks, each with a different uneven share of the images, against one process on all of them:
loss, full gradients and the parameters after one SGD step agree in fp32."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from harness.gloo_ranks import run_distributed
from tests.models.test_vit_model import GRIDS, inputs, tiny_model
from tests.parity_utils import assert_grads_parity, assert_parity, full_grads, full_params
from veomni.parallel.fsdp import apply_fsdp, mixed_precision_policy


def _train_step(rank: int, world: int) -> dict:
    model = tiny_model()
    images = inputs(GRIDS, model.config.patch_dim)
    total_tokens = int(model.num_output_tokens(torch.tensor(GRIDS)).sum())
    mine = list(range(rank, len(GRIDS), world))  # rank 0: 3 images, rank 1: 2 (one a video)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        apply_fsdp(model, model.parallel_plan(), mesh, mixed_precision_policy("fp32", "cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(torch.cat([images[i] for i in mine]), torch.tensor([GRIDS[i] for i in mine]))
    # FSDP averages gradients over ranks: scale so the sum over ranks is the global mean loss
    loss = out.square().sum() / total_tokens * world
    loss.backward()
    global_loss = loss.detach() / world
    if world > 1:
        dist.all_reduce(global_loss)
    grads = full_grads(model)
    optimizer.step()
    return {"loss": global_loss, "grads": grads, "params": full_params(model)}


def test_fsdp_two_ranks_match_one_process() -> None:
    reference = run_distributed(_train_step, 1)[0]
    for got in run_distributed(_train_step, 2):
        assert_parity(got["loss"], reference["loss"], "loss")
        assert_grads_parity(got["grads"], reference["grads"], "fsdp 2")
        for name, param in reference["params"].items():
            assert_parity(got["params"][name], param, f"param {name}")
