"""A model whose plan names a module that lacks the hook its role declares gets an error naming
the model, the module and what it must declare (``veomni/contract/hooks.py``, ``graph.py``),
never an ``AttributeError`` from deep inside a parallel recipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from veomni.contract.hooks import AttentionSpec, attention_modules
from veomni.contract.media import ShardableEncoder
from veomni.contract.plan import ParallelPlan
from veomni.contract.plugin_check import plan_hook_problems
from veomni.ops.graph import NeighbourAggregation
from veomni.parallel.expert import check_model_experts
from veomni.parallel.graph.halo import apply_graph_parallel
from veomni.parallel.media.encoder_sp import encoder_share_problems
from veomni.parallel.sequence import check_sequence_parallel


class BareAttention(nn.Module):
    """Has the injection point and head counts as attributes, but declares no ``attention_spec``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_fn, self.num_heads, self.num_kv_heads, self.head_dim = torch.nn.functional.linear, 4, 4, 8


class DeclaredAttention(BareAttention):
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(4, 4, 8, causal=False)


class Experts(nn.Module):
    def __init__(self, count: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 2, 2))
        self.local_weight = lambda weight: weight
        if count:
            self.expert_count = lambda: 4


class Layer(nn.Module):
    def __init__(self, experts: nn.Module, dispatcher: bool = True) -> None:
        super().__init__()
        self.experts, self.reduce_load = experts, lambda counts: counts
        if dispatcher:
            self.dispatcher = lambda *args: args[0]


class Toy(nn.Module):
    def __init__(self, layer: nn.Module, role: str) -> None:
        super().__init__()
        self.layers, self.role = nn.ModuleList([layer]), role

    def parallel_plan(self) -> ParallelPlan:
        path = "layers.*.experts" if self.role == "experts" else "layers.*"
        return ParallelPlan(blocks=("layers.*",), **{self.role: (path,)})


def test_an_attention_module_must_declare_its_spec() -> None:
    model = Toy(BareAttention(), "attention")
    problem = check_sequence_parallel(model, 2)[0]
    assert problem.startswith("parallel.sp=2: Toy: layers.0 (BareAttention) is listed in parallel_plan().attention "
                              "but does not implement veomni.contract.hooks.AttentionModule: an `attn_fn` injection "
                              "point and `attention_spec()`")
    with pytest.raises(TypeError, match=r"Toy: layers\.0 \(BareAttention\).*AttentionModule"):
        attention_modules(model, model.parallel_plan().attention)
    assert check_sequence_parallel(Toy(DeclaredAttention(), "attention"), 2) == []


def test_an_encoder_attention_module_must_declare_its_spec() -> None:
    class Encoder(Toy, ShardableEncoder):
        rows_per_feature = 1

    problem = encoder_share_problems("vision", Encoder(BareAttention(), "attention"), 2)[0]
    assert problem.startswith("parallel.encoder_sp=2, encoder vision: Encoder: layers.0 (BareAttention) is listed in "
                              "parallel_plan().attention but does not implement veomni.contract.hooks.AttentionModule")


def test_grouped_experts_must_say_how_many_they_are() -> None:
    model = Toy(Layer(Experts(count=False)), "experts")
    with pytest.raises(TypeError, match=r"Toy: layers\.0\.experts \(Experts\) is listed in parallel_plan\(\)\."
                                        r"experts but does not implement veomni\.contract\.hooks\.ExpertGroup: a "
                                        r"`local_weight` injection point and `expert_count\(\)`"):
        check_model_experts(model, 2)
    check_model_experts(Toy(Layer(Experts(count=True)), "experts"), 2)


def test_the_layer_holding_experts_must_declare_its_injection_points() -> None:
    model = Toy(Layer(Experts(count=True), dispatcher=False), "experts")
    with pytest.raises(TypeError, match=r"Toy: layers\.0 \(Layer\) holds the grouped experts layers\.0\.experts but "
                                        r"does not implement veomni\.contract\.hooks\.MoELayer: `dispatcher` and "
                                        r"`reduce_load` injection points"):
        check_model_experts(model, 1)
    assert "MoELayer" in plan_hook_problems(model)[0]  # the launcher reports it before any worker starts


def test_a_message_passing_module_must_declare_its_aggregation() -> None:
    model = Toy(nn.Linear(2, 2), "message_passing")
    with pytest.raises(TypeError, match=r"Toy: layers\.0 \(Linear\) is listed in parallel_plan\(\)\.message_passing "
                                        r"but does not implement veomni\.contract\.graph_model\.MessagePassingLayer"):
        apply_graph_parallel(model, model.parallel_plan(), None)
    assert "MessagePassingLayer" in plan_hook_problems(model)[0]
    layer = nn.Linear(2, 2)
    layer.aggregate = nn.Identity()
    with pytest.raises(TypeError, match=r"Toy: layers\.0 \(Linear\) holds a Identity as `aggregate`, not the "
                                        r"veomni\.ops\.graph\.NeighbourAggregation"):
        apply_graph_parallel(Toy(layer, "message_passing"), ParallelPlan(message_passing=("layers.*",)), None)
    layer.aggregate = NeighbourAggregation()
    assert plan_hook_problems(Toy(layer, "message_passing")) == []


def test_lora_adapts_experts_only_through_their_declared_delta_hook() -> None:
    from veomni.adapters.lora import add_lora
    from veomni.config.schema import LoraConfig

    with pytest.raises(ValueError, match="Toy has no linear layer or adaptable expert group to adapt in its blocks"):
        add_lora(Toy(Layer(Experts(count=True)), "experts"), LoraConfig(rank=2))  # its only experts lack the hook
    with pytest.raises(ValueError, match=r"expert group layers\.0\.experts of Toy, which has no `expert_delta` "
                                         r"injection point \(veomni\.contract\.hooks\.AdaptableExperts\)"):
        add_lora(Toy(Layer(Experts(count=True)), "experts"), LoraConfig(rank=2, targets=["experts"]))
    adaptable = Experts(count=True)
    adaptable.expert_delta = None
    model = Toy(Layer(adaptable), "experts")
    add_lora(model, LoraConfig(rank=2, targets=["experts"]))
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        "layers.0.experts.gate_up_proj_lora_A", "layers.0.experts.gate_up_proj_lora_B"]
