"""Muon on sharded parameters equals Muon on one process, on real gloo ranks: FSDP2 over 2 and
over 4 ranks (matrices whose rows do not divide: some ranks hold 1 row or none, an expert stack
with fewer experts than ranks), HSDP 2x2, EP 2 (experts whole on their rank) and EP 2 x FSDP 2
(each expert's rows split too; and a matrix split on both dims, which takes the whole-tensor
fallback). The gradients are set by hand, equal to one process's, so the
optimizer alone is compared. With one owner per matrix (``muon_split_balance: 0``) gather,
orthogonalise, scatter must give the one-process result exactly (same inputs, same arithmetic on
the owner); with the default plan, which splits the larger matrices' iterations over teams of
ranks here, the result equals one process by the parity rule (the Gram sums add in another order)."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_parity
from veomni.config.schema import OptimConfig, TrainConfig
from veomni.optim import build_optimizer
from veomni.optim.muon_plan import ns_flops, plan_owners

STEPS = 3
TRAIN = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1)
WHOLE = OptimConfig(muon_adjust_lr="match_rms_adamw", muon_split_balance=0)
SPLIT = replace(WHOLE, muon_split_balance=1.05)


class Blocks(nn.Module):
    """Matrices of uneven row counts (12, 5, 3 rows) and a stack of 3 experts."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 12), nn.Linear(12, 5), nn.Linear(5, 3)])
        self.experts = nn.Parameter(torch.randn(3, 6, 4))


def _model() -> Blocks:
    torch.manual_seed(0)
    return Blocks()


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in _model().named_parameters()}


def _train(model: nn.Module, optim: OptimConfig = WHOLE) -> dict[str, torch.Tensor]:
    opt = build_optimizer(model, TRAIN, optim=optim)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            grad = _grads(step)[name]
            p.grad = (distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                      if isinstance(p, DTensor) else grad)
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _fsdp(rank, world, mesh_shape, optim=WHOLE):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = _model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, optim)


def _expert_parallel(rank, world, mesh_shape, optim=WHOLE):
    """Experts as the EP recipe lays them (``Shard(0)`` on ``ep``), with ``Shard(1)`` of their rows
    over ``ep_fsdp`` when that is > 1; the dense layers replicated."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ep_fsdp", "ep"))
    model = _model()
    placements = [Shard(1) if mesh_shape[0] > 1 else Replicate(), Shard(0)]
    model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh, placements, src_data_rank=None))
    if mesh_shape[0] > 1:  # a matrix split on both of its dims: the whole-tensor fallback
        weight = model.layers[0].weight.detach()
        model.layers[0].weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0), Shard(1)], src_data_rank=None))
    return _train(model, optim)


def _assert_equal_to_one_process(results):
    want = _train(_model())
    for got in results:
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


def test_fsdp_2_and_fsdp_4_with_uneven_rows_equal_one_process():
    _assert_equal_to_one_process(run_distributed(_fsdp, 2, (2,)))
    _assert_equal_to_one_process(run_distributed(_fsdp, 4, (4,)))


def test_hsdp_2x2_equals_one_process():
    _assert_equal_to_one_process(run_distributed(_fsdp, 4, (2, 2)))


def test_ep_2_and_ep_2_x_fsdp_2_equal_one_process():
    _assert_equal_to_one_process(run_distributed(_expert_parallel, 2, (1, 2)))
    _assert_equal_to_one_process(run_distributed(_expert_parallel, 4, (2, 2)))


@pytest.mark.parametrize("layout,world,mesh_shape", [(_fsdp, 4, (4,)), (_fsdp, 4, (2, 2)),
                                                     (_expert_parallel, 4, (2, 2))])
def test_iterations_split_over_teams_equal_one_process_by_the_parity_rule(layout, world, mesh_shape):
    """The default plan splits here (a 12 x 8 matrix among 5 x 12 and 3 x 5 ones cannot be balanced
    whole, nor one expert over 2 ranks): tall and wide matrices, shards of 1 row or none, an
    expert's rows over ``ep_fsdp`` (the second EP slice holds one of the 3 experts)."""
    shard = mesh_shape[-1] if layout is _fsdp else mesh_shape[0]
    shapes = [(12, 8), (5, 12), (3, 5)] if layout is _fsdp else [(6, 4)]
    teams = plan_owners([ns_flops(*shape) for shape in shapes], shard, [min(shape) for shape in shapes]).teams
    assert max(len(team) for team in teams) > 1
    want = _train(_model(), SPLIT)
    for got in run_distributed(layout, world, mesh_shape, SPLIT):
        for name, tensor in want.items():
            assert_parity(got[name], tensor, name)
