"""Weight EMA: the update rule, swapping for sampling, and exact checkpoint/resume under FSDP."""

from pathlib import Path

import pytest
import torch
from torch import nn

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.train.ema import WeightEMA
from veomni.train.trainer import Trainer


def test_update_follows_the_warmed_up_decay_and_swap_restores():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = WeightEMA([model], decay=0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        decay = min(0.9, (1 + step) / (10 + step))
        for n, p in model.named_parameters():
            expected[n] = decay * expected[n] + (1 - decay) * p.detach()
        ema.update()
    for n in expected:
        torch.testing.assert_close(ema.averages[n], expected[n])
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped():
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[n])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match="ema_decay"):
        WeightEMA([model], decay=1.0)


def _full_ema(trainer):
    return {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for n, v in trainer.ema.averages.items()}


def _uninterrupted(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), ema_decay=0.9))
    trainer.train()
    return _full_ema(trainer), trainer.ema.updates


def _crash_after_3_then_resume(rank, world, tmp):
    first = Trainer(tiny_run_config(Path(tmp), ema_decay=0.9))
    for _ in range(3):
        first.run_step()  # checkpoint.interval=3 saves here
    del first
    second = Trainer(tiny_run_config(Path(tmp), ema_decay=0.9))
    assert second.step == 3 and second.ema.updates == 3
    second.train()
    return _full_ema(second), second.ema.updates


def test_ema_is_checkpointed_and_resumes_exactly_on_two_ranks(tmp_path):
    full, updates = run_distributed(_uninterrupted, 2, str(tmp_path / "a"))[0]
    resumed, resumed_updates = run_distributed(_crash_after_3_then_resume, 2, str(tmp_path / "b"))[0]
    assert updates == resumed_updates == 6
    assert set(full) == set(resumed)
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0)
