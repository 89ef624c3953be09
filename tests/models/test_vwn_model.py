"""VWN: equivalence with the dense decoder, DGHC gradients, initialisation, config errors,
MTP targets, optimizer groups and the FLOP count."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from models.vwn.hyper_connection import GeneralizedHyperConnection
from tests.models.test_llm_model import _naive_attention
from tests.parity_utils import assert_parity
from veomni.config.schema import TrainConfig
from veomni.contract import build_config, build_model, get_model_spec
from veomni.contract.plan import match_modules
from veomni.data.packing import pack_samples
from veomni.ops.grouped_gemm import grouped_mm
from veomni.optim import build_optimizer
from veomni.tasks import MultiTokenLMTask, next_two_token_labels

BACKBONE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=128, family="qwen3", qk_norm=True,
                tie_embeddings=False, init_std=0.1)
LENGTHS = (5, 11, 3, 8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           router_aux_loss_coef=0.01)


def _samples(lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, BACKBONE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def _vwn(**options):
    torch.manual_seed(0)
    _, model = build_model("vwn", BACKBONE | options)
    model.init_weights()
    return model


def _forward(model, batch, **kwargs):
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                 **kwargs)


@pytest.mark.parametrize("m, factorized, ffn", [(1, False, {}), (2, False, {}), (4, True, {}), (2, False, MOE)],
                         ids=["m1", "m2", "m4-factorised", "m2-moe"])
def test_n_equal_m_at_init_equals_the_plain_decoder(m, factorized, ffn):
    """n = m, dynamic parts at zero, the plain (dense or MoE) decoder's weights: the same logits (fp32)."""
    torch.manual_seed(3)
    _, llm = build_model("llm", BACKBONE | ffn)
    llm.init_weights()
    vwn = _vwn(vwn_m=m, vwn_n=m, factorized_embedding=factorized, **ffn)
    missing, unexpected = vwn.load_state_dict(llm.state_dict(), strict=False)
    assert not unexpected
    assert all("_hc." in k or k.startswith(("reduce.", "embed_expand.")) for k in missing), missing
    batch = pack_samples(_samples())
    diff = (_forward(vwn, batch) - _forward(llm, batch)).abs().max().item()
    assert diff <= 1e-6, diff
    # and the hyper-connections are live: a non-zero dynamic weight changes the logits
    with torch.no_grad():
        vwn.layers[0].attn_hc.dynamic_alpha.normal_()
    assert (_forward(vwn, batch) - _forward(llm, batch)).abs().max().item() > 1e-3


def test_static_initialisation_is_the_papers():
    hc = GeneralizedHyperConnection(hidden_size=8, m=2, n=3)
    # A = [[I_m, I_m, 0], [0, 0, I_{n-m}]] (n x (m+n)); B[i, j] = [i == j mod m] stored as B^T (n x m)
    assert torch.equal(hc.static_alpha, torch.tensor([[1., 0, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 1]]))
    assert torch.equal(hc.static_beta.T, torch.tensor([[1., 0, 1], [0, 1, 0]]))
    assert not hc.dynamic_alpha.any() and not hc.dynamic_beta.any()
    assert (hc.alpha_scale == 1).all() and (hc.beta_scale == 1).all()


def test_hyper_connection_gradcheck_float64():
    """Gradients of read -> block -> write w.r.t. the state and every DGHC parameter, away from
    the initialisation (random dynamic weights, scales and static maps) so every path is live."""
    torch.manual_seed(0)
    hc = GeneralizedHyperConnection(hidden_size=4, m=2, n=3).double()
    names = [name for name, _ in hc.named_parameters()]
    values = [(p.detach() + 0.5 * torch.randn_like(p)).requires_grad_() for _, p in hc.named_parameters()]
    weight = torch.randn(4, 4, dtype=torch.float64)

    def layer(h, *params):
        return functional_call(hc, dict(zip(names, params)), (h, lambda x: torch.tanh(x @ weight)))

    h = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (h, *values), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(hidden_size=30, vwn_m=4, vwn_n=6), "divisible by vwn_m"),
    (dict(vwn_m=4, vwn_n=2), "must be >= vwn_m"),
    (dict(vwn_m=0), "vwn_m must be a positive int"),
    (dict(vwn_m=2, vwn_n=3, tie_embeddings=True), "tie_embeddings"),
    (dict(vwn_m=2, vwn_n=3, reduce_group_norm=True), "multiple of the group size"),
    (dict(vwn_m=2, vwn_n=4, hyper_connections=False), "needs vwn_n == vwn_m"),
    (dict(mtp_loss_weight=-1.0), "mtp_loss_weight"),
])
def test_impossible_configs_fail_at_config_time(options, message):
    with pytest.raises(ValueError, match=message):
        build_config("vwn", BACKBONE | options)


def test_group_norm_default_follows_the_paper():
    def on(m, n):
        return build_config("vwn", BACKBONE | dict(vwn_m=m, vwn_n=n)).use_group_norm
    assert not on(2, 3) and not on(2, 2)  # omitted at 1.5x (fractional r) and at r = 1
    assert on(2, 4) and on(4, 16) and on(2, 16)


