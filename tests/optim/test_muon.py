"""Muon equals ``torch.optim.Muon`` of the installed torch where that applies (2-D weights, its
bf16 iteration: bit for bit, both update scales, with and without Nesterov), each matrix of a
3-D expert stack equals it on that matrix alone, and the fp32 iteration equals the quintic
written out independently here (in float64) by the parity rule. Both sides use their own default
coefficients, so a changed coefficient fails."""

import pytest
import torch

from tests.parity_utils import PARITY_ULPS, assert_parity
from veomni.config.schema import OptimConfig, TrainConfig
from veomni.optim import Muon, build_optimizer, newton_schulz
from veomni.optim.muon import KELLER_COEFFICIENTS


def _matrices(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _step_both(ours, theirs, params_ours, params_theirs, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(params_ours, params_theirs):
            grad = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()


@pytest.mark.parametrize("adjust_lr,nesterov", [("original", True), ("match_rms_adamw", False)])
def test_equals_torch_muon_on_matrices(adjust_lr, nesterov):
    shapes = [(8, 5), (5, 8), (6, 6)]
    ours_p, theirs_p = _matrices(*shapes), _matrices(*shapes)
    ours = Muon(ours_p, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr=adjust_lr, ns_dtype="bf16")
    theirs = torch.optim.Muon(theirs_p, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr)
    _step_both(ours, theirs, ours_p, theirs_p)
    for a, b in zip(ours_p, theirs_p):
        assert torch.equal(a, b)
    for a, b in zip(ours_p, theirs_p):
        assert torch.equal(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"])


def test_each_expert_of_a_3d_stack_equals_torch_muon_on_that_matrix():
    (stack,) = _matrices((3, 6, 4))
    experts = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    ours = Muon([stack], lr=0.01, adjust_lr="match_rms_adamw", ns_dtype="bf16")
    theirs = torch.optim.Muon(experts, lr=0.01, adjust_lr_fn="match_rms_adamw")
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        stack.grad = torch.randn(stack.shape, generator=gen)
        for e, p in enumerate(experts):
            p.grad = stack.grad[e].clone()
        ours.step()
        theirs.step()
    for e, p in enumerate(experts):
        assert torch.equal(stack[e], p), f"expert {e}"


def test_built_from_the_config_it_is_torch_muon_with_keller_coefficients():
    """``train.optimizer: muon`` with the config's defaults: the same coefficients as torch's."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(6, 4, bias=False)

    torch.manual_seed(0)
    model = Block()
    (theirs_p,) = [torch.nn.Parameter(model.w.weight.detach().clone())]
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.0),
                          optim=OptimConfig(muon_ns_dtype="bf16", muon_adjust_lr="original"))
    theirs = torch.optim.Muon([theirs_p], lr=0.02, weight_decay=0.0)
    _step_both(opt, theirs, [model.w.weight], [theirs_p])
    assert torch.equal(model.w.weight, theirs_p)


def _quintic_float64(matrix, steps=5):
    """X <- a X + b (X X^T) X + c (X X^T)^2 X on the wide orientation, X0 = M / ||M||_F."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.double()
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


@pytest.mark.parametrize("shape", [(12, 7), (7, 12)])
def test_fp32_iteration_is_the_quintic(shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    got = newton_schulz(matrix, KELLER_COEFFICIENTS, 5, 1e-7, torch.float32)
    assert got.dtype == torch.float32 and got.shape == matrix.shape
    assert_parity(got, _quintic_float64(matrix).float(), "Newton-Schulz fp32", ulps=PARITY_ULPS)
    singular = torch.linalg.svdvals(got.double())
    assert 0.5 < singular.min() and singular.max() < 1.5  # orthogonal up to the quintic's spread


def test_refuses_vectors_and_bad_options():
    with pytest.raises(ValueError, match="Muon takes 2-D matrices"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr 'rms'"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], adjust_lr="rms")
