"""Record (or recompute) the reference run of tests/optim/test_reference.py: a tiny model trained
a few steps by the engine's ``build_optimizer`` + ``build_scheduler`` with AdamW and with SGD;
per run the losses (float.hex) and each parameter's SHA-256.

The stored ``adamw_sgd_reference.json`` was written by the code before the optimizer package
(commit 8ae054f, ``veomni.train.optim``; this file pins one thread), with:

    git archive 8ae054f | tar -x -C /tmp/old && cd /tmp/old && \
      PYTHONPATH=/tmp/old python $REPO/tests/optim/record_reference.py > adamw_sgd_reference.json
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

try:
    from veomni.optim import build_optimizer, build_scheduler
except ImportError:  # the code before the optimizer package
    from veomni.train.optim import build_optimizer, build_scheduler
from veomni.config.schema import TrainConfig
from veomni.contract import ParamRule

RULES = [ParamRule({"weight_decay": 0.0, "lr": 5e-3}, pattern="head.bias", name="head_bias")]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def run(optimizer: str, steps: int = 5) -> dict:
    """One thread: a CPU kernel's sums are ordered by its thread count, so the bits are the same on
    any machine only when it is pinned."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(optimizer, steps)
    finally:
        torch.set_num_threads(threads)


def _run(optimizer: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    cfg = TrainConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, warmup_steps=2, max_steps=steps + 1)
    opt = build_optimizer(model, cfg, RULES)
    sched = build_scheduler(opt, cfg)
    tokens = torch.randint(0, 16, (4, 10), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss.detach()).hex())
    params = {n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def main() -> None:
    print(json.dumps({name: run(name) for name in ("adamw", "sgd")}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