def test_mtp_targets_are_two_ahead_within_each_sample():
    batch = pack_samples([[10, 11, 12, 13], [20, 21], [30, 31, 32]])
    labels = next_two_token_labels(batch["labels"], batch["cu_seqlens"]).tolist()
    assert labels == [12, 13, -100, -100, -100, -100, 32, -100, -100]


def test_packed_row_equals_each_sample_alone_with_mtp():
    model = _vwn(vwn_m=2, vwn_n=6, mtp=True, factorized_embedding=True)
    samples = _samples()
    packed_ntp, packed_mtp = _forward(model, pack_samples(samples), mtp=True)
    alone = [_forward(model, pack_samples([s]), mtp=True) for s in samples]
    assert_parity(packed_ntp, torch.cat([a for a, _ in alone]), "packed_ntp")
    packed = pack_samples(samples)
    valid = next_two_token_labels(packed["labels"], packed["cu_seqlens"]) != -100
    alone_mtp = torch.cat([b for _, b in alone])
    assert_parity(packed_mtp[valid], alone_mtp[valid], "packed_mtp[valid]")


def test_mtp_task_reports_both_losses_and_weights_the_sum():
    model = _vwn(vwn_m=2, vwn_n=4, mtp=True, mtp_loss_weight=0.5)
    batch = pack_samples(_samples())
    task = get_model_spec("vwn").task(model.config)
    assert isinstance(task, MultiTokenLMTask)
    out = task(model, batch)
    (ntp, n_ntp), (mtp, n_mtp) = out.metrics["loss_ntp"], out.metrics["loss_mtp"]
    assert n_ntp == sum(LENGTHS) - len(LENGTHS) and n_mtp == sum(n - 2 for n in LENGTHS)
    assert_parity(out.loss_sum.detach(), ntp + 0.5 * mtp, "out.loss_sum.detach()")


def test_static_maps_do_not_decay_dynamic_parts_do():
    model = _vwn(vwn_m=2, vwn_n=3, mtp=True)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), get_model_spec("vwn").param_rules(model.config))
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("static_alpha", "static_beta") or param.ndim < 2:
            assert decay[id(param)] == 0.0, name
        else:
            assert decay[id(param)] == 0.1, name
    statics = [n for n, _ in model.named_parameters() if n.endswith("static_alpha")]
    assert len(statics) == 2 * 3  # two DGHCs in each of 2 layers and the MTP block


def test_plan_names_hyper_connected_blocks_and_attention_cores():
    model = _vwn(vwn_m=2, vwn_n=3, mtp=True)
    plan = model.parallel_plan()
    blocks = match_modules(model, plan.blocks)
    assert [name for name, _ in blocks] == ["layers.0", "layers.1", "mtp.block"]
    assert all(hasattr(m, "attn_fn") for _, m in match_modules(model, plan.attention))
    assert len(match_modules(model, plan.attention)) == 3


@pytest.mark.parametrize("options", [
    dict(vwn_m=2, vwn_n=3),
    dict(vwn_m=2, vwn_n=8, factorized_embedding=True, mtp=True),
    dict(vwn_m=2, vwn_n=2, hyper_connections=False, mtp=True),
    dict(vwn_m=2, vwn_n=4, mtp=True, **MOE),
], ids=["r1.5", "r4-factorised-mtp", "baseline-mtp", "r2-moe-mtp"])
def test_training_flops_match_flop_counter(options, monkeypatch):
    """Every matmul (linears, DGHC maps, attention, the k routed experts) of forward + backward,
    counted by torch (experts through the per-segment matmuls: the counter skips grouped_mm)."""
    monkeypatch.setattr("models.llm.moe.grouped_mm", functools.partial(grouped_mm, fused=False))
    model = _vwn(**options)
    for module in model.modules():
        if hasattr(module, "attn_fn"):
            module.attn_fn = _naive_attention
    batch = pack_samples(_samples())
    with FlopCounterMode(display=False) as counter:
        out = _forward(model, batch, mtp=model.mtp is not None)
        (torch.cat(out) if isinstance(out, tuple) else out).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.bmm"}
    # the model counts causal pairs; the naive reference kernel computes full squares
    cfg = model.config
    blocks = cfg.num_layers + int(model.mtp is not None)
    masked = 12 * cfg.num_heads * cfg.dim_per_head * sum(n * n - n * (n + 1) // 2 for n in LENGTHS)
    assert sum(counts.values()) == model.training_flops(list(LENGTHS)) + blocks * masked


def test_virtual_width_overhead_matches_the_paper_count():
    """(m, n) = (2, 3): 42D matmul FLOPs per DGHC per token forward (paper: 42D + 6D incl. a 6D norm)."""
    hc = GeneralizedHyperConnection(hidden_size=64, m=2, n=3)
    assert hc.training_flops_per_token() == 3 * 42 * 64
