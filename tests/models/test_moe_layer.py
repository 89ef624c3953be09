"""The MoE block on one device: grouped GEMM paths, dispatch, capacity, balance losses, bias update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.llm.config import LLMConfig
from models.llm.moe import MoE
from tests.parity_utils import assert_parity
from veomni.ops.grouped_gemm import grouped_mm

CFG = dict(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)


def _moe(**overrides) -> MoE:
    torch.manual_seed(0)
    cfg = LLMConfig(**{**CFG, **overrides})
    cfg.validate()
    moe = MoE(cfg, None)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped path must reproduce."""
    _, _, idx, weights = moe.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gate, up = (moe.experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "segments"])
def test_grouped_mm_matches_per_expert_matmuls_with_empty_groups(fused):
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    counts = torch.tensor([5, 0, 15, 0])
    got = grouped_mm(x, w, counts, fused=fused)
    ref = torch.cat([x[:5] @ w[0], x[5:] @ w[2]])
    assert_parity(got, ref, "got")
    got.pow(2).sum().backward()
    assert w.grad[1].abs().max() == 0 and w.grad[3].abs().max() == 0 and w.grad[0].abs().max() > 0


def test_grouped_mm_without_rows_still_gives_zero_weight_gradient():
    w = torch.randn(3, 4, 5, requires_grad=True)
    grouped_mm(torch.zeros(0, 4), w, torch.zeros(3, dtype=torch.long)).sum().backward()
    assert w.grad is not None and w.grad.abs().max() == 0


@pytest.mark.parametrize("overrides", [{}, {"router_scoring": "sigmoid", "routed_scaling_factor": 2.5},
                                       {"norm_topk_prob": False}], ids=["softmax", "sigmoid", "raw-topk"])
def test_grouped_dispatch_matches_naive_loop(overrides):
    moe = _moe(**overrides)
    x = torch.randn(40, 32)
    assert_parity(moe(x), _naive(moe, x), "moe(x)")


def test_capacity_factor_drops_only_overflow():
    moe = _moe(capacity_factor=1.0)
    x = torch.randn(60, 32)
    moe.router.expert_bias[0] = 10.0  # every token wants expert 0
    out = moe(x)
    capacity = 60 * 2 // 6
    _, _, idx, _ = moe.router(x)
    kept = moe._drop_over_capacity(idx)
    assert int((kept == 0).sum()) == capacity and int((kept >= 0).sum()) < idx.numel()
    # rows past capacity lose only their expert-0 contribution
    loaded = _moe(capacity_factor=0.0)
    loaded.load_state_dict(moe.state_dict())
    assert_parity(out[:capacity], loaded(x)[:capacity], "rows within capacity")
    assert not torch.allclose(out[capacity:], loaded(x)[capacity:], atol=1e-3)


def test_balance_and_z_losses_follow_their_definitions():
    moe = _moe(router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    x = torch.randn(30, 32)
    moe(x)
    logits, probs, idx, _ = moe.router(x)
    fraction = torch.bincount(idx.flatten(), minlength=6).float() / idx.numel()
    balance = 6 * (fraction * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert_parity(moe.last_aux, 0.1 * balance + 0.01 * z, "moe.last_aux")
    assert moe.last_load.tolist() == torch.bincount(idx.flatten(), minlength=6).tolist()


@pytest.mark.parametrize("overrides", [{"router_scoring": "sigmoid", "routed_scaling_factor": 2.5},
                                       {"norm_topk_prob": False}], ids=["sigmoid-normed", "softmax-raw"])
def test_balancing_bias_chooses_experts_but_never_weighs_them(overrides):
    """DeepSeek-V3's auxiliary-loss-free rule, written out here from the scores: the bias is added to
    the scores only to pick the top-k experts; the combine weights are the unbiased scores of the
    picked experts (normalised over them if asked, times the routed scale). The bias is large enough
    to change many tokens' choice, so a bias that leaked into the weights, or was left out of the
    choice, changes the output far beyond rounding (issue 47)."""
    moe = _moe(router_bias_update_rate=0.01, **overrides)
    moe.router.expert_bias.copy_(torch.tensor([0.6, -0.4, 0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    logits = x @ moe.router.weight.T
    scores = torch.sigmoid(logits) if moe.router.scoring == "sigmoid" else torch.softmax(logits, -1)
    chosen = torch.topk(scores + moe.router.expert_bias, 2, dim=-1).indices
    assert (chosen.sort(-1).values != torch.topk(scores, 2, -1).indices.sort(-1).values).any(-1).sum() >= 10
    weights = scores.gather(1, chosen)
    if moe.router.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * moe.router.scale
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            gate, up = (moe.experts.gate_up_proj[chosen[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (moe.experts.down_proj[chosen[t, j]] @ (F.silu(gate) * up))
    _, _, idx, got_weights = moe.router(x)
    assert torch.equal(idx, chosen)
    assert_parity(got_weights, weights, "combine weights")
    assert_parity(moe(x), want, "moe(x) with a balancing bias")


def test_bias_update_moves_towards_the_mean_load():
    moe = _moe(router_bias_update_rate=0.01)
    delta = moe.update_bias(torch.tensor([10.0, 0, 5, 5, 5, 5]))
    assert delta.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0])
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0])
    assert _moe().update_bias(torch.ones(6)).abs().sum() == 0  # off by default


def test_training_flops_count_only_activated_experts():
    from models.llm.model import DecoderLM

    moe = LLMConfig(**{**CFG, "num_experts": 64, "num_experts_per_tok": 4, "shared_expert_intermediate_size": 8})
    dense = LLMConfig(**{**CFG, "num_experts": 0, "intermediate_size": 4 * 16 + 8})
    router = 6 * 64 * 32 * 10  # the router's matmul, 10 tokens
    assert DecoderLM(moe).training_flops([10]) == DecoderLM(dense).training_flops([10]) + router


def test_padding_rows_are_not_routed_and_change_no_statistic():
    """Rows from ``valid_tokens`` on (sequence-parallel / pipeline padding) get no routed expert
    and leave the loads, the capacity and the auxiliary losses those of the real rows alone."""
    moe = _moe(router_aux_loss_coef=0.1, router_z_loss_coef=0.01, capacity_factor=1.0)
    x = torch.randn(30, 32)
    real = moe(x[:23])
    load, aux = moe.last_load, moe.last_aux
    padded = moe(x, valid_tokens=23)
    assert_parity(padded[:23], real, "padded[:23]")
    assert padded[23:].abs().max() == 0
    assert moe.last_load.tolist() == load.tolist() and int(load.sum()) == 23 * 2
    assert_parity(moe.last_aux, aux, "moe.last_aux")
    assert moe(x, valid_tokens=0).abs().max() == 0 and int(moe.last_load.sum()) == 0
