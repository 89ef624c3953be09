import math

import pytest
import torch
from torch import nn

from veomni.config.schema import TrainConfig
from veomni.contract import ParamRule
from veomni.train.optim import build_optimizer, lr_multiplier


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
