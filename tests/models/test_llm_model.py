"""DecoderLM and its ops on their own: packing, attention dispatch, FLOPs, plan, registry."""

from __future__ import annotations

import functools
import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from models.llm import DecoderLM, LLMConfig
from tests.parity_utils import assert_parity
from veomni.contract import ModelSpec, build_model, get_model_spec
from veomni.contract.plan import match_modules
from veomni.data.packing import pack_samples
from veomni.ops.attention import SeqInfo, gqa_keywords, sdpa_varlen_attention, varlen_attention

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "tie_embeddings": False,
    "init_std": 0.1,
}
LENGTHS = (5, 11, 3, 8)


def _tiny_model(**overrides) -> DecoderLM:
    _, model = build_model("llm", TINY | overrides)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def _samples(lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def _run(model: DecoderLM, batch: dict) -> torch.Tensor:
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])


def _qkv(lengths, hq=4, hkv=2, d=8, pad=0):
    gen = torch.Generator().manual_seed(2)
    total = sum(lengths) + pad
    q, k, v = (torch.randn(total, h, d, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, SeqInfo(cu, max(lengths))


def _dense_reference(q, k, v, seq: SeqInfo) -> torch.Tensor:
    """Plain softmax attention over the whole row with an explicit block-diagonal causal mask."""
    used = int(seq.cu_seqlens[-1])
    group = q.shape[1] // k.shape[1]
    qh = q[:used].transpose(0, 1)
    kh, vh = (x[:used].repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
    sample = torch.repeat_interleave(torch.arange(len(seq.cu_seqlens) - 1), seq.cu_seqlens.diff())
    pos = torch.arange(used)
    allowed = (sample[:, None] == sample[None, :]) & (pos[:, None] >= pos[None, :])
    scores = (qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    out = (scores.softmax(-1) @ vh).transpose(0, 1)
    return torch.cat([out, out.new_zeros(q.shape[0] - used, *out.shape[1:])])


def _naive_attention(q, k, v, seq: SeqInfo) -> torch.Tensor:
    """Per-sample attention from explicit matmuls, so FlopCounterMode sees its FLOPs."""
    bounds = seq.cu_seqlens.tolist()
    outs = [
        _dense_reference(q[a:b], k[a:b], v[a:b], SeqInfo(torch.tensor([0, b - a]), b - a))
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(outs)


def test_packed_logits_and_loss_equal_per_sample_runs() -> None:
    model = _tiny_model()
    samples = _samples()
    batch = pack_samples(samples)
    packed = _run(model, batch)
    alone = torch.cat([_run(model, pack_samples([s])) for s in samples])
    assert_parity(packed, alone, "packed")

    packed_loss = F.cross_entropy(packed, batch["labels"], ignore_index=-100, reduction="sum")
    alone_loss = sum(
        F.cross_entropy(_run(model, b := pack_samples([s])), b["labels"], reduction="sum") for s in samples
    )
    assert_parity(packed_loss, alone_loss, "packed_loss")


@pytest.mark.parametrize("block_diagonal", [False, True, None])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_varlen_attention_matches_dense_reference(block_diagonal, hkv) -> None:
    q, k, v, seq = _qkv([5, 1, 9, 4], hkv=hkv, pad=3)
    out = sdpa_varlen_attention(q, k, v, seq, block_diagonal=block_diagonal)
    assert_parity(out, _dense_reference(q, k, v, seq), "out")
    assert out[-3:].abs().max() == 0  # padding tail: zero output


def test_fallback_paths_agree_in_values_and_gradients() -> None:
    q, k, v, seq = _qkv([7, 2, 12], hkv=2)
    grads = []
    for block_diagonal in (False, True):
        out = sdpa_varlen_attention(q, k, v, seq, block_diagonal=block_diagonal)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*grads):
        assert_parity(a, b, "a")
    assert_parity(varlen_attention(q, k, v, seq), grads[0][0], "varlen_attention(q, k, v, seq)")


def test_training_flops_match_flop_counter() -> None:
    model = _tiny_model()
    for layer in model.layers:
        layer.attn.attn_fn = _naive_attention
    batch = pack_samples(_samples())
    with FlopCounterMode(display=False) as counter:
        _run(model, batch).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    cfg = model.config
    lengths = list(LENGTHS)
    per_pair = 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head
    causal = per_pair * sum(n * (n + 1) // 2 for n in lengths)
    assert counts["aten.mm"] == model.training_flops(lengths) - causal  # every linear, fwd + bwd
    # the naive reference kernel computes QK^T and PV over full squares, fwd + bwd
    assert counts["aten.bmm"] == per_pair * sum(n * n for n in lengths)
    assert set(counts) == {"aten.mm", "aten.bmm"}


def test_default_attention_dispatch_is_used_and_injectable() -> None:
    model = _tiny_model()
    batch = pack_samples(_samples())
    reference = _run(model, batch)
    for layer in model.layers:
        assert layer.attn.attn_fn is varlen_attention
        layer.attn.attn_fn = functools.partial(sdpa_varlen_attention, block_diagonal=True)
    assert_parity(_run(model, batch), reference, "_run(model, batch)")


def test_parallel_plan_globs_match_the_intended_modules() -> None:
    model = _tiny_model(num_layers=3)
    plan = model.parallel_plan()
    assert [n for n, _ in match_modules(model, plan.blocks)] == ["layers.0", "layers.1", "layers.2"]
    assert [n for n, _ in match_modules(model, plan.attention)] == [
        "layers.0.attn",
        "layers.1.attn",
        "layers.2.attn",
    ]
    assert all(hasattr(m, "attn_fn") for _, m in match_modules(model, plan.attention))
    assert [n for n, _ in match_modules(model, plan.stages)] == list(plan.stages)


def test_init_weights_is_reproducible_and_tied_head_shares_the_embedding() -> None:
    a, b = (
        _tiny_model(tie_embeddings=True, qk_norm=True, family="qwen3"),
        _tiny_model(tie_embeddings=True, qk_norm=True, family="qwen3"),
    )
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert a.lm_head.weight is a.embed_tokens.weight
    assert torch.equal(a.layers[0].attn.q_norm.weight, torch.ones(TINY["head_dim"]))
    assert a.num_params() == sum(p.numel() for p in a.parameters())
    assert a.num_params() < _tiny_model().num_params()  # tied embedding counted once


def test_activation_estimate_orders_checkpointing_modes() -> None:
    model = _tiny_model(num_layers=8)  # "full" keeps one whole block live: it wins only when deep
    none, selective, full = (model.activation_bytes_per_token(2, m) for m in ("none", "selective", "full"))
    assert none > selective > full > 0
    assert model.activation_bytes_per_token(4, "none") == 2 * none
    with pytest.raises(ValueError, match="checkpointing"):
        model.activation_bytes_per_token(2, "partial")


def test_registry_unknown_option_names_the_closest_key() -> None:
    with pytest.raises(ValueError, match="'num_kv_head'.*did you mean 'num_kv_heads'"):
        build_model("llm", {"num_kv_head": 2})
    with pytest.raises(ValueError, match="known models: .*llm"):
        get_model_spec("lmm")
    assert get_model_spec("llm").config_cls is LLMConfig


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": None, "hidden_size": 30, "num_heads": 4}, "divisible by num_heads"),
        ({"head_dim": 7}, "even"),
        ({"family": "qwen2", "qkv_bias": False, "qk_norm": False}, "qkv_bias=True"),
        ({"family": "llama", "qk_norm": True}, "only 'qwen3'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "not supported"),
    ],
)
def test_config_validation_messages(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_model("llm", TINY | options)


def test_a_family_whose_build_returns_no_trainable_model_is_refused():
    spec = ModelSpec(name="broken", config_cls=LLMConfig, build=lambda config: torch.nn.Linear(2, 2),
                     task=lambda config: None, dataset="packed_text", cost=None)
    with pytest.raises(TypeError, match="parallel_plan"):
        spec.instantiate(LLMConfig())


def test_the_cuda_varlen_kernel_gets_gqa_the_way_its_torch_release_takes_it() -> None:
    """torch 2.13's ``varlen_attn`` needs ``enable_gqa=True`` for fewer K/V heads; 2.11's has no such
    keyword (calling it with one raised TypeError at the first bf16 forward on a GPU) and takes
    GQA as it is. The keyword set is read from the signature, here from both."""
    from torch.nn.attention.varlen import varlen_attn

    def varlen_attn_of_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                                  scale=None, window_size=(-1, -1)):
        raise AssertionError("only its signature is read")

    assert gqa_keywords(varlen_attn_of_torch_2_11) == {}
    expected = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    assert gqa_keywords(varlen_attn) == expected
