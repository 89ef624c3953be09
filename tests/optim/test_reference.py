"""Today's AdamW and SGD runs are bit-identical to the code before the optimizer package: the
losses and every parameter after five steps equal a run recorded by that code
(``adamw_sgd_reference.json``; ``record_reference.py`` says how it was made), and AdamW equals a
``torch.optim.AdamW`` built by hand with the groups the engine always made."""

import json
from pathlib import Path

import pytest
import torch

from tests.optim.record_reference import TinyLM, run

REFERENCE = json.loads((Path(__file__).parent / "adamw_sgd_reference.json").read_text())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_runs_equal_the_recorded_run_of_the_previous_code(optimizer):
    assert run(optimizer) == REFERENCE[optimizer]


def test_adamw_equals_torch_adamw_built_by_hand():
    from veomni.config.schema import TrainConfig
    from veomni.optim import build_optimizer

    torch.manual_seed(0)
    ours, theirs = TinyLM(), TinyLM()
    theirs.load_state_dict(ours.state_dict())
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(ours, cfg)
    matrices = [p for p in theirs.parameters() if p.ndim >= 2]
    vectors = [p for p in theirs.parameters() if p.ndim < 2]
    ref = torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2,
                            weight_decay=0.1, betas=cfg.betas, eps=cfg.eps)
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))
    for model, optimizer in ((ours, opt), (theirs, ref)):
        for _ in range(3):
            model(tokens).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
