import copy
import math

import pytest
import torch
from torch import nn

from tests.parity_utils import tiny_model
from veomni.adapters.lora import add_lora, is_adapter_name
from veomni.config.schema import LoraConfig, OptimConfig, ParamGroupConfig, TrainConfig
from veomni.contract import ParamRule
from veomni.contract.plan import ParallelPlan
from veomni.optim import OptimizerEntry, build_optimizer, build_scheduler, lr_multiplier, register_optimizer
from veomni.optim.check import optimizer_problems


def test_schedule_warmup_then_cosine_to_floor():
    values = [lr_multiplier(s, warmup_steps=4, max_steps=20, min_ratio=0.1) for s in range(21)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(1.0)
    assert values[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.static = nn.Parameter(torch.zeros(3, 3))


def _decay_of(optimizer, param):
    return next(g["weight_decay"] for g in optimizer.param_groups if any(p is param for p in g["params"]))


def test_vectors_do_not_decay_and_models_add_rules():
    model = Tiny()
    rules = [ParamRule({"weight_decay": 0.0}, pattern="static", name="static_no_decay")]
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), rules)
    assert _decay_of(opt, model.proj.weight) == 0.1
    assert _decay_of(opt, model.proj.bias) == 0.0
    assert _decay_of(opt, model.norm.weight) == 0.0
    assert _decay_of(opt, model.static) == 0.0
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


class Planned(nn.Module):
    """Embedding, two blocks (a plan's ``blocks``), a norm and a head: what Muon's authors split."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)

    def parallel_plan(self):
        return ParallelPlan(blocks=("layers.*",))

    def init_weights(self):
        pass


def _owner(optimizer, param):
    return next(type(o).__name__ for o in optimizer.optimizers for g in o.param_groups
                if any(p is param for p in g["params"]))


def test_muon_takes_the_matrices_of_the_blocks_and_adamw_the_rest():
    model = Planned()
    opt = build_optimizer(model, TrainConfig(optimizer="muon"))
    assert [type(o).__name__ for o in opt.per_part[0]] == ["AdamW", "Muon"]
    assert _owner(opt, model.layers[0].weight) == _owner(opt, model.layers[1].weight) == "Muon"
    for param in (model.embed.weight, model.head.weight, model.norm.weight, model.layers[0].bias):
        assert _owner(opt, param) == "AdamW"
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_recipe_groups_choose_optimizer_lr_and_schedule():
    model = Planned()
    optim = OptimConfig(groups=[ParamGroupConfig(pattern="layers.1.*", optimizer="sgd", lr=0.5, warmup_steps=0,
                                                 min_lr_ratio=0.5)])
    train = TrainConfig(lr=0.1, warmup_steps=4, max_steps=8, min_lr_ratio=0.0)
    opt = build_optimizer(model, train, optim=optim)
    assert _owner(opt, model.layers[1].weight) == _owner(opt, model.layers[1].bias) == "SGD"
    assert _owner(opt, model.layers[0].weight) == "AdamW"
    sched = build_scheduler(opt, train)
    lrs = {g["group"]: g["lr"] for g in opt.param_groups}
    assert lrs["optim.groups[0]"] == 0.5 and lrs["default"] == pytest.approx(0.1 / 4)  # group: no warmup
    for _ in range(8):
        opt.step()  # (no gradients: the parameters stay)
        sched.step()
    lrs = {g["group"]: g["lr"] for g in opt.param_groups}
    assert lrs["optim.groups[0]"] == pytest.approx(0.25) and lrs["default"] == pytest.approx(0.0)


def test_a_plugin_registers_an_optimizer_and_unknown_names_are_refused():
    entry = OptimizerEntry("plugin_sgd_nesterov", lambda groups, train, _optim: torch.optim.SGD(
        groups, lr=train.lr, momentum=0.9, nesterov=True))
    register_optimizer(entry)
    opt = build_optimizer(Tiny(), TrainConfig(optimizer="plugin_sgd_nesterov"))
    assert opt.optimizers[0].defaults["nesterov"] is True
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'.*did you mean 'adamw'"):
        build_optimizer(Tiny(), TrainConfig(optimizer="adamm"))


def test_launcher_check_names_a_glob_that_matches_nothing_and_muon_on_a_vector():
    model = Planned()
    bad_glob = OptimConfig(groups=[ParamGroupConfig(pattern="layerz.*", lr=0.1)])
    assert "optim.groups[0].pattern 'layerz.*' matches no trainable parameter" in \
        optimizer_problems(model, TrainConfig(), bad_glob)[0]
    vector_to_muon = OptimConfig(groups=[ParamGroupConfig(pattern="norm.*", optimizer="muon")])
    assert "Muon takes 2-D matrices" in optimizer_problems(model, TrainConfig(), vector_to_muon)[0]
    assert optimizer_problems(model, TrainConfig(optimizer="muon"), OptimConfig()) == []
    for fine in (0.0, 1.0, 1.2):
        assert optimizer_problems(model, TrainConfig(optimizer="muon"), OptimConfig(muon_split_balance=fine)) == []
    assert "optim.muon_split_balance 0.9 is below 1" in \
        optimizer_problems(model, TrainConfig(optimizer="muon"), OptimConfig(muon_split_balance=0.9))[0]


def test_under_lora_muon_takes_only_the_adapters():
    """The frozen base is in no group; the adapters' matrices (inside the blocks) go to Muon."""
    model = add_lora(tiny_model(num_layers=1), LoraConfig(rank=2))
    opt = build_optimizer(model, TrainConfig(optimizer="muon"))
    muon = [p for o in opt.optimizers if type(o).__name__ == "Muon" for g in o.param_groups for p in g["params"]]
    adapters = [p for n, p in model.named_parameters() if is_adapter_name(n)]
    assert muon and len(muon) == len(adapters) and all(any(p is a for a in adapters) for p in muon)
    assert all(p.requires_grad for g in opt.param_groups for p in g["params"])


def test_optimizer_set_state_dict_round_trips_muon_and_adamw():
    def trained(steps):
        torch.manual_seed(0)
        model = Planned()
        opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.01))
        gen = torch.Generator().manual_seed(5)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return model, opt

    model, opt = trained(2)
    fresh_model, fresh = trained(0)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as from a file: torch shares same-dtype tensors)
    assert {type(v).__name__ for s in opt.state_dict()["state"].values() for v in s.values()} == {"Tensor"}
    assert sorted(k for s in opt.state_dict()["state"].values() for k in s) == \
        sorted(k for s in fresh.state_dict()["state"].values() for k in s)
    for m, o in ((model, opt), (fresh_model, fresh)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(a, b), name
